r"""One upstream connection: one exchange at a time, the reply framed and its seqid checked.

The client's seqid travels unchanged (no rewriting), so a reply whose seqid
differs is a bad reply. Bytes that arrive while no exchange is under way mean
the connection is unusable (the upstream closed it, or sent garbage): it is
closed and never reused.

    IDLE --exchange()--> BUSY --reply framed--> IDLE (back to the pool)
                           \--lost / bad reply / abandon()--> CLOSED

A reply larger than `stream_threshold` that does not come in one read may stream: its
head (and first result field, for the outcome) is read from its first bytes and the
exchange decides (`start_stream`); then each read is passed on as it arrives. A framed
or THeader reply says its length up front. An unframed one does not: it is a candidate
once `stream_threshold` bytes of it are here without its end (the decoder has read them
whole so far), and from then on `UnframedStream` finds its end in each read, keeping
only a cut field header between reads. Bytes past a streamed reply's end discard the
connection, as for any reply.

A large reply whose call is not yet first in line (the client pipelined, and an earlier call's
reply has not gone out) waits for its turn unread: the exchange says `WAIT_TURN`, this
connection keeps the bytes it has (at most a probe's, or `stream_threshold` of an unframed
reply) and stops reading, so the rest stays in the kernel (the upstream's send buffer, then the
upstream itself, holds it back). `take_turn()` (the client connection, once the call is first)
asks again and streams it, or reads it whole after all. Without it, every such reply would be
read whole into the proxy meanwhile: up to max_inflight x max_reply_size for one client.

Once the client's transport holds nothing and at least `splice.SPLICE_MIN` bytes of a framed
reply are still to come, the rest goes by splice(2), kernel to kernel (`proxy.splice`): this
connection's transport stays paused meanwhile and takes over again at the reply's end.
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic_ns

import struct

from proxy.codec import Decoder, Framing, Message, MessageType, Protocol, ProtocolError
from proxy.codec.wire import M_EXCEPTION, M_REPLY
from proxy.codec.heads import SETTING_HINT, UNVERSIONED_HINT, peek_result_field, read_head
from proxy.codec.stream import UnframedStream
from proxy.codec.theader import parse_header_block
from proxy import splice
from proxy.sockets import peer_closed, set_nodelay, unread_bytes, unsent_bytes
from proxy.tls import refusal

_I32 = struct.Struct("!i")
PROBE_MAX = 64 * 1024  # bytes gathered to read a large reply's head before deciding to stream it
SENT_WATCH_MIN = 64 * 1024  # requests this large are watched until the upstream's kernel has them
SENT_POLL_FIRST = 0.001     # s, then doubling up to SENT_POLL_MAX
SENT_POLL_MAX = 0.01
SETTLE_DELAY = 0.001        # s: a TLS connection with bytes unread is lent again after this (closed_by_peer)

WAIT_TURN = "wait_turn"  # Exchange.start_stream: stream it, but only once the call is first in line


class StreamHead:
    """The head of a reply that will stream: enough to check and classify it.

    `total`: bytes of the whole reply, length prefix included; None for an unframed reply
    (it has no length: the exchange hears its size at the end, `Exchange.stream_sized`).
    """

    __slots__ = ("name", "type", "seqid", "result_field", "total", "framing")

    def __init__(self, name, mtype, seqid, result_field, total, framing) -> None:
        self.name = name
        self.type = mtype
        self.seqid = seqid
        self.result_field = result_field
        self.total = total
        self.framing = framing


def stream_head(buf, framing: Framing, protocol: Protocol, total: int) -> StreamHead | None:
    """Read the head (and first result field) of a framed/THeader reply from its first bytes.

    None when more bytes are needed (or it cannot stream: a transformed THeader payload).
    """
    end = len(buf)
    start = 4
    if framing is Framing.FRAMED_HEADER:
        start = 8
    if framing.is_header:
        block, start = parse_header_block(buf, start, min(end, total), framing)
        if block.transforms:
            return None
        protocol = Protocol.COMPACT if block.protocol is Protocol.COMPACT else protocol
    r = read_head(buf, start, end, protocol)
    if r is None:
        return None
    name, mtype, seqid, body = r
    field = None
    if mtype == MessageType.REPLY:
        if body + 3 > end:
            return None
        field = peek_result_field(buf, body, end, protocol)
    return StreamHead(name, mtype, seqid, field, total, framing)

log = logging.getLogger(__name__)


class UpstreamError(Exception):
    """An attempt failed; `written` says whether any request byte reached the socket."""

    def __init__(self, message: str, written: bool, timeout: bool = False, endpoint_fault: bool = True,
                 own_limit: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.written = written
        self.timeout = timeout
        # False when the proxy itself refused (pool full, limits, shutting down), or when the
        # failure was already counted against the endpoint's breaker (a failed connect: the pool
        # reports it itself, proxy.cluster): breakers ignore it here.
        self.endpoint_fault = endpoint_fault
        # The proxy's own limit refused what the endpoint did as asked (a reply over max_reply_size):
        # no breaker counts it, and it is never retried (another attempt would fail the same way).
        self.own_limit = own_limit


class Exchange:
    """What an upstream connection reports to (the pipeline's attempt implements it)."""

    seqid: int
    name: str           # the method name sent (a reply must answer it: see `answers`)
    t_first_reply: int

    def start_stream(self, head: StreamHead) -> bool | str:  # pragma: no cover - interface
        """A large reply begins: True to stream it to the client as it arrives, False to read it
        whole, WAIT_TURN to hold it unread until `take_turn()` (then asked again)."""
        return False

    def owner(self):  # pragma: no cover - interface
        """The client the call is for (any hashable; None: none): one client's held replies
        keep at most its share of a pool's connections while others' calls wait (Pool.relieve)."""
        return None

    def held_for(self, ns: int) -> None:  # pragma: no cover - interface
        """The reply was held unread for its turn this long (however the hold ended)."""

    def read_whole_now(self, head: StreamHead, force: bool = False) -> bool:  # pragma: no cover - interface
        """Calls wait for this upstream connection: may the reply it would hold unread for its
        turn be read whole instead, to free the connection? (No when memory for replies waiting
        their turn is short, unless `force`: then it stays held, and the calls wait for another
        connection.)"""
        return True

    def stream_data(self, data) -> int:  # pragma: no cover - interface
        """Pass on a piece of the reply; returns the bytes the client's transport still holds."""
        raise NotImplementedError

    def splice_to(self):  # pragma: no cover - interface
        """The client connection the rest of a streaming reply may be spliced into now, or None."""
        return None

    def stream_end(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def stream_sized(self, size: int) -> None:  # pragma: no cover - interface
        """An unframed streamed reply's size, known only once it ended (or broke): what
        `StreamHead.total` says up front for a framed one. Called before stream_end/on_failure."""
        raise NotImplementedError

    def on_reply(self, reply: Message) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def on_failure(self, error: UpstreamError) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def answers(ex: Exchange, seqid: int, mtype: int, name: str) -> bool:
    """Does a reply with this head answer `ex`'s request: its seqid, REPLY or EXCEPTION, and its
    method (bare or multiplexed, as a multiplexed processor replies with the bare name; an
    EXCEPTION with no name is taken too)? Clients' seqids are not unique across a pool's
    connections, so the name is what tells a stale duplicate reply to another client's request
    on the same connection from its own; one to the same method with the same seqid cannot be
    told apart (seqids are not rewritten)."""
    if seqid != ex.seqid or (mtype != M_REPLY and mtype != M_EXCEPTION):
        return False
    sent = ex.name
    # (`_bare(sent)`: a multiplexed processor, or strip_service, removed only the service's
    # prefix: `Svc:a:b` is answered as `a:b`, whose own `_bare` would be `b`)
    return (name == sent or name == _bare(sent) or _bare(name) == _bare(sent)
            or (not name and mtype == M_EXCEPTION))


def reply_terms(message: str) -> str:
    """The codec's error text, worded for requests and the listener's settings, said of a reply
    (a cluster's transport and protocol cannot be auto)."""
    return SETTING_HINT.sub(r"set the cluster's \1 to \2", message.removeprefix("bad request: ").replace(
        "max_frame_size", "max_reply_size").replace(
        UNVERSIONED_HINT, "(not strict binary: does the endpoint speak the cluster's transport and "
                          "protocol? one that sends unversioned binary needs protocol binary_nonstrict)"))


def _bare(name: str) -> str:
    return name[name.find(":") + 1:]


class UpstreamConnection(asyncio.Protocol):
    __slots__ = ("pool", "transport", "decoder", "exchange_", "idle_since", "closed", "label", "framing",
                 "protocol", "max_reply_size", "stream_threshold", "_probe", "_stream_left", "_may_stream", "_tail",
                 "paused", "upload", "owned", "_splice", "_write_full", "_held_oneway", "fd", "_sent_poll",
                 "turn", "turn_since", "tls13", "replied", "oneways", "settling", "expires")

    def __init__(self, pool, framing: Framing, protocol: Protocol, max_reply_size: int,
                 stream_threshold: int = 0) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.decoder = Decoder(framing, protocol, max_reply_size)
        self.exchange_: Exchange | None = None
        self.idle_since = 0.0
        self.closed = False
        self.label = pool.label
        self.framing = framing
        self.protocol = protocol
        self.max_reply_size = max_reply_size
        # Replies larger than this may stream (0 = never).
        self.stream_threshold = stream_threshold
        self._probe: bytes | None = None   # first bytes of a framed reply, while deciding whether to stream
        self._stream_left = 0              # bytes of a streaming framed reply still to pass on
        self._may_stream = False           # the unframed reply being read whole may still stream
                                           # (set by its first read; cleared once asked)
        self._tail: UnframedStream | None = None  # finds the end of a streaming unframed reply
        self.paused = False                # reading paused by a streaming client's backpressure
        self.upload = None                 # the streaming request still being written (calls.Upload)
        self.owned = False                 # counted in the pool's `open` as a connection (not a connect)
        self._write_full = False           # the transport's buffer is over its high-water mark
        self._held_oneway = False          # kept from the pool until the upstream takes a oneway's bytes
        self._splice: splice.Splice | None = None  # moving the rest of a streaming reply (transport paused)
        self.fd = -1                       # the socket's (for the send queue: watch_sent)
        self._sent_poll = None             # the timer of watch_sent, while it looks
        self.turn: tuple | None = None     # a large reply held unread for its turn: (head, bytes so far)
        self.turn_since = 0                # since when (monotonic ns)
        self.tls13 = False                 # TLS 1.3 (a refusal of our certificate comes after our handshake)
        self.replied = False               # a reply's first byte came on it (a refusal comes before any)
        self.oneways = 0                   # oneway calls written on it
        self.settling = None               # TLS bytes unread when it was to be lent: the timer that
                                           # looks again once the loop has read them (closed_by_peer)
        self.expires = 0.0                 # monotonic time past which it closes when released (max_age); 0 = never

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        set_nodelay(sock)
        if sock is not None:
            self.fd = sock.fileno()
        ssl_object = transport.get_extra_info("ssl_object")  # (the handshake is done: it knows)
        self.tls13 = ssl_object is not None and ssl_object.version() == "TLSv1.3"

    def data_received(self, data: bytes) -> None:
        ex = self.exchange_
        if ex is None:
            log.info("upstream %s sent %d bytes while idle; closing that connection", self.label, len(data))
            self._discard()
            return
        if self._stream_left:
            self._stream_chunk(ex, data)
            return
        if self._tail is not None:
            self._stream_unframed(ex, data)
            return
        if not ex.t_first_reply:
            ex.t_first_reply = monotonic_ns()
            self.replied = True
            if self.upload is not None:  # it answers a streaming request before its end: the writing
                ex.t_written = ex.t_first_reply  # stops here (write_upstream; service_time 0)
            reply = self.decoder.take(data)  # the common case: the whole reply in one read
            if reply is not None:
                self._replied(ex, reply)
                return
            if self.stream_threshold:
                if self.framing is Framing.BUFFERED:
                    self._may_stream = True
                else:
                    self._probe = b""
        if self._probe is not None:
            data = self._probe_stream(ex, data)
            if data is None:
                return
        dec = self.decoder
        dec.feed(data)
        try:
            reply = dec.next_message()
        except ProtocolError as e:
            self._fail_garbage(e)
            return
        if reply is None:
            if self._may_stream and dec.buffered >= self.stream_threshold:
                self._begin_unframed_stream(ex)
            return
        self._replied(ex, reply)

    def _replied(self, ex: Exchange, reply: Message) -> None:
        """A whole reply: checked, the connection back to the pool, the exchange told."""
        if (reply.seqid != ex.seqid or (reply.type != M_REPLY and reply.type != M_EXCEPTION)
                or (reply.name != ex.name and not answers(ex, reply.seqid, reply.type, reply.name))):
            self._fail_head(ex, reply.seqid, reply.type, reply.name)
            return
        self.exchange_ = None
        if self.decoder.buffered or self.upload is not None:
            log.info("upstream %s %s; closing that connection", self.label,
                     "replied before the whole request was written" if self.upload is not None
                     else "sent bytes past its reply")
            self._discard()
            ex.on_reply(reply)
            return
        try:
            ex.on_reply(reply)  # the reply on its way to the client first...
        finally:
            self.pool.release(self)  # ...then this connection back to the pool (or a waiter)

    # -- streaming a large reply -------------------------------------------------------

    def _probe_stream(self, ex: Exchange, data: bytes):
        """Decide from a reply's first bytes whether it streams. Returns the bytes to decode
        normally, or None (kept for later, or now streaming)."""
        buf = self._probe + data if self._probe else data
        if len(buf) < 4:
            self._probe = buf
            return None
        length = _I32.unpack_from(buf, 0)[0]
        total = 4 + length
        if length <= self.stream_threshold or length > self.max_reply_size or total <= len(buf):
            self._probe = None
            return buf
        try:
            head = stream_head(buf, self.framing, self.protocol, total)
        except ProtocolError:
            head = None
            if len(buf) >= PROBE_MAX:
                self._probe = None
                return buf  # the decoder reports the garbage properly
        if head is None:
            if len(buf) < PROBE_MAX:
                self._probe = buf
                return None
            self._probe = None
            return buf
        self._probe = None
        if not answers(ex, head.seqid, head.type, head.name):
            self._fail_head(ex, head.seqid, head.type, head.name)
            return None
        go = ex.start_stream(head)
        if go is WAIT_TURN:
            if self._hold(head, buf):
                return None
            go = False
        if not go:
            return buf  # read it whole after all
        self._begin_stream(ex, head, buf)
        return None

    def _begin_stream(self, ex: Exchange, head: StreamHead, buf) -> None:
        """Stream a large reply from its first bytes (framed: `buf`; unframed: the decoder's)."""
        if head.total is None:
            first, self._tail = self.decoder.detach_unframed()
            ex.stream_data(first)
        else:
            self._stream_left = head.total
            self._stream_chunk(ex, buf)

    def _hold(self, head: StreamHead, buf) -> bool:
        """Keep a large reply unread until its call's turn (take_turn). Not while calls wait for
        a connection of this pool, if the exchange may read it whole instead (False: as under
        Pool.acquire's pressure): holding spares the proxy's memory, and costs other calls only
        when that memory is short."""
        pool = self.pool
        if pool.waiters and self.exchange_.read_whole_now(head):
            return False
        self.turn = (head, buf)
        self.turn_since = monotonic_ns()
        pool.held.add(self)
        if pool.waiters:  # (then: every connection of the pool may be holding now)
            pool.loop.call_soon(pool.relieve)
        if self._may_stream:
            self._may_stream = False
        self.transport.pause_reading()  # (not `paused`: that is the client's backpressure)
        return True

    def _end_hold(self) -> tuple | None:
        """The hold is over, however: (head, bytes so far), or None if there was none. The
        exchange hears how long it lasted first (before any of the reply moves)."""
        held = self.turn
        if held is None:
            return None
        self.turn = None
        self.pool.held.discard(self)
        ex = self.exchange_
        if ex is not None:
            ex.held_for(monotonic_ns() - self.turn_since)
        self.turn_since = 0
        return held

    def take_turn(self) -> None:
        """The held reply's call is first in line: stream the reply now (or read it whole after
        all: the exchange says)."""
        held = self._end_hold()
        ex = self.exchange_
        if held is None or ex is None or self.closed:
            return
        head, buf = held
        go = ex.start_stream(head)
        if go is WAIT_TURN:  # (not first after all: held again)
            if self._hold(head, buf):
                return
            go = False
        self._go_on(ex, head, buf, go)

    def held_owner(self):
        """The client the held reply is for (Pool.relieve's share), or None."""
        ex = self.exchange_
        return ex.owner() if ex is not None else None

    def held_size(self) -> float:
        """The held reply's size (inf: unframed, not known; or none held)."""
        total = self.turn[0].total if self.turn is not None else None
        return float("inf") if total is None else total

    def read_held_whole(self, force: bool = False) -> bool:
        """Read the held reply whole now, not waiting for its turn (its pool needs this
        connection back sooner: Pool.relieve), if the exchange may (`read_whole_now`; `force`:
        whatever the memory budget says); it then waits its turn as any reply read whole.
        False: it stays held."""
        ex = self.exchange_
        if self.turn is None or ex is None or self.closed or not ex.read_whole_now(self.turn[0], force):
            return False
        head, buf = self._end_hold()
        self._go_on(ex, head, buf, False)
        return True

    def _go_on(self, ex: Exchange, head: StreamHead, buf, stream: bool) -> None:
        """After a hold: stream the reply from its first bytes, or read it whole; reading resumes."""
        if stream:
            self._begin_stream(ex, head, buf)
        elif head.total is not None:  # (an unframed reply's bytes so far are the decoder's already)
            self.decoder.feed(buf)  # read it whole (it is larger than these bytes)
        if not self.paused and not self.closed and self.exchange_ is ex and self._splice is None:
            self.transport.resume_reading()

    def _stream_chunk(self, ex: Exchange, data: bytes) -> None:
        left = self._stream_left
        n = len(data)
        if n < left:
            self._stream_left = left = left - n
            if not ex.stream_data(data) and left >= splice.SPLICE_MIN and self.spliceable:
                self._start_splice(ex)
            return
        self._stream_left = 0
        self._stream_last(ex, data, left)

    @property
    def spliceable(self) -> bool:
        """Its socket may be a splice's end (proxy.splice): plain TCP, where splice(2) exists."""
        return splice.available and self.pool.ssl is None

    def _start_splice(self, ex: Exchange) -> None:
        """The client's transport holds nothing: the rest of the reply goes kernel to kernel."""
        client = ex.splice_to()
        sock = self.transport.get_extra_info("socket")
        if client is None or sock is None:
            return
        try:
            sp = splice.Splice(self.pool.loop, self, client, sock.fileno(), client.fd, self._stream_left)
        except OSError as e:  # (out of fds): counted, not logged per chunk
            self.pool.stats["splice_failures"] += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("upstream %s: no splice (%s); the reply streams through the proxy", self.label, e)
            return
        self._splice = sp
        self._stream_left = 0
        self.transport.pause_reading()
        self.pool.stats["spliced_replies"] += 1
        sp.start()

    # -- a splice's source (its reply) or sink (a streaming request: listener.py) -------------

    def splice_read(self, n: int) -> None:
        self.pool.stats["spliced_bytes"] += n  # (a spliced reply's size came with its head)

    def splice_done(self) -> None:
        """The spliced reply's last byte went to the client: this connection reads again (or is
        discarded: bytes past the reply came), then the exchange ends."""
        self._splice = None
        ex = self.exchange_
        self.exchange_ = None
        sock = self.transport.get_extra_info("socket")
        if sock is not None and unread_bytes(sock.fileno()):
            log.info("upstream %s sent bytes past its reply; closing that connection", self.label)
            self._discard()
        else:
            self.resume_reading()  # (the splice paused the transport)
            self.pool.release(self)
        ex.stream_end()

    def splice_failed(self, why: str, error: OSError | None) -> None:
        """The upstream socket closed or failed mid-reply (bytes went to the client already)."""
        self._fail(UpstreamError(f"connection to {self.label} lost after the request was written: {why}",
                                 written=True))

    def splice_wrote(self, n: int) -> None:
        self.pool.stats["spliced_bytes"] += n

    def splice_full(self) -> None:
        self.pause_writing()  # (what the transport would have said: the client is held back)

    def splice_ready(self) -> None:
        self.resume_writing()

    def splice_broken(self, exc: OSError) -> None:
        """Writing a spliced request failed: the exchange fails as a lost connection does."""
        self._fail(UpstreamError(f"connection to {self.label} lost while the request was being written: "
                                 f"{exc.strerror or exc}", written=True))

    def _begin_unframed_stream(self, ex: Exchange) -> None:
        """An unframed reply is still incomplete after `stream_threshold` bytes: stream the rest?

        An unframed reply has no length, so "larger than the threshold" is only known once
        that many bytes came without its end. Why wait for them rather than stream from the
        first read that leaves a reply incomplete: it is the framed rule (a small reply cut by
        a read is still read whole and written at once, and never marked streamed), and it
        cost nothing measurable on the bench's 945 KB get_users reply, whose first read is
        past 64 KiB ~98% of the time (reads are up to 256 KB): +~520 µs p50 and ~680 µs CPU
        per call either way, within noise (the scan for the end is ~200 µs of it).
        """
        dec = self.decoder
        try:
            head = dec.unframed_head()
        except ProtocolError:  # (never in practice: the scan has passed that field header)
            self._may_stream = False
            return  # read it whole: the decoder reports the garbage
        if head is None:
            return  # its first field header is not here yet (a huge method name)
        self._may_stream = False  # asked once per reply
        name, mtype, seqid, field = head
        if not answers(ex, seqid, mtype, name):
            self._fail_head(ex, seqid, mtype, name)
            return
        head = StreamHead(name, mtype, seqid, field, None, Framing.BUFFERED)
        go = ex.start_stream(head)
        if go is WAIT_TURN and self._hold(head, None):
            return
        if not go or go is WAIT_TURN:
            return  # read it whole after all
        self._begin_stream(ex, head, None)

    def _stream_unframed(self, ex: Exchange, data: bytes) -> None:
        tail = self._tail
        try:
            n = tail.feed(data)
        except ProtocolError as e:
            if e.over_limit:  # (its head answered the call: checked when it began to stream)
                self._fail(self._too_large(e))
            else:
                self._fail_garbage(e)
            return
        if not tail.done:
            ex.stream_data(data)
            return
        self._tail = None
        ex.stream_sized(tail.size)
        self._stream_last(ex, data, n)

    def _stream_last(self, ex: Exchange, data: bytes, n: int) -> None:
        """The read holding a streamed reply's end (its first `n` bytes): passed on, then the
        connection back to the pool, or discarded if the upstream sent bytes past the reply."""
        self.exchange_ = None
        ex.stream_data(data if n == len(data) else memoryview(data)[:n])
        if n < len(data):
            log.info("upstream %s sent bytes past its reply; closing that connection", self.label)
            self._discard()
        else:
            self.pool.release(self)  # resumes our reading if backpressure paused it
        ex.stream_end()

    def _stream_cut(self, ex: Exchange) -> None:
        """A streaming unframed reply broke off: its size is what got through."""
        tail = self._tail
        if tail is not None:
            self._tail = None
            ex.stream_sized(tail.size)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = True
            if self._splice is not None:
                self._splice.pause()  # (the transport itself stays paused while it splices)
            else:
                self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = False
            if self._splice is not None:
                self._splice.resume()
            elif self.turn is None:  # (a reply held for its turn stays unread: take_turn)
                self.transport.resume_reading()

    def eof_received(self) -> bool:
        """The upstream closed its side (FIN). A connection no call is on leaves the pool now,
        not at connection_lost (a later loop turn): a call leased in between would be written
        nowhere and told "may have run". One a call is on fails at connection_lost, as before."""
        if self.exchange_ is None:
            self._leave_pool()
        return False

    def closed_by_peer(self) -> bool:
        """Before this pooled connection takes a call: did the upstream close it already? (Its
        FIN or reset may wait unread behind the reply just read: the transport has not said so
        yet.) Such a connection is discarded here, and a new one is to be had instead.

        Over TLS a close is a close_notify record (or a refusal's alert) before the FIN, so any
        byte waiting unread may be one; but it is as often a TLS 1.3 server's session tickets,
        sent after the handshake, unread on a connection that only wrote oneways since. Such a
        connection is set aside, not lent (True, still open): the loop reads those bytes first,
        and `_settled` then finds it closed (a refusal counted as such by connection_lost) or
        gives it back to the pool. Before, it was aborted: a burst of oneways over TLS 1.3 made
        a handshake per few calls, and an alert aborted unread was never counted."""
        if self.settling is not None:
            return True
        if self.transport.is_closing() or peer_closed(self.fd):
            self._discard()
            return True
        if self.pool.ssl is not None and unread_bytes(self.fd) > 0:
            # (a timer, not call_soon: ready callbacks run before the loop's next read)
            self.settling = self.pool.loop.call_later(SETTLE_DELAY, self._settled)
            return True
        return False

    def _settled(self) -> None:
        """Set aside by closed_by_peer: the loop has read what was waiting. Closed by it (a
        close_notify, an alert) it is gone already; still holding bytes nobody reads, it is
        discarded; else it is the pool's again, as if just released."""
        self.settling = None
        if self.closed:
            return
        if self.transport.is_closing() or peer_closed(self.fd) or unread_bytes(self.fd) > 0:
            self._discard()
            return
        self.pool.release(self)

    def pause_writing(self) -> None:
        """The upstream is not taking a streaming request's bytes: the client waits too."""
        self._write_full = True
        if self.upload is not None:
            self.upload.hold(True)

    def resume_writing(self) -> None:
        self._write_full = False
        if self.upload is not None:
            self.upload.hold(False)
        if self._held_oneway:  # it took a oneway's bytes: free for the next call
            self._held_oneway = False
            if not self.closed:
                self.pool.release(self)

    def connection_lost(self, exc) -> None:
        self._stop_splice()
        self._leave_pool()
        self._end_hold()
        # (TLS 1.3: a refusal of our certificate comes after our side's handshake, before any
        # reply, whether or not the connection sat idle after a oneway; TLS 1.2 could
        # renegotiate later: not trusted there)
        alert = refusal(exc) if self.tls13 and not self.replied else None
        if alert is not None and self.oneways:
            self.pool.oneways_refused(alert, self.oneways)  # (nobody waits to be told)
        ex = self.exchange_
        if ex is not None:
            self.exchange_ = None
            self._stream_cut(ex)
            if alert is not None:
                self.pool.warnings.warn(log, ("refused", alert), "upstream %s refused the proxy's TLS connection: %s",
                                        self.label, alert)
                ex.on_failure(UpstreamError(f"{self.label} refused the TLS connection ({alert}): "
                                            "the request never reached the service", written=False))
                return
            why = f": {exc}" if exc else ""
            when = "while the request was being written" if self.upload is not None else "after the request was written"
            ex.on_failure(UpstreamError(f"connection to {self.label} lost {when}{why}", written=True))

    # -- used by the pipeline -------------------------------------------------

    def exchange(self, ex: Exchange | None, data) -> None:
        """Write a request. With `ex` None (oneway) the connection is free again at once, unless
        the upstream is not taking the bytes (the transport's buffer over its high-water mark):
        then only once it took them. So oneways sent to an upstream that stops reading fill at
        most the pool's connections' buffers, then wait for a connection like any call (bounded
        by acquire_timeout and max_pending), instead of piling up in one buffer without end."""
        self.exchange_ = ex
        self._probe = None
        self.transport.write(data)
        if ex is None:
            self.oneways += 1
            if self._write_full:
                self._held_oneway = True
            else:
                self.pool.release(self)

    def watch_sent(self, ex: Exchange, size: int) -> None:
        """`ex`'s request was handed over whole (`ex.t_written`): for a large one, move
        `t_written` on while the upstream has not taken it all, so that an upstream slow to read
        a large request shows in `write_upstream`, not in `service_time`. "Taken" is as for
        replies (proxy.listener): nothing left in the transport's buffer or unsent in the send
        queue (SIOCOUTQNSD); looked at with growing intervals, until the first reply byte."""
        if self._sent_poll is not None:  # (a stale look, the exchange before this one's)
            self._sent_poll.cancel()
            self._sent_poll = None
        if size < SENT_WATCH_MIN or self.fd < 0:
            return
        if self.transport.get_write_buffer_size() or unsent_bytes(self.fd):
            ex.t_handoff = ex.t_written  # (the endpoint's latency, peak_ewma's, still counts from here)
            self._sent_poll = self.pool.loop.call_later(SENT_POLL_FIRST, self._sent_look, ex, SENT_POLL_FIRST)

    def _sent_look(self, ex: Exchange, delay: float) -> None:
        self._sent_poll = None
        if self.exchange_ is not ex or self.closed or ex.t_first_reply:
            return  # (answered, gone, or replying: its write is over as far as it can be seen)
        ex.t_written = monotonic_ns()  # still writing until now at least (or just done)
        if self.transport.get_write_buffer_size() or unsent_bytes(self.fd):
            delay = min(delay * 2, SENT_POLL_MAX)
            self._sent_poll = self.pool.loop.call_later(delay, self._sent_look, ex, delay)

    def abandon(self) -> None:
        """The attempt gave up (timeout, client gone): a late reply must never be read as another's."""
        self._end_hold()  # (its time counted for the call first: a retry may be held again)
        ex = self.exchange_
        self.exchange_ = None
        if ex is not None:
            self._stream_cut(ex)
        self._discard()

    def _fail_head(self, ex: Exchange, seqid: int, mtype: int, name: str) -> None:
        """A reply whose head does not answer the request (another seqid or method, not
        REPLY/EXCEPTION)."""
        if seqid != ex.seqid:
            why = f"seqid {seqid} does not match the request's {ex.seqid}"
        elif mtype != M_REPLY and mtype != M_EXCEPTION:
            why = f"message type {mtype}"
        else:
            why = f"method '{name}' does not match the request's '{ex.name}'"
        self._fail(UpstreamError(f"bad reply from {self.label}: {why}", written=True))

    def _fail_garbage(self, e: ProtocolError) -> None:
        """A reply the codec cannot read, said in the reply's terms. One that answers the call
        and is refused for its size alone (`max_reply_size`) is the proxy's limit and the call's
        doing, not the endpoint's fault: no breaker counts it, and no retry would fare better
        (as a client calling a method no server has cannot eject the endpoints)."""
        ex, head = self.exchange_, e.head
        if (e.over_limit and head is not None and ex is not None
                and (head.type == M_REPLY or head.type == M_EXCEPTION) and answers(ex, head.seqid, head.type, head.name)):
            self._fail(self._too_large(e))
            return
        self._fail(UpstreamError(f"bad reply from {self.label}: {reply_terms(e.message)}", written=True))

    def _too_large(self, e: ProtocolError) -> UpstreamError:
        """A reply that answers the call, refused for its size alone: the proxy's limit."""
        return UpstreamError(f"reply from {self.label} too large: {reply_terms(e.message)} (the proxy's limit: "
                             "the cluster's max_reply_size)", written=True, own_limit=True)

    def _fail(self, error: UpstreamError) -> None:
        ex = self.exchange_
        self.exchange_ = None
        self._discard()
        if ex is not None:
            self._stream_cut(ex)
            ex.on_failure(error)

    def _stop_splice(self) -> None:
        sp = self._splice
        if sp is not None:
            self._splice = None
            sp.cancel()
        up = self.upload  # a streaming request spliced onto this connection: it stops with it
        if up is not None and up.splice is not None:
            up.client.stop_upload_splice(up)

    def _leave_pool(self) -> None:
        """Closed, and out of its pool's counts: once, whichever way it closed."""
        if not self.closed:
            self.closed = True
            if self.owned:  # (a connect cancelled by its deadline just after it completed: the
                self.pool.forget(self)  # pool's connect path uncounts it, not this)

    def _discard(self) -> None:
        self._end_hold()
        if not self.closed:
            self.closed = True
            self._stop_splice()
            if self.owned:
                self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()
