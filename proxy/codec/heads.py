"""Message heads: decode (name, type, seqid) per protocol, encode replies, peek outcomes.

Only the head is decoded; the body stays bytes. `read_head` works on a
complete protocol message (framed or header payload) or on the start of an
unframed one; it returns `None` when more bytes are needed.
"""

from __future__ import annotations

import re
import struct

from proxy.codec.errors import ProtocolError
from proxy.codec.wire import (
    BINARY_VERSION_1,
    BINARY_VERSION_MASK,
    COMPACT_PROTOCOL_ID,
    COMPACT_TYPE_SHIFT,
    COMPACT_VERSION,
    COMPACT_VERSION_MASK,
    C_STOP,
    P_COMPACT,
    MessageType,
    Protocol,
    C_BINARY,
    C_BYTE,
    C_DOUBLE,
    C_FALSE,
    C_I16,
    C_I32,
    C_I64,
    C_TRUE,
    T_BOOL,
    T_BYTE,
    T_DOUBLE,
    T_I16,
    T_I32,
    T_I64,
    T_STOP,
    T_STRING,
)

_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_I16 = struct.Struct("!h")

# Method names longer than this are refused: real names are short, and a bogus
# length must not make us wait for megabytes of an unframed stream.
MAX_NAME_LENGTH = 64 * 1024


# The request-worded hints in read_head's bad-version errors; a reply's reader says them in its own
# terms (proxy.upstream.reply_terms).
UNVERSIONED_HINT = "(an unversioned message needs protocol binary_nonstrict)"
SET_LISTENER_TRANSPORT = "set the listener's transport"
SET_LISTENER_PROTOCOL = "set the listener's protocol"
# ... as the codec ends them ("... to header or auto"), with the setting and the value it names
SETTING_HINT = re.compile(r"set the listener's (transport|protocol) to (\w+) or auto")

def read_varint(buf, pos: int, end: int) -> tuple[int, int] | None:
    """Unsigned LEB128 varint of at most 10 bytes; None when incomplete."""
    result = 0
    shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ProtocolError("bad request: varint longer than 10 bytes")
    return None


def write_varint(out: bytearray, n: int) -> None:
    n &= 0xFFFFFFFFFFFFFFFF
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _signed32(n: int) -> int:
    n &= 0xFFFFFFFF
    return n - 0x100000000 if n & 0x80000000 else n


def _check_type(mtype: int) -> None:
    if mtype < MessageType.CALL or mtype > MessageType.ONEWAY:
        raise ProtocolError(f"bad request: invalid message type {mtype}")


def _decode_name(raw) -> str:
    return bytes(raw).decode("utf-8", "replace")


def read_head(buf, pos: int, end: int, protocol: Protocol, any_type: bool = False):
    """Decode a message head at buf[pos:end].

    Returns (name, type, seqid, body_offset) or None when more bytes are needed.
    Raises ProtocolError for bytes that cannot be a message head. `any_type`: a message type
    out of range is returned, not refused (to answer such a request with its seqid and name).
    """
    if protocol is Protocol.COMPACT:
        return _read_compact_head(buf, pos, end, any_type)
    return _read_binary_head(buf, pos, end, protocol is Protocol.BINARY_NONSTRICT, any_type)


def _read_binary_head(buf, pos: int, end: int, nonstrict_ok: bool, any_type: bool = False):
    if end - pos < 4:
        return None
    first = _I32.unpack_from(buf, pos)[0]
    if first < 0:
        if (first & BINARY_VERSION_MASK & 0xFFFFFFFF) != BINARY_VERSION_1:
            raise ProtocolError(f"bad request: bad binary protocol version 0x{first & 0xFFFFFFFF:08x}")
        mtype = first & 0xFF
        if not any_type:
            _check_type(mtype)
        if end - pos < 8:
            return None
        nlen = _I32.unpack_from(buf, pos + 4)[0]
        if nlen < 0 or nlen > MAX_NAME_LENGTH:
            raise ProtocolError(f"bad request: bad method name length {nlen}")
        need = pos + 8 + nlen + 4
        if end < need:
            return None
        name = _decode_name(buf[pos + 8:pos + 8 + nlen])
        seqid = _I32.unpack_from(buf, pos + 8 + nlen)[0]
        return name, mtype, seqid, need
    if not nonstrict_ok:
        if (first >> 16) & 0xFFFF == 0x0FFF:  # THeader's magic where a message was expected
            raise ProtocolError(
                f"bad request: bad binary protocol version 0x{first & 0xFFFFFFFF:08x} (this looks like "
                f"a THeader frame: {SET_LISTENER_TRANSPORT} to header or auto)")
        raise ProtocolError(
            f"bad request: bad binary protocol version 0x{first & 0xFFFFFFFF:08x} "
            f"{UNVERSIONED_HINT}")
    nlen = first
    if nlen > MAX_NAME_LENGTH:
        raise ProtocolError(f"bad request: bad method name length {nlen}")
    need = pos + 4 + nlen + 1 + 4
    if end < need:
        return None
    name = _decode_name(buf[pos + 4:pos + 4 + nlen])
    mtype = buf[pos + 4 + nlen]
    if not any_type:
        _check_type(mtype)
    seqid = _I32.unpack_from(buf, pos + 5 + nlen)[0]
    return name, mtype, seqid, need


def _read_compact_head(buf, pos: int, end: int, any_type: bool = False):
    if end - pos < 2:
        return None
    if buf[pos] != COMPACT_PROTOCOL_ID:
        raise ProtocolError(f"bad request: bad compact protocol id 0x{buf[pos]:02x}")
    vt = buf[pos + 1]
    if vt & COMPACT_VERSION_MASK != COMPACT_VERSION:
        raise ProtocolError(f"bad request: bad compact protocol version {vt & COMPACT_VERSION_MASK}")
    mtype = (vt >> COMPACT_TYPE_SHIFT) & 0x07
    if not any_type:
        _check_type(mtype)
    r = read_varint(buf, pos + 2, end)
    if r is None:
        return None
    seqid, p = r
    r = read_varint(buf, p, end)
    if r is None:
        return None
    nlen, p = r
    if nlen > MAX_NAME_LENGTH:
        raise ProtocolError(f"bad request: bad method name length {nlen}")
    if end < p + nlen:
        return None
    name = _decode_name(buf[p:p + nlen])
    return name, mtype, _signed32(seqid), p + nlen


def encode_head(name: str, mtype: int, seqid: int, protocol: Protocol) -> bytearray:
    raw = name.encode("utf-8")
    out = bytearray()
    if protocol is Protocol.COMPACT:
        out.append(COMPACT_PROTOCOL_ID)
        out.append(COMPACT_VERSION | ((mtype & 0x07) << COMPACT_TYPE_SHIFT))
        write_varint(out, seqid & 0xFFFFFFFF)
        write_varint(out, len(raw))
        out += raw
    elif protocol is Protocol.BINARY_NONSTRICT:
        out += _I32.pack(len(raw)) + raw + bytes((mtype,)) + _I32.pack(seqid)
    else:
        out += _U32.pack(BINARY_VERSION_1 | mtype) + _I32.pack(len(raw)) + raw + _I32.pack(seqid)
    return out


def encode_application_exception(name: str, seqid: int, protocol: Protocol,
                                 app_type: int, message: str) -> bytes:
    """A complete EXCEPTION message (no framing) carrying a TApplicationException."""
    out = encode_head(name, MessageType.EXCEPTION, seqid, protocol)
    text = message.encode("utf-8")
    if protocol is Protocol.COMPACT:
        # field 1 (string, delta 1), field 2 (i32, delta 1), stop
        out.append((1 << 4) | 8)
        write_varint(out, len(text))
        out += text
        out.append((1 << 4) | 5)
        write_varint(out, _zigzag32(app_type))
        out.append(C_STOP)
    else:
        out += bytes((T_STRING,)) + _I16.pack(1) + _I32.pack(len(text)) + text
        out += bytes((T_I32,)) + _I16.pack(2) + _I32.pack(app_type)
        out.append(T_STOP)
    return bytes(out)


def _zigzag32(n: int) -> int:
    return ((n << 1) ^ (n >> 31)) & 0xFFFFFFFF


def peek_result_field(buf, body: int, end: int, protocol: Protocol) -> int | None:
    """The id of the first field of a reply's result struct.

    None = STOP (a void success); 0 = success; any other = a declared exception (an IDL
    `throws` field without an explicit id gets a negative one from the Apache compiler).
    Only the first field header is read. Raises ProtocolError on garbage.
    """
    if body >= end:
        raise ProtocolError("bad reply: result struct missing")
    if protocol is P_COMPACT:
        b = buf[body]
        if b == C_STOP:
            return None
        delta = b >> 4
        if delta:
            return delta
        r = read_varint(buf, body + 1, end)
        if r is None:
            raise ProtocolError("bad reply: truncated result field header")
        z = r[0]
        return (z >> 1) ^ -(z & 1)
    b = buf[body]
    if b == T_STOP:
        return None
    if end - body < 3:
        raise ProtocolError("bad reply: truncated result field header")
    return _I16.unpack_from(buf, body + 1)[0]


# Bytes a field's value takes, for the fixed-size types an exception struct may carry before its
# `type` (binary protocol; compact's integers are varints, see _COMPACT_VARINT).
_BINARY_FIXED = {T_BOOL: 1, T_BYTE: 1, T_I16: 2, T_I32: 4, T_DOUBLE: 8, T_I64: 8}
_COMPACT_FIXED = {C_TRUE: 0, C_FALSE: 0, C_BYTE: 1, C_DOUBLE: 8}
_COMPACT_VARINT = frozenset({C_I16, C_I32, C_I64})


def peek_exception_type(buf, body: int, end: int, protocol: Protocol) -> int | None:
    """The `type` (field 2, i32) of the TApplicationException an EXCEPTION message carries.

    Walks the struct's fields up to that one, skipping strings and fixed-size values (the
    message, field 1, comes first). None when the struct has no type, is cut short, or holds a
    field of another kind before it: the caller then knows nothing about the type. Never raises.
    """
    pos = body
    if protocol is P_COMPACT:
        last = 0
        while pos < end:
            b = buf[pos]
            pos += 1
            if b == C_STOP:
                return None
            ctype = b & 0x0F
            if b >> 4:
                fid = last + (b >> 4)
            else:
                r = _read_varint_or_none(buf, pos, end)
                if r is None:
                    return None
                z, pos = r
                fid = (z >> 1) ^ -(z & 1)
            last = fid
            if ctype in _COMPACT_VARINT:
                r = _read_varint_or_none(buf, pos, end)
                if r is None:
                    return None
                z, pos = r
                if fid == 2 and ctype == C_I32:
                    z &= 0xFFFFFFFF  # (a varint may claim more bits than an i32 has)
                    return (z >> 1) ^ -(z & 1)
            elif ctype == C_BINARY:
                r = _read_varint_or_none(buf, pos, end)
                if r is None:
                    return None
                pos = r[1] + r[0]
            elif ctype in _COMPACT_FIXED:
                pos += _COMPACT_FIXED[ctype]
            else:
                return None
        return None
    while pos + 3 <= end:
        ftype = buf[pos]
        if ftype == T_STOP:
            return None
        fid = _I16.unpack_from(buf, pos + 1)[0]
        pos += 3
        if ftype == T_I32 and fid == 2:
            return _I32.unpack_from(buf, pos)[0] if pos + 4 <= end else None
        if ftype == T_STRING:
            if pos + 4 > end:
                return None
            pos += 4 + _U32.unpack_from(buf, pos)[0]
        elif ftype in _BINARY_FIXED:
            pos += _BINARY_FIXED[ftype]
        else:
            return None
    return None


def _read_varint_or_none(buf, pos: int, end: int) -> tuple[int, int] | None:
    try:
        return read_varint(buf, pos, end)
    except ProtocolError:
        return None
