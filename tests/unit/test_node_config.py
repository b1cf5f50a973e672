from __future__ import annotations

import pytest

from kvpool.node.config import NodeConfig, format_size, parse_size


@pytest.mark.parametrize(
    "text,size_bytes",
    [
        ("64MiB", 64 << 20),
        ("4GiB", 4 << 30),
        ("4gib", 4 << 30),
        ("512M", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("10GB", 10 * 10**9),
        ("4096", 4096),
        (" 2 KiB ", 2048),
    ],
)
def test_parse_size(text, size_bytes):
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "4XB", "1e9", "four"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size():
    assert format_size(64 << 20) == "64 MiB"
    assert format_size(100) == "100 B"


def test_config_validation():
    ok = NodeConfig("tcp://127.0.0.1:5555", 64 << 20, node_id="n-1")
    assert ok.node_id == "n-1"
    for bad in (
        dict(master_address="127.0.0.1:5555"),
        dict(memory_bytes=1000),
        dict(memory_bytes=64.0 * (1 << 20)),
        dict(node_id="has space"),
        dict(node_id=""),
        dict(timeout_s=0),
        dict(mount_timeout_s=-1),
    ):
        args = dict(master_address="tcp://127.0.0.1:5555", memory_bytes=64 << 20) | bad
        with pytest.raises(ValueError):
            NodeConfig(**args)
