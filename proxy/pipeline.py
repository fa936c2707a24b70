"""One call's path, top-down. The one file to read to see what happens to a request.

    listener (framed a request) ─► Pipeline.handle
      1. route       first matching route; none → UNKNOWN_METHOD "no route"
      2. oneway?     ONEWAY, or a method in oneway_methods: nothing is ever written back
      3. admit       cluster limits (max_requests) and the route deadline (in its timeout's
                     DeadlineQueue, or a loop.call_at handle when the client's THeader
                     `client_timeout` caps it); deposit in the retry budget
      4. attempt     balancer picks an endpoint (open breakers skipped, another one on a retry),
                     the pool lends a connection (or we wait: max_pending, acquire_timeout),
                     per-try deadline armed
      5. write       request bytes, re-framed only if the upstream framing differs; THeader
                     upstreams get the reduced deadline and trace context in the header block
      6. reply       the upstream connection frames the reply and checks its seqid
      7. classify    one outcome per attempt (calls.SUCCESS ... TIMEOUT), read by breaker,
                     retry, balancer, spans and metrics alike
      8. retry?      policy (idempotency, attempts, retry_buffer) → max_retries → budget → backoff
      9. answer      reply bytes re-framed for the client, queued in request order

A request over its route's `retry_buffer` that does not come in one read is
handled from its head instead (`upload_threshold`): steps 1-4 run at once, and its bytes go
upstream as they arrive (`upload_data`); it is never retried (DESIGN.md).

Everything here runs in protocol callbacks and timer handles: no task per
call. Error rule (DESIGN.md): if any attempt of the call was written
upstream, the client hears "may have run", else "not sent".
"""

from __future__ import annotations

import asyncio
import logging
import random
from time import monotonic_ns
from typing import Mapping

from proxy import calls
from proxy import config as cfgmod
from proxy.breaker import CLOSED, REQUEST_FAULTS, classify_for_breaker
from proxy.calls import Attempt, Call, Upload
from proxy.clock import STALL_GRACE
from proxy.codec.rename import strip_service
from proxy.codec.theader import HeaderBlockTooLarge
from proxy.codec import (AppErrorType, Message, MessageType, Protocol, ProtocolError, exception_reply,
                         reframe)
from proxy.codec.wire import F_FRAMED_HEADER, F_HEADER, M_CALL, M_EXCEPTION, M_ONEWAY
from proxy.deadlines import DeadlineQueue
from proxy.logs import MAX_NAME, Throttle, cut
from proxy.retry import RetryPolicy
from proxy.tracecontext import TRACE_HEADERS
from proxy.upstream import SENT_WATCH_MIN, WAIT_TURN, UpstreamError

log = logging.getLogger(__name__)

PREFIX = "thrift-sidecar: "
CLIENT_TIMEOUT_HEADER = "client_timeout"  # ms, as fbthrift carries it
_MAX_CLIENT_TIMEOUT_MS = 2**31 - 1        # ~24.8 days: any more is "no cap" in practice


def _client_timeout(value: str) -> float:
    """A THeader client_timeout (ASCII decimal ms) in seconds; 0 when it is not one (ignored).
    Not `int()`, which also takes "1_000", " 200 " and other scripts' digits."""
    if not value.isascii() or not value.isdigit():
        return 0.0
    return (min(int(value), _MAX_CLIENT_TIMEOUT_MS) if len(value) <= 12 else _MAX_CLIENT_TIMEOUT_MS) / 1000
DEFAULT_RETRY_BUFFER = cfgmod.Route.model_fields["retry_buffer"].default  # a route without settings
UPLOAD_HOLD = 1 << 20  # bytes of a streaming request held while it waits for a connection
WARN_EVERY = 5.0  # s between two warnings of one kind (a failed oneway: by its outcome)
STALL_RECHECK = 0.001  # s: a deadline the stalled loop overslept is looked at again after one I/O poll
DEADLINE_SLACK = 0.001  # s: a route timer that fires this much before its deadline is armed again


def _same_protocol(a: Protocol, b: Protocol) -> bool:
    return a is b or (a is not Protocol.COMPACT and b is not Protocol.COMPACT)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms"


class Pipeline:
    """The request path for one listener: router, clusters, resilience, the error rule."""

    def __init__(self, listener_name: str, router, oneway_methods: frozenset[str] = frozenset(),
                 loop: asyncio.AbstractEventLoop | None = None, rng: random.Random | None = None,
                 exception_ids: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """`exception_ids` (the listener's IDL: method → {exception name: result field id})
        resolves `on_exceptions` names. Every route's retry policy is built here, so a name
        that cannot be resolved is a ValueError now, naming the route, not at the first retry."""
        self.listener_name = listener_name
        self.router = router
        self.oneway_methods = oneway_methods
        self.loop = loop or asyncio.get_event_loop()
        self.rng = rng or random.Random()
        self.stats = {"calls": 0, "errors": 0, "oneway": 0, "oneway_failures": 0, "no_route": 0,
                      "retries": 0, "retries_refused_budget": 0, "retries_refused_limit": 0,
                      "timeouts": 0, "limit_rejections": 0, "client_gone": 0}
        self.on_complete = None   # telemetry: called once per finished call
        self.on_send = None       # telemetry: headers to add for a THeader upstream (trace context)
        self.on_begin = None      # telemetry: trace context for THeader traffic
        self.warnings = Throttle(WARN_EVERY)  # per-call warnings (a failed oneway), thinned per kind
        self._policies: dict[int, RetryPolicy | None] = {}
        # route and per-try deadlines, one queue per timeout value (proxy.deadlines: no loop
        # timer per call), and the words for each ("route timeout 250ms")
        self._deadlines: dict[float, DeadlineQueue] = {}
        self._route_what: dict[float, str] = {}
        self.exception_ids = exception_ids
        # no request this small streams (the smallest retry_buffer): the listener's cheap first test
        self.upload_min = min((r.settings.retry_buffer if r.settings is not None else DEFAULT_RETRY_BUFFER
                               for r in router.routes), default=DEFAULT_RETRY_BUFFER)
        for route in router.routes:
            try:
                self._policy(route)
            except ValueError as e:
                raise ValueError(f"routes[{route.index}].retry: {e}") from None

    # 1-3: route, oneway, admit -----------------------------------------------------

    def handle(self, conn, msg: Message, t_start: int, t_framed: int, upload: Upload | None = None,
               admitted: int = 0) -> None:
        """A request framed (or, with `upload`, a large one whose head is here: see `upload_threshold`).
        `admitted`: now, for a request the listener held back at max_inflight since `t_framed`."""
        self.stats["calls"] += 1
        call = Call(conn, msg, t_start, t_framed, self)
        if admitted:
            call.t_admitted = admitted
        if upload is not None:
            call.upload = upload
            upload.call = call
        call.oneway = msg.type == M_ONEWAY or (
            bool(self.oneway_methods) and (msg.name in self.oneway_methods or msg.method in self.oneway_methods))
        if not call.oneway:
            conn.queue.append(call)  # its place in the reply order
            call.req_held = n = len(msg.data)  # held for retries until answered (max_inflight_bytes)
            conn.open_bytes += n
        route = self.router.route(msg)
        if route is None:
            self.stats["no_route"] += 1
            if self.on_begin is not None and msg.header is not None:
                self.on_begin(call)  # (the client's trace, joined even by this error)
            call.outcome = calls.NO_ROUTE
            self.fail(call, AppErrorType.UNKNOWN_METHOD,
                      f"no route: method '{msg.name}' on listener '{self.listener_name}'")
            return
        call.route = route
        cluster = call.cluster = route.pick_cluster()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%r routed to cluster %s by route %d", call, cluster.name, route.index)
        if self.on_begin is not None and (msg.header is not None or
                                          (cluster.framing is F_HEADER or cluster.framing is F_FRAMED_HEADER)):
            self.on_begin(call)
        limits = cluster.limits
        if limits is not None:
            if not limits.try_enter_request():
                self.stats["limit_rejections"] += 1
                policy = self._policy(route)
                if policy is not None and policy.attempts > 1:
                    call.no_retry = "not retried: calls over max_requests fail fast"
                self._give_up(call, UpstreamError(
                    f"cluster '{cluster.name}' has max_requests {limits.max_requests} calls in flight",
                    written=False, endpoint_fault=False))
                return
            call.holds_request = True
        budget = cluster.budget
        if budget is not None:
            budget.deposit()
        timeout = route.settings.timeout if route.settings is not None else 0.0
        capped = False
        if msg.header is not None:
            client_ms = msg.headers.get(CLIENT_TIMEOUT_HEADER)
            if client_ms:
                cap = _client_timeout(client_ms)
                if cap > 0 and (timeout <= 0 or cap < timeout):
                    # A client's deadline under the route's is its own choice: its passing says
                    # nothing the route's bound would, and no breaker counts it. With no route
                    # timeout it is the only bound there is, and counts as the route's would.
                    call.client_cut = timeout > 0
                    timeout = cap
                    capped = True
        if timeout > 0 and not call.oneway:
            if capped:
                call.deadline_what = f"the client's THeader client_timeout {_ms(timeout)}"
            else:
                what = self._route_what.get(timeout)
                if what is None:
                    what = self._route_what[timeout] = f"route timeout {_ms(timeout)}"
                call.deadline_what = what
            if upload is not None:
                upload.timeout = timeout  # counts from the request's last byte (_upload_received)
            else:
                # From the request's last byte, or from when it was handled if the listener held
                # it back at max_inflight: that wait (`queued`, behind the client's own earlier
                # calls) is the client's doing, not the upstream's, as for a reply held for its turn.
                call.deadline = self.loop.time() + timeout - (monotonic_ns() - (admitted or t_framed)) / 1e9
                # (a client's own timeout, any value, gets a loop timer: one queue per route timeout)
                call.timer = (self.loop.call_at(call.deadline, self._call_timeout, call) if capped
                              else self._deadline_queue(timeout).set(call.deadline, self._call_timeout, call))
        self.start_attempt(call)

    def _deadline_queue(self, timeout: float) -> DeadlineQueue:
        q = self._deadlines.get(timeout)
        if q is None:
            q = self._deadlines[timeout] = DeadlineQueue(self.loop)
        return q

    # 1b: a large request streams in --------------------------------------------------

    def upload_threshold(self, msg: Message) -> int | None:
        """A request still arriving, of which only the head is here: past how many bytes does
        it pass upstream as it arrives? Its route's `retry_buffer` (over it, it could never be
        retried anyway), when it goes out as it came in (same framing, not renamed, a CALL that
        is answered); `upload_min` when no route takes it (answered at once, the rest read and
        dropped); None: never (it is read whole first, as any request)."""
        if msg.type != M_CALL:
            return None
        route = self.router.route(msg)
        if route is None:
            return self.upload_min
        if (route.strip_service
                or (self.oneway_methods and (msg.name in self.oneway_methods or msg.method in self.oneway_methods))):
            return None
        if not all(c.framing is None or c.framing is msg.framing for c in route.clusters):
            return None
        s = route.settings
        return s.retry_buffer if s is not None else DEFAULT_RETRY_BUFFER

    def upload_data(self, call: Call, data, last: bool) -> None:
        """The next piece of a streaming request (`last`: its end): written to the attempt's
        connection, held while the attempt waits for one, dropped once the call is answered."""
        up = call.upload
        now = monotonic_ns() if last else 0  # the request's last byte: read_request ends
        a = call.attempt
        conn = a.upconn if a is not None else None
        if conn is not None and conn.upload is up and not conn.closed:
            if data:  # (a spliced request's end comes with none)
                conn.transport.write(data)
            if last:
                conn.upload = None
                a.t_written = a.t_written or monotonic_ns()  # (set already: its reply came first)
                conn.watch_sent(a, up.size)
                up.hold(False)  # the upstream still has to take it all; the client may go on
        elif a is not None and not a.ended and call.reply is None and not call.cancelled:
            up.held.append(bytes(data))  # no connection yet
            up.held_size += len(data)
            if up.held_size > UPLOAD_HOLD:
                up.hold(True)
        if last and call.reply is None and not call.cancelled:
            call.t_framed = now
            self._upload_received(call)

    def _upload_received(self, call: Call) -> None:
        """The whole request is here: the route deadline (and the attempt's per-try timeout)
        count from now, as they do from a small request's framing."""
        up = call.upload
        if up.timeout > 0:
            call.deadline = self.loop.time() + up.timeout
            call.timer = self.loop.call_at(call.deadline, self._call_timeout, call)
        a = call.attempt
        settings = call.route.settings if call.route is not None else None
        per_try = settings.retry.per_try_timeout if settings is not None else 0.0
        if per_try > 0 and a is not None and not a.ended and a.timer is None:
            self._arm_per_try(a, per_try)

    def upload_broken(self, call: Call, text: str, outcome: str = calls.BAD_REQUEST,
                      app_type: AppErrorType = AppErrorType.PROTOCOL_ERROR) -> None:
        """The request stopped short (the client closed, or it did not arrive in time): the
        attempt stops (its connection, holding part of a request, is discarded) and the client
        hears `text`, unless the call was answered already."""
        # the client's doing (it closed, or was too slow) says nothing about the endpoint;
        # an upstream not taking the bytes (TIMEOUT) does
        self._cut(call, text, outcome, app_type, blame=outcome is not calls.BAD_REQUEST)

    def shutting_down(self, call: Call, why: str) -> None:
        """The proxy stops (the drain deadline passed, or a second signal) with this call open:
        its client hears "may have run: <why>" (or "not sent: …") instead of a bare close,
        unless it was answered already or its reply is streaming. The endpoint is not blamed."""
        if call.streamed:
            return
        kind = "may have run" if call.written else "not sent"
        self._cut(call, f"{kind}: {why}", calls.MAY_HAVE_RUN if call.written else calls.NOT_SENT,
                  AppErrorType.INTERNAL_ERROR, blame=False)

    def _cut(self, call: Call, text: str, outcome: str, app_type: AppErrorType, blame: bool) -> None:
        if call.reply is not None or call.cancelled or call.t_done:
            return
        a = call.attempt
        if a is not None and not a.ended:
            self._stop_attempt(a, "request cut")
            self._drop_attempt(a, text, calls.MAY_HAVE_RUN if call.written else calls.NOT_SENT, blame=blame)
        self._cancel_backoff(call)
        call.outcome = outcome
        self.fail(call, app_type, text)

    # 4: attempt ---------------------------------------------------------------

    def start_attempt(self, call: Call, retry_reason: str | None = None) -> None:
        cluster = call.cluster
        msg = call.msg
        if cluster.protocol is not None and not _same_protocol(cluster.protocol, msg.protocol):
            call.outcome = calls.NOT_SENT
            self.fail(call, AppErrorType.INTERNAL_ERROR,
                      f"not sent: the client speaks {msg.protocol.value} but cluster '{cluster.name}' "
                      f"speaks {cluster.protocol.value} (protocols are never transcoded)")
            return
        # a retry goes to another endpoint when one exists
        endpoint = cluster.pick([a.endpoint for a in call.attempts] if call.attempts else ())
        if endpoint is None:
            self._give_up(call, UpstreamError(cluster.why_no_endpoint(), written=False, endpoint_fault=False))
            return
        now = monotonic_ns()
        attempt = Attempt(call, endpoint, len(call.attempts) + 1, now)
        attempt.retry_reason = retry_reason
        call.attempts.append(attempt)
        call.attempt = attempt
        breaker = endpoint.breaker
        if breaker is not None:
            attempt.breaker_state = breaker.state_name
            if breaker.state is not CLOSED:
                attempt.probe = breaker.on_pick()
        settings = call.route.settings
        per_try = settings.retry.per_try_timeout if settings is not None else 0.0
        if per_try > 0 and not call.oneway and (call.upload is None or call.upload.done):
            self._arm_per_try(attempt, per_try)
        pool = cluster.pool(endpoint, cluster.framing or msg.framing, msg.protocol)
        attempt.pool = pool
        conn = pool.try_acquire()
        if conn is not None:
            self.send(attempt, conn)
            return
        limits = cluster.limits
        if limits is not None:
            if not limits.try_enter_pending():
                self.stats["limit_rejections"] += 1
                self.attempt_failed(attempt, UpstreamError(
                    f"cluster '{cluster.name}' has max_pending {limits.max_pending} calls "
                    "waiting for a connection", written=False, endpoint_fault=False))
                return
            attempt.pending = True
        attempt.waiter = pool.acquire(attempt, call.conn)

    def _arm_per_try(self, attempt: Attempt, per_try: float) -> None:
        """The attempt's per-try deadline, unless the route deadline comes first."""
        at = self.loop.time() + per_try
        call = attempt.call
        deadline = self._credit_pauses(call)
        if not deadline or at <= deadline:
            # (time the client held earlier attempts' replies back is not this attempt's credit)
            credited = call.conn.paused_ns(call)
            attempt.timer = self._deadline_queue(per_try).set(at, self._attempt_timeout, attempt, per_try, credited)

    # 5: write -------------------------------------------------------------------

    def send(self, attempt: Attempt, conn) -> None:
        call = attempt.call
        if attempt.pending:
            self._leave_pending(attempt)
        if call.cancelled or attempt is not call.attempt or attempt.ended:
            conn.pool.release(conn)
            return
        if call.deadline and self.loop.time() >= call.deadline and self._past_deadline(call):
            # The connection came after the deadline (the loop stalled through both): not
            # written, and the call is answered now, as its timer, due too, would.
            conn.pool.release(conn)
            if call.timer is not None:
                call.timer.cancel()
                call.timer = None
            error = self._waited_out(attempt, call.deadline_what)
            self._drop_attempt(attempt, error.message, calls.NOT_SENT)
            self._time_out(call, error)
            return
        timer = attempt.timer
        if timer is not None and self.loop.time() >= timer.when():
            # The same for the attempt's per-try deadline: not written; the attempt failed as not
            # sent (so it may be retried), as its timer, due too, would have failed it. (No client
            # pause can have moved that deadline: none of this call's replies is out yet.)
            conn.pool.release(conn)
            timer.cancel()
            attempt.timer = None
            self.stats["timeouts"] += 1
            per_try = call.route.settings.retry.per_try_timeout
            self.attempt_failed(attempt, self._waited_out(attempt, f"per-try timeout {_ms(per_try)}"))
            return
        attempt.t_acquired = monotonic_ns()
        attempt.upconn = conn
        if call.upload is not None:
            self._send_upload(attempt, conn, call.upload)
            return
        framing = conn.pool.framing
        try:
            data = self._request_bytes(call, attempt, framing)
        except ProtocolError as e:  # e.g. a THeader payload that does not inflate: the client's fault
            conn.pool.release(conn)
            attempt.upconn = None
            self._end_attempt(attempt, calls.NOT_SENT, False)
            call.outcome = calls.BAD_REQUEST
            if e.close:  # as for any malformed request: that client's connection closes after it
                call.conn.refuse_more()
            self.fail(call, e.app_type, e.message)
            return
        attempt.endpoint.outstanding += 1
        attempt.request_size = len(data)
        call.written = True
        conn.exchange(None if call.oneway else attempt, data)
        attempt.t_written = monotonic_ns()
        if len(data) >= SENT_WATCH_MIN and not call.oneway:
            conn.watch_sent(attempt, len(data))
        if call.oneway:
            attempt.endpoint.outstanding -= 1
            self.stats["oneway"] += 1
            call.t_done = attempt.t_written
            # Written says nothing of the endpoint's health (a hung server still takes bytes):
            # no verdict, or oneways would keep its breaker closed and close it when open.
            self._end_attempt(attempt, calls.SUCCESS, blame=False)
            self._release_call(call)
            self.completed(call)

    def _send_upload(self, attempt: Attempt, conn, up: Upload) -> None:
        """A streaming request got its connection: what is held goes out; the rest follows
        (upload_data) as it arrives."""
        attempt.endpoint.outstanding += 1
        attempt.call.written = True
        held = up.held
        up.held = []
        up.held_size = 0
        up.hold(False)  # too much was held: the client may go on now (before the write, which
                        # may hold it again: the upstream not taking the bytes)
        conn.upload = None if up.done else up
        conn.exchange(attempt, held[0] if len(held) == 1 else b"".join(held))
        if up.done:
            attempt.t_written = monotonic_ns()
            conn.watch_sent(attempt, up.size)

    def _request_bytes(self, call: Call, attempt: Attempt, framing) -> bytes:
        """The request as this upstream wants it: re-framed, renamed, with THeader headers added."""
        if (framing is F_HEADER or framing is F_FRAMED_HEADER) and (
                call.deadline or attempt.timer is not None or self.on_send is not None):
            headers = dict(call.msg.headers)
            if call.deadline or attempt.timer is not None:
                # the time this attempt has: the route deadline's, or its per-try timeout's if less
                now = self.loop.time()
                left = self._credit_pauses(call) - now if call.deadline else None
                if attempt.timer is not None:
                    per_try = attempt.timer.when() - now
                    left = per_try if left is None else min(left, per_try)
                headers[CLIENT_TIMEOUT_HEADER] = str(max(int(left * 1000), 1))
            if self.on_send is not None:
                self.on_send(attempt, headers)
            limit = call.conn.max_frame_size
            make = strip_service if call.route.strip_service else reframe
            try:
                return make(call.msg, framing, headers, limit)
            except HeaderBlockTooLarge:
                # The client's own headers fill the block: ours do not all fit. With tracing on,
                # its trace headers never go on as they came (the proxy may have dropped them as
                # invalid; the upstream would skip our span): ours replace them if they fit, else
                # none go. (Tracing off: the client's block goes on as it came, below.)
                self.warnings.warn(log, "theader full", "call %s: THeader header block full: sent without "
                                   "the proxy's client_timeout%s", cut(call.msg.name, MAX_NAME),
                                   "" if self.on_send is None else " (and its trace context, if that did not fit)")
                if self.on_send is not None:
                    theirs = {k: v for k, v in call.msg.headers.items() if k.lower() not in TRACE_HEADERS}
                    ours = dict(theirs)
                    self.on_send(attempt, ours)
                    try:
                        return make(call.msg, framing, ours, limit)
                    except HeaderBlockTooLarge:
                        return make(call.msg, framing, theirs, limit)  # (smaller than the client's block)
        msg = call.msg
        if framing is msg.framing and msg.header is None and not call.route.strip_service:
            return msg.data  # the common case: it goes out as it came in
        if call._req_framing is framing:  # a retry to the same framing: made already
            return call._req_data
        limit = call.conn.max_frame_size  # (a zlib THeader payload inflates up to it, no further)
        data = (strip_service(call.msg, framing, None, limit) if call.route.strip_service
                else reframe(call.msg, framing, None, limit))
        call._req_framing = framing
        call._req_data = data
        return data

    # 6-7: reply, classify ------------------------------------------------------------

    def attempt_replied(self, attempt: Attempt, reply: Message) -> None:
        self._off_connection(attempt)
        if attempt.call.cluster.tracks_latency and attempt.t_written:  # only peak_ewma reads it
            rtt = attempt.t_reply - attempt.t_sent
            if attempt.held_ns:  # held for its turn, then read whole: the client's order, not the
                rtt = max(rtt - attempt.held_ns, attempt.t_first_reply - attempt.t_sent)  # endpoint's
            attempt.endpoint.ewma.observe(rtt / 1e9)
        attempt.reply_size = len(reply.data)
        call = attempt.call
        field = None
        blame = True
        if reply.type == M_EXCEPTION:
            outcome = calls.APP_EXCEPTION
            blame = reply.exception_type() not in REQUEST_FAULTS  # a method it lacks: not its health
        else:
            try:
                field = reply.result_field()
            except Exception:  # a reply we framed but cannot peek: pass it on as is
                field = None
            outcome = calls.DECLARED_EXCEPTION if field else calls.SUCCESS  # (None: void; a negative id: declared)
        if (outcome is calls.SUCCESS and attempt is call.attempt and not call.cancelled
                and reply.framing is call.msg.framing):
            # The common case: the reply goes back first; the attempt's bookkeeping (breaker,
            # timers, limits) is not what the client waits for.
            attempt.outcome = outcome
            call.result_field = field
            call.outcome = outcome
            self.finish(call, reply.data)  # (its max_requests slot first: the write may start held requests)
            self._end_attempt(attempt, outcome)
            if call.t_acked:
                # Recorded already (the client's kernel took the reply at once): nothing calls
                # these attempts back now, so they let go of the call. That breaks the
                # call <-> attempt cycle: the call, its attempts and its request are freed by
                # reference counting when the last holder drops them, not left to the cyclic GC.
                for a in call.attempts:
                    a.call = None
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%r replied: %d bytes, outcome %s", attempt, attempt.reply_size, outcome)
            return
        self._end_attempt(attempt, outcome, blame=blame)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%r replied: %d bytes, outcome %s", attempt, attempt.reply_size, outcome)
        if call.cancelled or attempt is not call.attempt:
            return
        call.result_field = field
        if outcome != calls.SUCCESS and self._retry(call, attempt, outcome, field):
            return
        call.outcome = outcome
        framing = call.msg.framing
        try:
            # (a zlib THeader reply inflates up to the cluster's max_reply_size, as it came)
            data = (reply.data if reply.framing is framing
                    else reframe(reply, framing, None, call.cluster.pool_settings.max_reply_size))
        except ProtocolError as e:  # a reply we cannot re-frame (e.g. its zlib payload is broken)
            call.outcome = calls.MAY_HAVE_RUN
            self.fail(call, AppErrorType.INTERNAL_ERROR,
                      f"may have run: bad reply from {attempt.endpoint.label}: {e.message.removeprefix('bad request: ')}")
            return
        self.finish(call, data)

    # 6b: a large reply streams: checked and classified from its head, passed on as it arrives

    def stream_start(self, attempt: Attempt, head) -> bool | str:
        call = attempt.call
        if (call.cancelled or attempt is not call.attempt or call.oneway
                or (call.upload is not None and not call.upload.done)):
            # read it whole: nobody waits for it, or it came before the whole request was
            # written (that connection is then discarded)
            return False
        now = call.conn.can_stream(call)
        if not now and not call.conn.stream_later(call):
            return False  # (its client connection is shut down or gone: read whole, dropped)
        if head.type == MessageType.EXCEPTION:
            outcome = calls.APP_EXCEPTION
        elif head.result_field:
            outcome = calls.DECLARED_EXCEPTION
        else:
            outcome = calls.SUCCESS
        if not now:
            # Replies ahead of it are still pending: read it whole to wait (a few, up to the client
            # connection's budget), or leave it unread until it is first in line (the client
            # connection calls take_turn), then ask again. This holds for a reply that will be
            # read whole in its turn too (re-framed, or retried), so that no reply waits in
            # memory outside the budget.
            return False if call.conn.wait_whole(call, head.total) else WAIT_TURN
        if head.framing is not call.msg.framing:
            return False  # read it whole: it is re-framed for the client
        if outcome is calls.APP_EXCEPTION:
            return False  # read it whole: its type, after its message, says whether to blame the endpoint
        if outcome != calls.SUCCESS and self._would_retry(call, attempt, outcome, head.result_field):
            return False  # read it whole, so that it can be retried
        call.streamed = True
        if attempt.timer is not None:
            # No retry can follow once reply bytes reach the client: from here the route timeout
            # alone bounds the call (as Envoy ignores a per-try timeout once it sent anything
            # downstream). Before, a healthy upstream's large reply that took longer than
            # per_try_timeout to arrive was cut, and the client's connection with it.
            attempt.timer.cancel()
            attempt.timer = None
        call.outcome = outcome
        call.result_field = head.result_field
        call.reply_size = head.total or 0  # unframed: no length up front (stream_sized at its end)
        call.conn.stream_begin(call, attempt.upconn)
        return True

    def stream_end(self, attempt: Attempt) -> None:
        self._off_connection(attempt)
        if attempt.call.cluster.tracks_latency and attempt.t_written:  # only peak_ewma reads it
            attempt.endpoint.ewma.observe((attempt.t_first_reply - attempt.t_sent) / 1e9)
        call = attempt.call
        attempt.reply_size = call.reply_size
        self._end_attempt(attempt, call.outcome)
        call.t_done = attempt.t_reply
        self._release_call(call)
        call.conn.stream_end(call)

    def attempt_failed(self, attempt: Attempt, error: UpstreamError) -> None:
        if attempt.call.streamed:  # (the proxy's own limit, or a fault already counted: not the breaker's)
            self._stream_failed(attempt, error.message, endpoint_blame=error.endpoint_fault and not error.own_limit)
            return
        self._leave_pending(attempt)
        self._off_connection(attempt)
        attempt.error = error.message
        if error.written:
            outcome = calls.TIMEOUT if error.timeout else calls.MAY_HAVE_RUN
        else:
            outcome = calls.NOT_SENT
        self._end_attempt(attempt, outcome, error.endpoint_fault, not error.own_limit)
        call = attempt.call
        if not error.written and call.written:  # written (maybe a streaming request's first part),
            # yet it reached no service (a TLS refusal): the call "may have run" only if an
            # earlier attempt's request may have
            call.written = any(a.t_written and a.outcome != calls.NOT_SENT for a in call.attempts)
        if call.cancelled or attempt is not call.attempt:
            return
        if error.own_limit:
            policy = self._policy(call.route)
            if policy is not None and attempt.number < policy.attempts:
                call.no_retry = "not retried: another attempt's reply would be as large"
        elif self._retry(call, attempt, outcome, None):
            return
        self._give_up(call, error, outcome)

    @staticmethod
    def _off_connection(attempt: Attempt) -> None:
        """The attempt is done with its upstream connection (replied, failed, gave up): when,
        and no longer outstanding on its endpoint (what least_request balances on)."""
        attempt.t_reply = monotonic_ns()
        if attempt.upconn is not None:
            attempt.endpoint.outstanding -= 1
            attempt.upconn = None

    def _end_attempt(self, attempt: Attempt, outcome: str, endpoint_fault: bool = True,
                     blame: bool = True) -> None:
        """Record an attempt's outcome once: breaker, limits, timers. `blame` False: how it ended
        says nothing about the endpoint whatever the outcome (the client went, or its request
        was cut; a oneway, only written; a reply refused for the proxy's own max_reply_size): the breaker only releases its probe slot, if any."""
        if attempt.ended:
            return
        attempt.ended = True
        attempt.outcome = outcome
        if attempt.timer is not None:
            attempt.timer.cancel()
            attempt.timer = None
        if outcome is calls.TIMEOUT and blame and attempt.t_written:
            # A timed-out attempt took at least this long: peak_ewma must see it (as Finagle's
            # and linkerd's do), or an endpoint that hangs now and then looks fast.
            call = attempt.call
            if call is not None and call.cluster.tracks_latency:
                took = (attempt.t_reply or monotonic_ns()) - attempt.t_sent - attempt.held_ns
                attempt.endpoint.ewma.observe(took / 1e9)
        if not blame:
            verdict = None
        elif outcome is calls.SUCCESS:
            verdict = True
        else:
            verdict = classify_for_breaker(outcome, endpoint_fault)
            if verdict is False and (outcome is calls.MAY_HAVE_RUN or outcome is calls.NOT_SENT):
                # peak_ewma: a connection reset or garbage at once must not look fast (a timeout's
                # time is observed above; a server's TApplicationException is an answer, its
                # latency measured as any reply's)
                attempt.endpoint.ewma.fail()
        breaker = attempt.endpoint.breaker
        if breaker is not None:
            if verdict is None:
                breaker.release(attempt.probe)
            else:
                breaker.record(verdict, attempt.probe)
        if attempt.is_retry:
            limits = attempt.call.cluster.limits
            if limits is not None:
                limits.leave_retry()
            attempt.is_retry = False

    def _leave_pending(self, attempt: Attempt) -> None:
        if attempt.pending:
            attempt.pending = False
            attempt.call.cluster.limits.leave_pending()

    # 8: retry? --------------------------------------------------------------------

    def _policy(self, route) -> RetryPolicy | None:
        key = id(route)
        try:
            return self._policies[key]
        except KeyError:
            s = route.settings
            policy = RetryPolicy(s.retry, s.retry_buffer, self.exception_ids) if s is not None else None
            self._policies[key] = policy
            return policy

    def _would_retry(self, call: Call, attempt: Attempt, outcome: str, field: int | None) -> bool:
        """The retry policy alone (not limits or budget) would retry this outcome."""
        policy = self._policy(call.route)
        return policy is not None and policy.decide(outcome, attempt.number, call.msg.method,
                                                    call.request_size, field)[0]

    def _retry(self, call: Call, attempt: Attempt, outcome: str, field: int | None) -> bool:
        """Start a backoff before another attempt, if policy, limits and budget all allow it.
        A oneway is retried only when not sent (nothing else about it is ever known)."""
        if call.cancelled or (call.oneway and outcome != calls.NOT_SENT):
            return False
        policy = self._policy(call.route)
        if policy is None:
            return False
        ok, why = policy.decide(outcome, attempt.number, call.msg.method, call.request_size, field)
        if not ok:
            if policy.attempts > 1 and attempt.number < policy.attempts:
                call.no_retry = f"not retried: {why}"  # (a route that retries: why not this one)
            return False
        delay = policy.backoff(attempt.number, self.rng)
        deadline = self._credit_pauses(call)
        if deadline and self.loop.time() + delay >= deadline:
            # (before the slot and the budget are taken: this retry never happens)
            call.no_retry = f"not retried: its backoff ({_ms(delay)}) would pass the deadline"
            return False
        cluster = call.cluster
        limits = cluster.limits
        if limits is not None and not limits.try_enter_retry():
            self.stats["retries_refused_limit"] += 1
            cluster.stats["retries_refused_limit"] += 1
            call.no_retry = (f"not retried: cluster '{cluster.name}' has {limits.retries} retries in "
                             f"flight (max_retries {limits.max_retries})")
            return False
        budget = cluster.budget
        if budget is not None and not budget.try_withdraw():
            self.stats["retries_refused_budget"] += 1
            cluster.stats["retries_refused_budget"] += 1
            call.no_retry = f"not retried: the retry budget of cluster '{cluster.name}' is spent"
            if limits is not None:
                limits.leave_retry()
            return False
        call.attempt = None
        call.conn.unwait(call)  # (a reply read whole to wait its turn is dropped: its budget is free)
        call.backoffs.append((monotonic_ns(), 0))  # (its end: _retry_now, or _cancel_backoff)
        call.retry_timer = self.loop.call_later(delay, self._retry_now, call, outcome)
        return True

    @staticmethod
    def _end_backoff(call: Call) -> None:
        start, _ = call.backoffs[-1]
        call.backoffs[-1] = (start, monotonic_ns())

    def _retry_now(self, call: Call, reason: str) -> None:
        call.retry_timer = None
        self._end_backoff(call)
        if call.cancelled or self._past_deadline(call):
            # (past the deadline: the loop stalled through the backoff's end and the deadline
            # both; no attempt starts after it, the route timeout, due too, answers the call)
            if call.cluster.limits is not None:
                call.cluster.limits.leave_retry()
            return
        tried = len(call.attempts)
        self.start_attempt(call, retry_reason=reason)
        if len(call.attempts) > tried:
            self.stats["retries"] += 1  # (made: a retry whose client left in its backoff is not)
            call.cluster.stats["retries"] += 1
        elif call.cluster.limits is not None:
            # No attempt was made (e.g. no endpoint): the slot is free again. An attempt that
            # was made holds it (Attempt.is_retry) until it ends, which may have been already.
            call.cluster.limits.leave_retry()

    # timeouts -------------------------------------------------------------------

    def _attempt_timeout(self, attempt: Attempt, per_try: float, credited: int = 0, rechecked: bool = False) -> None:
        timer = attempt.timer
        attempt.timer = None
        if attempt.ended:
            return
        if not rechecked and timer is not None and self.loop.time() - timer.when() > STALL_GRACE:
            # the loop was stalled past the deadline: a reply that came meanwhile is read first
            attempt.timer = self.loop.call_later(STALL_RECHECK, self._attempt_timeout, attempt, per_try,
                                                 credited, True)
            return
        call = attempt.call
        # As for the route timeout (_credit_pauses): time the client held the stream back (or its
        # earlier calls held the reply unread, even if it was then read whole) is not the
        # upstream's: the deadline moves.
        paused = call.conn.paused_ns(call)
        if paused > credited:
            due = timer.when() if timer is not None else self.loop.time()
            attempt.timer = self.loop.call_at(due + (paused - credited) / 1e9,
                                              self._attempt_timeout, attempt, per_try, paused)
            return
        self.stats["timeouts"] += 1
        self.attempt_failed(attempt, self._stop_attempt(attempt, f"per-try timeout {_ms(per_try)}"))

    def _stream_failed(self, attempt: Attempt, why: str, blame: bool = True,
                       outcome: str = calls.MAY_HAVE_RUN, endpoint_blame: bool = True) -> None:
        """Reply bytes already went to the client: all we can do is close its connection.
        `outcome`: the attempt's and the call's (`timeout` when a deadline cut the stream, as
        for a reply read whole: metrics, spans, the breaker and peak_ewma see it so).
        `blame` False: the client's connection went (it left, or the proxy cut it as a write
        stall), which says nothing about the endpoint: the call ran and its reply, as the
        upstream's head said (`call.outcome`), is recorded not delivered, as a reply read whole
        and then not taken is (calls.NOT_DELIVERED). `endpoint_blame` False: the call failed
        as `outcome` says, but not by the endpoint's doing (the client's own shorter
        client_timeout passed): the breaker and peak_ewma do not count it."""
        call = attempt.call
        self._off_connection(attempt)
        attempt.error = why
        self._end_attempt(attempt, outcome, blame=blame and endpoint_blame)
        self.stats["errors"] += 1
        if blame:
            call.outcome = outcome
            call.error = f"may have run: {why} (while streaming the reply; client connection closed)"
            call.error_type = outcome
            self.warnings.warn(log, "stream_failed", "call %s: %s", call.msg.name, call.error)
        else:
            call.error = f"not delivered: {why} (while its reply streamed)"
            call.error_type = calls.NOT_DELIVERED
            self.warnings.log(log, logging.INFO, "stream_not_delivered", "call %s: %s", call.msg.name, call.error)
        self._release_call(call)
        call.conn.stream_abort(call)

    def _credit_pauses(self, call: Call) -> float:
        """The route deadline (loop time; 0: none), moved on by the time the client held the
        call's replies back since it last moved (`call.credited_ns`).

        Time the client held a stream back (not reading) is not the upstream's: the deadline
        moves by it (a client that stops reading altogether is closed as a write stall after
        request_read_timeout). As when a reply is read whole: the route timeout bounds the
        upstream side of the call, not the client's reading. So is the time a large reply is
        held unread behind the client's earlier calls (take_turn), however that hold ended.
        Taken whenever the deadline is read (a retry's backoff, a per-try timer, the THeader
        timeout sent upstream), not only when its timer fires: a reply held for its turn and
        then retried must not find the deadline as if it had been the upstream's time."""
        if call.deadline:
            paused = call.conn.paused_ns(call)
            if paused > call.credited_ns:
                call.deadline += (paused - call.credited_ns) / 1e9
                call.credited_ns = paused
        return call.deadline

    def _past_deadline(self, call: Call) -> bool:
        return bool(call.deadline) and self.loop.time() >= self._credit_pauses(call)

    def _call_timeout(self, call: Call, rechecked: bool = False) -> None:
        """The call's deadline (`call.deadline_what`) passed."""
        call.timer = None
        if call.reply is not None or call.cancelled:
            return
        if not rechecked and self.loop.time() - call.deadline > STALL_GRACE:
            # The loop itself was stalled past the deadline (clock.STALL_GRACE): a reply that came
            # meanwhile is read first (the next poll, in STALL_RECHECK), then the timeout stands.
            call.timer = self.loop.call_later(STALL_RECHECK, self._call_timeout, call, True)
            return
        before = call.deadline
        if self._credit_pauses(call) > before or call.deadline - self.loop.time() > DEADLINE_SLACK:
            # the client's pauses moved it on (now, or since this timer was set)
            call.timer = self.loop.call_at(call.deadline, self._call_timeout, call)
            return
        self._time_out(call)

    def _time_out(self, call: Call, error: UpstreamError | None = None) -> None:
        """Answer the call as timed out (`error`: the current attempt's, already dropped)."""
        what = call.deadline_what
        if call.streamed:
            a = call.attempt
            if a is not None and a.upconn is not None:
                a.upconn.abandon()
            self.stats["timeouts"] += 1
            # (the client's own shorter deadline cuts the stream, as it cuts a reply read whole:
            # a timeout, but not the endpoint's, whose breaker and peak_ewma do not see it)
            self._stream_failed(a, what, outcome=calls.TIMEOUT, endpoint_blame=not call.client_cut)
            return
        self.stats["timeouts"] += 1
        self._cancel_backoff(call)
        if error is None:
            a = call.attempt
            if a is not None and not a.ended:
                error = self._stop_attempt(a, what)
                self._drop_attempt(a, error.message, calls.TIMEOUT if error.written else calls.NOT_SENT,
                                   blame=not call.client_cut)
            else:
                error = UpstreamError(f"{what} passed", written=call.written, timeout=True)
        self._give_up(call, error, calls.TIMEOUT if call.written else calls.NOT_SENT)

    def _drop_attempt(self, attempt: Attempt, error: str, outcome: str, blame: bool = True) -> None:
        """An attempt stopped (`_stop_attempt`, or its connection abandoned) by the proxy (a
        timeout, the request cut, the client gone): off its connection and its pending slot, its
        outcome recorded. The breaker counts a timeout or a written request that may have run as
        the endpoint's failure unless `blame` is False (the client's doing); never a request
        that was not sent."""
        self._leave_pending(attempt)
        self._off_connection(attempt)
        attempt.error = error
        self._end_attempt(attempt, outcome, False, blame)

    def _cancel_backoff(self, call: Call) -> None:
        """A retry was waiting out its backoff: it will not happen (its max_retries slot frees).
        The backoff span ends here (the client left, the route timed out, the proxy drains)."""
        if call.retry_timer is not None:
            call.retry_timer.cancel()
            call.retry_timer = None
            self._end_backoff(call)
            if call.cluster.limits is not None:
                call.cluster.limits.leave_retry()

    def _stop_attempt(self, attempt: Attempt, what: str) -> UpstreamError:
        """Stop waiting: a late reply must never reach the client (that connection is discarded)."""
        if attempt.waiter is not None:
            attempt.waiter.cancel()
            attempt.waiter = None
            return self._waited_out(attempt, what)
        conn = attempt.upconn
        if conn is not None:
            conn.abandon()
            return UpstreamError(f"{what}: no reply from {attempt.endpoint.label}", written=True, timeout=True)
        return UpstreamError(f"{what} connecting to {attempt.endpoint.label}", written=False, timeout=True)

    @staticmethod
    def _waited_out(attempt: Attempt, what: str) -> UpstreamError:
        """`what` deadline passed before the attempt had a connection: nothing was written, and
        it says nothing of the endpoint."""
        return UpstreamError(f"{what} while waiting for a connection to {attempt.endpoint.label}",
                             written=False, timeout=True, endpoint_fault=False)

    # 9: answer ----------------------------------------------------------------------

    def _give_up(self, call: Call, error: UpstreamError, outcome: str | None = None) -> None:
        """Answer with the last error. `outcome`: the last attempt's; a call an earlier attempt
        may have run is `may_have_run` even when its last attempt was not sent (what the client
        is told: `not_sent` would read as safe to send again)."""
        kind = "may have run" if (call.written or error.written) else "not sent"
        if outcome is None or (outcome == calls.NOT_SENT and kind == "may have run"):
            outcome = calls.MAY_HAVE_RUN if kind == "may have run" else calls.NOT_SENT
        call.outcome = outcome
        text = f"{kind}: {error.message}"
        if call.written and not error.written:  # the last attempt was not sent: say which one ran
            ran = next((a for a in reversed(call.attempts) if a.t_written and a.outcome != calls.NOT_SENT
                        and a.error), None)
            if ran is not None:
                text += f"; attempt {ran.number} may have run: {ran.error}"
        tries = len(call.attempts)
        if call.no_retry or tries != 1:
            said = "no attempt made" if not tries else f"{tries} attempt{'' if tries == 1 else 's'}"
            text += f" ({said}; {call.no_retry})" if call.no_retry else f" ({said})"
        self.fail(call, AppErrorType.INTERNAL_ERROR, text)

    def fail(self, call: Call, app_type: AppErrorType, text: str) -> None:
        """Answer with the proxy's own TApplicationException (never for oneway)."""
        self.stats["errors"] += 1
        call.error = text
        call.error_type = call.outcome or "error"
        if call.oneway:
            self.stats["oneway_failures"] += 1
            name = cut(call.msg.name, MAX_NAME) if call.msg is not None else "(unnamed)"
            self.warnings.warn(log, ("oneway failed", call.outcome), "oneway call %s on listener %s failed: %s",
                               name, self.listener_name, text)
            call.t_done = monotonic_ns()
            self._release_call(call)
            self.completed(call)
            return
        self.finish(call, exception_reply(call.msg.head, app_type, PREFIX + text))

    def finish(self, call: Call, data: bytes) -> None:
        call.t_done = monotonic_ns()
        call.reply = data
        self._release_call(call)
        up = call.upload
        if up is not None:  # (answered before its request is all here: the rest is dropped)
            up.held = []
            up.hold(False)
        call.conn.call_done(call)

    def _release_call(self, call: Call) -> None:
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if call.holds_request:
            call.holds_request = False
            call.cluster.limits.leave_request()

    def completed(self, call: Call) -> None:
        """The call is over (its reply acknowledged, or it never will be): record it."""
        if self.on_complete is not None:
            self.on_complete(call)

    def cancel(self, call: Call, closed_by_proxy: str | None = None) -> None:
        """The client went away: stop waiting, and stop an attempt that was written. Its reply
        would have nowhere to go, and nothing would bound the wait for it (the route timeout
        goes with the call): its connection is closed, as Envoy resets the upstream request
        when the downstream one goes, and the endpoint is not blamed. (A reply already
        streaming is the listener's to stop and record: `_stream_failed`.)

        The call is recorded (metrics, and a trace: it counts as failed), outcome
        `client_gone` when it had no reply yet: a client killed or reset in the middle of a
        slow call leaves exactly the call whose hops one wants to see. (A client that only
        half-closes, FIN, is still answered: its call goes on.) `closed_by_proxy`: it was the
        proxy that closed the connection (why: a write stall, an earlier streamed reply that
        broke): then the call is recorded as not delivered, not as the client's leaving."""
        call.cancelled = True
        self._cancel_backoff(call)
        a = call.attempt
        record = not call.streamed  # (a bad request the listener answered, msg None, too)
        if record and closed_by_proxy is not None:
            written = a is not None and a.upconn is not None
            call.outcome = call.outcome or (calls.MAY_HAVE_RUN if written or call.written else calls.NOT_SENT)
            call.error_type = calls.NOT_DELIVERED
            call.error = f"not delivered: the proxy closed the client's connection: {closed_by_proxy}"
            call.t_done = call.t_done or monotonic_ns()
        elif record:
            if call.reply is None:
                self.stats["client_gone"] += 1
                up = call.upload
                where = ("while its request was still arriving" if up is not None and not up.done
                         else "while it waited for a connection" if a is not None and a.waiter is not None
                         else "after its request was written" if a is not None and a.upconn is not None
                         else "before its reply")
                call.outcome = call.error_type = calls.CLIENT_GONE
                call.error = f"the client closed its connection {where}"
                call.t_done = monotonic_ns()
            else:  # answered, but an earlier reply was still due: never written, so not delivered
                call.never_read = True  # (as the listener records a reply the connection lost)
                call.error_type = calls.NOT_DELIVERED
                call.error = ("not delivered: the client closed its connection before its reply was "
                              "written (an earlier reply was still due)")
        if a is not None and a.waiter is not None:
            a.waiter.cancel()
            a.waiter = None
            a.t_reply = monotonic_ns()  # (its acquire hop ends here)
            self._leave_pending(a)
            self._end_attempt(a, calls.NOT_SENT, False)
        elif a is not None and a.upconn is not None and not a.ended and not call.streamed:
            what = ("while sending the request" if a.upconn.upload is not None
                    else "before its reply")
            a.upconn.abandon()
            self._drop_attempt(a, f"the client closed its connection {what}", calls.MAY_HAVE_RUN, blame=False)
        if a is not None and a.t_reply > call.t_done and call.reply is None:
            call.t_done = a.t_reply  # (the attempt, stopped just now, ends inside the call's span)
        self._release_call(call)
        if record:
            self.completed(call)
