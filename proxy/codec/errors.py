"""The codec's one error kind: the peer sent bytes we cannot accept.

A `ProtocolError` carries what to answer: the TApplicationException type and
message, the message head when it could be read (so the reply carries the
client's seqid and method), and whether the stream is broken (then the
connection closes after the reply). Anything else raised from the codec is a
bug in the proxy and must be loud.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.codec.wire import AppErrorType, Framing, Protocol


@dataclass(frozen=True, slots=True)
class Head:
    """Just enough of a message to address a reply to it."""

    name: str
    type: int
    seqid: int
    framing: Framing
    protocol: Protocol


class ProtocolError(Exception):
    """The peer's bytes are not a message we accept."""

    def __init__(
        self,
        message: str,
        app_type: AppErrorType = AppErrorType.PROTOCOL_ERROR,
        *,
        head: Head | None = None,
        close: bool = True,
        header_protocol: Protocol | None = None,
        over_limit: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        # The message is larger than the reader's limit (max_frame_size / max_reply_size): maybe
        # well-formed, refused for its size alone.
        self.over_limit = over_limit
        self.app_type = app_type
        self.head = head
        self.close = close
        # For errors before a head could be read: the framing/protocol, if known.
        self.header_protocol = header_protocol
        # The bad message was taken whole (a complete frame): its bytes are gone, so the
        # decoder's pending_head() would read the *next* message's head, not this one's.
        self.whole = False
        # A THeader request's header block, when it was read before the error: its headers
        # (the client's trace context) still hold for the proxy's answer.
        self.header_block = None

    def with_head(self, head: Head | None) -> "ProtocolError":
        if head is not None and self.head is None:
            self.head = head
        return self
