"""What to load and what to save, in pool objects and vLLM block ids (pure: no I/O, no vLLM).

Rules:
- Token counts handed to us by vLLM's scheduler are block-aligned for hits (vLLM presents a
  block-aligned local hit to connectors) and object-aligned for our own hits.
- A hit never covers the last token of a request: vLLM must compute at least one token to sample
  the next, so the lookup window stops at `num_tokens - 1` (vLLM's local prefix cache does the same).
- A load writes only blocks past the local hit. When the local hit ends inside an object (objects
  of several blocks), that object's leading blocks are read into a scratch region instead: they
  are shared, cached blocks of other requests and must never be written.
- A save covers objects whose every token has computed KV after the step AND whose block hashes
  exist (hashes appear when a block's tokens are all known; during decode they follow the output).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    block_size: int  # tokens per vLLM block
    blocks_per_object: int  # vLLM blocks per pool object

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.blocks_per_object < 1:
            raise ValueError(f"block_size and blocks_per_object must be >= 1, got {self}")

    @property
    def tokens_per_object(self) -> int:
        return self.block_size * self.blocks_per_object


def lookup_window(geom: Geometry, num_tokens: int, num_block_hashes: int) -> int:
    """How many leading objects may be loaded: complete, hashed, and leaving >= 1 token to compute."""
    if num_tokens <= 1:
        return 0
    return min(num_block_hashes // geom.blocks_per_object, (num_tokens - 1) // geom.tokens_per_object)


def external_tokens(geom: Geometry, num_hit_objects: int, num_local_tokens: int) -> int:
    """Tokens the pool adds beyond vLLM's local hit (0 when the local hit is as long)."""
    return max(0, num_hit_objects * geom.tokens_per_object - num_local_tokens)


@dataclass(frozen=True)
class LoadSpec:
    """Read `keys` into the request's blocks. block_ids[i] are object i's blocks in order; None marks
    a block already computed locally, read into scratch memory and dropped."""

    req_id: str
    keys: list[str]
    block_ids: list[list[int | None]]
    groups: list[int] | None = None  # hybrid models: object i is one block of KV-cache group groups[i]

    @property
    def real_block_ids(self) -> list[int]:
        return [b for blocks in self.block_ids for b in blocks if b is not None]


def plan_load(
    geom: Geometry, req_id: str, keys: list[str], first_object: int,
    num_local_tokens: int, num_external_tokens: int, block_ids: list[int],
) -> LoadSpec:
    """`keys` are the keys of objects first_object..; block_ids is the request's block table."""
    if num_local_tokens % geom.block_size:
        raise ValueError(f"the local hit ({num_local_tokens} tokens) is not block-aligned")
    end_tokens = num_local_tokens + num_external_tokens
    if num_external_tokens <= 0 or end_tokens % geom.tokens_per_object:
        raise ValueError(f"a load must end on an object boundary, got {num_local_tokens}+{num_external_tokens}")
    first_block = num_local_tokens // geom.block_size
    end_block = end_tokens // geom.block_size
    if len(block_ids) < end_block:
        raise ValueError(f"the request has {len(block_ids)} blocks, the load needs {end_block}")
    k = geom.blocks_per_object
    if first_object != first_block // k:
        raise ValueError(f"keys start at object {first_object}, the load at object {first_block // k}")
    objects = range(first_block // k, end_block // k)
    if len(keys) != len(objects):
        raise ValueError(f"{len(keys)} keys for {len(objects)} objects")
    per_object = [
        [block_ids[b] if b >= first_block else None for b in range(obj * k, (obj + 1) * k)] for obj in objects
    ]
    return LoadSpec(req_id, list(keys), per_object)


def failed_block_ids(spec: LoadSpec, num_loaded_objects: int) -> set[int]:
    """Blocks of objects that were not read completely: vLLM recomputes from the first of them."""
    return {b for blocks in spec.block_ids[num_loaded_objects:] for b in blocks if b is not None}


@dataclass(frozen=True)
class SaveSpec:
    """Write objects from the request's blocks. parents[i] is the key object i extends (the pool
    evicts chain tails first). The scheduler holds a reference on every block until `job_id` is
    reported done."""

    job_id: int
    req_id: str
    keys: list[str]
    parents: list[str | None]
    block_ids: list[list[int]]
    groups: list[int] | None = None  # hybrid models: object i is one block of KV-cache group groups[i]
    session: str = ""  # the agent session the request belongs to ("": none), a hint for the pool's eviction
    ttl_s: float = 0.0  # keep the objects at least this long (0: no TTL)


def savable_objects(
    geom: Geometry, num_computed_tokens: int, num_block_hashes: int, limit_tokens: int | None = None
) -> int:
    """Leading objects whose KV exists after this step and whose keys are known."""
    count = min(num_computed_tokens // geom.tokens_per_object, num_block_hashes // geom.blocks_per_object)
    if limit_tokens is not None:
        count = min(count, limit_tokens // geom.tokens_per_object)
    return max(count, 0)

