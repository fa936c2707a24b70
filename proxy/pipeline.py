"""One call's path, top-down. The one file to read to see what happens to a request.

    listener (framed a request) ─► Pipeline.handle
        1. route         which cluster (first matching route; none → UNKNOWN_METHOD)
        2. oneway?       ONEWAY, or a method listed in oneway_methods: nothing is written back
        3. attempt       balancer picks an endpoint (open breakers skipped), pool lends a connection
        4. write         request bytes, re-framed only if the upstream framing differs
        5. reply         upstream connection frames the reply and checks its seqid
        6. answer        reply bytes, re-framed for the client, queued in request order

Everything here runs in protocol callbacks: no task per call. A call's
timestamps (monotonic ns) are its hops; spans and metrics are built from
them after the call.

Errors follow DESIGN.md's rule: if any attempt was written upstream the
client hears "may have run", else "not sent".
"""

from __future__ import annotations

import logging
from time import monotonic_ns

from proxy.codec import AppErrorType, Framing, Message, MessageType, Protocol, exception_reply, reframe
from proxy.upstream import Exchange, UpstreamError

log = logging.getLogger(__name__)

PREFIX = "thrift-sidecar: "


def _same_protocol(a: Protocol, b: Protocol) -> bool:
    return a is b or (a is not Protocol.COMPACT and b is not Protocol.COMPACT)


class Call:
    """One client request from the moment its first byte arrived until its reply is written."""

    __slots__ = ("conn", "msg", "route", "cluster", "oneway", "reply", "error", "attempt", "attempts",
                 "written", "cancelled", "t_start", "t_framed", "t_done", "t_handed", "_request")

    def __init__(self, conn, msg: Message, t_start: int, t_framed: int) -> None:
        self.conn = conn
        self.msg = msg
        self.route = None
        self.cluster = None
        self.oneway = False
        self.reply: bytes | None = None     # what goes back to the client, once known
        self.error: str | None = None       # the proxy's own error text, if it answered
        self.attempt: Attempt | None = None
        self.attempts = 0
        self.written = False                # some attempt wrote request bytes upstream
        self.cancelled = False
        self.t_start = t_start
        self.t_framed = t_framed
        self.t_done = 0
        self.t_handed = 0
        self._request: dict = {}            # request bytes per upstream framing


class Attempt(Exchange):
    """One try of a call on one endpoint: acquire → write → reply."""

    __slots__ = ("call", "endpoint", "pool", "upconn", "waiter", "seqid", "number",
                 "t_acquire", "t_acquired", "t_written", "t_first_reply", "t_reply", "outcome")

    def __init__(self, call: Call, endpoint, number: int) -> None:
        self.call = call
        self.endpoint = endpoint
        self.pool = None
        self.upconn = None
        self.waiter = None
        self.seqid = call.msg.seqid
        self.number = number
        self.t_acquire = monotonic_ns()
        self.t_acquired = 0
        self.t_written = 0
        self.t_first_reply = 0
        self.t_reply = 0
        self.outcome = None

    # pool callback: a connection (or an error) arrived
    def __call__(self, conn, error) -> None:
        self.waiter = None
        if error is not None:
            self.call.conn.pipeline.attempt_failed(self, error)
        else:
            self.call.conn.pipeline.send(self, conn)

    def on_reply(self, reply: Message) -> None:
        self.call.conn.pipeline.attempt_replied(self, reply)

    def on_failure(self, error: UpstreamError) -> None:
        self.call.conn.pipeline.attempt_failed(self, error)


class Pipeline:
    """The request path for one listener: router, clusters, and the error rule."""

    def __init__(self, listener_name: str, router, oneway_methods: frozenset[str] = frozenset()) -> None:
        self.listener_name = listener_name
        self.router = router
        self.oneway_methods = oneway_methods
        self.stats = {"calls": 0, "errors": 0, "oneway": 0, "oneway_failures": 0, "no_route": 0}

    # 1-2: route, oneway ----------------------------------------------------------

    def handle(self, conn, msg: Message, t_start: int, t_framed: int) -> None:
        self.stats["calls"] += 1
        call = Call(conn, msg, t_start, t_framed)
        call.oneway = msg.type == MessageType.ONEWAY or (
            bool(self.oneway_methods) and (msg.name in self.oneway_methods or msg.method in self.oneway_methods))
        if not call.oneway:
            conn.enqueue(call)
        route = self.router.route(msg)
        if route is None:
            self.stats["no_route"] += 1
            self.fail(call, AppErrorType.UNKNOWN_METHOD,
                      f"no route: method '{msg.name}' on listener '{self.listener_name}'")
            return
        call.route = route
        call.cluster = route.pick_cluster()
        self.start_attempt(call)

    # 3: attempt ---------------------------------------------------------------

    def start_attempt(self, call: Call) -> None:
        cluster = call.cluster
        msg = call.msg
        if cluster.protocol is not None and not _same_protocol(cluster.protocol, msg.protocol):
            self.fail(call, AppErrorType.INTERNAL_ERROR,
                      f"not sent: the client speaks {msg.protocol.value} but cluster '{cluster.name}' "
                      f"speaks {cluster.protocol.value} (protocols are never transcoded)")
            return
        endpoint = cluster.pick()
        if endpoint is None:
            self._give_up(call, UpstreamError(f"no endpoint available in cluster '{cluster.name}'", written=False))
            return
        call.attempts += 1
        attempt = Attempt(call, endpoint, call.attempts)
        call.attempt = attempt
        pool = cluster.pool(endpoint, cluster.framing or msg.framing, msg.protocol)
        attempt.pool = pool
        conn = pool.try_acquire()
        if conn is not None:
            self.send(attempt, conn)
        else:
            attempt.waiter = pool.acquire(attempt)

    # 4: write -------------------------------------------------------------------

    def send(self, attempt: Attempt, conn) -> None:
        call = attempt.call
        if call.cancelled or attempt is not call.attempt:
            conn.pool.release(conn)
            return
        now = monotonic_ns()
        attempt.t_acquired = now
        attempt.upconn = conn
        framing = conn.pool.framing
        data = call._request.get(framing)
        if data is None:
            data = call._request[framing] = reframe(call.msg, framing)
        attempt.endpoint.outstanding += 1
        call.written = True
        conn.exchange(None if call.oneway else attempt, data)
        attempt.t_written = monotonic_ns()
        if call.oneway:
            attempt.endpoint.outstanding -= 1
            self.stats["oneway"] += 1
            call.t_done = attempt.t_written

    # 5-6: reply, answer ----------------------------------------------------------

    def attempt_replied(self, attempt: Attempt, reply: Message) -> None:
        attempt.t_reply = monotonic_ns()
        ep = attempt.endpoint
        ep.outstanding -= 1
        ep.ewma.observe((attempt.t_reply - attempt.t_written) / 1e9)
        call = attempt.call
        attempt.upconn = None
        if call.cancelled:
            return
        framing = call.msg.framing
        data = reply.data if reply.framing is framing else reframe(reply, framing)
        self.finish(call, data)

    def attempt_failed(self, attempt: Attempt, error: UpstreamError) -> None:
        if attempt.upconn is not None:
            attempt.endpoint.outstanding -= 1
            attempt.upconn = None
        attempt.t_reply = monotonic_ns()
        call = attempt.call
        if call.cancelled or attempt is not call.attempt:
            return
        self._give_up(call, error)

    def _give_up(self, call: Call, error: UpstreamError) -> None:
        kind = "may have run" if (call.written or error.written) else "not sent"
        self.fail(call, AppErrorType.INTERNAL_ERROR, f"{kind}: {error.message}")

    def fail(self, call: Call, app_type: AppErrorType, text: str) -> None:
        """Answer with the proxy's own TApplicationException (never for oneway)."""
        self.stats["errors"] += 1
        call.error = text
        if call.oneway:
            self.stats["oneway_failures"] += 1
            log.warning("oneway call %s on listener %s failed: %s", call.msg.name, self.listener_name, text)
            call.t_done = monotonic_ns()
            return
        self.finish(call, exception_reply(call.msg.head, app_type, PREFIX + text))

    def finish(self, call: Call, data: bytes) -> None:
        call.t_done = monotonic_ns()
        call.reply = data
        call.conn.call_done(call)

    def cancel(self, call: Call) -> None:
        """The client went away: stop waiting for a connection; a written attempt runs out."""
        call.cancelled = True
        a = call.attempt
        if a is not None and a.waiter is not None:
            a.waiter.cancel()
            a.waiter = None
