"""`kvpool status` against a master that does not answer."""

import argparse
import time

from kvpool.client import status_cli


def test_unreachable_master_exits_1_within_timeout(capsys):
    args = argparse.Namespace(master="tcp://127.0.0.1:9", json=False, timeout_s=0.3, credential=None)
    started = time.monotonic()
    assert status_cli.run(args) == 1
    assert time.monotonic() - started < 2.0
    assert "did not answer" in capsys.readouterr().err
