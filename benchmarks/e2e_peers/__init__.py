"""End to end against LMCache on the demo's agent workload; `run.py` is the command."""
