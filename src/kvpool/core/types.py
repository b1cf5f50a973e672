"""Identifier types. Absence is None, never a sentinel."""

from typing import NewType

ObjectKey = NewType("ObjectKey", str)  # a key inside one tenant's namespace
Tenant = NewType("Tenant", str)  # a namespace; one tenant never sees another's keys
NodeId = NewType("NodeId", str)  # a storage node (or an embedded node inside a vLLM worker)
SegmentId = NewType("SegmentId", int)  # one mount of one segment; never reused, a remount gets a new id
HostId = NewType("HostId", str)  # identifies a machine, for choosing the same-host shared-memory path

DEFAULT_TENANT = Tenant("default")
MAX_KEY_LENGTH = 1024
MAX_TENANT_LENGTH = 128
