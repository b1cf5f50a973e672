"""Pool namespaces and object keys for vLLM's KV (pure: no I/O, no vLLM import).

Rules:
- An object is `blocks_per_object` consecutive vLLM blocks. Its key is the hex of the LAST block's
  hash. vLLM's block hashes are chained (each hash covers the whole prefix up to its block, plus
  the request's cache_salt / LoRA / multimodal inputs), so a key names the entire prefix, and the
  key of object i-1 is the parent of object i: the pool evicts chain tails first.
- The namespace (the pool tenant) covers everything that makes two deployments' bytes for the same
  token prefix differ: model identity, dtypes, block size, KV layout, device kind, TP/PP rank and
  size, the block-hash algorithm, objects' size in blocks, and the operator's tenant / cache salt.
  It is a readable prefix plus a digest of all of these, so it fits the pool's tenant length limit
  and two deployments that could not share KV never collide.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence

from kvpool.core.types import MAX_TENANT_LENGTH, ObjectKey, Tenant

_DIGEST_CHARS = 32  # 128 bits of sha256
# vLLM 0.32 (v1/core/kv_cache_utils.init_none_hash): with a non-cryptographic block hash the chain's
# seed is random per process unless PYTHONHASHSEED is set, so two instances never share a key
_PER_PROCESS_SEED_ALGOS = ("xxhash", "xxhash_cbor")
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def unshareable_hash_reason(hash_algo: str, pythonhashseed: str | None) -> str | None:
    """Why instances configured so could never hit each other's KV in the pool, or None."""
    if hash_algo in _PER_PROCESS_SEED_ALGOS and pythonhashseed is None:
        return (
            f"vLLM's prefix_caching_hash_algo is {hash_algo!r} and PYTHONHASHSEED is not set: vLLM then seeds "
            "block hashes randomly in every process, so no two instances would ever share a pool object "
            "(0 % cross-instance hits). Set PYTHONHASHSEED to the same value on every instance, or use "
            "--prefix-caching-hash-algo sha256 (the default)"
        )
    return None


def derive_namespace(readable: str, identity: Mapping[str, object]) -> Tenant:
    """'vllm-<readable>-<digest of identity>'; `identity` must be JSON-serialisable."""
    try:
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    except TypeError as exc:  # keys that are not strings
        raise ValueError(f"namespace identity is not serialisable: {exc}") from None
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:_DIGEST_CHARS]
    room = MAX_TENANT_LENGTH - len("vllm--") - _DIGEST_CHARS
    label = _UNSAFE.sub("-", readable.lower()).strip("-")[:room].strip("-") or "model"
    return Tenant(f"vllm-{label}-{digest}")


def readable_model_name(model: str) -> str:
    """The last path component of a model path or hub id ('/x/y/Llama-3-8B' -> 'llama-3-8b')."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def hash_hex(block_hash: object) -> str:
    """vLLM's BlockHash is bytes (sha256 digest, or sha256 over CBOR); be explicit about others."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return format(block_hash & ((1 << 256) - 1), "x")
    raise TypeError(f"unsupported block hash type {type(block_hash).__name__}")


def object_keys(block_hashes: Sequence[object], blocks_per_object: int, start: int, stop: int) -> list[ObjectKey]:
    """Keys of objects [start, stop). Requires len(block_hashes) >= stop * blocks_per_object."""
    if blocks_per_object < 1:
        raise ValueError(f"blocks_per_object must be >= 1, got {blocks_per_object}")
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got {start}, {stop}")
    if stop * blocks_per_object > len(block_hashes):
        raise ValueError(
            f"objects up to {stop} need {stop * blocks_per_object} block hashes, have {len(block_hashes)}"
        )
    return [ObjectKey(hash_hex(block_hashes[(i + 1) * blocks_per_object - 1])) for i in range(start, stop)]
