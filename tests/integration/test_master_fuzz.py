"""A hostile client against a real master: >= 10,000 malformed or hostile messages while a
well-behaved client keeps putting, looking up and reading its own objects.

The master (`kvpool master`) and one storage node run as processes on 127.0.0.1. The fuzzer talks
the wire format of master/service.py on a raw DEALER socket: hypothesis draws every request type of
core/protocol/ with hostile field values (huge and mismatched lists, empty and over-long strings,
other tenants' names, ints at and past the int64 edges, NaN ages), wrong types and unknown tags
as raw msgpack, random bytes, wrong frame counts and bad request ids. Ids the fuzzer learned from
its own replies (write tokens, lease ids, the segments it mounted) are fed back into later
messages so the deeper paths (put ends, revokes, announcements, tier reports) run too.

Every message must be answered, never with kind "internal"; the good client (kvpool.client.Client)
must get correct bytes within its timeout throughout; at the end the master is alive, exits 0 on
SIGTERM and its log holds no internal error.

Two masters: `--insecure`, and `--auth` with the fuzzer holding a tenant's credential of its
own. Without authentication the fuzzer leaves out what is allowed there and would legitimately
hurt the good client: removing or starting puts in the good tenant's namespace, mounting segments
large enough to take the good client's objects (a fake segment would be chosen for its puts and
its reads would fail), unmounting or heartbeating the real node's segment. With authentication it
does all of that too (`THREATS`): node calls and Stats must be refused as forbidden, and the good
tenant's names reach only the fuzzer's own namespace.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core import protocol as p
from kvpool.rpc.credentials import AuthDir, Credential
from pool_worker import pattern

MAX_MESSAGE_BYTES = 1 << 20  # the master's limit here, so oversized frames are cheap to send
NUM_BATCHES = 400
BATCH = 25  # messages per hypothesis example: NUM_BATCHES * BATCH >= 10,000
GOOD_TENANT = "good"
REAL_NODE = "node0"
GOOD_MIN_BYTES = 48 * 1024  # the good client's objects never fit a fake segment (<= 16 KiB)
FAKE_SEGMENT_MAX_BYTES = 16 * 1024
GOOD_MAX_OBJECTS = 250
REPLY_TIMEOUT_S = 20.0


# ---- ids learned from replies, substituted at encoding time ---------------------------------


class Learned:
    """Stands for an id the fuzzer learned earlier (kind: token, lease, segment, node, real_segment);
    `pick` chooses which. Resolved by the encoder's enc_hook, so it can sit in any struct field
    (a plain class: msgspec would encode a dataclass itself, without asking the hook)."""

    __slots__ = ("kind", "pick")

    def __init__(self, kind: str, pick: int) -> None:
        self.kind, self.pick = kind, pick

    def __repr__(self) -> str:
        return f"Learned({self.kind!r}, {self.pick})"


@dataclass
class Known:
    tokens: list[int] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)  # the fuzzer's own mounts
    nodes: list[str] = field(default_factory=list)  # their node ids
    real_segments: list[int] = field(default_factory=list)  # read-only use (GetSegments)

    def add(self, kind: str, value) -> None:
        values = getattr(self, kind)
        values.append(value)
        del values[:-200]

    def resolve(self, obj):
        if not isinstance(obj, Learned):
            raise NotImplementedError(type(obj))
        values = {"token": self.tokens, "lease": self.leases, "segment": self.segments, "node": self.nodes,
                  "real_segment": self.real_segments}[obj.kind]
        if not values:
            return "node-x" if obj.kind == "node" else obj.pick
        return values[-1 - obj.pick % min(len(values), 8)]  # recent ones: older segments may have expired


# ---- strategies -----------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 63, 64, 65, 2**31, 2**32, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
hostile_int = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGE_INTS), st.integers(-3, 3))
hostile_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e308]))
odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "a" * 129, "k" * 1025, "good/1", "../..", "\u2603" * 50]),
    st.integers(0, 3000).map(lambda n: "x" * n),
)
good_keys = st.integers(0, GOOD_MAX_OBJECTS).map(lambda i: f"good/{i}")
key = st.one_of(odd_text, good_keys)
read_tenant = st.one_of(st.sampled_from([GOOD_TENANT, "evil", "other", "", "t" * 129, "t" * 128]), st.text(max_size=8))
# maps, not filters: a filter's rejected draws cost hypothesis time, and generation is this test's time
write_tenant = read_tenant.map(lambda t: t + "!" if t == GOOD_TENANT else t)


_FRESH = itertools.count()


def huge_list(item: str) -> st.SearchStrategy:
    return st.integers(1000, 30_000).map(lambda n: [f"{item}{i}" for i in range(n)])


keys = st.one_of(st.lists(key, max_size=8), huge_list("h/"))
ids = st.one_of(hostile_int, st.integers(0, 1000).map(lambda i: Learned("token", i)))
tokens = st.lists(ids, max_size=8)
lease_ids = st.lists(st.one_of(hostile_int, st.integers(0, 1000).map(lambda i: Learned("lease", i))), max_size=8)
own_segment = st.one_of(hostile_int, st.integers(0, 1000).map(lambda i: Learned("segment", i)))
node_id = st.one_of(odd_text.map(lambda n: n + "!" if n == REAL_NODE else n),
                    st.integers(0, 1000).map(lambda i: Learned("node", i)))
put_sizes = st.one_of(st.integers(-10, 4096), st.sampled_from([0, -(2**63), 2**40, 2**62, 2**63 - 1, 2**64 - 1]))
small_int_list = st.lists(hostile_int, max_size=8)

dir_entry = st.builds(p.DirEntry, offset=hostile_int, size=hostile_int, tenant=write_tenant, key=odd_text,
                      parent=st.none() | odd_text, checksum=hostile_int, op=st.one_of(st.integers(-1, 4), hostile_int))
disk_entry = st.builds(p.DiskEntry, tenant=write_tenant, key=odd_text, size=hostile_int, checksum=hostile_int,
                       parent=st.none() | odd_text, age_s=hostile_float)
tier_report = st.builds(p.TierReport, segment_id=own_segment, written=st.lists(disk_entry, max_size=4),
                        lost=st.lists(disk_entry, max_size=4), promoted=small_int_list, failed=small_int_list)


@st.composite
def mounts(draw) -> p.MountSegment:
    size = draw(st.one_of(st.integers(-100, FAKE_SEGMENT_MAX_BYTES), st.sampled_from(EDGE_INTS)))
    node = draw(node_id)
    if size > FAKE_SEGMENT_MAX_BYTES:
        node = ""  # a big fake segment would take the good client's puts (see the module comment)
    return p.MountSegment(node_id=node, host_id=draw(odd_text), size_bytes=size, base_addr=draw(hostile_int),
                          agent_name=draw(odd_text), agent_metadata=draw(st.binary(max_size=64)),
                          shm_path=draw(st.none() | odd_text), recovering=draw(st.booleans()),
                          disk_bytes=draw(st.one_of(st.integers(-5, 1 << 20), hostile_int)))


coherent_key = st.one_of(key, st.integers(0, 50).map(lambda i: f"evil/{i}"))


@st.composite
def coherent(draw):
    """Requests whose lists agree in length (so they pass the first checks and reach the index),
    built around tokens, leases and segments the fuzzer learned."""
    n = draw(st.integers(0, 6))
    learned_tokens = [Learned("token", draw(st.integers(0, 1000))) for _ in range(n)]
    some_keys = [draw(coherent_key) for _ in range(n)]
    tenant = draw(st.sampled_from(["evil", "other", GOOD_TENANT]))
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return p.PutEnd(tenant, some_keys, learned_tokens, [draw(hostile_int) for _ in range(n)],
                        landing=draw(st.booleans()))
    if choice == 4:
        return p.PutLanded(tenant, some_keys, learned_tokens,
                           draw(st.one_of(st.just([]), st.lists(hostile_int, min_size=n, max_size=n))))
    if choice == 1:
        return p.PutRevoke(tenant, some_keys, learned_tokens, draw(st.lists(st.integers(-1, 6), max_size=6)))
    if choice == 2:
        return p.AnnounceObjects(Learned("segment", draw(st.integers(0, 1000))),
                                 [draw(dir_entry) for _ in range(n)],
                                 [draw(hostile_float) for _ in range(n)], draw(st.booleans()),
                                 draw(st.lists(disk_entry, max_size=3)))
    return p.Heartbeat(Learned("node", draw(st.integers(0, 1000))), [Learned("segment", draw(st.integers(0, 1000)))],
                       draw(st.lists(hostile_int, max_size=1)), draw(st.lists(tier_report, max_size=2)))


requests = st.one_of(
    mounts(),
    coherent(),
    coherent(),
    st.builds(p.AnnounceObjects, segment_id=own_segment, entries=st.lists(dir_entry, max_size=6),
              ages_s=st.lists(hostile_float, max_size=6), last=st.booleans(),
              disk_entries=st.lists(disk_entry, max_size=4)),
    st.builds(p.UnmountSegment, segment_id=own_segment),
    st.builds(p.Heartbeat, node_id=node_id, segment_ids=st.lists(own_segment, max_size=4),
              directory_seqs=small_int_list, tier_reports=st.lists(tier_report, max_size=2)),
    st.builds(p.GetSegments, segment_ids=st.one_of(
        st.lists(st.one_of(hostile_int, st.integers(0, 9).map(lambda i: Learned("real_segment", i))), max_size=8),
        st.integers(1000, 30_000).map(lambda n: list(range(n))))),
    st.builds(p.PutStart, tenant=write_tenant, keys=st.lists(key, max_size=64), sizes=st.lists(put_sizes, max_size=64),
              parents=st.lists(st.none() | key, max_size=64), num_replicas=st.one_of(st.integers(-1, 10), hostile_int),
              pinned=st.booleans()),
    # a put that the master should take: its tokens come back and feed PutEnd / PutRevoke / EndQuarantine
    st.builds(lambda n, size, t: p.PutStart(t, [f"evil/{next(_FRESH)}" for _ in range(n)], [size] * n, []),
              st.integers(1, 16), st.integers(1, 4096), st.sampled_from(["evil", "other"])),
    st.builds(p.PutEnd, tenant=read_tenant, keys=keys, tokens=tokens, checksums=small_int_list),
    st.builds(p.PutRevoke, tenant=read_tenant, keys=keys, tokens=tokens, in_flight=small_int_list),
    st.builds(p.PutLanded, tenant=read_tenant, keys=keys, tokens=tokens, checksums=small_int_list),
    st.builds(p.EndQuarantine, tenant=read_tenant, tokens=tokens),
    st.builds(p.LookupPrefix, tenant=read_tenant, keys=keys, lease=st.booleans()),
    st.builds(p.ReleaseLeases, tenant=read_tenant, lease_ids=lease_ids),
    st.builds(p.Exists, tenant=read_tenant, keys=keys),
    st.builds(p.Remove, tenant=write_tenant, keys=keys),
    st.builds(p.PutValue, tenant=write_tenant, key=key, value=st.one_of(
        st.binary(max_size=64), st.integers(0, 200_000).map(lambda n: b"v" * n)), pinned=st.booleans()),
    st.builds(p.GetValue, tenant=read_tenant, key=key),
    st.just(p.Stats()),
    st.just(p.LaneQuery()),
    st.builds(p.SessionEvents, tenant=read_tenant, events=st.lists(st.builds(
        p.SessionEvent, session=st.one_of(st.text(max_size=8), st.just("s" * 300)), request=st.text(max_size=8),
        kind=st.one_of(st.integers(0, 3), hostile_int), ttl_s=hostile_float), max_size=4)),
    st.builds(p.PutStart, tenant=write_tenant, keys=st.lists(key, max_size=8), sizes=st.lists(put_sizes, max_size=8),
              parents=st.just([]), session=st.text(max_size=8), ttl_s=hostile_float),
    st.builds(p.LookupPrefix, tenant=read_tenant, keys=keys, lease=st.booleans(), ttl_s=hostile_float),
    st.builds(p.PoolEventsQuery, tenant=read_tenant, with_keys=st.booleans()),
)
FUZZED_TYPES = {p.MountSegment, p.AnnounceObjects, p.UnmountSegment, p.Heartbeat, p.GetSegments, p.PutStart, p.PutEnd,
                p.PutRevoke, p.PutLanded, p.EndQuarantine, p.LookupPrefix, p.ReleaseLeases, p.Exists, p.Remove,
                p.PutValue, p.GetValue, p.Stats, p.LaneQuery, p.SessionEvents, p.PoolEventsQuery}

# what only the authenticated master is given (see the module comment); node calls are forbidden
real_segment = st.integers(0, 9).map(lambda i: Learned("real_segment", i))
THREATS = st.one_of(
    st.integers(1, 8).flatmap(lambda n: st.builds(
        p.PutStart, tenant=st.just(GOOD_TENANT), keys=st.lists(good_keys, min_size=n, max_size=n, unique=True),
        sizes=st.lists(st.integers(1, 4096), min_size=n, max_size=n), parents=st.just([]))),
    st.builds(p.Remove, tenant=st.just(GOOD_TENANT), keys=st.lists(good_keys, min_size=1, max_size=64)),
    st.builds(p.UnmountSegment, segment_id=real_segment),
    st.builds(p.Heartbeat, node_id=st.just(REAL_NODE), segment_ids=st.lists(real_segment, min_size=1, max_size=2),
              directory_seqs=small_int_list),
    st.builds(p.AnnounceObjects, segment_id=real_segment, entries=st.lists(dir_entry, max_size=3), ages_s=st.just([]),
              last=st.booleans()),
    st.builds(p.MountSegment, node_id=st.just(REAL_NODE), host_id=odd_text, size_bytes=st.sampled_from([2**30, 2**40]),
              base_addr=hostile_int, agent_name=odd_text, agent_metadata=st.binary(max_size=16)),
)
NODE_CALLS = (p.MountSegment, p.AnnounceObjects, p.UnmountSegment, p.Heartbeat)

REQUEST_TYPES = [t for t in p.Request.__args__]  # type: ignore[attr-defined]
TAGS = [t.__struct_config__.tag for t in REQUEST_TYPES]
FIELDS = {t.__struct_config__.tag: [f.name for f in msgspec.structs.fields(t)] for t in REQUEST_TYPES}
msgpack_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), hostile_float, st.text(max_size=20),
              st.binary(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


raw_tags = st.one_of(st.sampled_from(TAGS), st.text(max_size=12), st.integers(-(2**63), 2**63 - 1), st.none())
extra_fields = st.dictionaries(st.text(max_size=8), msgpack_value, max_size=2)


@st.composite
def raw_maps(draw) -> dict:
    """A request-shaped msgpack map with wrong types, missing or extra fields, or an unknown tag."""
    tag = draw(raw_tags)
    names = FIELDS.get(tag, []) if isinstance(tag, str) else []
    body = {name: draw(msgpack_value) for name in names if draw(st.booleans())}
    body.update(draw(extra_fields))
    if draw(st.booleans()):
        body["type"] = tag
    return body


def _rid(rng: random.Random) -> bytes:
    return rng.getrandbits(64).to_bytes(8, "little")


FORMS = st.sampled_from(["struct"] * 6 + ["raw", "raw", "bytes", "frames", "request_id"])
request_ids = st.binary(min_size=8, max_size=8)
raw_payloads = st.one_of(raw_maps(), msgpack_value)
random_payloads = st.one_of(st.binary(max_size=300), st.sampled_from([b"", b"\xc1", b"\x81\xa4type"]))
bad_request_ids = st.one_of(st.binary(max_size=7), st.binary(min_size=9, max_size=40))
frame_counts = st.sampled_from([1, 3, 4, 7])
odd_frames = st.binary(max_size=12)


@st.composite
def wire_messages(draw, request_strategy):
    """(frames, request): the request, when it is one, for what its reply teaches, else None."""
    form = draw(FORMS)
    rid = draw(request_ids)
    if form == "struct":
        request = draw(request_strategy)
        return [rid, request], request
    if form == "raw":
        return [rid, draw(raw_payloads)], None
    if form == "bytes":
        return [rid, draw(random_payloads)], None
    if form == "request_id":
        bad_id = draw(bad_request_ids)
        return [bad_id, p.Stats()], None
    return [draw(odd_frames) for _ in range(draw(frame_counts))], None


# ---- the good client ------------------------------------------------------------------------


class GoodClient(threading.Thread):
    """Puts a chain of pinned objects (pinned: the fuzzer's puts must not evict them), and after
    each put reads it and a few older ones back, counts the chain and asks which exist."""

    def __init__(self, address: str, credential: str | None) -> None:
        super().__init__(name="good-client", daemon=True)
        self.client = Client(address, GOOD_TENANT, timeout_s=5.0, credential=credential)
        self.rng = random.Random(7)
        self.stop = threading.Event()
        self.objects: dict[str, int] = {}  # key -> size
        self.chain: list[str] = []
        self.errors: list[str] = []
        self.ops = 0
        self.slowest_s = 0.0

    def _timed(self, fn, *args, **kwargs):
        t0 = time.monotonic()
        out = fn(*args, **kwargs)
        self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
        self.ops += 1
        return out

    def check(self, keys: list[str]) -> None:
        for k in keys:
            got = self._timed(self.client.get, k)
            if got != pattern(k, self.objects[k]).tobytes():
                self.errors.append(f"get({k!r}) returned {None if got is None else len(got)} wrong bytes")

    def step(self) -> None:
        if len(self.chain) < GOOD_MAX_OBJECTS:
            k = f"good/{len(self.chain)}"
            size = self.rng.randrange(GOOD_MIN_BYTES, 2 * GOOD_MIN_BYTES)
            parent = self.chain[-1] if self.chain else None
            if self._timed(self.client.put, k, pattern(k, size).tobytes(), parent, pinned=True) is not True:
                self.errors.append(f"put({k!r}) found the key already there")
            self.objects[k] = size
            self.chain.append(k)
            self.check([k])
        self.check(self.rng.sample(self.chain, min(3, len(self.chain))))
        num_hit = self._timed(self.client.lookup_prefix, self.chain)
        if num_hit != len(self.chain):
            self.errors.append(f"lookup_prefix of the {len(self.chain)}-key chain hit {num_hit}")
        if self._timed(self.client.exists, self.chain[-5:]) != [True] * len(self.chain[-5:]):
            self.errors.append("exists() missed one of the last keys")

    def run(self) -> None:
        try:
            while not self.stop.is_set() and not self.errors:
                self.step()
                self.stop.wait(0.02)  # a steady client, not a second flood: the fuzzer's CPU is the test's time
        except Exception as e:  # a timeout or any failure is what this test looks for
            self.errors.append(f"{type(e).__name__}: {e}")


# ---- the test -------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


def _send_batch(sock: zmq.Socket, batch, known: Known, tally: Tally, rng: random.Random, authenticated: bool) -> None:
    encode = msgspec.msgpack.Encoder(enc_hook=known.resolve).encode
    waiting: dict[bytes, object] = {}
    expected = 0
    for frames, request in batch:
        wire = [f if isinstance(f, bytes) else encode(f) for f in frames]
        if request is not None:
            rid = _rid(rng)  # unique, so the reply can be matched to what it teaches
            wire[0] = rid
            waiting[rid] = request
        sock.send_multipart(wire)
        expected += 1
    tally.sent += expected
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while expected:
        assert sock.poll(max(0, int(1000 * (deadline - time.monotonic())))), (
            f"the master did not answer {expected} of {len(batch)} messages within {REPLY_TIMEOUT_S} s"
        )
        reply_frames = sock.recv_multipart()
        expected -= 1
        tally.answered += 1
        assert len(reply_frames) == 3, f"reply of {len(reply_frames)} frames"
        reply = p.reply_decoder.decode(reply_frames[2])
        name = reply.kind if isinstance(reply, p.ErrorReply) else type(reply).__name__
        tally.kinds[name] = tally.kinds.get(name, 0) + 1
        request = waiting.pop(reply_frames[0], None)
        assert not (isinstance(reply, p.ErrorReply) and reply.kind == "internal"), f"{reply.message}: {request!r:.600}"
        if authenticated and isinstance(request, (*NODE_CALLS, p.Stats)):  # a tenant's key may not make these
            assert isinstance(reply, p.ErrorReply) and reply.kind in ("forbidden", "rate_limited"), (reply, request)
        if isinstance(reply, p.PutStartReply):
            for token in reply.tokens:
                if token:
                    known.add("tokens", token)
        elif isinstance(reply, p.LookupReply) and reply.lease_id:
            known.add("leases", reply.lease_id)
        elif isinstance(reply, p.MountReply) and isinstance(request, p.MountSegment):
            known.add("segments", reply.segment_id)
            known.add("nodes", known.resolve(request.node_id) if isinstance(request.node_id, Learned) else request.node_id)


def _oversized(sock: zmq.Socket, tally: Tally) -> None:
    """Frames over the master's limit: answered with a protocol error (up to twice the limit)."""
    for size in (MAX_MESSAGE_BYTES + 1, 2 * MAX_MESSAGE_BYTES - 64):
        sock.send_multipart([b"\x01" * 8, b"\x00" * size])
        assert sock.poll(int(1000 * REPLY_TIMEOUT_S)), "no answer to an oversized message"
        reply = p.reply_decoder.decode(sock.recv_multipart()[2])
        assert isinstance(reply, p.ErrorReply) and reply.kind == "protocol", reply
        tally.sent += 1
        tally.answered += 1


def test_every_request_type_has_a_strategy():
    assert set(REQUEST_TYPES) == FUZZED_TYPES, "a new request type needs its strategy in `requests`"


@dataclass
class FuzzPool:
    master: procs.ManagedProcess
    auth: AuthDir | None  # None: an --insecure master

    def credential(self, role: str) -> str | None:
        return None if self.auth is None else str(self.auth.path / f"{role.replace(':', '-')}.cred")

    def connect(self, context: zmq.Context) -> zmq.Socket:
        """A raw DEALER, with the fuzzer's tenant key when the master authenticates."""
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.auth is not None:
            Credential.load(self.credential("tenant:evil")).apply_client(sock)
        sock.connect(self.master.info["address"])
        return sock


@pytest.fixture(params=["insecure", "auth"])
def fuzz_pool(tmp_path, request):
    master_args, node_args, auth = ["--max-message-bytes", str(MAX_MESSAGE_BYTES), "--put-timeout-s", "3"], [], None
    if request.param == "auth":
        auth = AuthDir(tmp_path / "auth")
        auth.init(("admin", "node"))
        for role in (f"tenant:{GOOD_TENANT}", "tenant:evil"):
            auth.add(role)
        master_args += ["--auth", str(auth.path)]
        node_args = ["--credential", str(auth.path / "node.cred")]
    master = procs.start_master(tmp_path, *master_args)
    node = None
    try:
        node = procs.start_node(tmp_path, master.info["address"], "128MiB", *node_args, name=REAL_NODE)
        yield FuzzPool(master, auth)
    finally:
        for proc in (node, master):
            if proc is not None:
                proc.stop(grace_s=5.0)


def test_master_serves_a_good_client_through_10000_hostile_messages(fuzz_pool):
    master = fuzz_pool.master
    address = master.info["address"]
    authenticated = fuzz_pool.auth is not None
    good = GoodClient(address, fuzz_pool.credential(f"tenant:{GOOD_TENANT}"))
    with Client(address, credential=fuzz_pool.credential("admin")) as admin:
        known = Known(real_segments=[n.segment_id for n in admin.stats().nodes])
    tally = Tally()
    rng = random.Random(1)
    context = zmq.Context()
    sock = fuzz_pool.connect(context)
    request_strategy = st.one_of(requests, THREATS) if authenticated else requests
    started = time.monotonic()
    good.start()
    try:

        @settings(max_examples=NUM_BATCHES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(batch=st.lists(wire_messages(request_strategy), min_size=BATCH, max_size=BATCH))
        def fuzz(batch) -> None:
            assert not good.errors, good.errors
            _send_batch(sock, batch, known, tally, rng, authenticated)

        fuzz()
        _oversized(sock, tally)
        # a frame over twice the limit: ZMQ drops it and closes that connection, nothing is answered
        flood = fuzz_pool.connect(context)
        flood.send_multipart([b"\x02" * 8, b"\x00" * (2 * MAX_MESSAGE_BYTES + 1)])
        flood.close()
        time.sleep(0.5)
    finally:
        good.stop.set()
        good.join(timeout=30)
        sock.close()
        context.term()
    elapsed_s = time.monotonic() - started
    print(f"fuzzed {tally.sent} messages in {elapsed_s:.1f} s; replies {tally.kinds}; good client "
          f"{good.ops} ops on {len(good.chain)} objects, slowest {good.slowest_s * 1000:.0f} ms")

    assert not good.errors, good.errors
    assert tally.sent >= 10_000 and tally.answered == tally.sent
    assert len(good.chain) >= 20, "the good client barely ran"
    # everything the good client stored is still there, byte for byte
    good.check(good.chain)
    assert good.client.lookup_prefix(good.chain) == len(good.chain)
    assert not good.errors, good.errors
    good.client.close()
    assert master.alive()
    assert master.stop(grace_s=10.0) == 0
    log_text = master.log_file.read_text(errors="replace")
    assert "internal error" not in log_text and "Traceback" not in log_text, log_text[-4000:]
