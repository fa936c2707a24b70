"""THeader frames: parse the header block, re-encode it around an untouched payload.

Layout after the i32 length prefix:
    magic 0x0FFF (u16) | flags (u16) | seqid (i32) | header size / 4 (u16)
    header block: protocol id (varint), transform count (varint), transform ids,
                  info headers (type 1 = key/value: count, then varint-length strings),
                  zero padding to a multiple of 4
    payload: the protocol message, possibly zlib-deflated (transform 1)

The payload is never rewritten: adding headers (trace context, a reduced
deadline) re-encodes only the block before it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from proxy.codec.errors import Head, ProtocolError
from proxy.codec.heads import read_varint, write_varint
from proxy.codec.wire import (
    THEADER_FIXED_SIZE,
    THEADER_INFO_KEYVALUE,
    THEADER_MAGIC,
    THEADER_PROTOCOL_BINARY,
    THEADER_PROTOCOL_COMPACT,
    THEADER_TRANSFORM_ZLIB,
    AppErrorType,
    Framing,
    Protocol,
)

_HDR_FIXED = struct.Struct("!HHiH")
_I32 = struct.Struct("!i")

SUPPORTED_TRANSFORMS = frozenset((THEADER_TRANSFORM_ZLIB,))
# At most this many key/value headers in one block (all its KEYVALUE sections together), as
# many sections (an empty one costs as much to walk as a header), and
# transforms. Each header costs ~1 µs of the event loop to read: without a bound, one 256 KiB
# block of empty pairs held every other client up for ~170 ms. Real blocks carry a handful.
MAX_HEADERS = 1024
MAX_TRANSFORMS = 16
# How much of a deflated payload is inflated to read its head (and a reply's first field).
INFLATE_PREFIX = 64 * 1024 + 64


@dataclass(slots=True)
class HeaderBlock:
    """What a THeader frame says besides its payload."""

    flags: int
    seqid: int
    protocol_id: int
    transforms: tuple[int, ...]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def protocol(self) -> Protocol:
        return Protocol.COMPACT if self.protocol_id == THEADER_PROTOCOL_COMPACT else Protocol.BINARY


def parse_header_block(buf, start: int, end: int, framing: Framing,
                       protocol: Protocol = Protocol.BINARY) -> tuple[HeaderBlock, int]:
    """Parse buf[start:end], the bytes after a THeader frame's length prefix.

    Returns the block and the offset of the payload. Raises ProtocolError, its head (for the
    answer) in `protocol` (the listener's) when the block is too broken to name its own.
    """
    if end - start < THEADER_FIXED_SIZE:
        raise ProtocolError("bad request: THeader frame shorter than its fixed header")
    magic, flags, seqid, words = _HDR_FIXED.unpack_from(buf, start)
    if magic != THEADER_MAGIC:
        raise ProtocolError(f"bad request: bad THeader magic 0x{magic:04x}")
    hstart = start + THEADER_FIXED_SIZE
    hend = hstart + words * 4
    if hend > end:
        raise ProtocolError(f"bad request: THeader header size {words * 4} beyond the frame",
                            head=Head("", 1, seqid, framing, protocol))
    try:
        pid, p = _varint(buf, hstart, hend)
        count, p = _varint(buf, p, hend)
        _at_most(count, MAX_TRANSFORMS, "transforms")
        _fits(count, 1, hend - p)
        transforms = []
        for _ in range(count):
            t, p = _varint(buf, p, hend)
            transforms.append(t)
        headers: dict[str, str] = {}
        read = 0
        sections = 0
        while p < hend:
            info, p = _varint(buf, p, hend)
            if info != THEADER_INFO_KEYVALUE:
                break  # padding (0) or an info type we do not read
            sections += 1
            _at_most(sections, MAX_HEADERS, "key/value sections")
            n, p = _varint(buf, p, hend)
            read += n
            _at_most(read, MAX_HEADERS, "headers")  # (all its sections together)
            _fits(n, 2, hend - p)
            for _ in range(n):
                k, p = _string(buf, p, hend)
                v, p = _string(buf, p, hend)
                headers[k] = v
    except ProtocolError as e:
        raise e.with_head(Head("", 1, seqid, framing, protocol))
    if pid not in (THEADER_PROTOCOL_BINARY, THEADER_PROTOCOL_COMPACT):
        raise ProtocolError(f"bad request: unsupported THeader protocol id {pid}",
                            head=Head("", 1, seqid, framing, protocol))
    block = HeaderBlock(flags, seqid, pid, tuple(transforms), headers)
    unknown = [t for t in transforms if t not in SUPPORTED_TRANSFORMS]
    if unknown:
        raise ProtocolError(
            f"bad request: unknown THeader transform {unknown[0]} (only zlib is supported)",
            AppErrorType.INVALID_TRANSFORM,
            head=Head("", 1, seqid, framing, block.protocol),
            close=False,
        )
    return block, hend


def _at_most(count: int, limit: int, what: str) -> None:
    """Refuse a block with more than `limit` items of a kind, before reading them."""
    if count > limit:
        raise ProtocolError(f"bad request: THeader block has {count} {what} (at most {limit})")


def _fits(count: int, least: int, left: int) -> None:
    """Refuse `count` items of `least` bytes each or more that the `left` bytes of the block cannot
    hold, before reading them (a count of 2^60 is not walked to the end)."""
    if count * least > left:
        raise ProtocolError("bad request: truncated THeader header block")


def _varint(buf, p: int, end: int) -> tuple[int, int]:
    r = read_varint(buf, p, end)
    if r is None:
        raise ProtocolError("bad request: truncated THeader header block")
    return r


def _string(buf, p: int, end: int) -> tuple[str, int]:
    n, p = _varint(buf, p, end)
    if p + n > end:
        raise ProtocolError("bad request: THeader header string beyond the header block")
    # (surrogateescape: bytes that are not UTF-8 come back unchanged when the block is re-encoded)
    return bytes(buf[p:p + n]).decode("utf-8", "surrogateescape"), p + n


def inflate(payload, transforms: tuple[int, ...], limit: int) -> bytes:
    """Undo the payload's transforms (zlib), producing at most `limit` bytes.

    With a limit below the full size this is a prefix: enough to read a head.
    The payload may be cut short (a frame still arriving): what inflates is returned.
    """
    data = payload
    for t in reversed(transforms):
        if t == THEADER_TRANSFORM_ZLIB:
            try:
                data = zlib.decompressobj().decompress(data, limit)
            except zlib.error as e:
                raise ProtocolError(f"bad request: zlib payload does not inflate: {e}") from None
    return bytes(data)


# Deflate's own bound on what one byte inflates to is ~1032: a payload inflating past this many
# times its size (plus some slack for tiny ones) was deflated more than once to make it so, a
# compression bomb (20 such requests of 197 bytes each, inflating to 16 MB, held the loop 2 s).
MAX_INFLATE_RATIO = 1032
INFLATE_SLACK = 64 * 1024


def inflate_all(payload, transforms: tuple[int, ...], max_size: int, complete: bool = True) -> bytes:
    """The whole inflated payload; refused if larger than max_size, larger than
    MAX_INFLATE_RATIO times the payload (a bomb), or (`complete`) cut short."""
    ratio_cap = MAX_INFLATE_RATIO * len(payload) + INFLATE_SLACK
    cap = min(max_size, ratio_cap)
    data = payload
    for t in reversed(transforms):
        if t == THEADER_TRANSFORM_ZLIB:
            d = zlib.decompressobj()
            try:
                data = d.decompress(data, cap + 1)
            except zlib.error as e:
                raise ProtocolError(f"bad request: zlib payload does not inflate: {e}") from None
            if len(data) > cap:
                if cap == max_size:
                    raise ProtocolError(f"bad request: inflated payload exceeds {max_size} bytes")
                raise ProtocolError(f"bad request: a {len(payload)}-byte zlib payload inflates past "
                                    f"{ratio_cap} bytes ({MAX_INFLATE_RATIO}x: deflated more than once, "
                                    "a compression bomb?)")
            if complete and not d.eof:
                raise ProtocolError("bad request: zlib payload is truncated")
    return bytes(data)


class HeaderBlockTooLarge(ValueError):
    """The headers do not fit a THeader header block (65,535 words)."""


def encode_header_block(block: HeaderBlock, headers: dict[str, str] | None = None) -> bytes:
    """The fixed part and the header block (no length prefix), for a payload to follow."""
    out = bytearray()
    write_varint(out, block.protocol_id)
    write_varint(out, len(block.transforms))
    for t in block.transforms:
        write_varint(out, t)
    hdrs = block.headers if headers is None else headers
    if hdrs:
        write_varint(out, THEADER_INFO_KEYVALUE)
        write_varint(out, len(hdrs))
        for k, v in hdrs.items():
            kb = k.encode("utf-8", "surrogateescape")
            vb = v.encode("utf-8", "surrogateescape")
            write_varint(out, len(kb))
            out += kb
            write_varint(out, len(vb))
            out += vb
    pad = (-len(out)) % 4
    out += b"\x00" * pad
    words = len(out) // 4
    if words > 0xFFFF:
        raise HeaderBlockTooLarge(f"THeader header block of {len(out)} bytes (at most {0xFFFF * 4})")
    return _HDR_FIXED.pack(THEADER_MAGIC, block.flags, block.seqid, words) + bytes(out)


def encode_header_frame(block: HeaderBlock, payload, headers: dict[str, str] | None = None) -> bytes:
    """A whole THeader frame: length prefix, header block, the payload as given."""
    head = encode_header_block(block, headers)
    return _I32.pack(len(head) + len(payload)) + head + bytes(payload)
