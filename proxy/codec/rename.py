"""Rename a message: drop the multiplexed `Svc:` prefix before forwarding (`strip_service`).

The one place where the proxy rewrites a message head. Everything after the
head (the args struct) is copied untouched; the head is re-encoded with the
bare name in the message's own protocol and head style (strict or unversioned
binary, compact), then framed for the target framing:

    framed / buffered      [len?][new head][rest of the message]
    header / framed_header THeader block kept (flags, seqid, protocol, info headers),
                           payload = new head + rest; a zlib payload is inflated
                           and sent without the transform (re-deflating would cost
                           more than it saves on a loopback hop)

Sans-IO like the rest of the codec: bytes in, bytes out.
"""

from __future__ import annotations

import struct

from proxy.codec.wire import DEFAULT_MAX_FRAME_SIZE
from proxy.codec.frames import frame_payload, reframe
from proxy.codec.heads import encode_head
from proxy.codec.message import Message
from proxy.codec.theader import HeaderBlock, encode_header_block
from proxy.codec.wire import Framing, Protocol

_I32 = struct.Struct("!i")


def strip_service(msg: Message, framing: Framing | None = None, headers: dict[str, str] | None = None,
                  max_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """`msg` with `Svc:method` renamed to `method`, framed for `framing` (default: its own).

    A message without a `Svc:` prefix is only re-framed. `headers` (THeader
    targets only) replaces the info headers, as `reframe` does.
    """
    framing = framing or msg.framing
    i = msg.name.find(":")
    if i < 0:
        return reframe(msg, framing, headers, max_size)
    payload = _renamed_payload(msg, msg.name[i + 1:], max_size)
    if framing.is_header and msg.header is not None:
        src = msg.header
        block = HeaderBlock(src.flags, src.seqid, src.protocol_id, (), src.headers)
        head = encode_header_block(block, src.headers if headers is None else headers)
        frame = _I32.pack(len(head) + len(payload)) + head + payload
        return _I32.pack(len(frame)) + frame if framing is Framing.FRAMED_HEADER else frame
    return frame_payload(payload, framing, msg.protocol, msg.seqid, headers)


def _renamed_payload(msg: Message, name: str, max_size: int) -> bytes:
    """The plain protocol message with its head re-encoded under `name`."""
    if msg.header is not None and msg.header.transforms:
        plain = msg.payload(max_size)  # the whole inflated message; `body` indexes it too
        start = 0
    else:
        plain = msg.data
        start = msg.start
    protocol = msg.protocol
    if protocol is Protocol.BINARY_NONSTRICT and plain[start] & 0x80:
        protocol = Protocol.BINARY  # a versioned head on a non-strict connection stays versioned
    head = encode_head(name, msg.type, msg.seqid, protocol)
    return bytes(head) + bytes(memoryview(plain)[msg.body:])
