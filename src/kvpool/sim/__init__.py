"""The fleet simulator: vLLM-like instances, the master's pool and the router's policies on a
virtual clock (see fleet.py for the rules). Pure: the CLI (cli.py) does the I/O."""
