"""Synthetic finished calls for the telemetry and metrics tests (imported by them).

These test the span builder and the histograms, not the wire: real `Call`/`Attempt` objects
with hand-set timestamps, a tiny stand-in for the request message, a stand-in route with
`settings.slow_call`. Times are monotonic ns from an arbitrary base; `ms(x)` converts.
"""

from __future__ import annotations

from types import SimpleNamespace

from proxy.calls import CLIENT_GONE, DECLARED_EXCEPTION, NOT_SENT, SUCCESS, TIMEOUT, Attempt, Call
from proxy.endpoint import Endpoint

BASE = 5_000_000_000_000  # monotonic ns


def ms(x: float) -> int:
    return int(round(x * 1_000_000))


class FakeMsg:
    """What telemetry reads of a Message: name, method, service, seqid, data, headers."""

    def __init__(self, name: str = "get_user", seqid: int = 7, size: int = 120, headers=None, oneway=False):
        self.name = name
        self.seqid = seqid
        self.data = b"\0" * size
        self.headers = headers or {}
        self.oneway = oneway

    @property
    def service(self):
        i = self.name.find(":")
        return self.name[:i] if i >= 0 else None

    @property
    def method(self):
        i = self.name.find(":")
        return self.name[i + 1:] if i >= 0 else self.name


def route(slow_call: float = 1.0):
    return SimpleNamespace(settings=SimpleNamespace(slow_call=slow_call))


CONN = SimpleNamespace(peer=("127.0.0.1", 51515))
EP1 = Endpoint("127.0.0.1", 9191)
EP2 = Endpoint("127.0.0.2", 9192)


def attempt(call: Call, ep: Endpoint, number: int, at: float, acquire=0.05, write=0.05, service=10.0,
            read=0.2, outcome=SUCCESS, reply_size=300) -> Attempt:
    """An attempt starting `at` ms after BASE; a hop of None did not happen (and neither did later ones)."""
    a = Attempt(call, ep, number, BASE + ms(at))
    a.breaker_state = "closed"
    t = at
    for hop, field in ((acquire, "t_acquired"), (write, "t_written"), (service, "t_first_reply"),
                       (read, "t_reply")):
        if hop is None:
            break
        t += hop
        setattr(a, field, BASE + ms(t))
    a.outcome = outcome
    a.reply_size = reply_size if a.t_reply else 0
    call.attempts.append(a)
    call.attempt = a
    return a


def call_success(msg=None, slow_call=1.0) -> Call:
    """read 0.1 ms → attempt (acquire .05, write .05, service 10, read .2) → write 0.3 ms → acked."""
    c = Call(CONN, msg or FakeMsg(), BASE, BASE + ms(0.1))
    c.route = route(slow_call)
    a = attempt(c, EP1, 1, 0.101)
    c.written = True
    c.outcome = SUCCESS
    c.reply = b"r" * 300
    c.reply_size = 300
    c.t_done = a.t_reply + ms(0.02)
    c.t_write = c.t_done + ms(0.005)
    c.t_handed = c.t_write + ms(0.01)
    c.t_acked = c.t_write + ms(0.3)
    return c


def call_declared() -> Call:
    c = call_success()
    c.outcome = DECLARED_EXCEPTION
    c.attempts[0].outcome = DECLARED_EXCEPTION
    return c


def call_retry() -> Call:
    """Attempt 1 times out after 500 ms on EP1, 25 ms backoff, attempt 2 succeeds on EP2."""
    c = Call(CONN, FakeMsg(), BASE, BASE + ms(0.1))
    c.route = route()
    a1 = attempt(c, EP1, 1, 0.101, service=None, outcome=TIMEOUT)
    a1.t_reply = a1.t_written + ms(500)
    a1.error = "per-try timeout 500ms"
    b0 = a1.t_reply + ms(0.01)
    c.backoffs.append((b0, b0 + ms(25)))
    a2 = attempt(c, EP2, 2, (b0 + ms(25) - BASE) / 1e6 + 0.01)
    a2.retry_reason = TIMEOUT
    c.written = True
    c.outcome = SUCCESS
    c.reply = b"r" * 300
    c.t_done = a2.t_reply + ms(0.02)
    c.t_write = c.t_done + ms(0.005)
    c.t_handed = c.t_write + ms(0.01)
    c.t_acked = c.t_write + ms(0.2)
    return c


def call_timeout() -> Call:
    """The route's 2 s timeout fires while the upstream is still working."""
    c = Call(CONN, FakeMsg(), BASE, BASE + ms(0.1))
    c.route = route()
    a = attempt(c, EP1, 1, 0.101, service=None, outcome=TIMEOUT)
    a.t_reply = BASE + ms(2000)
    c.written = True
    c.outcome = TIMEOUT
    c.error_type = "timeout"
    c.error = "may have run: route timeout 2s"
    c.reply = b"e" * 90
    c.t_done = a.t_reply + ms(0.02)
    c.t_write = c.t_done + ms(0.005)
    c.t_handed = c.t_write + ms(0.01)
    c.t_acked = c.t_write + ms(0.2)
    return c


def call_queued() -> Call:
    """Pipelined: this reply was ready 40 ms before the earlier call's reply let it go out."""
    c = call_success()
    c.waited = True  # the listener marks a reply that waits behind an earlier one
    c.t_write = c.t_done + ms(40)
    c.t_handed = c.t_write + ms(0.01)
    c.t_acked = c.t_write + ms(0.3)
    return c


def call_oneway() -> Call:
    c = Call(CONN, FakeMsg("log_event", oneway=True), BASE, BASE + ms(0.1))
    c.route = route()
    c.oneway = True
    a = attempt(c, EP1, 1, 0.101, service=None, outcome=SUCCESS)
    c.written = True
    c.outcome = SUCCESS
    c.t_done = a.t_written
    return c


def call_streamed() -> Call:
    """A 15 MB reply streamed: write_response starts while read_response is still going."""
    c = Call(CONN, FakeMsg("list_users"), BASE, BASE + ms(0.1))
    c.route = route(slow_call=5.0)
    a = attempt(c, EP1, 1, 0.101, service=20.0, read=None, reply_size=15_000_000)
    a.t_reply = a.t_first_reply + ms(300)
    c.written = True
    c.outcome = SUCCESS
    c.streamed = True
    c.client_paused_ns = ms(250)
    c.upstream_wait_ns = ms(12)
    c.reply_size = 15_000_000
    c.t_write = a.t_first_reply + ms(0.06)  # the head went out as it came (listener.stream_begin)
    c.t_done = a.t_reply                    # the reply is "ready" once its last byte came (stream_end)
    c.t_handed = a.t_reply + ms(0.5)
    c.t_acked = a.t_reply + ms(40)
    return c


def call_acquire_timeout() -> Call:
    """The pool is saturated: no connection within acquire_timeout 300 ms (the attempt never got
    one: t_acquired 0; the pipeline stamps t_reply when it fails), answered not_sent."""
    c = Call(CONN, FakeMsg(), BASE, BASE + ms(0.1))
    c.route = route()
    a = attempt(c, EP1, 1, 0.101, acquire=None, outcome=NOT_SENT)
    a.t_reply = a.t_acquire + ms(300)
    a.error = "no connection to 127.0.0.1:9191 within acquire_timeout 300ms (1 busy)"
    c.outcome = c.error_type = NOT_SENT
    c.error = "not sent: " + a.error
    c.reply = b"e" * 90
    c.t_done = a.t_reply + ms(0.03)
    c.t_write = c.t_done + ms(0.005)
    c.t_handed = c.t_write + ms(0.01)
    c.t_acked = c.t_write + ms(0.2)
    return c


def call_connect_timeout_retry() -> Call:
    """Attempt 1's connect to EP1 hangs until connect_timeout 300 ms; 50 ms backoff; attempt 2 on EP2 works."""
    c = Call(CONN, FakeMsg(), BASE, BASE + ms(0.1))
    c.route = route()
    a1 = attempt(c, EP1, 1, 0.101, acquire=None, outcome=NOT_SENT)
    a1.t_reply = a1.t_acquire + ms(300)
    a1.error = "connect to 127.0.0.1:9191 timed out after 300ms"
    b0 = a1.t_reply + ms(0.01)
    c.backoffs.append((b0, b0 + ms(50)))
    a2 = attempt(c, EP2, 2, (b0 + ms(50) - BASE) / 1e6 + 0.01, acquire=0.3)
    a2.retry_reason = NOT_SENT
    c.written = True
    c.outcome = SUCCESS
    c.reply = b"r" * 300
    c.t_done = a2.t_reply + ms(0.02)
    c.t_write = c.t_done + ms(0.005)
    c.t_handed = c.t_write + ms(0.01)
    c.t_acked = c.t_write + ms(0.2)
    return c


def call_gone_while_waiting() -> Call:
    """The client resets 200 ms into a wait for a connection: the pipeline ends the attempt without
    a t_reply (cancel), the call at t_done; no reply is written."""
    c = Call(CONN, FakeMsg(), BASE, BASE + ms(0.1))
    c.route = route()
    attempt(c, EP1, 1, 0.101, acquire=None, outcome=NOT_SENT)
    c.cancelled = True
    c.outcome = c.error_type = CLIENT_GONE
    c.error = "the client closed its connection while it waited for a connection"
    c.t_done = c.attempts[0].t_acquire + ms(200)
    return c


def call_never_read() -> Call:
    """The kernel took a 52 KB reply at once; the client never read it: the listener gave up at
    its 60 s cap, stamped t_acked then and marked the call never_read."""
    c = call_success()
    c.t_handed = c.t_write + ms(0.02)
    c.t_acked = c.t_write + ms(60_000)
    c.never_read = True
    return c


def test_fixtures_are_time_ordered():
    for make in (call_success, call_declared, call_retry, call_timeout, call_queued, call_oneway,
                 call_streamed, call_acquire_timeout, call_connect_timeout_retry, call_gone_while_waiting,
                 call_never_read):
        c = make()
        assert c.t_start < c.t_framed
        prev = c.t_framed
        for a in c.attempts:
            stamps = [t for t in (a.t_acquire, a.t_acquired, a.t_written, a.t_first_reply, a.t_reply) if t]
            assert stamps == sorted(stamps) and stamps[0] >= prev, make.__name__
            prev = stamps[-1]
