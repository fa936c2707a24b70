"""Client connections: frame requests, hand them to the pipeline, answer in request order.

One `ClientConnection` (an asyncio.Protocol) per accepted socket. Requests
may be pipelined; replies go back in request order. Bounded in-flight per
connection: reading pauses while `max_inflight` calls are open, or while the open calls'
requests hold `max_inflight_bytes` (`open_bytes`: a request is held for its retries until its
call is answered), or while the client is not reading its replies (the transport asked us to
pause writing). Requests past those wait, unframed, in the decoder. A client that
reads no reply byte for `request_read_timeout` while its replies back up is
closed (a write stall): what the proxy holds for it is bounded, then freed.

Timers are `loop.call_at` handles, armed only when needed: the request read
deadline once a request has started, the idle deadline when nothing is open.
A peer's malformed bytes get a PROTOCOL_ERROR reply and a lingering close, so
the client can read the reply before the socket goes away.

A large request streams upstream as it arrives (`_maybe_upload`, `calls.Upload`); once its
upstream connection's transport holds nothing and over `splice.SPLICE_MIN` of a framed one is
still to come, the rest goes by splice(2) (`_splice_upload`), this connection's transport not
reading meanwhile. The other way, it is a splice's sink for a streaming reply (`splice_target`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, replace
from time import monotonic_ns

from proxy.codec import Decoder, Framing, Head, MessageType, Protocol, ProtocolError, exception_reply
from proxy.codec import AppErrorType
from proxy.codec.heads import SETTING_HINT
from proxy.codec.message import Message
from proxy.codec.wire import F_BUFFERED, F_FRAMED, M_CALL, M_ONEWAY
from proxy import splice
from proxy.calls import BAD_REQUEST, CLIENT_GONE, NOT_DELIVERED, NOT_SENT, TIMEOUT, Call, Upload
from proxy.logs import Throttle
from proxy.pipeline import PREFIX
from proxy.sockets import sent_bytes, set_nodelay, unread_bytes, unsent_bytes

log = logging.getLogger(__name__)

LINGER = 2.0  # seconds a closing connection keeps reading (and discarding) so its reply is read
ACK_POLL_FIRST = 0.001  # then doubling, up to ACK_POLL_MAX, while a reply is not acknowledged
ACK_POLL_MAX = 0.01
NOTE_EVERY = 10.0  # seconds between two lines of one kind about clients' doings (ListenerState.notes)
STALL_LOOKS = 4  # looks per request_read_timeout at a client whose reading holds our writing back
WAITING_REPLY_BUDGET = 16 << 20  # bytes of large replies read whole while they wait behind a client's
                                 # earlier calls; past it they wait unread (take_turn)
PROXY_WAITING_BUDGET = 64 << 20  # the same, summed over every client connection of the proxy


# The answer to whole requests read behind a bad one (the connection closes after its answer).
AFTER_BAD = "not sent: an earlier request on this connection was malformed, and the connection closes after its answer"

class WaitingBudget:
    """Bytes of large replies read whole to wait their turn, over all client connections (one
    per proxy, kept across reloads): what `ClientConnection.wait_whole` draws on besides its
    own WAITING_REPLY_BUDGET. Past it, replies wait unread in the upstream's socket."""

    __slots__ = ("limit", "used", "unsized")

    def __init__(self, limit: int = PROXY_WAITING_BUDGET) -> None:
        self.limit = limit
        self.used = 0
        self.unsized = 0  # unframed replies let in before their size is known (at most one unforced)


ACK_CAP_NS = 60_000_000_000  # a client that has not acknowledged a reply after this never read it
UNDECIDED, NEVER = -2, -1    # ClientConnection._upload_at before a request's head is looked at / never


@dataclass(frozen=True, slots=True)
class ListenerSettings:
    name: str
    framing: Framing | None        # None = detect per connection
    protocol: Protocol | None      # None = detect per connection
    max_frame_size: int = 16_384_000
    max_connections: int = 10_000
    request_read_timeout: float = 30.0
    idle_timeout: float = 0.0
    max_inflight: int = 128        # open calls per client connection before reading pauses
    # ... or their requests' bytes (held for retries until each is answered: a call answered
    # while an earlier one is open lets its request go at once); one call always may be open
    max_inflight_bytes: int = 16 * 1024 * 1024
    # request_read_timeout also bounds a write stall: replies backed up (writing paused) and
    # not one byte read by the client for that long closes the connection.


class ListenerState:
    """What all connections of one listener share: settings, pipeline, counters."""

    def __init__(self, settings: ListenerSettings, pipeline, loop: asyncio.AbstractEventLoop,
                 waiting: WaitingBudget | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.loop = loop
        self.waiting = waiting if waiting is not None else WaitingBudget()  # (the server shares one)
        self.drain_by: tuple[float, float] | None = None  # removed by a reload: (deadline, drain_timeout)
        self.connections: set[ClientConnection] = set()
        self.stats = {"accepted": 0, "refused": 0, "protocol_errors": 0, "read_timeouts": 0,
                      "idle_closed": 0, "write_stalls": 0}
        # lines about clients' doings (bad requests, write stalls, refusals), thinned per kind: a
        # client that reconnects per call with the wrong framing is one line per NOTE_EVERY
        self.notes = Throttle(NOTE_EVERY)

    def protocol_factory(self) -> "ClientConnection":
        return ClientConnection(self)


class ClientConnection(asyncio.Protocol):
    __slots__ = ("state", "settings", "transport", "decoder", "queue", "peer", "t_first",
                 "closing", "paused_reading", "paused_writing", "_read_timer", "_idle_timer",
                 "_last_active", "_linger", "fd", "bytes_out", "_unacked", "_ack_poll", "_ack_delay",
                 "stream_call", "stream_up", "_waiting", "_waiting_bytes", "_paused_at", "_framing", "_eof", "_stall_timer",
                 "_stall_mark", "_stall_seen", "upload", "_upload_at", "_upload_by", "_upload_held", "_closed_why",
                 "_held_since", "_held_part", "_resumed_at", "open_bytes")

    def __init__(self, state: ListenerState) -> None:
        self.state = state
        # The settings it was accepted under, for its whole life: a reload's new settings are
        # for new connections (a timer armed under one idle_timeout must not read another).
        self.settings = s = state.settings
        self.transport = None
        self.decoder = Decoder(s.framing, s.protocol, s.max_frame_size, whole_body=True)
        self.queue: deque[Call] = deque()
        self.peer = None
        self.t_first = 0
        self.closing = False
        self.paused_reading = False
        self.paused_writing = False
        self._read_timer = None
        self._idle_timer = None
        self._last_active = 0
        self._linger = None
        self.fd = -1
        self.bytes_out = 0                 # reply bytes written to the transport, ever
        self._unacked: deque = deque()     # (end offset in bytes_out, call) not yet acknowledged
        self._ack_poll = None
        self._ack_delay = ACK_POLL_FIRST
        self.stream_call: Call | None = None   # the call whose reply is streaming now
        self.stream_up = None                  # its upstream connection (paused with us)
        self._waiting: dict[Call, int] = {}    # large replies read whole to wait their turn: their sizes
        self._waiting_bytes = 0                # (their sum: WAITING_REPLY_BUDGET bounds it)
        self._paused_at = 0
        self._framing = False                  # in _frame_requests (no nested framing)
        self._eof = False                      # half-closed while requests wait in the decoder
        self._stall_timer = None               # armed while writing is paused
        self._stall_mark = 0                   # bytes the client had read at the last look
        self._stall_seen = 0                   # when the last look saw it take bytes
        self._closed_why: str | None = None    # why the proxy itself closed it (else: the client did)
        self.upload: Upload | None = None      # a large request passing upstream as it arrives
        self._upload_at = UNDECIDED            # bytes past which the request arriving streams
        self._upload_by = None                 # the pipeline (config) that decided _upload_at
        self._upload_held = False              # reading paused for the upload (calls.Upload.paused)
        self._held_since = 0                   # requests held back at max_inflight arrived by then
        self._held_part = 0                    # the start of a request held back unfinished, read on
        self._resumed_at = 0                   # since this resume (its wait is `queued`, not reading)
        self.open_bytes = 0                    # request bytes held for open calls (Call.req_held's sum)

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport) -> None:
        state = self.state
        self.transport = transport
        if len(state.connections) >= state.settings.max_connections:
            state.stats["refused"] += 1
            state.notes.warn(log, "refused", "listener %s has max_connections %d open: refusing new connections",
                             state.settings.name, state.settings.max_connections)
            self.closing = True
            transport.abort()
            return
        state.connections.add(self)
        state.stats["accepted"] += 1
        sock = transport.get_extra_info("socket")
        set_nodelay(sock)
        self.fd = sock.fileno()
        self.peer = transport.get_extra_info("peername")
        if self.settings.idle_timeout > 0:
            self._last_active = monotonic_ns()
            self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # lingering: read and discard
        now = monotonic_ns()
        if self._unacked and self._ack_poll is not None:
            self._ack_poll.cancel()  # a client that sends has likely read: look now
            self._check_acks()
        if self._idle_timer is not None:
            self._last_active = now
        if self.upload is not None:
            data = self._upload_more(data)
            if not data:
                return  # (what follows the streamed request, if anything, begins the next one)
        dec = self.decoder
        if len(self.queue) < self.settings.max_inflight and self.open_bytes < self.settings.max_inflight_bytes:
            msg = dec.take(data)  # the common case: this read is one whole request
            if msg is not None:
                self.t_first = now
                if msg.type == M_CALL or msg.type == M_ONEWAY:
                    self.state.pipeline.handle(self, msg, now, now)
                else:
                    self._bad_type(msg)
                if (not self.closing and (self._read_timer is not None or self._eof
                                          or len(self.queue) >= self.settings.max_inflight
                                          or self.open_bytes >= self.settings.max_inflight_bytes)):
                    self._after_framing(dec)
                return
        if not dec.buffered:
            self.t_first = now
        dec.feed(data)
        self._frame_requests(now)

    def _frame_requests(self, now: int) -> None:
        """Hand whole requests to the pipeline while fewer than `max_inflight` calls are open
        (and their requests hold less than `max_inflight_bytes`); the rest waits in the
        decoder, reading paused, until replies go out (_maybe_resume)."""
        dec = self.decoder
        pipeline = self.state.pipeline  # the current config's (a reload swaps it)
        limit = self.settings.max_inflight
        self._framing = True
        try:
            self._frame_loop(dec, pipeline, limit, now)
        finally:
            self._framing = False
        self._after_framing(dec)

    def _after_framing(self, dec: Decoder) -> None:
        """Pause reading at max_inflight (calls or bytes); arm or cancel the read deadline; a waiting EOF."""
        if self.closing:
            return
        if self._full() and self.upload is None:  # (an upload's bytes are its counted call's)
            self._disarm_read()  # bytes we hold back are not the client's delay
            if dec.buffered and not self._held_since:
                self._held_since = self.t_first  # (when the bytes held back arrived)
            if not self.paused_reading:
                self.paused_reading = True
                self.transport.pause_reading()
            return
        if dec.buffered or self.upload is not None:
            if self._read_timer is None:
                self._arm_read_timer(self.t_first)
        elif self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._eof:  # the client half-closed while requests waited: now handle its EOF
            self._eof = False
            if not self._half_closed():
                self.transport.close()

    def _full(self) -> bool:
        """As many calls open as one connection may have: `max_inflight`, or requests holding
        `max_inflight_bytes` (one call always may be open, however large its request)."""
        q = self.queue
        return len(q) >= self.settings.max_inflight or (self.open_bytes >= self.settings.max_inflight_bytes
                                                         and bool(q))

    def _frame_loop(self, dec, pipeline, limit: int, now: int) -> None:
        budget = self.settings.max_inflight_bytes
        while len(self.queue) < limit and (self.open_bytes < budget or not self.queue):
            try:
                msg = dec.next_message()
            except ProtocolError as e:
                self._protocol_error(e)
                if self.closing:
                    return
                continue  # the bad frame was consumed (INVALID_TRANSFORM): requests behind it go on
            if msg is None:
                if dec.buffered and self._upload_at != NEVER and (dec.framing is F_FRAMED
                                                                  or dec.framing is F_BUFFERED):
                    self._maybe_upload(dec, pipeline, now)
                break
            self._upload_at = UNDECIDED
            self._upload_by = None
            t_start = self.t_first
            t_framed = now
            admitted = 0
            held = self._held_since
            if held:  # held back by us at max_inflight: it was here (whole) all that time, which
                t_start = t_framed = min(held, t_start)  # counts in its total, not as the client's:
                admitted = now  # it waited behind the client's earlier calls (`queued`)
            elif self._held_part:  # its start was held back too, its rest read since the resume: the
                t_start = self._held_part  # hold is `queued` as above, its reading read_request (drawn
                t_framed = t_start + now - self._resumed_at  # first: the two times, not their order)
                admitted = now
            self._held_part = 0
            self.t_first = now
            if msg.type != M_CALL and msg.type != M_ONEWAY:
                self._bad_type(msg)
                return
            pipeline.handle(self, msg, t_start, t_framed, None, admitted)
            if self.closing:
                return

    # -- a large request streams in -----------------------------------------------------

    def _maybe_upload(self, dec: Decoder, pipeline, now: int) -> None:
        """A request still arriving, its head here: pass it upstream as it arrives once it is
        over `Pipeline.upload_threshold` (a frame's size is known at once; an unframed one's
        only grows), else leave it to be read whole."""
        if self._upload_by is not pipeline:  # (a reload since it was decided: the new config's route decides)
            self._upload_by = pipeline
            self._upload_at = UNDECIDED
        if dec.framing is F_FRAMED:
            size = dec.pending_size()
            if size is not None and size <= pipeline.upload_min:
                self._upload_at = NEVER  # too small to stream on any route: read it whole
                return
            pending = dec.pending_frame()
            if pending is None:
                return  # its head is not here yet
            msg, total = pending
            size = total
        else:
            if dec.buffered <= pipeline.upload_min or dec.buffered <= self._upload_at:
                return  # (not yet over its route's threshold)
            try:
                head = dec.unframed_head()
            except ProtocolError:
                return  # read on: the decoder reports it
            if head is None:
                return
            msg = Message(head[0], head[1], head[2], dec.framing, dec.protocol, b"", 0, None, b"", 0)
            total = None
            size = dec.buffered
        at = self._upload_at
        if at == UNDECIDED:
            at = pipeline.upload_threshold(msg)
            at = self._upload_at = NEVER if at is None else at
        if size <= at or at == NEVER:
            if total is not None:
                self._upload_at = NEVER  # a frame's size does not grow: read it whole
            return
        self._upload_at = UNDECIDED
        self._upload_by = None
        if total is not None:
            up = Upload(self, total, dec.detach_frame())
            check = up.check = dec.frame_body(msg, total)
            if check is not None:
                try:
                    for part in up.held:
                        check.feed(part)
                except ProtocolError as e:  # (nothing of it went upstream)
                    self._protocol_error(e.with_head(msg.head))
                    return
        else:
            buf, tail = dec.detach_unframed()
            up = Upload(self, None, [buf], tail)
        self.upload = up
        pipeline.handle(self, msg, self.t_first, now, up)

    def _upload_more(self, data: bytes):
        """The next read while a request streams: its part goes on; returns what follows it."""
        up = self.upload
        n = len(data)
        call = up.call
        tail = up.tail
        if tail is None:
            left = up.total - up.received  # bytes of it still to come
            last = n >= left
            if up.check is not None:
                try:  # (before the bytes go upstream: a frame hiding a second message never does whole)
                    up.check.feed(data if n <= left else memoryview(data)[:left])
                except ProtocolError as e:
                    self._upload_garbage(e, data[left:] if n > left else None)
                    return None
        else:
            try:
                left = tail.feed(data)  # the bytes of it in this read (all, until its end)
            except ProtocolError as e:
                self._upload_garbage(e)
                return None
            last = tail.done
        if not last:
            up.received += n
            call.pipeline.upload_data(call, data, False)
            if up.total is not None and up.total - up.received >= splice.SPLICE_MIN:
                self._splice_upload(up)
            return None
        self.upload = None
        up.call = None  # (the call keeps its Upload: no call <-> upload cycle left for the GC)
        up.received += left
        up.total = up.received
        up.done = True
        call.pipeline.upload_data(call, data if n == left else memoryview(data)[:left], True)
        if n == left:
            self._disarm_read()
            return None
        return data[left:]

    def _splice_upload(self, up: Upload) -> None:
        """The rest of a framed request goes client socket → upstream socket by splice(2)
        (proxy.splice) once its connection is writing it and that transport holds nothing.
        Checked (`up.check`), only the inside of the long value it is in goes so (`opaque`):
        then its transport reads the rest again, and the check goes on there."""
        count = up.total - up.received
        if up.check is not None:
            count = min(count, up.check.opaque)
            if count < splice.SPLICE_MIN:
                return
        a = up.call.attempt
        conn = a.upconn if a is not None else None
        if (conn is None or conn.upload is not up or conn.closed or not conn.spliceable or up.paused
                or self.closing or self.fd < 0 or conn.transport.get_write_buffer_size()):
            return
        sock = conn.transport.get_extra_info("socket")
        if sock is None:
            return
        try:
            sp = splice.Splice(self.state.loop, self, conn, self.fd, sock.fileno(), count)
        except OSError:
            conn.pool.stats["splice_failures"] += 1
            return
        conn.pool.stats["spliced_requests"] += 1
        up.splice = sp
        if not self.paused_reading:  # its bytes are the splice's to read now
            self.paused_reading = True
            self.transport.pause_reading()
        sp.start()

    # a splice's source (the rest of a streaming request)

    def splice_read(self, n: int) -> None:
        up = self.upload
        up.received += n
        if up.check is not None:
            up.check.pass_over(n)
        if self._idle_timer is not None:  # (the transport, which would say so, reads nothing now)
            self._last_active = monotonic_ns()

    def splice_done(self) -> None:
        """The spliced request's last byte is upstream: as when its last read came. (Or the
        long value spliced has ended: the transport reads, and the check sees, the rest.)"""
        up = self.upload
        up.splice = None
        if up.received < up.total:
            self._maybe_resume()
            return
        call = up.call
        self.upload = None
        up.call = None
        up.done = True
        self._disarm_read()
        call.pipeline.upload_data(call, b"", True)
        self._maybe_resume()  # (the next request, if any, is the transport's to read)

    def splice_failed(self, why: str, error: OSError | None) -> None:
        """The client's socket closed (`error` None: answered as a half-close is) or failed (the
        client is gone: its connection_lost cancels the call) inside the spliced request."""
        up = self.upload
        up.splice = None
        if error is not None:
            self.transport.abort()
            return
        self._upload_broken(f"bad request: connection closed inside a request ({up.progress()})")

    def stop_upload_splice(self, up: Upload) -> None:
        """The request will not be finished (its attempt stopped, the client is gone): the
        splice stops; the rest of it, if the connection goes on, is read (and dropped) as usual."""
        sp = up.splice
        if sp is not None:
            up.splice = None
            sp.cancel()
            self._maybe_resume()

    def hold_upload(self, on: bool) -> None:
        """Pause reading while a streaming request cannot go on (the upstream is not taking it,
        or it waits for a connection with enough held); resume when it can."""
        self._upload_held = on
        if on:
            if not self.paused_reading and not self.closing and self.transport is not None:
                self.paused_reading = True
                self.transport.pause_reading()
        else:
            self._maybe_resume()

    def _upload_garbage(self, e: ProtocolError, after: bytes | None = None) -> None:
        """A streaming request that turned out malformed mid-stream (unframed: where the next
        request would begin cannot be known; framed: its struct does not fill its frame). Its
        upstream connection, holding part of it, is closed: the upstream never has it whole.
        `after`: the bytes past its frame in the same read; whole requests among them are
        answered "not sent", as behind any bad request (`_protocol_error`)."""
        self.state.stats["protocol_errors"] += 1
        self.state.notes.log(log, logging.INFO, "protocol_error", "client %s on listener %s: %s", self.peer,
                             self.settings.name, e.message)
        if after:  # (queued behind its call, whose answer writes them: _upload_broken)
            self.decoder.feed(after)
            self._refuse_held(AFTER_BAD)
        self._upload_broken(e.message)
        if after and self.queue and self.queue[0].reply is not None:
            self.call_done(self.queue[0])  # (its call was answered already: no route, an early reply)

    def _upload_broken(self, text: str, outcome=None) -> None:
        """The streaming request will not be finished: its call is answered with `text` (unless
        it was already), then the connection closes after the replies."""
        up = self.upload
        self.upload = None
        self._upload_held = False
        self.closing = True
        self.stop_upload_splice(up)  # (after `closing`: nothing resumes the transport's reading)
        self._disarm_read()
        call = up.call
        up.call = None
        if outcome is None:
            call.pipeline.upload_broken(call, text)
        else:
            call.pipeline.upload_broken(call, text, outcome, AppErrorType.INTERNAL_ERROR)
        if not self.queue:
            self._close_after_replies()

    def _bad_type(self, msg) -> None:
        self._protocol_error(ProtocolError(
            f"bad request: message type {msg.type} from a client (expected CALL or ONEWAY)", head=msg.head))

    def eof_received(self) -> bool:
        if self.closing:
            # Closing already (a refused request, a read deadline, our own lingering close):
            # replies still owed are written first (False would close the transport at once and
            # lose them with their calls); call_done closes it after the last.
            return bool(self.queue)
        up = self.upload
        if up is not None:  # answer it (the client half-closed), then close
            self._upload_broken(f"bad request: connection closed inside a request ({up.progress()})")
            return bool(self.queue)
        if self.decoder.buffered and self._full():
            self._eof = True  # whole requests wait in the decoder: answer them first
            return True
        return self._half_closed()

    def _half_closed(self) -> bool:
        try:
            self.decoder.eof()
        except ProtocolError as e:
            # A request the client's FIN cut short: answered (it may still read) and counted as
            # any malformed request is, with its seqid when its head is here, as a large one
            # that streamed is (_upload_broken). Before: closed unanswered and uncounted.
            self._protocol_error(e)
        # Half-closed: answer what is open, then close.
        if not self.queue:
            return False
        self.closing = True
        return True

    def connection_lost(self, exc) -> None:
        self.closing = True
        self.state.connections.discard(self)
        self.state.waiting.unsized -= sum(1 for size in self._waiting.values() if not size)
        self._waiting.clear()  # (its calls end below: no budget left to keep)
        self.state.waiting.used -= self._waiting_bytes
        self._waiting_bytes = 0
        if self.upload is not None:  # gone mid-request: the call is cancelled below
            self.stop_upload_splice(self.upload)
            self.upload.call = None
            self.upload = None
        for t in (self._read_timer, self._idle_timer, self._linger, self._stall_timer):
            if t is not None:
                t.cancel()
        if self.decoder.buffered:
            self._drop_held()
        for call in self.queue:
            if call.pipeline is not None:
                call.pipeline.cancel(call, self._closed_why)
        self.queue.clear()
        self.open_bytes = 0
        up = self.stream_up
        if up is not None:  # gone mid-stream: its upstream connection (maybe paused) goes too
            call = self.stream_call
            self._stream_times(call)  # (before the splice, if any, stops: it would end the pause)
            self.stream_call = self.stream_up = None
            up.abandon()
            a = call.attempt
            if a is not None and not a.ended:
                why = self._closed_why or (f"the client's connection broke before it took the reply ({exc})"
                                           if exc is not None else "the client closed its connection")
                call.pipeline._stream_failed(a, why, blame=False)
        if self._ack_poll is not None:
            self._ack_poll.cancel()
            self._ack_poll = None
        if self._unacked and (exc is not None or self._closed_why is not None):
            self._lost_with_replies_out(exc)
        if self._unacked:
            try:
                self._check_acks()  # what it acknowledged before closing
            except OSError:
                pass
            if self._ack_poll is not None:
                self._ack_poll.cancel()
                self._ack_poll = None
        now = monotonic_ns()
        while self._unacked:  # the client is gone: nothing more will be acknowledged
            _, call = self._unacked.popleft()
            call.t_acked = now
            call.pipeline.completed(call)

    def _lost_with_replies_out(self, exc) -> None:
        """The connection broke (a reset) or the proxy cut it (a write stall) with replies not yet
        seen leaving the send queue. The socket's count of bytes that left it (TCP_INFO, still
        readable here) says which of them did: replies past it never reached the client and are
        recorded as not delivered, not as delivered because the connection ended. (When it
        cannot be read, they are recorded as before.)"""
        sent = sent_bytes(self.fd)
        if sent is None:
            return
        why = self._closed_why or f"the client's connection broke before it took the reply ({exc})"
        now = monotonic_ns()
        unacked = self._unacked
        while unacked:
            end, call = unacked.popleft()
            call.t_acked = now  # (when we learned: write_response lasted at least this)
            if end <= sent:
                call.t_handed = call.t_handed or now
            else:  # never reached the client: recorded (and traced) as failed
                call.never_read = True
                call.error_type = NOT_DELIVERED
                call.error = f"not delivered: {why}"
            call.pipeline.completed(call)

    def pause_writing(self) -> None:
        self.paused_writing = True
        self._paused_at = monotonic_ns()
        if self.stream_up is not None:
            self.stream_up.pause_reading()  # backpressure reaches the upstream
        if not self.paused_reading and not self.closing:
            self.paused_reading = True
            self.transport.pause_reading()
        # Not reading is our doing, not the client's delay: its read deadline stops until writing
        # resumes (the write-stall check bounds a client that stops reading its replies).
        self._disarm_read()
        if self._stall_timer is None and self.settings.request_read_timeout > 0:
            self._stall_mark = self._client_read()
            self._stall_seen = monotonic_ns()
            self._stall_timer = self.state.loop.call_later(
                self.settings.request_read_timeout / STALL_LOOKS, self._write_stall)

    def _client_read(self) -> int:
        """Reply bytes the client's kernel has taken (written, handed, and not left unsent)."""
        return self.bytes_out - self.transport.get_write_buffer_size() - unsent_bytes(self.fd)

    def _write_stall(self) -> None:
        self._stall_timer = None
        if not self.paused_writing or self.transport is None or self.transport.is_closing():
            return
        read = self._client_read()
        timeout = self.settings.request_read_timeout
        now = monotonic_ns()
        if read != self._stall_mark:  # slow, but reading (or its kernel still taking bytes)
            self._stall_mark = read
            self._stall_seen = now
        if now - self._stall_seen < timeout * 1e9:  # a stall is a whole timeout with no byte taken
            self._stall_timer = self.state.loop.call_later(timeout / STALL_LOOKS, self._write_stall)
            return
        self.state.stats["write_stalls"] += 1
        self.state.notes.log(log, logging.INFO, "write_stall",
                             "client %s on listener %s read no reply byte for %gs (%d bytes waiting): closing",
                             self.peer, self.settings.name, timeout, self.transport.get_write_buffer_size())
        self._closed_why = f"the client read no reply byte for {timeout:g}s (write stall: closed by the proxy)"
        self.transport.abort()

    def resume_writing(self) -> None:
        self.paused_writing = False
        now = monotonic_ns()
        if self._idle_timer is not None:
            self._last_active = now
        if self.stream_call is not None:
            self.stream_call.client_paused_ns += now - self._paused_at
        if self.upload is not None:
            self.t_first += now - self._paused_at  # (its read deadline stood still: pause_writing)
        if self.stream_up is not None:
            self.stream_up.resume_reading()
        self._maybe_resume()

    # -- a streaming reply ---------------------------------------------------------------

    def can_stream(self, call: Call) -> bool:
        """Only the first reply in line may stream (replies go back in request order). A
        connection that closes once its replies are out (`closing`: the client half-closed, or
        sent a bad request behind this one) still streams them: read whole, a large reply to a
        client that half-closes after its request would be held in memory, up to
        max_reply_size each. Not once its transport is closing (shut down, gone)."""
        t = self.transport
        return (self.stream_call is None and t is not None and not t.is_closing()
                and bool(self.queue) and self.queue[0] is call)

    def stream_later(self, call: Call) -> bool:
        """`call`'s reply may stream once it is first in line (its upstream connection holds it
        unread until `_give_turn`): this connection's transport is open and the call in line."""
        t = self.transport
        return t is not None and not t.is_closing() and call in self.queue

    def wait_whole(self, call: Call, size: int | None, pressed: bool = False, force: bool = False) -> bool:
        """May `call`'s large reply (`size` bytes; None: unframed, not known) behind earlier
        calls be read whole to wait its turn? Yes while this connection's replies read whole for
        that stay within WAITING_REPLY_BUDGET, and all the proxy's within its WaitingBudget
        (reading it frees its upstream connection at once: a client pipelining many calls does
        not hold as many connections); else it waits unread. `pressed`: calls wait for that
        upstream connection (Pool.relieve), so only the proxy's budget applies (an unframed
        reply, whose size is not known, is let in while that has room and no other such reply
        is being read, counted as 0 until call_done counts its size: one max_reply_size at most
        past the budget); `force`: none does (counted all the same)."""
        shared = self.state.waiting
        if size is None:
            if not (force or (pressed and shared.used < shared.limit and not shared.unsized)):
                return False
            if call not in self._waiting:
                shared.unsized += 1
            size = 0
        elif self._waiting.get(call) == 0:  # an unsized one's size, now known
            shared.unsized -= 1
        have = self._waiting.get(call, 0)
        if not force and ((not pressed and self._waiting_bytes - have + size > WAITING_REPLY_BUDGET)
                          or shared.used - have + size > shared.limit):
            return False
        self._waiting[call] = size
        self._waiting_bytes += size - have
        shared.used += size - have
        return True

    def unwait(self, call: Call) -> None:
        """`call`'s reply read whole to wait its turn (wait_whole) is written, or dropped for a
        retry: its share of the budgets is free."""
        if self._waiting:
            size = self._waiting.pop(call, None)
            if size is None:
                return
            self._waiting_bytes -= size
            self.state.waiting.used -= size
            if not size:  # (never sized: its reply was dropped before it was all read)
                self.state.waiting.unsized -= 1

    def _give_turn(self, call: Call) -> None:
        """`call` is first in line now: if its large reply is held unread, let it come. (The time
        it was held counts as the client's: Attempt.held_for.)"""
        a = call.attempt
        if a is not None and a.held:
            a.upconn.take_turn()

    def stream_begin(self, call: Call, upconn) -> None:
        self.stream_call = call
        self.stream_up = upconn
        if call.req_held:  # (answered: no attempt can follow)
            self._answered(call)
        call.t_write = monotonic_ns()
        if self.paused_writing:
            upconn.pause_reading()
            # (the pause began before this stream, behind earlier replies: it holds this one back
            # from now, not from then, which would count its hold twice)
            self._paused_at = call.t_write

    def paused_ns(self, call: Call) -> int:
        """How long this connection has held `call`'s streaming reply back so far (not reading)."""
        paused = call.client_paused_ns
        if self.paused_writing and self.stream_call is call:
            paused += monotonic_ns() - self._paused_at
        a = call.attempt
        if a is not None and a.held:  # held for its turn (_give_turn)
            paused += monotonic_ns() - a.upconn.turn_since
        return paused

    def stream_write(self, call: Call, data) -> int:
        """Write a piece of `call`'s streaming reply; returns the bytes the transport still holds."""
        t = self.transport
        if call is not self.stream_call or t is None:
            return 0
        t.write(data)
        self.bytes_out += len(data)
        return t.get_write_buffer_size()

    # a splice's sink (the rest of a streaming reply: proxy.splice), as the transport would be

    def splice_wrote(self, n: int) -> None:
        self.bytes_out += n

    def splice_full(self) -> None:
        self.pause_writing()

    def splice_ready(self) -> None:
        self.resume_writing()

    def splice_broken(self, exc: OSError) -> None:
        if self.transport is not None:  # its connection_lost abandons the upstream connection
            self.transport.abort()

    def splice_target(self, call: Call):
        """This connection, when the rest of `call`'s streaming reply may go straight into its
        socket (proxy.splice): the reply is streaming to it and its transport holds nothing."""
        t = self.transport
        if (call is self.stream_call and t is not None and not t.is_closing() and not self.paused_writing
                and self.fd >= 0 and t.get_write_buffer_size() == 0):
            return self
        return None

    def stream_end(self, call: Call) -> None:
        if call is not self.stream_call:
            return
        self.stream_call = None
        self.stream_up = None  # (the upstream connection resumed its own reading when it finished)
        self._stream_times(call)
        q = self.queue
        if q and q[0] is call:
            q.popleft()
        self.unwait(call)  # (it waited to be read whole once; a retry's reply streamed)
        self._unacked.append((self.bytes_out, call))
        call.reply = b""  # written already; nothing left to send
        if q and q[0].reply is not None:
            self.call_done(q[0])
        else:
            if self._ack_poll is not None:
                self._ack_poll.cancel()
            self._check_acks()
            if self.closing and not q:
                self._close_after_replies()
            elif self.paused_reading:
                self._maybe_resume()
            if q and self.stream_call is None:
                self._give_turn(q[0])

    def _stream_times(self, call: Call) -> None:
        """A stream is over (whole or cut): the time the client held it back, a pause still
        open included, and the time it waited for upstream bytes (the spans' client_paused_ms
        and upstream_wait_ms, which `hops` splits the overlap with)."""
        if self.paused_writing:
            now = monotonic_ns()
            call.client_paused_ns += now - self._paused_at
            self._paused_at = now
        a = call.attempts[-1] if call.attempts else None
        if a is not None and a.t_reply and a.t_first_reply:
            # the stream's own pauses: what the client held back, less every attempt's hold for
            # its turn (an earlier attempt's too; this one's is not part of its stream either)
            paused = call.client_paused_ns - call.held_ns
            call.upstream_wait_ns = max(a.t_reply - a.t_first_reply - a.held_ns - paused, 0)

    def stream_abort(self, call: Call) -> None:
        """The reply broke after bytes reached the client: only closing its connection is left.
        The call is over all the same: recorded (metrics, a failed call's spans) like any other,
        its write_response hop ending now."""
        self.stream_call = None
        self.stream_up = None
        self._stream_times(call)
        q = self.queue
        if q and q[0] is call:
            q.popleft()
        now = monotonic_ns()
        call.t_done = call.t_done or now
        call.t_handed = now
        if self.transport is not None:
            if self._closed_why is None:  # (calls behind it are not the client's leaving)
                self._closed_why = f"an earlier call's streamed reply broke ({call.msg.name}: {call.error})"
            self.transport.abort()
        call.pipeline.completed(call)

    # -- calls ------------------------------------------------------------------

    def call_done(self, call: Call) -> None:
        """A call has its reply: write every reply that is now first in line."""
        q = self.queue
        if not q or q[0] is not call:
            if call.cancelled or self.transport is None:
                return
            call.waited = True  # an earlier call is still open: this reply waits its turn (the `queued` hop)
            if self._waiting and self._waiting.get(call) == 0 and call.reply is not None:
                # an unframed reply, let in while its size was not known (wait_whole): counted now
                self.wait_whole(call, len(call.reply), force=True)
            if call.req_held:
                # its answer is final: no attempt can follow, and its request's bytes go now, not
                # when the slow call ahead of it is answered (they would count in open_bytes)
                self._answered(call)
                call.drop_request()
                if self.paused_reading:
                    self._maybe_resume()
            return
        t = self.transport
        write = t.write
        unacked = self._unacked
        while q and q[0].reply is not None:
            c = q.popleft()
            if c.req_held:  # (_answered, inline: once per call)
                self.open_bytes -= c.req_held
                c.req_held = 0
            if self._waiting:
                self.unwait(c)
            c.t_write = monotonic_ns()
            data = c.reply
            write(data)
            self.bytes_out += len(data)
            c.reply_size = len(data)
            unacked.append((self.bytes_out, c))
        if self._idle_timer is not None:
            self._last_active = c.t_write  # (idle_timeout counts from the last reply too)
        self._ack_delay = ACK_POLL_FIRST
        if self._ack_poll is not None:
            self._ack_poll.cancel()
            self._ack_poll = None
        if t.is_closing():
            # The write failed (the client is gone): connection_lost, which follows, records these
            # replies by what left the socket (_lost_with_replies_out), not this look.
            self._ack_poll = self.state.loop.call_later(ACK_POLL_FIRST, self._check_acks)
        elif len(unacked) == 1 and not t.get_write_buffer_size() and not unsent_bytes(self.fd):
            # The common case, _check_acks' first look inline: one reply, all of it gone to the client.
            _, c = unacked.popleft()
            c.t_handed = c.t_acked = monotonic_ns()
            c.pipeline.completed(c)
        else:
            self._check_acks()
        if q and self.stream_call is None:  # the next in line may be a large reply held for its turn
            self._give_turn(q[0])
        if self.closing:
            if not q:
                self._close_after_replies()
            return
        if self.paused_reading:
            self._maybe_resume()

    def _answered(self, call: Call) -> None:
        """`call` has its answer: its request's bytes no longer count in open_bytes."""
        self.open_bytes -= call.req_held
        call.req_held = 0

    def _maybe_resume(self) -> None:
        if (self.paused_reading and not self.paused_writing and not self.closing and not self._upload_held
                and not self.transport.is_closing()  # (a write failed: the client is gone, start nothing)
                and (not self._full() or self.upload is not None)  # (an upload's bytes are its counted call's)
                and (self.upload is None or self.upload.splice is None)):
            self.paused_reading = False
            self.transport.resume_reading()
            if self.upload is not None and self._read_timer is None:
                self._arm_read_timer(self.t_first)
            if self.decoder.buffered and not self._framing:  # requests held back at max_inflight
                now = monotonic_ns()
                held = self._held_since
                if self._read_timer is None:
                    self.t_first = now  # held by us, not late: its read deadline starts now
                self._frame_requests(now)  # (whole held requests start when they arrived: _held_since)
                if not self.paused_reading:
                    self._held_since = 0  # every whole held request is framed (else: held again)
                    if held and self.decoder.buffered and self.upload is None:  # and the start of one more:
                        self._held_part, self._resumed_at = held, now  # its span starts when it came

    # -- the write_response hop: until the client acknowledged every byte -------------

    def _check_acks(self) -> None:
        """Record `t_handed` (the kernel took the bytes) and `t_acked` (the client's kernel has
        them) for written replies; poll with growing intervals until done.

        The kernel swallows megabytes at once, so "written" says nothing about a slow
        reader; the send queue does. Offsets make this exact for pipelined replies.
        "Has them" = no byte left unsent in our send queue (SIOCOUTQNSD), not SIOCOUTQ = 0:
        a client that reads at once still delays its ACK (Linux delayed ACKs in request/reply
        traffic: until its next request, else ~40 ms), which would pass for a slow reader.
        A slow reader's full receive window keeps bytes unsent, so it still shows.
        """
        self._ack_poll = None
        t = self.transport
        unacked = self._unacked
        if t is None or not unacked:
            return
        now = monotonic_ns()
        buffered = t.get_write_buffer_size()
        handed = self.bytes_out - buffered
        unsent = unsent_bytes(self.fd)
        acked = handed - unsent
        if t.is_closing():
            # A write that failed (the client reset) leaves the transport closing, its buffer
            # dropped and the socket's queue purged: "nothing unsent" would pass for "all taken"
            # if this look came before connection_lost (a busy loop's timer can). What left the
            # socket is the truth here, as in _lost_with_replies_out.
            sent = sent_bytes(self.fd)
            if sent is not None:
                handed = min(handed, sent + unsent)
                acked = sent
        for end, call in unacked:
            if call.t_handed == 0 and handed >= end:
                call.t_handed = now
        while unacked and unacked[0][0] <= acked:
            _, call = unacked.popleft()
            call.t_acked = now
            call.pipeline.completed(call)
        if not unacked:
            if self._idle_timer is not None:
                self._last_active = now  # the client has read every reply: idle from here
            return
        oldest = unacked[0][1]
        if now - oldest.t_write > ACK_CAP_NS:
            while unacked:  # it never read: recorded as such, not waited for forever
                _, call = unacked.popleft()
                call.never_read = True
                call.t_acked = now  # (when we stopped waiting: write_response lasted at least this)
                call.pipeline.completed(call)
            return
        loop = self.state.loop
        if self._ack_delay == ACK_POLL_FIRST and buffered == 0 and oldest.t_handed == now:
            self._ack_poll = loop.call_soon(self._check_acks)  # loopback ACKs take microseconds
            self._ack_delay = ACK_POLL_FIRST / 2
        else:
            self._ack_delay = min(self._ack_delay * 2, ACK_POLL_MAX)
            self._ack_poll = loop.call_later(self._ack_delay, self._check_acks)

    # -- errors and closing ------------------------------------------------------

    @property
    def max_frame_size(self) -> int:
        """The listener's bound on a request, also on what a zlib THeader payload inflates to."""
        return self.settings.max_frame_size

    def refuse_more(self) -> None:
        """A request turned out malformed only once handled (its zlib payload does not inflate,
        or inflates past max_frame_size): as for one the codec refuses, no more requests are
        read, and the connection closes once the replies so far (its error's included) are
        written. (A bomb costs its inflating once per connection, not once per frame.)"""
        if not self.closing:
            self.closing = True
            self._disarm_read()
        if not self.queue:  # (a oneway's: no error reply, after which call_done would close)
            self._close_after_replies()

    def _oneway_name(self, name: str) -> bool:
        """A method the listener treats as oneway (`oneway_methods`, the IDL's) even when sent
        as a CALL: nothing is ever written back for it, errors included."""
        oneway = self.state.pipeline.oneway_methods
        return bool(oneway) and bool(name) and (name in oneway or name[name.find(":") + 1:] in oneway)

    def _protocol_error(self, e: ProtocolError, event: str | None = "protocol_errors") -> None:
        """Answer a bad request (with its seqid and name when its head could be read) and close.
        `event`: the listener counter it adds to (None: the caller counted it as another kind,
        so the two listener_events_total series never count one connection's close twice)."""
        if event is not None:
            self.state.stats[event] += 1
        dec = self.decoder
        if self.settings.framing is None or self.settings.protocol is None:
            e.message = SETTING_HINT.sub(self._auto_hint, e.message)
        head = e.head
        if head is None and not e.whole:  # (a whole bad frame is gone: the next one's head is not its)
            try:
                head = dec.pending_head()  # a started request: answer with its seqid and name
            except Exception:  # noqa: BLE001 - best effort only
                head = None
        if head is None and dec.framing is not None and dec.protocol is not None:
            head = Head("", MessageType.CALL, 0, dec.framing, dec.protocol)
        self.state.notes.log(log, logging.INFO, "protocol_error", "client %s on listener %s: %s", self.peer,
                             self.settings.name, e.message)
        if head is not None:
            # Its head, when it could be read (e.g. a frame over max_frame_size), names the call in
            # metrics and spans as in the client's answer: method and seqid, not `_INVALID`.
            msg = (Message(head.name, head.type, head.seqid, head.framing, head.protocol, b"", 0, None, b"", 0)
                   if head.name else None)
            if head.type == MessageType.ONEWAY or self._oneway_name(head.name):
                self._fail_oneway(msg, self.t_first, BAD_REQUEST, e.app_type, e.message)  # (no answer)
            else:
                self._queue_answer(msg, head, self.t_first, BAD_REQUEST, e.app_type, e.message,
                                   e.header_block.headers if e.header_block is not None else None)
        if e.close:
            # whole requests read behind it are answered, not dropped: the connection closes
            self._refuse_held(AFTER_BAD)
            self.closing = True
            self._disarm_read()
        if self.queue and self.queue[0].reply is not None:
            self.call_done(self.queue[0])
        elif self.closing and not self.queue:
            self._close_after_replies()

    def _auto_hint(self, hint) -> str:
        """A hint to set the listener's transport or protocol, where the listener detects it: it
        detected this connection's from its first request, and setting it is no help."""
        dec = self.decoder
        if hint[1] == "transport":
            if self.settings.framing is not None or dec.framing is None:
                return hint[0]
            first = "THeader" if dec.framing.is_header else dec.framing.value
        else:
            if self.settings.protocol is not None or dec.protocol is None:
                return hint[0]
            first = dec.protocol.value
        return (f"this connection's first request was {first}, and a connection keeps the {hint[1]} "
                "of its first request")

    def shut_down(self, why: str, cause: str = "the proxy shut down") -> None:
        """The proxy stops with this client connected (or `cause`, e.g. its listener was removed
        and drained): each call still open is answered with it and `why`
        (`Pipeline.shutting_down`: "may have run" or "not sent"), then the connection closes
        once that is written. A reply already streaming is cut, recorded as not delivered."""
        if self.transport is None:
            return
        self._closed_why = self._closed_why or f"{cause} ({why})"
        # Nothing more is read or started: answering the open calls must not resume reading and
        # hand requests held back at max_inflight to the pipeline (they would start upstream).
        self.closing = True
        self._disarm_read()
        self._refuse_held(f"not sent: {cause} before it handled this request ({why})")
        for call in list(self.queue):
            if call.reply is None and call.pipeline is not None:
                call.pipeline.shutting_down(call, f"{cause} before its reply ({why})")
        if self.queue and self.queue[0].reply is not None:
            self.call_done(self.queue[0])  # (only held ones: no call was open)
        self.transport.close()  # (only connection_lost, which comes later, drops the transport)

    def _refuse_held(self, text: str, outcome: str = NOT_SENT, answer: bool = True) -> int:
        """Whole requests read but not yet handed to the pipeline (held back at max_inflight, or
        behind a bad request) get `text` as their answer, queued behind the open calls (written
        with them: `shut_down`), each with its own seqid; oneways among them are logged and
        counted as failed (`Pipeline.fail`). Bytes still in the kernel were never read: the
        close resets them, which no client takes for an answer. `answer` False (the client is
        gone): each is only recorded, as `outcome`. Returns how many calls (not oneways)."""
        n = 0
        while True:
            try:
                msg = self.decoder.next_message()
            except ProtocolError:
                return n  # (a bad frame: what follows it is not readable either)
            if msg is None:
                return n
            if msg.type != M_CALL and msg.type != M_ONEWAY:
                continue  # (a reply-typed message from a client gets nothing: as when read)
            t_start = self._held_since or self.t_first
            if msg.type == M_ONEWAY or self._oneway_name(msg.name):
                self._fail_oneway(msg, t_start, outcome, AppErrorType.INTERNAL_ERROR, text)
                continue
            n += 1
            if answer:
                call = self._queue_answer(msg, msg.head, t_start, outcome, AppErrorType.INTERNAL_ERROR, text)
            else:
                call = self._own_call(msg, t_start, outcome, text)
            call.error_type = outcome
            call.t_done = call.t_framed
            if not answer:
                call.pipeline.completed(call)

    def _drop_held(self) -> None:
        """The connection is gone with whole requests read but never handed to the pipeline
        (held back at max_inflight): none starts now, and nothing can answer them, but each is
        still recorded (metrics, access log, a span), as `client_gone` when the client left, or
        `not_sent` when the proxy closed the connection (`_closed_why`: a write stall, a
        streamed reply that broke), instead of vanishing with the connection."""
        why = self._closed_why
        if why is None:
            n = self._refuse_held("the client closed its connection before the proxy handled this request "
                                  "(held back at max_inflight)", CLIENT_GONE, answer=False)
            self.state.pipeline.stats["client_gone"] += n
        else:
            self._refuse_held(f"not sent: the proxy closed the client's connection before it handled "
                              f"this request: {why}", answer=False)

    def _fail_oneway(self, msg: Message | None, t_start: int, outcome: str, app_type: AppErrorType,
                     text: str) -> None:
        """A oneway this connection does not pass on (a bad request; refused as the proxy stops):
        nothing is answered, but it is counted, logged and recorded as failed (`Pipeline.fail`)."""
        pipeline = self.state.pipeline
        pipeline.stats["calls"] += 1
        call = Call(self, msg, t_start, monotonic_ns(), pipeline)
        call.oneway = True
        call.outcome = outcome
        pipeline.fail(call, app_type, text)

    def _queue_answer(self, msg: Message | None, head: Head, t_start: int, outcome: str,
                      app_type: AppErrorType, text: str, headers: dict | None = None) -> Call:
        """A call this connection answers itself (a bad request; a request refused as the proxy
        stops), recorded as `_own_call` says and queued in its turn, not yet written
        (`call_done` writes it, and may half-close after it)."""
        call = self._own_call(msg, t_start, outcome, text, headers)
        call.reply = exception_reply(head, app_type, PREFIX + text)
        self.queue.append(call)
        return call

    def _own_call(self, msg: Message | None, t_start: int, outcome: str, text: str,
                  headers: dict | None = None) -> Call:
        """A call this connection ends itself, never handed to the pipeline: counted as the
        pipeline counts its calls (as calls_total counts it). It joins the client's trace, as
        any call does: from its THeader headers (`headers`, those of a request whose payload
        could not be read)."""
        pipeline = self.state.pipeline
        pipeline.stats["calls"] += 1
        pipeline.stats["errors"] += 1
        call = Call(self, msg, t_start, monotonic_ns(), pipeline)
        call.outcome = outcome
        call.error = text
        if pipeline.on_begin is not None and (headers is not None or (msg is not None and msg.header is not None)):
            pipeline.on_begin(call, headers)  # the client's trace, joined by the proxy's own answer too
        return call

    def _close_after_replies(self) -> None:
        """Lingering close: send FIN after the replies, keep reading, then close."""
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.paused_reading:
            self.paused_reading = False
            t.resume_reading()
        try:
            if t.can_write_eof():
                t.write_eof()
        except OSError:
            pass
        if self._linger is None:
            self._linger = self.state.loop.call_later(LINGER, t.close)

    # -- timers -----------------------------------------------------------------

    def _disarm_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _arm_read_timer(self, t_first: int) -> None:
        timeout = self.settings.request_read_timeout
        if timeout <= 0:
            return
        loop = self.state.loop
        self._read_timer = loop.call_at(loop.time() + timeout - (monotonic_ns() - t_first) / 1e9,
                                        self._read_timeout, t_first)

    def _read_timeout(self, t_first: int) -> None:
        self._read_timer = None
        up = self.upload
        if self.closing or not (self.decoder.buffered or up is not None):
            return
        if self.t_first != t_first:  # another request started since: re-arm for it
            self._arm_read_timer(self.t_first)
            return
        timeout = self.settings.request_read_timeout
        now = monotonic_ns()
        if up is not None and not self._upload_held:
            # The client is sending: the time the proxy held it back (the upstream not taking
            # bytes, no connection yet) was not its own. It has its whole budget of its own time.
            left = timeout - (now - t_first - up.held_for(now)) / 1e9
            if left > 0.001:
                self._read_timer = self.state.loop.call_later(left, self._read_timeout, t_first)
                return
        self.state.stats["read_timeouts"] += 1
        if up is not None:
            a = up.call.attempt
            held = up.held_for(now) / 1e9
            if self._upload_held and a is not None and a.upconn is not None:
                self._upload_broken(f"may have run: {a.endpoint.label} did not take the whole request within "
                                    f"request_read_timeout {timeout:g}s ({up.progress()}; the client was held "
                                    f"back {held:.1f}s waiting for it)", TIMEOUT)
            elif self._upload_held and a is not None:
                self._upload_broken(f"not sent: no connection to {a.endpoint.label} within "
                                    f"request_read_timeout {timeout:g}s ({up.progress()})", NOT_SENT)
            else:
                also = f"; not counting {held:.1f}s the proxy held it back for the upstream" if held >= 0.05 else ""
                self._upload_broken(f"bad request: request not complete within request_read_timeout "
                                    f"{timeout:g}s ({up.progress()}{also})")
            return
        self._protocol_error(ProtocolError(
            f"bad request: request not complete within request_read_timeout {timeout:g}s "
            f"({self.decoder.buffered} bytes received)"), event=None)  # (a read_timeout, counted above)

    def _arm_idle(self) -> None:
        loop = self.state.loop
        self._idle_timer = loop.call_later(self.settings.idle_timeout, self._idle_check)

    def close_when_quiet(self, quiet: float) -> None:
        """From now on, an idle_timeout of `quiet` seconds (unless its own is shorter): closed
        once no call is in flight, no reply is being delivered and nothing has come for that
        long, so a client between calls loses nothing. A listener a reload removed drains so."""
        if self.closing or self.transport is None or 0 < self.settings.idle_timeout <= quiet:
            return
        self.settings = replace(self.settings, idle_timeout=quiet)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._last_active = monotonic_ns()
        self._arm_idle()

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self.closing:
            return
        idle = self.settings.idle_timeout
        now = monotonic_ns()
        if self.queue or self._unacked or self.stream_call is not None or self.paused_writing:
            # Calls in flight, replies still being delivered (a slow reader is not idle). Their
            # ends (a reply written, the client's last ack, writing resumed) stamp _last_active,
            # so the idle time counts from there, not from this look.
            self._last_active = now
        quiet = (now - self._last_active) / 1e9
        if not self.decoder.buffered and quiet >= idle:
            if not self.paused_reading and unread_bytes(self.fd):
                # a request the loop has not read yet (busy as this timer came due: libuv runs
                # timers before it polls); closed now, it would be reset. Read first, look again.
                self._idle_timer = self.state.loop.call_later(0.01, self._idle_check)
                return
            self.state.stats["idle_closed"] += 1
            self.closing = True
            self.transport.close()
            return
        loop = self.state.loop
        self._idle_timer = loop.call_later(max(idle - quiet, 0.01), self._idle_check)
