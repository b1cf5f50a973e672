"""The peers benchmark's store adapters: one per store, each offering the same operations in the
store's own best way (clients.py runs the cases on them).

Every adapter offers zero-copy batch put/get between registered memory and the store (Redis has
none: its client copies into and out of Python bytes, which is part of what Redis costs), a batch
existence check (kvpool: one prefix lookup; Mooncake: batch_is_exist; Redis: a pipeline of
EXISTS), a single-key existence round trip, and plain bytes get/put.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

KiB, MiB = 1024, 1024 * 1024
MOONCAKE_MAX_REGIONS_PER_CALL = 1024  # a 4,096-region call stored half its objects (notes/nixl.md)


class KvpoolAdapter:
    def __init__(self, spec: dict) -> None:
        from kvpool.client import Client
        from kvpool.transfer import DataPlane

        path = spec.get("path", "auto")
        for option in ("lane_spin_us", "segment_lane_spin_us"):  # master calls' and lane jobs' spins (A/Bs)
            if option in spec:
                os.environ[f"KVPOOL_{option.upper()}"] = str(spec[option])
        self.plane = None
        if "nixl_progress_thread" in spec:  # a variant of the data plane (before/after a fix)
            self.plane = DataPlane(path=path, nixl_progress_thread=spec["nixl_progress_thread"])
        # lane=False: master round trips over ZMQ only, as before the lane (rpc/tcp_channel.py)
        self.client = Client(spec["master"], spec["tenant"], timeout_s=30.0, path=path, plane=self.plane,
                             lane=spec.get("lane", True), landing=spec.get("landing", True),
                             checksums=spec.get("checksums", True))

    def register(self, buf: np.ndarray) -> None:
        self.client.register(buf)

    def put_from(self, keys, addrs, sizes) -> None:
        statuses = self.client.put_from(keys, addrs, sizes, parents=[None] * len(keys))
        if any(s != 0 for s in statuses):
            raise RuntimeError(f"kvpool put: statuses {sorted(set(statuses))}")

    def get_into(self, keys, addrs, sizes) -> int:
        return self.client.get_into(keys, addrs, sizes)

    def exists_batch(self, keys) -> int:
        return self.client.lookup_prefix(keys)

    def exists_one(self, key) -> bool:
        return self.client.lookup_prefix([key]) == 1

    def put_bytes(self, key, value: bytes) -> None:
        self.client.put(key, value)

    def get_bytes(self, key) -> bytes | None:
        return self.client.get(key)

    def remove(self, keys) -> None:
        self.client.remove(keys)

    def route(self) -> list[str]:
        """The routes made, and "lane" once a job went over a segment lane (a nixl route's small jobs)."""
        used = {path for path, jobs in self.client.plane.jobs_by_path.items() if jobs}
        return sorted(set(self.client.plane.paths().values()) | (used & {"lane"}))

    def close(self) -> None:
        self.client.close()
        if self.plane is not None:
            self.plane.close()


class MooncakeAdapter:
    def __init__(self, spec: dict) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        # global segment 0: this client contributes no memory (standalone-store mode), so every
        # byte goes to the storage process on the other host, as kvpool's do
        rc = self.store.setup(spec["local_ip"], spec["metadata_url"], 0, 64 * MiB, spec["protocol"], "",
                              spec["master"])  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"mooncake setup returned {rc}")

    def register(self, buf: np.ndarray) -> None:
        rc = self.store.register_buffer(int(buf.ctypes.data), buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer returned {rc}")

    @staticmethod
    def _calls(keys, addrs, sizes):
        """Split into calls of at most MOONCAKE_MAX_REGIONS_PER_CALL regions."""
        start, regions = 0, 0
        for i, a in enumerate(addrs):
            if regions + len(a) > MOONCAKE_MAX_REGIONS_PER_CALL and i > start:
                yield keys[start:i], addrs[start:i], sizes[start:i]
                start, regions = i, 0
            regions += len(a)
        if start < len(keys):
            yield keys[start:], addrs[start:], sizes[start:]

    def put_from(self, keys, addrs, sizes) -> None:
        for k, a, s in self._calls(keys, addrs, sizes):
            if all(len(x) == 1 for x in a):
                rcs = self.store.batch_put_from(k, [x[0] for x in a], [x[0] for x in s])
            else:
                rcs = self.store.batch_put_from_multi_buffers(k, a, s)
            if any(rc != 0 for rc in rcs):
                raise RuntimeError(f"mooncake put: return codes {sorted(set(rcs))}")

    def get_into(self, keys, addrs, sizes) -> int:
        count = 0
        for k, a, s in self._calls(keys, addrs, sizes):
            if all(len(x) == 1 for x in a):
                rcs = self.store.batch_get_into(k, [x[0] for x in a], [x[0] for x in s])
            else:
                rcs = self.store.batch_get_into_multi_buffers(k, a, s)
            for rc, sz in zip(rcs, s):
                if rc != sum(sz):
                    return count
                count += 1
        return count

    def exists_batch(self, keys) -> int:
        found = self.store.batch_is_exist(keys)
        return next((i for i, f in enumerate(found) if f != 1), len(keys))

    def exists_one(self, key) -> bool:
        return self.store.is_exist(key) == 1

    def put_bytes(self, key, value: bytes) -> None:
        rc = self.store.put(key, value)
        if rc != 0:
            raise RuntimeError(f"mooncake put returned {rc}")

    def get_bytes(self, key) -> bytes | None:
        value = self.store.get(key)
        return value if value else None

    def remove(self, keys) -> None:
        self.store.batch_remove(keys, True)

    def route(self) -> list[str]:
        return []

    def close(self) -> None:
        self.store.close()


class MooncakeIpcAdapter(MooncakeAdapter):
    """Mooncake's same-host mode: a `mooncake_client` process on this host owns the segment and
    talks to the master; this process attaches over IPC (`setup_dummy`). Its zero-copy calls take
    only memory from its shared pool (`alloc_from_mem_pool`), so the cases get their buffers from
    `buffer()`; the pool is sized for one worker's cases: twice the fill (source and destination)
    or 640 MiB (a round's largest cases together: 2 x 128 MiB + 2 x 64 MiB + 2 x 64 MiB)."""

    def __init__(self, spec: dict) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        pool_bytes = 2 * spec["fill_bytes"] + 64 * MiB if "fill_bytes" in spec else 640 * MiB
        rc = self.store.setup_dummy(pool_bytes, 16 * MiB, spec["real_client"])
        if rc != 0:
            raise RuntimeError(f"mooncake setup_dummy returned {rc}")

    def buffer(self, nbytes: int) -> np.ndarray:
        import ctypes

        addr = self.store.alloc_from_mem_pool(nbytes)
        if not addr:
            raise RuntimeError(f"mooncake alloc_from_mem_pool({nbytes}) failed (pool exhausted?)")
        rc = self.store.register_buffer(addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer returned {rc}")
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class RedisAdapter:
    def __init__(self, spec: dict) -> None:
        import redis

        self.redis = redis.Redis(host=spec["host"], port=spec["port"], socket_timeout=30)
        self.redis.ping()
        self.buf_base: list[tuple[int, np.ndarray]] = []

    def register(self, buf: np.ndarray) -> None:
        self.buf_base.append((int(buf.ctypes.data), buf))

    def _view(self, addr: int, size: int) -> np.ndarray:
        for base, buf in self.buf_base:
            if base <= addr and addr + size <= base + buf.nbytes:
                return buf[addr - base : addr - base + size]
        raise ValueError("address not in a registered buffer")

    def put_from(self, keys, addrs, sizes) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for k, a, s in zip(keys, addrs, sizes):
            value = self._view(a[0], s[0]).tobytes() if len(a) == 1 else b"".join(
                self._view(x, n).tobytes() for x, n in zip(a, s))  # fmt: skip
            pipe.set(k, value)
        if not all(pipe.execute()):
            raise RuntimeError("redis SET failed")

    def get_into(self, keys, addrs, sizes) -> int:
        pipe = self.redis.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        count = 0
        for value, a, s in zip(pipe.execute(), addrs, sizes):
            if value is None or len(value) != sum(s):
                break
            src, off = np.frombuffer(value, dtype=np.uint8), 0
            for x, n in zip(a, s):
                self._view(x, n)[:] = src[off : off + n]
                off += n
            count += 1
        return count

    def exists_batch(self, keys) -> int:
        pipe = self.redis.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        found = pipe.execute()
        return next((i for i, f in enumerate(found) if not f), len(keys))

    def exists_one(self, key) -> bool:
        return bool(self.redis.exists(key))

    def put_bytes(self, key, value: bytes) -> None:
        self.redis.set(key, value)

    def get_bytes(self, key) -> bytes | None:
        return self.redis.get(key)

    def remove(self, keys) -> None:
        for i in range(0, len(keys), 1000):
            self.redis.delete(*keys[i : i + 1000])

    def route(self) -> list[str]:
        return []

    def close(self) -> None:
        self.redis.close()


class RawTcpAdapter:
    """The TCP ceiling (raw_tcp.py): each batch one request and one reply on one connection, values
    sent from and received straight into registered memory; no metadata server, no checks."""

    def __init__(self, spec: dict) -> None:
        import socket

        import raw_tcp  # beside this module, so on the path of clients.py that imports it

        self.wire = raw_tcp
        self.sock = socket.create_connection((spec["host"], spec["port"]), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # `connections: 2`: batches of two or more objects go in two halves, the second half on
        # its own connection and thread (as kvpool's lane splits a large job); plain values on one
        self.other = RawTcpAdapter({**spec, "connections": 1}) if spec.get("connections", 1) == 2 else None
        self.pool = ThreadPoolExecutor(1) if self.other is not None else None

    def _split(self, keys, addrs, sizes):
        """(first half, second half) of a batch, by objects; None when it is not split."""
        if self.other is None or len(keys) < 2:
            return None
        h = len(keys) // 2
        return (keys[:h], addrs[:h], sizes[:h]), (keys[h:], addrs[h:], sizes[h:])

    def register(self, buf: np.ndarray) -> None:
        pass  # any memory will do: the kernel copies from and into it

    @staticmethod
    def _views(addrs, sizes) -> list[memoryview]:
        return [memoryview((ctypes.c_char * n).from_address(a)).cast("B")
                for a_i, s_i in zip(addrs, sizes) for a, n in zip(a_i, s_i)]  # fmt: skip

    def _ack(self, nbytes: int) -> bytes:
        reply = bytearray(nbytes)
        self.wire.recv_exact(self.sock, memoryview(reply))
        return bytes(reply)

    def put_from(self, keys, addrs, sizes) -> None:
        halves = self._split(keys, addrs, sizes)
        if halves is not None:
            other = self.pool.submit(self.other.put_from, *halves[1])
            self._put_one(*halves[0])
            other.result()
            return
        self._put_one(keys, addrs, sizes)

    def _put_one(self, keys, addrs, sizes) -> None:
        head = self.wire.encode_request(self.wire.PUT, keys, [sum(s) for s in sizes])
        self.wire.send_all(self.sock, [memoryview(head)] + self._views(addrs, sizes))
        self._ack(1)

    def get_into(self, keys, addrs, sizes) -> int:
        halves = self._split(keys, addrs, sizes)
        if halves is not None:
            other = self.pool.submit(self.other.get_into, *halves[1])
            first = self._get_one(*halves[0])
            second = other.result()
            return first + second if first == len(halves[0][0]) else first
        return self._get_one(keys, addrs, sizes)

    def _get_one(self, keys, addrs, sizes) -> int:
        self.sock.sendall(self.wire.encode_request(self.wire.GET, keys))
        head = self._ack(8 * len(keys))
        found = [self.wire.SIZE.unpack_from(head, 8 * i)[0] for i in range(len(keys))]
        count = next((i for i, n in enumerate(found) if n == self.wire.MISSING), len(keys))
        views = self._views(addrs[:count], sizes[:count])
        for view in views:
            self.wire.recv_exact(self.sock, view)
        for n in found[count:]:  # values present after a miss: read and drop
            if n != self.wire.MISSING:
                self._ack(n)
        return count

    def exists_batch(self, keys) -> int:
        self.sock.sendall(self.wire.encode_request(self.wire.EXISTS, keys))
        return int.from_bytes(self._ack(4), "little")

    def exists_one(self, key) -> bool:
        return self.exists_batch([key]) == 1

    def put_bytes(self, key, value: bytes) -> None:
        self.sock.sendall(self.wire.encode_request(self.wire.PUT, [key], [len(value)]) + value)
        self._ack(1)

    def get_bytes(self, key) -> bytes | None:
        self.sock.sendall(self.wire.encode_request(self.wire.GET, [key]))
        n = self.wire.SIZE.unpack(self._ack(8))[0]
        return None if n == self.wire.MISSING else self._ack(n)

    def remove(self, keys) -> None:
        self.sock.sendall(self.wire.encode_request(self.wire.DELETE, keys))
        self._ack(1)

    def route(self) -> list[str]:
        return []

    def close(self) -> None:
        self.sock.close()
        if self.other is not None:
            self.other.close()
            self.pool.shutdown()


ADAPTERS = {"kvpool": KvpoolAdapter, "mooncake": MooncakeAdapter, "mooncake-ipc": MooncakeIpcAdapter,
            "redis": RedisAdapter, "raw-tcp": RawTcpAdapter}
