r"""One upstream connection: one exchange at a time, the reply framed and its seqid checked.

The client's seqid travels unchanged (no rewriting), so a reply whose seqid
differs is a bad reply. Bytes that arrive while no exchange is under way mean
the connection is unusable (the upstream closed it, or sent garbage): it is
closed and never reused.

    IDLE --exchange()--> BUSY --reply framed--> IDLE (back to the pool)
                           \--lost / bad reply / abandon()--> CLOSED
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic_ns

from proxy.codec import Decoder, Framing, Message, MessageType, Protocol, ProtocolError
from proxy.sockets import set_nodelay

log = logging.getLogger(__name__)


class UpstreamError(Exception):
    """An attempt failed; `written` says whether any request byte reached the socket."""

    def __init__(self, message: str, written: bool, timeout: bool = False, endpoint_fault: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.written = written
        self.timeout = timeout
        # False when the proxy itself refused (pool full, limits, shutting down): says nothing
        # about the endpoint's health, so breakers ignore it.
        self.endpoint_fault = endpoint_fault


class Exchange:
    """What an upstream connection reports to (the pipeline's attempt implements it)."""

    seqid: int
    t_first_reply: int

    def on_reply(self, reply: Message) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def on_failure(self, error: UpstreamError) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class UpstreamConnection(asyncio.Protocol):
    __slots__ = ("pool", "transport", "decoder", "exchange_", "idle_since", "closed", "label")

    def __init__(self, pool, framing: Framing, protocol: Protocol, max_reply_size: int) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.decoder = Decoder(framing, protocol, max_reply_size)
        self.exchange_: Exchange | None = None
        self.idle_since = 0.0
        self.closed = False
        self.label = pool.label

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        set_nodelay(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        ex = self.exchange_
        if ex is None:
            log.info("upstream %s sent %d bytes while idle; closing that connection", self.label, len(data))
            self._discard()
            return
        if not ex.t_first_reply:
            ex.t_first_reply = monotonic_ns()
        dec = self.decoder
        dec.feed(data)
        try:
            reply = dec.next_message()
        except ProtocolError as e:
            self._fail(UpstreamError(f"bad reply from {self.label}: {e.message.removeprefix('bad request: ')}",
                                     written=True))
            return
        if reply is None:
            return
        if reply.seqid != ex.seqid:
            self._fail(UpstreamError(
                f"bad reply from {self.label}: seqid {reply.seqid} does not match the request's {ex.seqid}",
                written=True))
            return
        if reply.type != MessageType.REPLY and reply.type != MessageType.EXCEPTION:
            self._fail(UpstreamError(f"bad reply from {self.label}: message type {reply.type}", written=True))
            return
        self.exchange_ = None
        if dec.buffered:
            log.info("upstream %s sent bytes past its reply; closing that connection", self.label)
            self._discard()
        else:
            self.pool.release(self)
        ex.on_reply(reply)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
        ex = self.exchange_
        if ex is not None:
            self.exchange_ = None
            why = f": {exc}" if exc else ""
            ex.on_failure(UpstreamError(
                f"connection to {self.label} lost after the request was written{why}", written=True))

    # -- used by the pipeline -------------------------------------------------

    def exchange(self, ex: Exchange | None, data) -> None:
        """Write a request. With `ex` None (oneway) the connection is free again at once."""
        self.exchange_ = ex
        self.transport.write(data)
        if ex is None:
            self.pool.release(self)

    def abandon(self) -> None:
        """The attempt gave up (timeout, client gone): a late reply must never be read as another's."""
        self.exchange_ = None
        self._discard()

    def _fail(self, error: UpstreamError) -> None:
        ex = self.exchange_
        self.exchange_ = None
        self._discard()
        if ex is not None:
            ex.on_failure(error)

    def _discard(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()
