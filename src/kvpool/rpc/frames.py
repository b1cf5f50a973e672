"""The TCP channel's frames, shared by its client (tcp_channel.py) and the master (tcp_server.py).

Wire format (little endian), one frame per request and per reply, in order on one connection:
    request: u32 payload length | u64 request id | msgpack Request
    reply:   u32 payload length | u64 request id | u64 master epoch | msgpack Reply
Rules:
- Request ids and epochs are the ZMQ channel's (zmq_channel.py), so its rules hold: a reply whose
  id is not the call's is a late one and is dropped; a new epoch empties the caller's caches first.
- Request id 0 (ONE_WAY_ID, which the channel's ids never take) is one-way: the master answers
  nothing to it, not even an error.
"""

from __future__ import annotations

import struct

REQUEST_HEAD = struct.Struct("<IQ")
REPLY_HEAD = struct.Struct("<IQQ")
REPLY_HEAD_BYTES = REPLY_HEAD.size  # room a reply frame leaves for its head (LaneServer.reply_frame)
ONE_WAY_ID = 0  # a request with this id gets no reply (ids of calls start at 1)
ONE_WAY_BYTES = ONE_WAY_ID.to_bytes(8, "little")  # the same id as it travels in a frame
RECV_CHUNK = 1 << 16  # bytes asked of one receive
DIRECT_BODY_BYTES = 16 << 10  # a body this large is received into its own buffer, not the inbox
