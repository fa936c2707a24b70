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
from proxy.calls import Attempt, Call
from proxy.upstream import UpstreamError

log = logging.getLogger(__name__)

PREFIX = "thrift-sidecar: "


def _same_protocol(a: Protocol, b: Protocol) -> bool:
    return a is b or (a is not Protocol.COMPACT and b is not Protocol.COMPACT)


class Pipeline:
    """The request path for one listener: router, clusters, and the error rule."""

    def __init__(self, listener_name: str, router, oneway_methods: frozenset[str] = frozenset()) -> None:
        self.listener_name = listener_name
        self.router = router
        self.oneway_methods = oneway_methods
        self.stats = {"calls": 0, "errors": 0, "oneway": 0, "oneway_failures": 0, "no_route": 0}
        self.on_complete = None  # telemetry: called once per finished call

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
        attempt = Attempt(call, endpoint, len(call.attempts) + 1, monotonic_ns())
        call.attempts.append(attempt)
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

    def completed(self, call: Call) -> None:
        """The call is over (its reply acknowledged, or it never will be): record it."""
        if self.on_complete is not None:
            self.on_complete(call)

    def cancel(self, call: Call) -> None:
        """The client went away: stop waiting for a connection; a written attempt runs out."""
        call.cancelled = True
        a = call.attempt
        if a is not None and a.waiter is not None:
            a.waiter.cancel()
            a.waiter = None
