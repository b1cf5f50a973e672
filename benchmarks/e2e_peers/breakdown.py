"""Where a request's time goes, from the servers' own histograms (vLLM's and KVPoolConnector's).

Pure: Prometheus text in, means out. Each run starts fresh servers, so a histogram's _sum/_count
at the end of the replay covers exactly that run's requests.

- queue: waiting in vLLM's scheduler before the first step (vllm:request_queue_time_seconds);
- prefill: from the first scheduled step to the first token, which includes loading external KV
  (vllm:request_prefill_time_seconds);
- server TTFT (vllm:time_to_first_token_seconds); the client's TTFT adds the router and HTTP;
- kvpool lookup round trip and load / save job (vllm:kvpool_{lookup,load,save}_seconds), per call;
- counters summed over servers (`counters`): kvpool's lookups and the engine steps in which a
  request's lookup was still in flight (each such step skips the request once), vLLM's external
  prefix-cache queries and hits.
"""

from __future__ import annotations

HISTOGRAMS = {
    "server_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "pool_lookup": "vllm:kvpool_lookup_seconds",
    "pool_load": "vllm:kvpool_load_seconds",
    "pool_save": "vllm:kvpool_save_seconds",
}


# MooncakeStoreConnector's one histogram, split by its `operation` label: the same columns as kvpool's
MOONCAKE_OPERATIONS = {"load_get": "pool_load", "save_put": "pool_save"}
MOONCAKE_HISTOGRAM = "vllm:mooncake_store_operation_time_seconds"


def _name_of(metric: str, labels: str, by_metric: dict[str, str]) -> str | None:
    if metric == MOONCAKE_HISTOGRAM:
        return next((n for op, n in MOONCAKE_OPERATIONS.items() if f'operation="{op}"' in labels), None)
    return by_metric.get(metric)


def _samples(text: str):
    """(metric, labels, value) per sample line of a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        metric, _, labels = key.partition("{")
        try:
            yield metric, labels, float(value)
        except ValueError:
            pass


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """{short name: (sum of seconds, count)} summed over label sets, for the HISTOGRAMS present (and
    Mooncake's load and save operations, under kvpool's load and save names)."""
    by_metric = {metric: name for name, metric in HISTOGRAMS.items()}
    out: dict[str, list[float]] = {}
    for metric, labels, value in _samples(text):
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            name = _name_of(metric.removesuffix(suffix), labels, by_metric) if metric.endswith(suffix) else None
            if name is not None:
                out.setdefault(name, [0.0, 0.0])[slot] += value
    return {name: (s, c) for name, (s, c) in out.items()}


def merge(texts: list[str | None]) -> dict[str, dict[str, float]] | None:
    """Means over every server's requests: {name: {"mean_s", "count"}}; None if no server answered."""
    totals: dict[str, list[float]] = {}
    answered = False
    for text in texts:
        if text is None:
            continue
        answered = True
        for name, (s, c) in histogram_totals(text).items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += s
            acc[1] += c
    if not answered:
        return None
    return {name: {"mean_s": s / c if c else None, "count": c} for name, (s, c) in totals.items()}


COUNTERS = {
    "lookups": "vllm:kvpool_lookups_total",
    "lookups_deferred": "vllm:kvpool_lookups_deferred_total",
    "lookups_cached": "vllm:kvpool_lookups_cached_total",
    "loads": "vllm:kvpool_loads_total",
    "loaded_blocks": "vllm:kvpool_loaded_blocks_total",
    "load_failed_blocks": "vllm:kvpool_load_failed_blocks_total",
    "saved_blocks": "vllm:kvpool_saved_blocks_total",
    "save_existing_blocks": "vllm:kvpool_save_existing_blocks_total",
    "save_failed_blocks": "vllm:kvpool_save_failed_blocks_total",
    "saves_deferred": "vllm:kvpool_saves_deferred_total",
    "saves_dropped": "vllm:kvpool_saves_dropped_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
}


def counters(texts: list[str | None]) -> dict[str, float]:
    """{short name: value summed over label sets and servers} for the COUNTERS present."""
    by_metric = {metric: name for name, metric in COUNTERS.items()}
    out: dict[str, float] = {}
    for text in texts:
        for metric, _, value in _samples(text or ""):
            if (name := by_metric.get(metric)) is not None:
                out[name] = out.get(name, 0.0) + value
    return out
