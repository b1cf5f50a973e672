"""The TCP ceiling for the peers benchmark: the least a key-value store over TCP can do.

    python benchmarks/peers/raw_tcp.py --port 7000 --memory BYTES      (started by servers.py)

Not a store anyone should run: one process, no metadata server, no allocator worth the name, no
checksums, no leases, no eviction, no authentication. Each batch is one request and one reply on
one TCP connection, values land in (and leave from) one preallocated buffer with `recv_into` /
`sendmsg`, so what it costs is the kernel's TCP plus a few lines of Python per request. It is the
row a real store cannot beat on this link by more than its own overheads: kvpool's, Mooncake's and
Redis's figures are read against it.

Space is a ring over the buffer: a put takes the next range, wrapping at the end. A range still
holding a live value can be overwritten once the ring wraps past it; the benchmark compares every
byte it reads, so that would fail a case loudly, never pass a wrong figure (the cases keep far
less live than the buffer holds).

Wire format (little endian), requests and replies in order on each connection:
    request: u8 op | u32 count | u32 table bytes | table: count x (u16 key length, key[, PUT: u64 size])
             | PUT: the values
    PUT reply: u8 0           EXISTS reply: u32 leading keys present        DELETE reply: u8 0
    GET reply: count x u64 size (2**64-1: missing) | the present values' bytes, in order
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import threading

import numpy as np

PUT, GET, EXISTS, DELETE = 1, 2, 3, 4
HEAD = struct.Struct("<BII")
KEY_LEN = struct.Struct("<H")
SIZE = struct.Struct("<Q")
MISSING = 2**64 - 1


def recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def send_all(conn: socket.socket, buffers: list[memoryview]) -> None:
    """sendmsg until every buffer is out (at most 512 buffers per call: IOV_MAX is 1024)."""
    i = 0
    while i < len(buffers):
        sent = conn.sendmsg(buffers[i : i + 512])
        while i < len(buffers) and sent >= len(buffers[i]):
            sent -= len(buffers[i])
            i += 1
        if sent:
            buffers[i] = buffers[i][sent:]


def read_request(conn: socket.socket) -> tuple[int, list[bytes], list[int]]:
    """(op, keys, sizes) of the next request; sizes only for PUT."""
    head = bytearray(HEAD.size)
    recv_exact(conn, memoryview(head))
    op, count, table_bytes = HEAD.unpack(head)
    table = bytearray(table_bytes)
    recv_exact(conn, memoryview(table))
    keys, sizes, at = [], [], 0
    for _ in range(count):
        (klen,) = KEY_LEN.unpack_from(table, at)
        keys.append(bytes(table[at + 2 : at + 2 + klen]))
        at += 2 + klen
        if op == PUT:
            sizes.append(SIZE.unpack_from(table, at)[0])
            at += SIZE.size
    return op, keys, sizes


def encode_request(op: int, keys: list[str], sizes: list[int] | None = None) -> bytes:
    parts = []
    for i, key in enumerate(keys):
        raw = key.encode()
        parts.append(KEY_LEN.pack(len(raw)) + raw)
        if op == PUT:
            parts.append(SIZE.pack(sizes[i]))
    table = b"".join(parts)
    return HEAD.pack(op, len(keys), len(table)) + table


class RingStore:
    def __init__(self, size_bytes: int) -> None:
        self.buf = np.zeros(size_bytes, dtype=np.uint8)  # touched now: no page faults while measured
        self.buf[:] = 1
        self.view = memoryview(self.buf).cast("B")
        self.lock = threading.Lock()
        self.where: dict[bytes, tuple[int, int]] = {}
        self.next = 0

    def allocate(self, size: int) -> int:
        with self.lock:
            if size > len(self.view):
                raise ValueError(f"value of {size} bytes is larger than the store")
            if self.next + size > len(self.view):
                self.next = 0
            offset, self.next = self.next, self.next + size
            return offset

    def serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                op, keys, sizes = read_request(conn)
                if op == PUT:
                    placed = [(self.allocate(s), s) for s in sizes]
                    for offset, size in placed:
                        recv_exact(conn, self.view[offset : offset + size])
                    with self.lock:
                        self.where.update(zip(keys, placed))
                    conn.sendall(b"\0")
                elif op == GET:
                    with self.lock:
                        found = [self.where.get(k) for k in keys]
                    head = b"".join(SIZE.pack(MISSING if f is None else f[1]) for f in found)
                    send_all(conn, [memoryview(head)] + [self.view[o : o + s] for o, s in (f for f in found if f is not None)])
                elif op == EXISTS:
                    with self.lock:
                        n = next((i for i, k in enumerate(keys) if k not in self.where), len(keys))
                    conn.sendall(struct.pack("<I", n))
                elif op == DELETE:
                    with self.lock:
                        for k in keys:
                            self.where.pop(k, None)
                    conn.sendall(b"\0")
                else:
                    return
        except (ConnectionError, OSError):
            return
        finally:
            conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=7000)
    ap.add_argument("--memory", type=int, required=True, help="bytes of value storage")
    args = ap.parse_args()
    store = RingStore(args.memory)
    listener = socket.create_server((args.host, args.port), backlog=64)
    signal.signal(signal.SIGTERM, lambda *_: listener.close())
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # SIGTERM closed the listener
        threading.Thread(target=store.serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
