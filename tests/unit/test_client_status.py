"""`kvpool status`: rendering of the stats and behaviour when the master is not there."""

import argparse

from rich.console import Console

from kvpool.client import status_cli
import msgspec

from kvpool.core.protocol import NodeStats, StatsReply, TenantStats


def _stats() -> StatsReply:
    return StatsReply(
        capacity_bytes=128 * 2**20,
        used_bytes=32 * 2**20,
        num_objects=7,
        num_pending=1,
        puts=9,
        gets=4,
        lookups=6,
        hit_keys=3,
        miss_keys=1,
        evictions=2,
        evicted_bytes=2**20,
        lease_grants=3,
        lease_expiries=0,
        fragmentation=0.125,
        nodes=[
            NodeStats("node-b", 2, "h", "dead", 64 * 2**20, 0, 0, 12.5),
            NodeStats("node-a", 1, "h", "alive", 64 * 2**20, 32 * 2**20, 7, 0.4),
        ],
    )


def test_render_shows_pool_and_nodes():
    console = Console(record=True, width=160)
    console.print(status_cli.render(_stats(), "tcp://127.0.0.1:1"))
    text = console.export_text()
    assert "1 alive / 2" in text
    assert "128.0 MiB" in text and "32.0 MiB (25.0 %)" in text
    assert "7 (1 pending)" in text
    assert "75.0 % of 4" in text  # hit rate: 3 hit keys of 4 looked up
    assert "2 (1.0 MiB)" in text  # evictions
    assert "12.5 %" in text  # fragmentation
    assert text.index("node-a") < text.index("node-b")  # sorted by node id
    assert "dead" in text and "12.5 s" in text
    assert "tenants" not in text  # no tenant table without tenants


def test_render_shows_tenants_and_refusals():
    stats = msgspec.structs.replace(_stats(), forbidden=3, rate_limited=5, refused_handshakes=1, tenants=[
        TenantStats("bob", 16 * 2**20, 4, max_bytes=16 * 2**20, quota_refusals=2, num_segments=1),
        TenantStats("alice", 2**20, 1),
    ])
    console = Console(record=True, width=200)
    console.print(status_cli.render(stats, "tcp://127.0.0.1:1"))
    text = console.export_text()
    assert "3 / 5 / 1" in text
    assert text.index("alice") < text.index("bob")
    bob = next(line for line in text.splitlines() if "bob" in line)
    assert "16.0 MiB" in bob and " 2 " in bob


def test_render_shows_a_hybrid_models_kv_cache_groups():
    from kvpool.core.protocol import KeyGroupStats

    stats = msgspec.structs.replace(_stats(), tenants=[TenantStats(
        "vllm-gemma", 40 * 2**20, 500, key_groups=[KeyGroupStats("g0", 400, 32 * 2**20), KeyGroupStats("g1", 100, 8 * 2**20)],
    )])  # fmt: skip
    console = Console(record=True, width=200)
    console.print(status_cli.render(stats, "tcp://127.0.0.1:1"))
    text = console.export_text()
    assert "KV-cache groups" in text
    g1 = next(line for line in text.splitlines() if " g1 " in line)
    assert "100" in g1 and "8.0 MiB" in g1 and "81.9 KiB" in g1 and "20.0 %" in g1  # 8 MiB / 100 objects
    assert "KV-cache groups" not in _render(_stats())


def _render(stats) -> str:
    console = Console(record=True, width=200)
    console.print(status_cli.render(stats, "tcp://127.0.0.1:1"))
    return console.export_text()


def test_bad_address_is_a_usage_exit():
    args = argparse.Namespace(master="not-an-endpoint", json=True, timeout_s=0.3, credential=None)
    assert status_cli.run(args) == 2
