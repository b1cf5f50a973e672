"""Per-tenant quotas (bytes, objects), each tenant's namespace with its usage, and quota config.

Rules:
- Pure: no I/O. The TOML file is read at the CLI edge (master/cli.py, tomllib); this module turns
  its parsed tables and `--quota TENANT=BYTES[:OBJECTS]` flags into a frozen QuotaTable.
- A tenant's usage counts its objects that hold pool DRAM: pending (space allocated for the writer)
  and complete with replicas. Bytes are object size x replicas (a second replica takes a second
  range of the pool). Disk-only objects (tiers.py) count nothing, so a DRAM eviction that demotes
  an object frees its quota; removed-but-leased objects and quarantined allocations count nothing
  either (no longer the tenant's objects; their space ends with a lease TTL / quarantine_max_s).
- Quotas, usage and dedicated segments belong to the tenant that owns a namespace (`TenantAccount`,
  keyed by access.namespace_owner: an authenticated tenant's namespaces are stored as
  `<name>/<namespace>`, all counted in `<name>`'s account); each namespace is a `TenantSpace`.
- Only `TenantAccount.charge` changes usage. The master calls it with +1 when a record gains DRAM
  replicas (put_start, announce, a promotion done) and with -1 before it loses them (drop, demotion,
  one replica's segment gone, an overlapping announced range), so usage is exact after every call
  (tests compare it with a scan of the index). The same call keeps `segment_replicas`, the tenant's
  replicas per segment: `segments()` is then O(its segments), never a scan of objects.
- The quota is checked per new key at put_start against size x num_replicas asked and one object.
  A tenant at its quota evicts its own least recently used unleased tails (pressure.py, its own
  heap) until the key fits, never another tenant's objects; if it cannot, the key is refused
  (PUT_NO_SPACE, which the client raises as CapacityError) with `refusal_message`, naming the
  tenant and the quota.
- A promotion from disk (tiers.py) is not refused by the quota: it may take a tenant above its
  quota for a moment, and its next put evicts back down. Rejected: refusing the promotion (a
  lookup would turn into a miss while the tenant's own older objects could have made room).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvpool.core.protocol import REPLICA_BYTES, KeyGroupStats, TenantStats
from kvpool.core.sizes import format_size, parse_size
from kvpool.core.types import MAX_TENANT_LENGTH, SegmentId

DEFAULT_TENANT = "*"  # in `--quota *=SIZE` and the TOML [default] table: tenants not listed


@dataclass(frozen=True)
class TenantQuota:
    """max_bytes: object bytes x replicas the tenant may hold in pool DRAM (None: no limit).
    max_objects: objects it may hold (None: no limit)."""

    max_bytes: int | None = None
    max_objects: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_objects"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int (or None for no limit), got {value!r}")

    @property
    def limited(self) -> bool:
        return self.max_bytes is not None or self.max_objects is not None

    def describe(self) -> str:
        parts = []
        if self.max_bytes is not None:
            parts.append(f"{self.max_bytes} bytes ({format_size(self.max_bytes)})")
        if self.max_objects is not None:
            parts.append(f"{self.max_objects} objects")
        return ", ".join(parts) or "no limit"


@dataclass(frozen=True)
class QuotaTable:
    """Quotas by tenant; `default` applies to tenants not listed (None: they have no quota).
    `dedicated`: tenants that place only on segments dedicated to them from the master's start,
    before any such segment has mounted (segments.py), so no put of theirs lands on shared memory
    while their nodes are still (re)mounting."""

    tenants: Mapping[str, TenantQuota] = field(default_factory=dict)
    default: TenantQuota | None = None
    dedicated: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for tenant in self.dedicated:
            if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LENGTH:
                raise ValueError(f"dedicated tenant names must be 1..{MAX_TENANT_LENGTH} characters, got {tenant!r}")
        for tenant, quota in self.tenants.items():
            if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LENGTH or tenant == DEFAULT_TENANT:
                raise ValueError(f"quota tenant names must be 1..{MAX_TENANT_LENGTH} characters (not "
                                 f"{DEFAULT_TENANT!r}, which names the default), got {tenant!r}")
            if not isinstance(quota, TenantQuota):
                raise ValueError(f"the quota of {tenant!r} must be a TenantQuota, got {quota!r}")

    def quota_of(self, tenant: str) -> TenantQuota | None:
        quota = self.tenants.get(tenant, self.default)
        return quota if quota is not None and quota.limited else None

    def updated(self, entries: Iterable[tuple[str, TenantQuota]], dedicated: Iterable[str] = ()) -> "QuotaTable":
        """This table with `entries` (from parse_quota) replacing what it says for those tenants,
        and `dedicated` tenants added."""
        tenants = dict(self.tenants)
        default = self.default
        for tenant, quota in entries:
            if tenant == DEFAULT_TENANT:
                default = quota
            else:
                tenants[tenant] = quota
        return QuotaTable(tenants, default, self.dedicated | frozenset(dedicated))


def parse_quota(text: str) -> tuple[str, TenantQuota]:
    """`TENANT=BYTES[:OBJECTS]` -> (tenant, quota): 'b=64MiB:1000', 'b=1GiB', 'b=none:500';
    tenant `*` is the default for tenants not listed."""
    tenant, sep, limits = text.partition("=")
    tenant = tenant.strip()
    if not sep or not tenant:
        raise ValueError(f"cannot read quota {text!r}: use TENANT=BYTES[:OBJECTS], e.g. alice=64MiB:10000 "
                         "(BYTES or OBJECTS 'none' for no limit; TENANT '*' for tenants not listed)")
    size_text, _, objects_text = limits.partition(":")
    try:
        max_bytes = None if size_text.strip().lower() in ("none", "") else parse_size(size_text)
        max_objects = None if objects_text.strip().lower() in ("none", "") else int(objects_text)
        quota = TenantQuota(max_bytes, max_objects)
    except ValueError as e:
        raise ValueError(f"cannot read quota {text!r}: {e}") from None
    if not quota.limited:
        raise ValueError(f"quota {text!r} limits nothing: give BYTES and/or :OBJECTS")
    return tenant, quota


def _quota_from_toml(where: str, table: object, known: tuple[str, ...] = ("max_bytes", "max_objects")) -> TenantQuota:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table with max_bytes and/or max_objects, got {table!r}")
    unknown = set(table) - set(known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(known)})")
    max_bytes = table.get("max_bytes")
    if isinstance(max_bytes, str):
        max_bytes = parse_size(max_bytes)
    try:
        quota = TenantQuota(max_bytes, table.get("max_objects"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not quota.limited and "dedicated" not in table:
        raise ValueError(f"{where} limits nothing: give max_bytes and/or max_objects")
    return quota


def quota_table_from_toml(data: Mapping[str, object]) -> QuotaTable:
    """A QuotaTable from a parsed TOML document:

        [default]                 # optional: tenants not listed below
        max_bytes = "1GiB"        # a size string or a number of bytes
        [tenants.alice]
        max_bytes = "64MiB"
        max_objects = 100000
        dedicated = true          # alice places only on `kvpool node --tenant alice` segments
    """
    unknown = set(data) - {"default", "tenants"}
    if unknown:
        raise ValueError(f"quota file: unknown tables {sorted(unknown)} (known: [default], [tenants.NAME])")
    default = _quota_from_toml("[default]", data["default"]) if "default" in data else None
    tenants_table = data.get("tenants", {})
    if not isinstance(tenants_table, dict):
        raise ValueError("quota file: [tenants] must hold one table per tenant ([tenants.NAME])")
    tenants: dict[str, TenantQuota] = {}
    dedicated: set[str] = set()
    for name, table in tenants_table.items():
        where = f"[tenants.{name}]"
        quota = _quota_from_toml(where, table, ("max_bytes", "max_objects", "dedicated"))
        flag = table.get("dedicated", False)
        if not isinstance(flag, bool):
            raise ValueError(f"{where}: dedicated must be true or false, got {flag!r}")
        if flag:
            dedicated.add(name)
        if quota.limited:
            tenants[name] = quota
    return QuotaTable(tenants, default, frozenset(dedicated))


class TenantSpace(dict):
    """One stored namespace (key -> record): a plain dict on the hot path, with its name as stored
    and the account of the tenant that owns it (several namespaces of one tenant share one)."""

    __slots__ = ("name", "account")

    def __init__(self, name: str, account: "TenantAccount") -> None:
        super().__init__()
        self.name = name
        self.account = account


def key_group(key: str) -> str | None:
    """'g3' for a key 'g3-<hash>' (one KV-cache group of a hybrid model), else None."""
    end = key.find("-", 1, 6)
    return key[:end] if end > 1 and key[1:end].isdigit() else None


class TenantAccount:
    """A tenant's usage and quota, over all its namespaces: the one state object per tenant."""

    __slots__ = ("name", "quota", "used_bytes", "num_objects", "segment_replicas", "heap", "dedicated",
                 "quota_refusals", "quota_evictions", "key_groups")

    def __init__(self, name: str, quota: TenantQuota | None) -> None:
        self.name = name
        self.quota = quota
        self.used_bytes = 0
        self.num_objects = 0
        self.segment_replicas: dict[SegmentId, int] = {}  # segment id -> its replicas of this tenant's objects
        self.heap: list | None = None  # its own eviction heap (eviction.py), or None: in the shared one
        self.dedicated = False  # places only on segments dedicated to it (segments.py)
        self.quota_refusals = 0
        self.quota_evictions = 0
        # a hybrid model's KV-cache groups (keys "g<N>-<hash>", connector/groups.py): [objects, bytes]
        self.key_groups: dict[str, list[int]] = {}

    def charge(self, rec, sign: int) -> None:
        """Count `rec`'s DRAM replicas in (+1) or out (-1) of this tenant's usage."""
        loc = rec.locations
        if not loc:
            return
        size_bytes = sign * int.from_bytes(loc[16:24], "little") * (len(loc) // REPLICA_BYTES)
        self.used_bytes += size_bytes
        self.num_objects += sign
        key = rec.key
        if key[:1] == "g":
            group = key_group(key)
            if group is not None:
                usage = self.key_groups.setdefault(group, [0, 0])
                usage[0] += sign
                usage[1] += size_bytes
                if not usage[0]:
                    del self.key_groups[group]
        counts = self.segment_replicas
        for start in range(0, len(loc), REPLICA_BYTES):
            segment_id = int.from_bytes(loc[start : start + 8], "little", signed=True)
            left = counts.get(segment_id, 0) + sign
            if left:
                counts[segment_id] = left
            else:
                del counts[segment_id]

    def fits(self, size_bytes: int, num_replicas: int) -> bool:
        """Whether one more object of `size_bytes` x `num_replicas` stays within the quota."""
        quota = self.quota
        if quota is None:
            return True
        return ((quota.max_bytes is None or self.used_bytes + size_bytes * num_replicas <= quota.max_bytes)
                and (quota.max_objects is None or self.num_objects + 1 <= quota.max_objects))

    def fits_when_empty(self, size_bytes: int, num_replicas: int) -> bool:
        """Whether evicting its objects could ever make room for this one (else it is refused at once)."""
        quota = self.quota
        return quota is None or quota.max_bytes is None or size_bytes * num_replicas <= quota.max_bytes

    def refusal_message(self, size_bytes: int, num_replicas: int) -> str:
        quota = self.quota
        held = f"it holds {self.used_bytes} bytes in {self.num_objects} objects"
        if quota is not None and quota.max_bytes is not None and size_bytes * num_replicas > quota.max_bytes:
            return (f"tenant {self.name!r}: an object of {size_bytes} bytes x {num_replicas} replicas is larger than "
                    f"its quota of {quota.describe()}; use smaller objects or raise the quota "
                    f"(kvpool master --quota {self.name}=SIZE[:OBJECTS])")
        return (f"tenant {self.name!r} is at its quota of {self.describe_quota()} ({held}) and none of its own "
                f"objects can be evicted for {size_bytes} bytes x {num_replicas} replicas more (the rest is leased, "
                f"pending or pinned): remove objects, retry later or raise the quota "
                f"(kvpool master --quota {self.name}=SIZE[:OBJECTS])")

    def describe_quota(self) -> str:
        return self.quota.describe() if self.quota is not None else "no limit"

    def segments(self) -> set[SegmentId]:
        return set(self.segment_replicas)

    def stats(self) -> TenantStats:
        quota = self.quota
        return TenantStats(
            tenant=self.name,
            used_bytes=self.used_bytes,
            num_objects=self.num_objects,
            max_bytes=(quota.max_bytes or 0) if quota is not None else 0,
            max_objects=(quota.max_objects or 0) if quota is not None else 0,
            quota_refusals=self.quota_refusals,
            quota_evictions=self.quota_evictions,
            num_segments=len(self.segment_replicas),
            key_groups=[KeyGroupStats(g, n, b) for g, (n, b) in sorted(self.key_groups.items())],
        )
