"""One error hierarchy. A cache miss is a return value; these are for what went wrong.

Errors carry a `kind` that crosses the wire unchanged, so a remote error is re-raised as the same
class on the client side (translated in one place: `error_from_reply`).
"""


class KVPoolError(Exception):
    kind = "internal"


class UsageError(KVPoolError, ValueError):
    """The caller asked for something invalid (bad key, size, tenant, message)."""

    kind = "usage"


class ProtocolError(UsageError):
    """A control message could not be decoded or is not a known request."""

    kind = "protocol"


class ForbiddenError(KVPoolError):
    """The caller's identity may not make this call (wrong role, another tenant's or node's data)."""

    kind = "forbidden"


class AuthError(KVPoolError):
    """The master did not accept this identity (unknown or missing key, or it needs CURVE and none
    was given): nothing was sent. Fix the credential; retrying does not help."""

    kind = "auth"


class CapacityError(KVPoolError):
    """The pool cannot hold the object: larger than any segment, or full after eviction."""

    kind = "capacity"


class UnavailableError(KVPoolError):
    """The master or a node could not be reached in time."""

    kind = "unavailable"


class RateLimitedError(UnavailableError):
    """The master refused the call because this identity asks too much too fast; retry later."""

    kind = "rate_limited"


class TransferError(KVPoolError):
    """A data-plane transfer failed (dead peer, NIXL error). `in_flight` is None when nothing of
    it can land any more; otherwise the data plane's handle on a transfer that missed its deadline
    and may still write (it has `wait(timeout_s)` and `add_done_callback(fn)`): the memory it
    touches must not be reused until it is done."""

    kind = "transfer"

    def __init__(self, message: str = "", in_flight: object | None = None) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class LeaseExpiredError(TransferError):
    """A read finished after its lease expired; its bytes may belong to another object."""

    kind = "lease_expired"


_BY_KIND = {
    cls.kind: cls
    for cls in (
        KVPoolError,
        UsageError,
        ProtocolError,
        ForbiddenError,
        AuthError,
        CapacityError,
        UnavailableError,
        RateLimitedError,
        TransferError,
        LeaseExpiredError,
    )
}


def error_from_reply(kind: str, message: str) -> KVPoolError:
    return _BY_KIND.get(kind, KVPoolError)(message)
