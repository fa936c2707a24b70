"""A decoded message: its head plus its wire bytes, untouched; and the hot path's shortcut to one.

`Message` keeps its fields in `proxy.codec._message.MessageBase` (C, built by `pip install`)
when it was built, else in `__slots__`: the same attributes either way.

`take_framed(data, protocol, max_frame_size)` is `data` as one Message when the read is
exactly one whole framed strict-binary message (the common case on both legs), else None.
The compiled one builds the Message without running `__init__` (about 0.3 µs, where the pure
one costs about 2); `PureTakeFramed` is the reference, and tests/test_codec_take.py checks the
two agree on any input. TAKE_IMPL says which one runs; THRIFT_SIDECAR_PURE_PYTHON=1 forces
the pure one and the slots.
"""

from __future__ import annotations

import struct

from proxy.codec.errors import Head
from proxy.codec.heads import MAX_NAME_LENGTH, peek_exception_type, peek_result_field
from proxy.codec.theader import HeaderBlock, inflate_all
from proxy.codec.twins import load, pure_forced
from proxy.codec.wire import DEFAULT_MAX_FRAME_SIZE, Framing, MessageType, Protocol

_I32 = struct.Struct("!i")
_FRAME_HEAD = struct.Struct("!iIi")  # frame length, strict binary version|type, name length


_c = None if pure_forced() else load("proxy.codec._message")


class _Fields:
    __slots__ = ("name", "type", "seqid", "framing", "protocol", "data", "start",
                 "header", "readable", "body")


class Message(_c.MessageBase if _c is not None else _Fields):
    """One Thrift message as it arrived.

    `data` is the whole wire form (length prefix and THeader block included);
    `start` is where the protocol message begins inside it. `readable` is the
    buffer the head was read from (`data`, or the inflated prefix of a zlib
    THeader payload) and `body` the offset of the args/result struct in it.
    """

    __slots__ = ()

    def __init__(self, name: str, mtype: int, seqid: int, framing: Framing, protocol: Protocol,
                 data, start: int, header: HeaderBlock | None, readable, body: int) -> None:
        self.name = name
        self.type = mtype
        self.seqid = seqid
        self.framing = framing
        self.protocol = protocol
        self.data = data
        self.start = start
        self.header = header
        self.readable = readable
        self.body = body

    @property
    def head(self) -> Head:
        return Head(self.name, self.type, self.seqid, self.framing, self.protocol)

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def headers(self) -> dict[str, str]:
        return self.header.headers if self.header is not None else {}

    @property
    def service(self) -> str | None:
        """The multiplexed service name (`Svc` of `Svc:method`), or None."""
        i = self.name.find(":")
        return self.name[:i] if i >= 0 else None

    @property
    def method(self) -> str:
        """The bare method name (without a multiplexed `Svc:` prefix)."""
        i = self.name.find(":")
        return self.name[i + 1:] if i >= 0 else self.name

    @property
    def oneway(self) -> bool:
        return self.type == MessageType.ONEWAY

    def payload(self, max_size: int = DEFAULT_MAX_FRAME_SIZE):
        """The plain protocol message (inflated if the THeader payload is deflated).

        A deflated payload inflating past max_size is refused (ProtocolError): a
        16 MB frame of zlib can otherwise claim gigabytes (Apache Thrift bounds it too).
        """
        if self.header is not None and self.header.transforms:
            return inflate_all(memoryview(self.data)[self.start:], self.header.transforms, max_size)
        if self.start == 0:
            return self.data
        return memoryview(self.data)[self.start:]

    def result_field(self) -> int | None:
        """First field id of a REPLY's result struct: None (void), 0 (success), >= 1 (exception)."""
        readable = self.readable
        return peek_result_field(readable, self.body, len(readable), self.protocol)

    def exception_type(self) -> int | None:
        """An EXCEPTION's TApplicationException type (`AppErrorType` numbering), None if unreadable."""
        readable = self.readable
        return peek_exception_type(readable, self.body, len(readable), self.protocol)

    def __reduce__(self):
        """Copies and pickles the same whichever storage holds the fields (C has no default)."""
        return (Message, (self.name, self.type, self.seqid, self.framing, self.protocol, self.data, self.start,
                          self.header, self.readable, self.body))

    def __repr__(self) -> str:
        return (f"Message({self.name!r}, type={self.type}, seqid={self.seqid}, "
                f"{self.framing.value}/{self.protocol.value}, {len(self.data)} bytes)")


def PureTakeFramed(data, protocol: Protocol, max_frame_size: int) -> Message | None:
    """`data` as one Message if it is exactly one whole framed strict-binary message, else None."""
    if type(data) is not bytes or (protocol is not Protocol.BINARY and protocol is not Protocol.BINARY_NONSTRICT):
        return None
    n = len(data)
    if n < 17:
        return None
    length, first, nlen = _FRAME_HEAD.unpack_from(data, 0)
    body = 16 + nlen
    if (length != n - 4 or length > max_frame_size or first & 0xFFFF0000 != 0x80010000
            or not 1 <= first & 0xFF <= 4 or nlen < 0 or nlen > MAX_NAME_LENGTH or body >= n):
        return None
    return Message(data[12:12 + nlen].decode("utf-8", "replace"), first & 0xFF,
                   _I32.unpack_from(data, 12 + nlen)[0], Framing.FRAMED, protocol, data, 4, None, data, body)


if _c is not None:
    _c.bind(Message, Framing.FRAMED, Protocol.BINARY, Protocol.BINARY_NONSTRICT, MAX_NAME_LENGTH, PureTakeFramed)
    CompiledTakeFramed = _c.take_framed
    take_framed = CompiledTakeFramed
    TAKE_IMPL = "c"
else:
    CompiledTakeFramed = None
    take_framed = PureTakeFramed
    TAKE_IMPL = "python"
