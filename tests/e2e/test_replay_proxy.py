"""`kvpool router` as a real process (round-robin) in front of two small HTTP backends and a dead one."""

import asyncio
import json
import threading

import urllib.request

import pytest
from aiohttp import web

from kvpool.bench import procs


class Backend:
    """An HTTP server in a thread that names itself and streams a few SSE chunks."""

    def __init__(self, name: str) -> None:
        self.name, self.port, self.bodies = name, None, []
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def completions(request: web.Request) -> web.StreamResponse:
            self.bodies.append(await request.json())
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'backend': self.name, 'i': i})}\n\n".encode())
                await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def router(tmp_path):
    a, b = Backend("a"), Backend("b")
    # checks every 60 s: the dead backend is found by the requests themselves
    proc = procs.start_router(tmp_path, [a.url, b.url, "http://127.0.0.1:9"], "--health-interval-s", "60")
    yield proc.info["url"], a, b
    assert proc.stop() == 0  # SIGTERM: clean exit
    a.stop(), b.stop()


def test_round_robin_streams_and_retries_past_a_dead_backend(router):
    url, a, b = router
    answers = [post(url + "/v1/completions", {"prompt": [i]}) for i in range(6)]
    assert [status for status, _ in answers] == [200] * 6  # the dead backend's turns were retried
    first_chunks = [json.loads(body.split(b"\n\n")[0][5:])["backend"] for _, body in answers]
    assert first_chunks == ["a", "b"] * 3
    assert all(body.count(b"data:") == 4 for _, body in answers)  # the whole stream
    assert [x["prompt"] for x in a.bodies] == [[0], [2], [4]] and [x["prompt"] for x in b.bodies] == [[1], [3], [5]]
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert f'kvpool_router_requests_total{{backend="{a.url}",status="2xx"}} 3.0' in metrics
    assert 'kvpool_router_backend_failures_total{backend="http://127.0.0.1:9"} 2.0' in metrics
    assert 'kvpool_router_backend_healthy{backend="http://127.0.0.1:9"} 0.0' in metrics


def test_bad_arguments_are_refused(tmp_path):
    import subprocess, sys

    out = subprocess.run([sys.executable, "-m", "kvpool", "router", "--backend", "localhost:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must start with http://" in out.stderr
