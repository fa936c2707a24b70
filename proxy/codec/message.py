"""A decoded message: its head plus its wire bytes, untouched."""

from __future__ import annotations

from proxy.codec.errors import Head
from proxy.codec.heads import peek_result_field
from proxy.codec.theader import HeaderBlock, inflate_all
from proxy.codec.wire import DEFAULT_MAX_FRAME_SIZE, Framing, MessageType, Protocol


class Message:
    """One Thrift message as it arrived.

    `data` is the whole wire form (length prefix and THeader block included);
    `start` is where the protocol message begins inside it. `readable` is the
    buffer the head was read from (`data`, or the inflated prefix of a zlib
    THeader payload) and `body` the offset of the args/result struct in it.
    """

    __slots__ = ("name", "type", "seqid", "framing", "protocol", "data", "start",
                 "header", "readable", "body")

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

    def __repr__(self) -> str:
        return (f"Message({self.name!r}, type={self.type}, seqid={self.seqid}, "
                f"{self.framing.value}/{self.protocol.value}, {len(self.data)} bytes)")
