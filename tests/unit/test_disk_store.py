"""The node's disk store on a real directory: round trip, commit and checksums (a cut or corrupted
file is detected and dropped, never read as good), capacity (a full tier refuses clearly and
leaves nothing behind), recycled files, reopening after a restart."""

import ctypes
import mmap

import pytest
import xxhash

from kvpool.node.disk_store import BLOCK, DiskError, DiskFull, DiskStore, file_bytes_for

KiB = 1024


def region(data: bytes):
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[: len(data)] = data
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def value(i: int, size: int = 100 * KiB) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def put(store, key: str, data: bytes, parent=None) -> int:
    buf, addr = region(data)
    checksum = xxhash.xxh3_64_intdigest(data) or 1
    assert store.write_from("t", key, parent, checksum, addr, len(data))
    return checksum


def get(store, key: str, checksum: int, size: int) -> bytes | None:
    buf, addr = region(bytes(size))
    return bytes(buf[:size]) if store.read_into("t", key, checksum, addr) else None


def test_round_trip_reopen_and_recycled_files(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.open() == []
    sums = {f"k{i}": put(store, f"k{i}", value(i), parent=f"k{i - 1}" if i else None) for i in range(3)}
    assert store.used_bytes == 3 * file_bytes_for(100 * KiB)
    assert get(store, "k1", sums["k1"], 100 * KiB) == value(1)
    assert get(store, "k1", sums["k1"] ^ 1, 100 * KiB) is None  # another version: not this object
    store.forget("t", "k0")
    assert store.free_file_bytes == file_bytes_for(100 * KiB) and len(list((tmp_path / "free").iterdir())) == 1
    put(store, "k3", value(3))  # written over the recycled file
    assert store.free_file_bytes == 0 and store.used_bytes == 3 * file_bytes_for(100 * KiB)
    store.close()
    again = DiskStore(tmp_path, 1 << 20)
    found = {o.key: o for o in again.open()}
    assert sorted(found) == ["k1", "k2", "k3"]
    assert found["k2"].parent == "k1" and found["k3"].parent is None
    assert get(again, "k3", found["k3"].checksum, 100 * KiB) == value(3)


def test_cut_and_corrupted_files_are_dropped(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.open()
    sums = [put(store, f"k{i}", value(i)) for i in range(3)]
    paths = [store.path_of("t", f"k{i}") for i in range(3)]
    store.close()
    with open(paths[0], "r+b") as f:
        f.truncate(BLOCK + 50 * KiB)
    with open(paths[1], "r+b") as f:
        f.seek(BLOCK + 10)
        f.write(b"\xff")
    with open(paths[2].with_suffix(".tmp"), "wb") as f:  # a write cut by a crash before its rename
        f.write(b"partial")
    store = DiskStore(tmp_path, 1 << 20)
    assert sorted(o.key for o in store.open()) == ["k1", "k2"]
    assert not paths[0].exists() and not paths[2].with_suffix(".tmp").exists()
    with pytest.raises(DiskError, match="corrupted"):
        get(store, "k1", sums[1], 100 * KiB)
    assert ("t", "k1") not in store.objects and not paths[1].exists()
    assert get(store, "k2", sums[2], 100 * KiB) == value(2)


def test_full_tier_refuses_and_keeps_nothing(tmp_path):
    store = DiskStore(tmp_path, 2 * file_bytes_for(100 * KiB) + BLOCK)
    store.open()
    put(store, "a", value(1))
    put(store, "b", value(2))
    data = value(3)
    buf, addr = region(data)
    with pytest.raises(DiskFull, match="--disk-size"):
        store.write_from("t", "c", None, xxhash.xxh3_64_intdigest(data) or 1, addr, len(data))
    assert ("t", "c") not in store.objects and not store.path_of("t", "c").exists()
    assert not list(tmp_path.glob("*/*.tmp"))
    # bytes changed since the commit: nothing is written
    assert not store.write_from("t", "d", None, 12345, addr, len(data))
