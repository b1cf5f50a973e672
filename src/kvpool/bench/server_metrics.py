"""vLLM's prefix-cache counters, scraped from each server's /metrics before and after a replay.

vLLM counts tokens: `prefix_cache_queries/hits` for its local (device) prefix cache over every
scheduled prompt, `external_prefix_cache_queries/hits` for a KV connector over the tokens that
missed locally. Sums are taken over every label set (engines, models). A server that does not
answer, or answers without vLLM counters (a proxy), gives None: the report says "unknown" rather
than a made-up zero.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

COUNTERS = {
    "local_queries": "vllm:prefix_cache_queries_total",
    "local_hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    # KVPoolConnector's own counters (absent without it): a hit whose load fails is recomputed,
    # but vLLM has already counted it in external_prefix_cache_hits
    "pool_loaded_blocks": "vllm:kvpool_loaded_blocks_total",
    "pool_load_failed_blocks": "vllm:kvpool_load_failed_blocks_total",
    "pool_saves_deferred": "vllm:kvpool_saves_deferred_total",
    "pool_saves_dropped": "vllm:kvpool_saves_dropped_total",
    "pool_lookups_deferred": "vllm:kvpool_lookups_deferred_total",
    "pool_lookups_given_up": "vllm:kvpool_lookups_given_up_total",
    "pool_unavailable": "vllm:kvpool_pool_unavailable_total",
}


@dataclass(frozen=True)
class CacheCounters:
    local_queries: float = 0.0
    local_hits: float = 0.0
    external_queries: float = 0.0
    external_hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    pool_loaded_blocks: float = 0.0
    pool_load_failed_blocks: float = 0.0
    pool_saves_deferred: float = 0.0
    pool_saves_dropped: float = 0.0
    pool_lookups_deferred: float = 0.0
    pool_lookups_given_up: float = 0.0
    pool_unavailable: float = 0.0

    def __add__(self, other: "CacheCounters") -> "CacheCounters":
        return CacheCounters(**{k: getattr(self, k) + getattr(other, k) for k in COUNTERS})

    def __sub__(self, other: "CacheCounters") -> "CacheCounters":
        return CacheCounters(**{k: getattr(self, k) - getattr(other, k) for k in COUNTERS})

    def hit_rates(self, block_size: int | None = None) -> dict[str, float | None]:
        """local: local hits / prompt tokens queried; external: pool hits / tokens that missed
        locally; combined: local + pool hits / prompt tokens queried; combined_loaded: the same
        less the blocks whose pool load failed (`block_size` tokens each; needs the block size)."""

        def ratio(a: float, b: float) -> float | None:
            return a / b if b > 0 else None

        loaded = None
        if block_size is not None:
            failed_tokens = self.pool_load_failed_blocks * block_size
            loaded = ratio(self.local_hits + max(0.0, self.external_hits - failed_tokens), self.local_queries)
        return {
            "local": ratio(self.local_hits, self.local_queries),
            "external": ratio(self.external_hits, self.external_queries),
            "combined": ratio(self.local_hits + self.external_hits, self.local_queries),
            "combined_loaded": loaded,
        }


def parse_counters(text: str) -> CacheCounters | None:
    """Sum the counters in a Prometheus text exposition; None when it has no vLLM prefix counters."""
    wanted = {name: field for field, name in COUNTERS.items()}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        field = wanted.get(line[:name_end])
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        totals[field] = totals.get(field, 0.0) + value
    if "local_queries" not in totals:
        return None
    return CacheCounters(**totals)


async def scrape(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0) -> CacheCounters | None:
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return parse_counters(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


async def scrape_all(session: aiohttp.ClientSession, base_urls: list[str]) -> list[CacheCounters | None]:
    return list(await asyncio.gather(*(scrape(session, url) for url in base_urls)))


def total_delta(before: list[CacheCounters | None], after: list[CacheCounters | None]) -> CacheCounters | None:
    """Sum of after - before over servers; None if any server could not be read either time."""
    total = CacheCounters()
    for b, a in zip(before, after, strict=True):
        if a is None or b is None:
            return None
        total = total + (a - b)
    return total
