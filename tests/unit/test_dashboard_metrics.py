"""Every metric the shipped Grafana dashboard queries is one kvpool exports (its name is in the
source): a renamed metric must not leave a panel silently empty."""

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def queried_metrics() -> set[str]:
    dashboard = json.loads((ROOT / "docs/operations/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"(?:vllm:)?kvpool_[a-z0-9_]+", e)}


def connector_metric_names() -> set[str]:
    """vllm:kvpool_* names, as connector/stats.py builds them from its COUNTERS and LATENCIES (read
    without importing vLLM)."""
    tree = ast.parse((ROOT / "src/kvpool/connector/stats.py").read_text())
    tables = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("COUNTERS", "LATENCIES")}  # fmt: skip
    return ({f"vllm:kvpool_{n}" for n in tables["COUNTERS"]}
            | {f"vllm:kvpool_{n.removesuffix('_latency_s')}_seconds" for n in tables["LATENCIES"]})


def master_metric_names() -> set[str]:
    """The families the master's collector exports (built from its stats, so read them off it)."""
    from kvpool.core.protocol.stats import StatsReply
    from kvpool.master.metrics import MasterCollector

    zeros = dict.fromkeys(("capacity_bytes", "used_bytes", "num_objects", "num_pending", "puts", "gets", "lookups",
                           "hit_keys", "miss_keys", "evictions", "evicted_bytes", "lease_grants", "lease_expiries"), 0)
    stats = StatsReply(**zeros, fragmentation=0.0, nodes=[])
    return {family.name for family in MasterCollector(lambda: stats).collect()}


def base_name(metric: str) -> str:
    for suffix in SUFFIXES:
        if metric.endswith(suffix):
            return metric[: -len(suffix)]
    return metric


def test_every_dashboard_metric_is_exported():
    source = "\n".join(p.read_text() for p in (ROOT / "src/kvpool").rglob("*.py"))
    queried, exported = queried_metrics(), connector_metric_names() | master_metric_names()
    assert len(queried) > 20
    missing = sorted(m for m in queried if not (
        base_name(m) in exported or f'"{base_name(m)}"' in source))
    assert not missing, f"the dashboard queries metrics nothing exports: {missing}"
