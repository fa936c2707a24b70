"""A call and its attempts: state plus hop timestamps (the record telemetry reads).

Timestamps are `time.monotonic_ns()` values; 0 means "did not happen".
Telemetry turns them into histogram samples for every call and, for sampled,
slow or failed calls, into spans after the call (see `proxy.spans`):

    Call.t_start ─ read_request ─ Call.t_framed (─ queued ─ Call.t_admitted: held at max_inflight)
        Attempt.t_acquire ─ acquire ─ t_acquired ─ write_upstream ─ t_written
            ─ service_time ─ t_first_reply ─ read_response ─ t_reply
        (Call.backoffs: (start, end) between attempts)
    Call.t_done ─ queued ─ Call.t_write ─ write_response ─ Call.t_acked
                            (Call.t_handed: the kernel took the last byte)

A request that streams upstream as it arrives (`Upload`) ends `read_request` at its last
byte, so that hop overlaps `acquire` and `write_upstream`.
"""

from __future__ import annotations

from time import monotonic_ns

from proxy.upstream import Exchange

# Outcomes of an attempt (and of a call: its last attempt's, or the proxy's own error).
SUCCESS = "success"
DECLARED_EXCEPTION = "declared_exception"
APP_EXCEPTION = "app_exception"
NOT_SENT = "not_sent"
MAY_HAVE_RUN = "may_have_run"
TIMEOUT = "timeout"
BAD_REQUEST = "bad_request"
NO_ROUTE = "no_route"
CLIENT_GONE = "client_gone"  # the client closed its connection before its reply
# (not an outcome) the error_type of a call whose reply never reached its client: the connection
# broke, or the proxy closed it, with the reply unwritten or unsent (metrics, spans)
NOT_DELIVERED = "not_delivered"


class Call:
    """One client request, from its first byte until the client acknowledged its reply."""

    __slots__ = ("conn", "pipeline", "msg", "route", "cluster", "oneway", "reply", "error", "error_type",
                 "outcome", "attempt", "attempts", "written", "cancelled", "backoffs",
                 "t_start", "t_framed", "t_admitted", "t_done", "t_write", "t_handed", "t_acked", "never_read",
                 "streamed", "client_paused_ns", "upstream_wait_ns", "reply_size", "loop_lag_ns",
                 "trace", "timer", "deadline", "deadline_what", "client_cut", "credited_ns", "retry_timer", "holds_request", "result_field", "waited",
                 "_req_framing", "_req_data", "upload", "no_retry", "req_held", "kept_size")

    def __init__(self, conn, msg, t_start: int, t_framed: int, pipeline=None) -> None:
        self.conn = conn                    # the client connection (listener)
        self.pipeline = pipeline            # the pipeline (config generation) that handles it
        self.msg = msg                      # the request Message (None for a bad-request answer)
        self.route = None
        self.cluster = None
        self.oneway = False
        self.reply: bytes | None = None     # what goes back to the client, once known
        self.error: str | None = None       # the proxy's own error text, if it answered
        self.error_type: str | None = None  # error.type for spans and metrics
        self.outcome: str | None = None
        self.attempt: Attempt | None = None  # the current attempt
        self.attempts: list[Attempt] = []
        self.written = False                # some attempt wrote request bytes upstream
        self.cancelled = False              # the client went away
        self.backoffs: list[tuple[int, int]] = []
        self.t_start = t_start              # first request byte read
        self.t_framed = t_framed            # whole request framed
        self.t_admitted = 0                 # handled, when it was held back at max_inflight (else 0:
                                            # at t_framed); that wait is `queued`
        self.t_done = 0                     # reply (or error) ready
        self.t_write = 0                    # first reply byte written to the client transport
        self.t_handed = 0                   # the kernel took the last reply byte
        self.t_acked = 0                    # every reply byte left our send queue (SIOCOUTQNSD = 0);
                                            # with never_read: when the proxy stopped waiting for that
        self.never_read = False             # the client did not acknowledge within the cap
        self.streamed = False
        self.client_paused_ns = 0
        self.upstream_wait_ns = 0
        self.reply_size = 0
        self.loop_lag_ns = 0                # the largest loop lag seen while the call ran
        self.trace = None                   # trace context (telemetry)
        self.timer = None                   # route deadline handle
        self.deadline = 0.0                 # loop time of the route deadline (0 = none)
        self.deadline_what = ""             # which deadline, as the client hears it ("route timeout 2000ms")
        self.client_cut = False             # the deadline is the client's own, under the route timeout
        self.credited_ns = 0                # client pauses the deadline has moved by (Pipeline._credit_pauses)
        self.retry_timer = None             # backoff before the next attempt
        self.holds_request = False          # counted in the cluster's max_requests
        self.result_field = None            # the reply's first result field id (outcome peek)
        self.waited = False                 # its reply waited behind an earlier pipelined one (queued)
        self.no_retry = ""                  # why a retry the route allows was not made (the error says)
        self._req_framing = None            # the upstream framing _req_data is for
        self._req_data = None               # the request bytes as that framing wants them
        self.upload: Upload | None = None   # a large request streaming in (msg is its head only)
        self.req_held = 0                   # its request's bytes counted in its connection's open_bytes
        self.kept_size = -1                 # the request's size once its bytes were let go (drop_request)

    @property
    def request_size(self) -> int:
        if self.upload is not None:
            return self.upload.size
        if self.kept_size >= 0:
            return self.kept_size
        return len(self.msg.data) if self.msg is not None else 0

    def drop_request(self) -> None:
        """Its answer is final and waits behind an earlier call: no attempt can follow, so the
        request's bytes go now (its size, its head and THeader headers stay)."""
        msg = self.msg
        if msg is None or self.kept_size >= 0 or self.upload is not None:
            return
        self.kept_size = len(msg.data)
        msg.data = msg.readable = b""
        self._req_data = None

    @property
    def held_ns(self) -> int:
        """How long its attempts' large replies were held unread for their turn (a part of
        client_paused_ns: the `queued` hop, not the stream's own pauses)."""
        return sum(a.held_ns for a in self.attempts)

    def __repr__(self) -> str:
        name = self.msg.name if self.msg is not None else "?"
        seqid = self.msg.seqid if self.msg is not None else "?"
        return f"<Call {name} seqid={seqid} attempts={len(self.attempts)} outcome={self.outcome}>"


class Upload:
    """A request larger than its route's `retry_buffer`, passed upstream as it arrives
    (DESIGN.md: such requests stream and are never retried).

    The listener reads it: `received` bytes so far, `done` once its last byte came, `total` its
    whole size (a frame's is known from its length; an unframed request's only at its end, which
    `tail`, a `proxy.codec.stream.UnframedStream`, finds; a frame's struct is checked by `check`,
    a `proxy.codec.stream.FrameBody`, each read before it goes on). The pipeline writes each piece onto the
    attempt's connection, or holds the pieces while the attempt waits for one. `paused`: the
    client's reading is held back for this upload (too much held, or the upstream connection is
    not taking bytes); `held_ns` sums those times (the spans' `sidecar.upload_held_ms`: how much
    of `read_request` was the upstream side's doing).
    """

    __slots__ = ("client", "call", "total", "received", "done", "tail", "check", "held", "held_size", "paused",
                 "timeout", "held_ns", "_held_at", "splice")

    def __init__(self, client, total: int | None, held: list, tail=None) -> None:
        self.client = client                # the ClientConnection it arrives on
        self.call: Call | None = None       # set by the pipeline; cleared once the listener is done
        self.total = total                  # the whole request (a frame's length prefix included)
        self.tail = tail                    # finds an unframed request's end (total None till then)
        self.check = None                   # a framed request's struct check (codec.stream.FrameBody)
        self.held = held                    # pieces not written yet (no connection yet)
        self.held_size = sum(map(len, held))
        self.received = self.held_size
        self.done = False
        self.paused = False
        self.timeout = 0.0                  # the route timeout, armed once the request is whole
        self.held_ns = 0
        self._held_at = 0
        self.splice = None                  # moving the rest of it kernel to kernel (proxy.splice)

    def hold(self, on: bool) -> None:
        """Hold the client's reading back (on) or let it go on (off); the time is counted."""
        if on == self.paused:
            return
        self.paused = on
        if on:
            self._held_at = monotonic_ns()
        else:
            self.held_ns += monotonic_ns() - self._held_at
        self.client.hold_upload(on)

    def held_for(self, now: int) -> int:
        """Nanoseconds the client was held back so far, the hold going on now included."""
        return self.held_ns + (now - self._held_at if self.paused else 0)

    @property
    def size(self) -> int:
        return self.total if self.total is not None else self.received

    def progress(self) -> str:
        if self.total is None:
            return f"{self.received} bytes received"
        return f"{self.received} of {self.total} bytes received"


class Attempt(Exchange):
    """One try of a call on one endpoint: acquire → write → reply."""

    __slots__ = ("call", "endpoint", "pool", "upconn", "waiter", "seqid", "name", "number", "timer",
                 "t_acquire", "t_acquired", "t_written", "t_handoff", "t_first_reply", "t_reply", "outcome",
                 "error", "retry_reason", "breaker_state", "request_size", "reply_size", "span_id", "probe",
                 "pending", "is_retry", "ended", "held_ns")

    def __init__(self, call: Call, endpoint, number: int, t_acquire: int) -> None:
        self.call = call
        self.endpoint = endpoint
        self.pool = None
        self.upconn = None
        self.waiter = None
        self.seqid = call.msg.seqid
        self.name = call.msg.name
        self.number = number                # 1-based
        self.timer = None                   # per-try deadline handle
        self.t_acquire = t_acquire
        self.t_acquired = 0
        self.t_written = 0
        self.t_handoff = 0                  # the request handed over whole, when a large one's t_written
                                            # waits for the upstream to take it (watch_sent); peak_ewma's start
        self.t_first_reply = 0
        self.t_reply = 0
        self.outcome: str | None = None
        self.error: str | None = None
        self.retry_reason: str | None = None  # the previous attempt's outcome, for retries
        self.breaker_state: str | None = None
        self.request_size = 0               # bytes written upstream (re-framed, with our THeader headers);
                                            # 0: as the client sent it (a streaming request)
        self.reply_size = 0
        self.span_id = 0                    # pre-chosen when trace context is injected upstream
        self.probe = 0                      # the half-open breaker's probe token (Breaker.on_pick)
        self.pending = False                # counted in the cluster's max_pending
        self.is_retry = number > 1          # counted in the cluster's max_retries
        self.ended = False                  # its outcome is recorded (exactly once)
        self.held_ns = 0                    # its reply was held unread this long for its turn

    @property
    def held(self) -> bool:
        """Its large reply is held unread until its call is first in line (UpstreamConnection.take_turn)."""
        conn = self.upconn
        return conn is not None and conn.turn is not None

    @property
    def queued_ns(self) -> int:
        """The part of its read_response hop that its reply was held unread for its turn (spans,
        access log: `queued`, from the first reply byte; proxy.metrics.pure_record_hops and its
        compiled twin take the same rule inline)."""
        held, t0, t1 = self.held_ns, self.t_first_reply, self.t_reply
        return min(held, t1 - t0) if held > 0 and t0 and t1 >= t0 else 0

    @property
    def t_sent(self) -> int:
        """Where the endpoint's latency (peak_ewma) counts from: the request handed over whole,
        even when write_upstream waits longer for a large one to be taken (`t_handoff`)."""
        return self.t_handoff or self.t_written

    def __repr__(self) -> str:
        return f"<Attempt {self.number} of {self.call!r} on {self.endpoint.label} outcome={self.outcome}>"

    # pool callback: a connection (or an error) arrived
    def __call__(self, conn, error) -> None:
        self.waiter = None
        if error is not None:
            self.call.pipeline.attempt_failed(self, error)
        else:
            self.call.pipeline.send(self, conn)

    def on_reply(self, reply) -> None:
        self.call.pipeline.attempt_replied(self, reply)

    def on_failure(self, error) -> None:
        self.call.pipeline.attempt_failed(self, error)

    def start_stream(self, head) -> bool | str:
        return self.call.pipeline.stream_start(self, head)

    def read_whole_now(self, head, force: bool = False) -> bool:
        call = self.call
        if call.cancelled or self is not call.attempt:
            return True  # (nobody waits for it: read whole and dropped)
        return call.conn.wait_whole(call, head.total, pressed=True, force=force)

    def owner(self):
        return self.call.conn

    def held_for(self, ns: int) -> None:
        # held unread behind the client's earlier calls: the client's doing (client_paused_ms;
        # the timeouts credit it), as when it holds a streaming reply back by not reading; this
        # attempt's own share is what its per-try timeout and latency sample leave out
        self.call.client_paused_ns += ns
        self.held_ns += ns

    def stream_data(self, data) -> int:
        return self.call.conn.stream_write(self.call, data)

    def splice_to(self):
        return self.call.conn.splice_target(self.call)

    def stream_sized(self, size: int) -> None:
        self.call.reply_size = size  # an unframed stream's size (a framed one's came with its head)

    def stream_end(self) -> None:
        self.call.pipeline.stream_end(self)
