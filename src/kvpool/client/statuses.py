"""A put's outcome per key as the client reports it: the master's PUT_* statuses plus PUT_FAILED."""

from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE

PUT_FAILED = 3  # client-side only: space was allocated but the write failed; revoked, safe to retry
PUT_STATUS_NAMES = {PUT_ALLOCATED: "stored", PUT_EXISTS: "exists", PUT_NO_SPACE: "no_space", PUT_FAILED: "failed"}
