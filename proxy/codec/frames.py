"""Encoding: frame a protocol message for a framing, translate framings, build error replies.

Protocols are never transcoded; only the framing around the bytes changes.
"""

from __future__ import annotations

import struct

from proxy.codec.errors import Head
from proxy.codec.heads import encode_application_exception
from proxy.codec.message import Message
from proxy.codec.theader import HeaderBlock, encode_header_block, encode_header_frame
from proxy.codec.wire import DEFAULT_MAX_FRAME_SIZE, AppErrorType, Framing, Protocol

_I32 = struct.Struct("!i")


def frame_payload(payload, framing: Framing, protocol: Protocol, seqid: int,
                  headers: dict[str, str] | None = None) -> bytes:
    """Wrap a plain protocol message in `framing`."""
    if framing is Framing.FRAMED:
        return _I32.pack(len(payload)) + bytes(payload)
    if framing is Framing.BUFFERED:
        return bytes(payload)
    block = HeaderBlock(0, seqid, protocol.header_id, (), dict(headers or {}))
    frame = encode_header_frame(block, payload)
    if framing is Framing.FRAMED_HEADER:
        return _I32.pack(len(frame)) + frame
    return frame


def reframe(msg: Message, framing: Framing, headers: dict[str, str] | None = None,
            max_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """`msg` in `framing`: its own bytes when nothing changes, else re-framed.

    `headers` (THeader targets only) replaces the info headers; for a THeader
    source the header block is re-encoded around the untouched (maybe deflated)
    payload. Leaving THeader inflates a zlib payload: ProtocolError if it does not
    inflate or inflates past `max_size`.
    """
    src = msg.framing
    if src is framing and (headers is None or not framing.is_header):
        return msg.data
    if src.is_header and framing.is_header:
        if headers is None:
            # Only the outer prefix changes: the block (unknown info types, padding) stays as sent.
            if framing is Framing.FRAMED_HEADER:
                return _I32.pack(len(msg.data)) + bytes(msg.data)
            return bytes(memoryview(msg.data)[4:])
        block = msg.header
        assert block is not None
        head = encode_header_block(block, headers)
        payload = memoryview(msg.data)[msg.start:]
        frame = _I32.pack(len(head) + len(payload)) + head + bytes(payload)
        if framing is Framing.FRAMED_HEADER:
            return _I32.pack(len(frame)) + frame
        return frame
    return frame_payload(msg.payload(max_size), framing, msg.protocol, msg.seqid, headers)


def exception_reply(head: Head, app_type: AppErrorType | int, message: str) -> bytes:
    """A TApplicationException reply to `head`, in the client's framing and protocol.

    The method name is the bare one (`method`, not `Svc:method`), as a
    multiplexed processor replies.
    """
    name = head.name
    i = name.find(":")
    if i >= 0:
        name = name[i + 1:]
    # A versioned (strict) binary head: every binary reader accepts it, non-strict ones included.
    protocol = Protocol.BINARY if head.protocol is Protocol.BINARY_NONSTRICT else head.protocol
    payload = encode_application_exception(name, head.seqid, protocol, int(app_type), message)
    return frame_payload(payload, head.framing, protocol, head.seqid)
