"""Agentic workloads: the session model, trace formats, synthesis, analysis. Pure: no network I/O."""

from kvpool.workload.model import Session, Turn, read_sessions, write_sessions

__all__ = ["Session", "Turn", "read_sessions", "write_sessions"]
