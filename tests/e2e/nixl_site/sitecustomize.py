"""Loaded at start-up by the vLLM servers of the P/D test (their PYTHONPATH names this folder): every
NIXL agent of the process polls its UCX progress thread every 100 ms when idle (it is woken at once
by its own events) instead of spinning a core. vLLM's NixlConnector creates its agent without a
delay, so each P/D instance keeps one core busy; three of them on a 2-core machine starve the
engines (decode steps of ~0.5 s instead of ~10 ms). kvpool's own agents set the same period
(kvpool.transfer.config.DEFAULT_PROGRESS_DELAY_US)."""

try:
    import nixl._api as _api
except ImportError:  # no NIXL in this interpreter: nothing to quiet
    _api = None

if _api is not None:
    _make = _api.nixlBind.nixlAgent

    def _quiet_agent(name, config):
        if not config.pthrDelay:  # an agent given its own period keeps it
            config.pthrDelay = 100_000
        return _make(name, config)

    _api.nixlBind.nixlAgent = _quiet_agent
