"""End to end against LMCache on the demo's agent workload (issue 15); `run.py` is the command."""
