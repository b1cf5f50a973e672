"""Who may call what: the master's authorization policy, pure (no I/O, no keys, no sockets).

Rules:
- The service turns each message's authenticated public key into a `Principal` (its role from the
  auth directory); without authentication (`--insecure`) every caller is `OPEN`, today's behaviour.
- Roles: `node` may mount, heartbeat, announce and unmount, and only segments of node ids it mounted
  itself (the key that mounted a node id owns it); `tenant:<name>` may put, look up, read, check
  and remove objects, always inside its own namespace; `admin` may do what tenants do in any
  namespace, plus Stats (which covers every tenant and node). Anything else is refused with a
  `forbidden` error that names the role and the call, and counted.
- Namespaces: a tenant's request names a namespace of its own choosing (the connector derives one
  from the model); the master stores it as `<name>/<namespace>`, so two tenants can never name the
  same objects, whatever they send, and quotas and metrics key on `namespace_owner`.
- A tenant gets segment metadata (the NIXL descriptors and shared-memory paths that make a
  segment reachable) only for segments that hold its objects or its pending puts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core import protocol as p

NODE_CALLS = frozenset({p.MountSegment, p.AnnounceObjects, p.UnmountSegment, p.Heartbeat})
TENANT_CALLS = frozenset({p.GetSegments, p.PutStart, p.PutEnd, p.PutRevoke, p.PutLanded, p.EndQuarantine,
                          p.LookupPrefix, p.ReleaseLeases, p.Exists, p.Remove, p.PutValue, p.GetValue,
                          p.SessionEvents})
ADMIN_CALLS = TENANT_CALLS | {p.Stats}
NAMESPACE_SEPARATOR = "/"


@dataclass(frozen=True)
class Principal:
    role: str  # "open" (no authentication), "node", "admin" or "tenant"
    name: str = ""  # the tenant's name; "" for the others
    key: str = ""  # the public key it proved; "" when open

    @classmethod
    def from_role(cls, role: str, key: str) -> "Principal":
        kind, _, name = role.partition(":")
        return cls(kind, name, key)

    def __str__(self) -> str:
        return f"tenant:{self.name}" if self.role == "tenant" else self.role


OPEN = Principal("open")


def refusal(principal: Principal, request: p.Request) -> str | None:
    """None if `principal` may send this kind of request, else the reason."""
    role = principal.role
    kind = type(request)
    if role == "open":
        return None
    allowed = NODE_CALLS if role == "node" else TENANT_CALLS if role == "tenant" else \
        ADMIN_CALLS if role == "admin" else frozenset()
    if kind in allowed:
        return None
    needs = "a node" if kind in NODE_CALLS else "admin" if kind is p.Stats else "a tenant or admin"
    return f"{kind.__name__} needs {needs} identity; this one is {principal}"


def scoped_tenant(principal: Principal, tenant: str) -> str:
    """The namespace a request's tenant field names, as stored: a tenant's own `<name>/<tenant>`."""
    if principal.role == "tenant":
        return principal.name + NAMESPACE_SEPARATOR + tenant
    return tenant


def namespace_owner(tenant: str) -> str:
    """Whom a stored namespace belongs to (quotas and per-tenant metrics key on this)."""
    return tenant.partition(NAMESPACE_SEPARATOR)[0]
