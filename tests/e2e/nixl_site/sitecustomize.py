"""Loaded at start-up by the vLLM servers of the P/D test (their PYTHONPATH names this folder): every
NIXL agent of the process without a progress-thread period of its own gets the one kvpool's agents
use (kvpool.transfer.config.DEFAULT_PROGRESS_DELAY_US: the thread is woken at once by its own
events, the period bounds only its idle polling) instead of spinning a core. vLLM's NixlConnector
creates its agent without a period, so each P/D instance keeps one core busy; three of them on a
2-core machine starve the engines (decode steps of ~0.5 s instead of ~10 ms)."""

try:
    import nixl._api as _api
except ImportError:  # no NIXL in this interpreter: nothing to quiet
    _api = None

if _api is not None:
    from kvpool.transfer.config import DEFAULT_PROGRESS_DELAY_US

    _make = _api.nixlBind.nixlAgent

    def _quiet_agent(name, config):
        if not config.pthrDelay:  # an agent given its own period keeps it
            config.pthrDelay = DEFAULT_PROGRESS_DELAY_US
        return _make(name, config)

    _api.nixlBind.nixlAgent = _quiet_agent
