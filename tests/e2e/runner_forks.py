"""A fork server for tests/e2e/connector_run.py: one process imports vLLM once, and every run is a
child forked from it, a fresh process with nothing of vLLM started in it (no engine, no KV cache,
no connector), so a hit is still the pool's. Importing vLLM costs ~16 s of CPU per process here; the
e2e tests start ~35 runs.

    python tests/e2e/runner_forks.py        (driven by tests/e2e/conftest.py through stdin/stdout)

Requests, one JSON line each on stdin: {"spec", "out", "log", "env"}; answers on stdout: {"pid"} for
each request in order, and {"exited": pid, "returncode"} when a child ends (negative: its signal).
The server holds no threads of its own (only OpenBLAS's idle ones, which are fork-safe) and never
starts an engine, so each child begins as clean as a fresh interpreter after the same imports.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["OPENBLAS_NUM_THREADS"] = (
    "1"  # before numpy: no BLAS threads to carry over a fork
)

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2])
)  # `tests.e2e...` importable, as under pytest
from tests.e2e import connector_run


def preload() -> None:
    """What every run imports; a child finds it loaded."""
    import vllm
    import vllm.v1.engine.llm_engine  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import kvpool.client
    import kvpool.connector  # noqa: F401


def child(request: dict) -> None:
    """In the forked child: become the run's process, run it, never return."""
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is the run's
        sys.argv = [connector_run.__file__, request["spec"], request["out"]]
        code = connector_run.main(request["spec"], request["out"])
    except BaseException:  # noqa: BLE001  (a child never returns into the server loop)
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        answer({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve() -> int:
    preload()
    answer({"ready": os.getpid()})
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], 0.1)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:  # the tests are over
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(request)
                answer({"pid": pid})
        reap()


if __name__ == "__main__":
    sys.exit(serve())
