"""Unit tests run pure code in this process: a unit test that binds or connects a socket or starts a
process fails here, and belongs in tests/integration."""

from __future__ import annotations

import socket
import subprocess

import pytest


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a unit test may not {what}; move the test to tests/integration")

    return refused


@pytest.fixture(autouse=True)
def _no_processes_or_sockets(monkeypatch):
    monkeypatch.setattr(socket.socket, "bind", _refuse("bind a socket"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("connect a socket"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
    try:
        import zmq
    except ImportError:
        return
    monkeypatch.setattr(zmq.Socket, "bind", _refuse("bind a ZMQ socket"))
    monkeypatch.setattr(zmq.Socket, "connect", _refuse("connect a ZMQ socket"))
