"""The TCP path's server: the segment's owner serving READ / WRITE (and tags) to its clients.

The wire format and the rules are tcp_path.py's (and tcp_path_tags.py's for ops 3 and 4); this is
the node's side of it: one thread per connection, requests checked against the segment before a
byte moves, at most MAX_CONNECTIONS connections.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from kvpool.transfer import tcp_path_tags
from kvpool.transfer.tcp_path_tags import READ_TAG, TAG, TAG_BYTES, TagIndex
from kvpool.transfer.tcp_path_wire import (
    HEAD, MAGIC, MAX_REGIONS, MAX_REQUEST_BYTES, READ, REGION, REPLY, WRITE, recv_all, send_all, view,
)

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # per segment: each is a thread; more are closed at once (clients then use NIXL)


class TcpPathServer:
    """Serves READ/WRITE of [base_addr, base_addr + size_bytes) to lane clients."""

    def __init__(self, base_addr: int, size_bytes: int, host: str) -> None:
        self._segment = view(base_addr, size_bytes)
        self._size = size_bytes
        self.tags = TagIndex()  # where values were last written, by tag (tcp_path_tags.py)
        self._max_regions, self._max_bytes, self._max_connections = MAX_REGIONS, MAX_REQUEST_BYTES, MAX_CONNECTIONS
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        self._listener.listen(256)
        self.address = f"[{host}]:{self._listener.getsockname()[1]}" if ":" in host else \
            f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvpool-segment-lane", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: keep serving the others
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn,), name="kvpool-segment-lane-conn", daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._connections) >= self._max_connections:
                    log.warning("TCP path: %d connections open, refusing another", len(self._connections))
                    conn.close()
                    continue
                self._connections[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        first = bytearray(HEAD.size + REGION.size)  # a request's head and its first region, usually one recv
        first_view = memoryview(first)
        try:
            while True:
                got = 0
                while got < HEAD.size:
                    n = conn.recv_into(first_view[got:])
                    if n == 0:
                        return  # the client went away (between requests, or mid-head)
                    got += n
                refusal = self._serve_one(conn, first, got)
                if refusal is not None:
                    log.warning("TCP path: refused a request (%s); connection closed", refusal)
                    conn.sendall(REPLY.pack(1, len(refusal)) + refusal.encode())
                    return
        except OSError:
            return  # reset, or close() shut the connection
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def _serve_one(self, conn: socket.socket, first: bytearray, got: int) -> str | None:
        """One request, whose first `got` bytes (>= its head) are in `first`; the reason it was
        refused, or None once it was answered."""
        magic, op, count = HEAD.unpack_from(first)
        if magic != MAGIC or op not in (READ, WRITE, TAG, READ_TAG):
            return "not a segment-lane request"
        if op in (TAG, READ_TAG):
            return self._serve_tag(conn, op, count, first, got)
        if not 0 < count <= self._max_regions:
            return f"{count} regions (1..{self._max_regions} allowed)"
        table = bytearray(count * REGION.size)
        have = got - HEAD.size
        table[:have] = first[HEAD.size : got]
        if have < len(table):
            recv_all(conn, [memoryview(table)[have:]], 0)
        regions = list(REGION.iter_unpack(table))
        total = 0
        for offset, size in regions:
            if size == 0 or offset + size > self._size:
                return f"region at offset {offset} of {size} bytes is outside the {self._size}-byte segment"
            total += size
        if total > self._max_bytes:
            return f"{total} bytes in one request (at most {self._max_bytes})"
        segment = self._segment
        if op == READ:
            send_all(conn, [memoryview(REPLY.pack(0, total))] + [segment[o : o + s] for o, s in regions])
        else:  # scattered straight into the regions, many per receive (not one receive loop per region)
            recv_all(conn, [segment[o : o + s] for o, s in regions], 0)
            conn.sendall(REPLY.pack(0, 0))
        return None

    def _serve_tag(self, conn: socket.socket, op: int, count: int, first: bytearray, got: int) -> str | None:
        """A TAG (recorded, no reply) or a READ_TAG (answered) request (tcp_path_tags.py)."""
        if count != 1:
            return f"a tag request names one tag, not {count}"
        body = bytearray(REGION.size + TAG_BYTES if op == TAG else TAG_BYTES)
        have = min(got - HEAD.size, len(body))
        body[:have] = first[HEAD.size : HEAD.size + have]
        if have < len(body):
            recv_all(conn, [memoryview(body)[have:]], 0)
        if op == TAG:  # no reply (a refusal would be read as the answer to the writer's next request)
            offset, size = REGION.unpack_from(body)
            if size == 0 or offset + size > self._size:
                log.warning("TCP path: a tag for %d bytes at offset %d is outside the %d-byte segment: not "
                            "recorded", size, offset, self._size)
            else:
                self.tags.note(bytes(body[REGION.size :]), offset, size)
            return None
        place = self.tags.find(bytes(body))
        if place is None or place[1] > self._max_bytes:  # too large for one reply: read the usual way
            self.tags.not_known += 1
            conn.sendall(REPLY.pack(tcp_path_tags.NOT_KNOWN, 0))
            return None
        self.tags.known += 1
        offset, size = place
        send_all(conn, [memoryview(REPLY.pack(tcp_path_tags.KNOWN, size) + tcp_path_tags.OFFSET.pack(offset)),
                         self._segment[offset : offset + size]])
        return None

    def close(self) -> None:
        """Stop serving; returns once no connection thread can touch the segment any more."""
        with self._lock:
            self._closed = True
            connections = dict(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in connections.values():
            thread.join(5.0)
        self._acceptor.join(5.0)
