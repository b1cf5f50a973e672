"""The workload tools' error: a trace that is not in the format it claims."""

from kvpool.core.errors import UsageError


class TraceFormatError(UsageError):
    """A trace file is not in the format it claims (or that was detected)."""

    kind = "usage"
