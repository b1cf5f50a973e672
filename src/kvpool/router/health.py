"""Active health checks: GET /health on every backend each `health_interval_s`.

Rules:
- A check that is refused or answers other than 200 takes the backend out of rotation; one that
  gets no answer within `health_timeout_s` counts toward `fail_threshold` like a failed request
  (a busy server, or this loop held up, is not a dead one); the next passing check brings it back
  (see `backends.Backend` for the table).
- Checks of different backends run concurrently, so one hanging backend delays no other's.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvpool.router.backends import Backend
from kvpool.router.config import RouterConfig
from kvpool.router.metrics import RouterMetrics

log = logging.getLogger("kvpool.router")


class HealthChecker:
    def __init__(self, backends: list[Backend], config: RouterConfig, metrics: RouterMetrics) -> None:
        self.backends = backends
        self.config = config
        self.metrics = metrics
        self._task: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None

    def start(self) -> None:
        # a fresh connection per check: a pooled one the backend closed while idle would read as a
        # failed check of a live backend
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self._task = asyncio.create_task(self._loop(self._http), name="health checks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._http is not None:
            await self._http.close()

    async def check_all(self, http: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._check(http, b) for b in self.backends))

    async def _loop(self, http: aiohttp.ClientSession) -> None:
        while True:  # backends start in rotation: a dead one is found by its first failed request or check
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all(http)

    async def _check(self, http: aiohttp.ClientSession, backend: Backend) -> None:
        error, timed_out = None, False
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with http.get(backend.url + "/health", timeout=timeout) as r:
                await r.read()
                if r.status != 200:
                    error = f"/health answered {r.status}"
        except asyncio.TimeoutError as e:
            error, timed_out = f"/health: no answer in {self.config.health_timeout_s:g} s ({type(e).__name__})", True
        except (aiohttp.ClientError, OSError) as e:
            error = f"/health: {type(e).__name__}: {e}"
        if error is None:
            if backend.check_passed():
                log.warning("backend %s is healthy again", backend.name)
            self.metrics.healthy.labels(backend.name).set(1)
        else:
            if (backend.check_timed_out(error) if timed_out else backend.check_failed(error)):
                log.warning("backend %s leaves the rotation: %s", backend.name, error)
            self.metrics.healthy.labels(backend.name).set(int(backend.healthy))
