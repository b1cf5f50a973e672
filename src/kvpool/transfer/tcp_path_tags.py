"""Tags on the TCP path: where a value was last written, under a digest of its name, so that a
reader that never saw it can read it while it asks the master where it is.

Why: without a tag, a plain get by a client that never saw the value is two exchanges one after
the other (GetValue to the master, then the read from the node). A writer that knows where its
value went (client/known_places.py) already reads there while GetValue travels; a tag lets any
client do the same (docs/design/data-plane.md).

Wire (after tcp_path.py's head b"KVSL" | u8 op | u32 count; little endian):
    TAG (3), count 1:       (u64 offset, u64 size) | 16-byte tag. No reply. A writer sends it in
                            the same send just before its WRITE, on the same connection, so the
                            node has recorded it by the time that WRITE is answered (a reader
                            that comes between reads half-written bytes: see the first rule).
    READ_TAG (4), count 1:  16-byte tag. Reply: u8 status | u64 length, then for status 0 (known):
                            u64 offset | the `length` bytes at that offset now; status 2: not known
                            here (length 0); status 1: refused, its reason follows (as any request).
Rules:
- A tag only says where some writer last wrote under that digest; the bytes there may since be
  another value's (freed and reused, half written, a hostile writer's). The reader trusts nothing of
  it: the client keeps the bytes only when the master's leased answer places the value at that
  (segment, offset, size) and they match the checksum the master recorded (known_places.py).
- A node keeps at most MAX_TAGS tags, the least recently written or read forgotten first. A TAG
  naming a range outside the segment is not recorded (a log line; still no reply, so the writer's
  next request is answered as it expects); a malformed tag request is refused like any request.
  A READ_TAG of a tag over one request's bytes (64 MiB) is answered "not known".
  Tags live in the node's memory only: a restarted node knows none (readers then ask the master
  first, as before).
- Pure bookkeeping and wire helpers: the TCP path's server and connections (tcp_path.py) do the I/O.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict

TAG, READ_TAG = 3, 4
TAG_BYTES = 16
KNOWN, NOT_KNOWN = 0, 2
MAX_TAGS = 1 << 16  # ~250 bytes each (key, tuple, dict and order entries): ~16 MiB per segment at most
OFFSET = struct.Struct("<Q")  # a known tag's offset, between the reply's head and its bytes


def tag_of(namespace: str, name: str) -> bytes:
    """The 16-byte tag of `name` in `namespace` (a tenant and a key): a digest, so that a tag has
    one size whatever the key's (up to 1,024 characters) and the node never sees names."""
    return hashlib.blake2b(f"{namespace}\0{name}".encode(), digest_size=TAG_BYTES).digest()


class TagIndex:
    """tag -> (offset, size), least recently used forgotten first; thread-safe (one lock)."""

    def __init__(self, max_tags: int = MAX_TAGS) -> None:
        self._max = max_tags
        self._lock = threading.Lock()
        self._places: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.known = self.not_known = 0  # READ_TAG answers so far, by outcome (the TCP path's server counts them)

    def note(self, tag: bytes, offset: int, size: int) -> None:
        with self._lock:
            self._places[tag] = (offset, size)
            self._places.move_to_end(tag)
            if len(self._places) > self._max:
                self._places.popitem(last=False)

    def find(self, tag: bytes) -> tuple[int, int] | None:
        with self._lock:
            place = self._places.get(tag)
            if place is not None:
                self._places.move_to_end(tag)
            return place

    def __len__(self) -> int:
        return len(self._places)
