"""Upstream connection pool per (endpoint, framing, protocol, TLS): the `acquire` hop.

LIFO idle list (the warmest connection first; the coldest age out), a bound on
open connections, a connect deadline, idle eviction, a maximum age (`max_age`: closed when
released past it, less up to `AGE_JITTER`), and one queue of waiters
served oldest first: a connection that comes free, or a new one, goes to the
call that has waited longest, whichever call's connect opened it (as Envoy's
pools do). Calls so get connections in the order they asked, and two calls a
client sends back to back while the pool connects leave in that order (a oneway
frees its connection once written: the next call goes out on it). A waiter counts on a connect it started (and gets its error if it fails),
else on a connection coming free within `acquire_timeout`.

Acquiring is a plain call on the hot path: an idle connection is returned at
once; only a new connection (a connect, amortised over many calls) or a full
pool makes the caller wait for a callback.

Every connect is the pool's to report, whether or not its caller still waits
(a per-try or route timeout shorter than `connect_timeout` stops waiting
first): `on_connect_start()` / `on_connect_end(ok)`, set by the owner
(`proxy.cluster`, which counts a connect in progress as load on the endpoint
and a failed one against its breaker), and a log line for a failure, a
timeout as much as a refusal (the first at once, then at most one per
`WARN_EVERY` per pool and reason, with a count of those held back: an endpoint
that refuses every connect under load does not flood the log; a count no next
line will carry is said when a connect succeeds or the pool closes). The error handed to a waiter then says
`endpoint_fault=False`: the failure was reported once, here, and the caller's
attempt must not count it again.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import ssl as ssl_mod
from collections import deque
from dataclasses import dataclass
from time import monotonic
from typing import Callable

from proxy.clock import STALL_GRACE
from proxy.codec import Framing, Protocol
from proxy.logs import Throttle
from proxy.upstream import UpstreamConnection, UpstreamError

log = logging.getLogger(__name__)

AGE_JITTER = 0.1  # a connection's max_age is cut by up to this share: a pool's connections age out apart
WARN_EVERY = 5.0  # seconds between two warnings of one kind (the same reason) about one pool's endpoint
# A connect that fails for want of the proxy's own resources (file descriptors, memory,
# ephemeral ports) says nothing about the endpoint: not counted against its breaker.
LOCAL_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL))


def describe_connect_error(e: BaseException, tls: bool) -> str:
    """Why a connect (and TLS handshake) failed, never empty: an upstream that closes during the
    TLS handshake raises ConnectionResetError('') (no errno, no text)."""
    reason = (e.strerror if isinstance(e, OSError) else None) or str(e)
    if isinstance(e, OSError) and e.errno in LOCAL_ERRNOS:
        return f"{reason} (the proxy's own limit, not the endpoint's fault)"
    if tls and isinstance(e, (ConnectionResetError, ConnectionAbortedError, EOFError)):
        # (TCP was up: a refused or unreachable connect is a different error) - the usual cause
        # is an endpoint that does not speak TLS
        return (f"{reason or type(e).__name__} during the TLS handshake (closed by the endpoint; "
                "does it speak TLS?)")
    return reason or type(e).__name__


@dataclass(frozen=True, slots=True)
class PoolSettings:
    max_connections: int = 64
    idle_timeout: float = 30.0
    acquire_timeout: float = 1.0
    max_age: float = 0.0  # 0 = none
    connect_timeout: float = 0.25
    max_reply_size: int = 16_384_000
    stream_threshold: int = 64 << 10  # larger replies stream to the client as they arrive


class Connect:
    """A connect in flight, and the waiter counting on it (whose it is to fail, if it fails)."""

    __slots__ = ("owner",)

    def __init__(self, owner: Waiter | None) -> None:
        self.owner = owner


class Waiter:
    """A caller waiting for a connection: `callback(conn, error)` runs once."""

    __slots__ = ("callback", "owner", "timer", "done", "queue", "connect")

    def __init__(self, callback, owner=None) -> None:
        self.callback = callback
        self.owner = owner  # the client (connection) the call is for: Pool's fair share of held replies
        self.timer: asyncio.TimerHandle | None = None  # acquire_timeout, when it waits for a release
        self.done = False
        self.queue: deque | None = None  # the pool's waiters, while it waits in them
        self.connect: Connect | None = None  # the connect it counts on, while one is in flight

    def cancel(self) -> None:
        """The caller gave up: out of the pool's queue at once (it would otherwise hold its call
        there, and count as waiting, until a connection came free)."""
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        queue = self.queue
        if queue is not None:
            self.queue = None
            try:
                queue.remove(self)
            except ValueError:
                pass

    def fire(self, conn, error) -> bool:
        if self.done:
            return False
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        queue = self.queue
        if queue is not None:  # (an error: a waiter served was taken off the queue first)
            self.queue = None
            try:
                queue.remove(self)
            except ValueError:
                pass
        self.callback(conn, error)
        return True


class Pool:
    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, framing: Framing,
                 protocol: Protocol, settings: PoolSettings, ssl: ssl_mod.SSLContext | None = None,
                 server_hostname: str | None = None) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        self.framing = framing
        self.protocol = protocol
        self.settings = settings
        self.ssl = ssl
        self.server_hostname = server_hostname
        self.label = f"{host}:{port}"
        self.warnings = Throttle(WARN_EVERY)  # its connects' failures, its connections' TLS refusals (per reason)
        self.idle: list[UpstreamConnection] = []
        self.open = 0            # connections open or connecting
        self.connecting = 0
        self.waiters: deque[Waiter] = deque()
        self.held: set[UpstreamConnection] = set()  # busy holding a large reply unread for its turn
        self.closed = False
        self._sweep: asyncio.TimerHandle | None = None
        # The owner's (proxy.cluster) hooks: a connect started; it ended (ok or failed), whether
        # or not a caller still waits for it. With on_connect_end set, the pool is where a failed
        # connect is counted against the endpoint (its errors to waiters say endpoint_fault=False).
        self.on_connect_start: Callable[[], None] | None = None
        self.on_connect_end: Callable[[bool | None], None] | None = None  # ok; None: cancelled
        self.on_refused: Callable[[], None] | None = None  # a connection refused after oneways went out on it
        self.stats = {"connects": 0, "connect_failures": 0, "acquire_timeouts": 0, "evicted": 0, "aged_out": 0,
                      "oneways_refused": 0,  # oneways written on a connection the upstream's TLS then refused
                      # large messages passed by splice(2) (proxy.splice), or not (no fd or pipe to be had)
                      "spliced_replies": 0, "spliced_requests": 0, "spliced_bytes": 0, "splice_failures": 0}

    # -- the acquire hop ------------------------------------------------------

    def try_acquire(self) -> UpstreamConnection | None:
        """An idle connection, or None (then call `acquire`)."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.closed_by_peer():
                return conn
        return None

    def acquire(self, callback, owner=None) -> Waiter:
        """Arrange `callback(conn, error)`: a new connection, or the next one released.
        `owner`: the client the call is for (its held replies' share of the pool: `relieve`)."""
        w = Waiter(callback, owner)
        if self.closed:
            self.loop.call_soon(w.fire, None, UpstreamError(f"pool for {self.label} is closed", written=False,
                                                            endpoint_fault=False))
            return w
        w.queue = self.waiters
        self.waiters.append(w)
        if self.open < self.settings.max_connections:
            self._start_connect(w)
        else:
            self._wait_for_release(w)
        return w

    def _wait_for_release(self, w: Waiter) -> None:
        """`w` counts on no connect: a busy connection must come free within acquire_timeout."""
        w.timer = self.loop.call_later(self.settings.acquire_timeout, self._acquire_timeout, w)
        self.relieve()

    def relieve(self) -> None:
        """Calls wait for a connection: a connection holding a large reply unread for its turn
        (only to spare the proxy's memory) reads it whole instead, then serves them, if the
        memory for replies waiting their turn allows (smallest first). When it does not, the
        smallest is read whole all the same (past the budget) when
        - every connection of the pool holds a reply: none of them would come free by itself
          (the calls they wait behind may be the very calls waiting here: a retry of a client's
          earlier call, behind its own later call's reply); or
        - one client's held replies take more than its share of the pool (`share`) while a call
          of a client under its share waits: one client pipelining large calls behind a slow one
          must not starve the others out of the pool. The connection freed goes to that call
          (`_serve`), and a client at its share gets no more while others wait: so one reply is
          read past the budget per call of another client's, not one per call of its own."""
        if not self.held or not self.waiters:
            return
        held = sorted(self.held, key=lambda c: c.held_size())
        for conn in held:
            if conn.read_held_whole():
                return
        if len(held) >= self.open:
            held[0].read_held_whole(force=True)
            return
        counts = self._holders()
        share = self.share()
        greedy = max(counts, key=counts.__getitem__)
        if counts[greedy] > share and any(not w.done and counts.get(w.owner, 0) < share for w in self.waiters):
            for conn in held:
                if conn.held_owner() is greedy and conn.read_held_whole(force=True):
                    return

    def share(self) -> int:
        """Connections of this pool one client's held replies may keep while others' calls wait."""
        return max(1, self.settings.max_connections // 2)

    def _holders(self) -> dict:
        """Held connections (`held`) by the client their reply is for."""
        counts: dict = {}
        for conn in self.held:
            owner = conn.held_owner()
            counts[owner] = counts.get(owner, 0) + 1
        return counts

    def _fair_waiter(self) -> Waiter | None:
        """The oldest waiter whose client holds fewer than its share of held connections, taken
        off the queue, when another client holds its share or more; None: serve the oldest."""
        counts = self._holders()
        share = self.share()
        if max(counts.values()) < share:
            return None
        for w in self.waiters:
            if not w.done and counts.get(w.owner, 0) < share:
                self.waiters.remove(w)
                return w
        return None

    def release(self, conn: UpstreamConnection) -> None:
        if conn.closed:
            return
        expires = conn.expires
        if expires and monotonic() >= expires:
            self.stats["aged_out"] += 1
            conn.abandon()  # (its exchange is over; forget() offers its slot to any waiter: a new connection)
            return
        if conn.paused:
            # A stream's last chunk can fill the client's buffer, pausing this connection's
            # reading (backpressure) just as it finishes: never lend out a paused connection.
            conn.resume_reading()
        if self.waiters and not conn.closed_by_peer() and self._serve(conn, None):
            return  # (closed by the upstream: discarded, and forget() offered its slot to the waiters)
        if conn.closed or conn.settling is not None:
            return  # (set aside until the loop read its unread TLS bytes: _settled releases it)
        if self.closed:
            conn.abandon()
            return
        conn.idle_since = monotonic()
        self.idle.append(conn)
        if self._sweep is None and self.settings.idle_timeout > 0:
            self._sweep = self.loop.call_later(self.settings.idle_timeout, self._evict)

    def _serve(self, conn: UpstreamConnection, made: Connect | None) -> bool:
        """Hand `conn` (released, or new from connect `made`) to the oldest waiter; False if
        none waits. Each waiter still waiting keeps a connect to count on, or an acquire
        deadline: the oldest may be served before its own connect ends (that connect is then
        counted on by the waiter `made` was for), or may have counted on none (then `made`'s
        waiter now waits for a release)."""
        waiters = self.waiters
        w = self._fair_waiter() if self.held and len(waiters) > 1 else None
        if w is not None:
            w.queue = None
        else:
            while waiters:
                w = waiters.popleft()
                w.queue = None
                if not w.done:
                    break
            else:
                return False
        heir = made.owner if made is not None else None
        if heir is w or (heir is not None and heir.done):
            heir = None
        own = w.connect
        w.connect = None
        if own is not None and own is not made:
            own.owner = heir
            if heir is not None:
                heir.connect = own
        elif heir is not None:
            heir.connect = None
            self._wait_for_release(heir)
            self._offer_slots()  # (a slot may be free for it after all: a connect, not a wait)
        w.fire(conn, None)
        return True

    def forget(self, conn: UpstreamConnection) -> None:
        """A connection closed (by either side): drop it from the counts."""
        self.open -= 1
        try:
            self.idle.remove(conn)
        except ValueError:
            pass
        self._offer_slots()

    def oneways_refused(self, alert: str, n: int) -> None:
        """A connection's TLS 1.3 server refused the proxy (its certificate) before any reply,
        after `n` oneway calls were written on it: they never reached the service, and nobody
        waits to be told. Logged, counted, and the endpoint's failure, as a failed connect is."""
        self.stats["oneways_refused"] += n
        self.warnings.warn(log, ("refused oneways", alert),
                           "upstream %s refused the proxy's TLS connection (%s): %d oneway call(s) written on it "
                           "never reached the service", self.label, alert, n)
        if self.on_refused is not None:
            self.on_refused()

    def _offer_slots(self) -> None:
        """A slot freed (a connection closed, a connect failed): waiters counting on a release
        may now open a connection."""
        if self.waiters and self.open < self.settings.max_connections and not self.closed:
            for w in list(self.waiters):
                if self.open >= self.settings.max_connections:
                    break
                if w.done or w.connect is not None:
                    continue
                if w.timer is not None:
                    w.timer.cancel()
                    w.timer = None
                self._start_connect(w)

    # -- lifecycle work (tasks are fine here: not per call) --------------------

    def _start_connect(self, w: Waiter) -> None:
        self.open += 1
        self.connecting += 1
        if self.on_connect_start is not None:
            self.on_connect_start()
        w.connect = made = Connect(w)
        self.loop.create_task(self._connect(made))

    async def _connect(self, made: Connect) -> None:
        s = self.settings
        try:
            conn = await self._open(s)
        except asyncio.CancelledError:  # the loop is going away: says nothing about the endpoint
            self.connecting -= 1
            self.open -= 1
            if self.on_connect_end is not None:
                self.on_connect_end(None)
            raise
        except Exception as e:  # OSError (TimeoutError too), SSLError, UnicodeError (a host IDNA refuses)
            timeout = isinstance(e, TimeoutError) and e.errno is None  # our deadline (else the kernel's)
            self._connect_failed(made, (f"timed out after {s.connect_timeout * 1000:.0f}ms"
                                        + (" (TCP connect and TLS handshake)" if self.ssl is not None else ""))
                                 if timeout
                                 else f"failed: {describe_connect_error(e, self.ssl is not None)}", timeout,
                                 local=isinstance(e, OSError) and e.errno in LOCAL_ERRNOS)
            return
        if conn.closed:
            # Closed before it was ours to count (`owned`): the upstream sent bytes unasked, or
            # reset it, while the connect task had yet to resume. Never handed out as a connection.
            self._connect_failed(made, "failed: the upstream closed the new connection before any "
                                       "request (it sent bytes unasked, or reset it)", False)
            return
        self.connecting -= 1
        if self.on_connect_end is not None:
            self.on_connect_end(True)
        self.stats["connects"] += 1
        # (the connect failures' lines: keyed by their reason, a str; TLS refusals by a tuple)
        self.warnings.say_held(log, "before a connect succeeded", lambda key: isinstance(key, str))
        conn.owned = True
        if s.max_age > 0:
            conn.expires = monotonic() + s.max_age * (1 - AGE_JITTER * random.random())
        if not self._serve(conn, made):
            # Nobody waits (its caller gave up, or was served sooner): keep it for the next one.
            self.release(conn)

    def _connect_failed(self, made: Connect, reason: str, timeout: bool, local: bool = False) -> None:
        """A connect ended without a connection: counted, logged (throttled), told to the owner
        (and first to the endpoint's hooks: a failure may open the breaker, and a retry then
        picks another endpoint); its slot goes to a waiter counting on a release. `local`: the
        proxy ran out of its own resources (LOCAL_ERRNOS), which is no failure of the endpoint's."""
        self.connecting -= 1
        self.open -= 1
        self.stats["connect_failures"] += 1
        self.warnings.warn(log, reason, "connect to %s %s", self.label, reason)
        if self.on_connect_end is not None:
            self.on_connect_end(None if local else False)
        w = made.owner
        if w is not None:
            w.connect = None
            w.fire(None, UpstreamError(f"connect to {self.label} {reason}", written=False, timeout=timeout,
                                       endpoint_fault=self.on_connect_end is None and not local))
        self._offer_slots()

    async def _open(self, s: PoolSettings) -> UpstreamConnection:
        """Connect (and TLS handshake) within `connect_timeout` of the loop's own time.

        A deadline timer that fires late because the event loop itself was stalled (a slow
        callback, a GC pause, the GIL held by another thread) would otherwise count a connect
        that completed meanwhile as timed out: libuv runs due timers before it polls for I/O.
        So a deadline passed by more than STALL_GRACE is extended once by how late it was;
        a connect that is really slow still times out. (A timeout counts against the breaker.)
        """
        loop = self.loop
        limit = s.connect_timeout
        async with asyncio.timeout(None) as cm:
            timer = None

            def check(deadline: float, extended: bool) -> None:
                nonlocal timer
                late = loop.time() - deadline
                if extended or late <= STALL_GRACE:
                    cm.reschedule(loop.time())  # expire now: the connect is cancelled
                    return
                again = loop.time() + min(late, limit)  # the loop was stalled that long
                timer = loop.call_at(again, check, again, True)

            first = loop.time() + limit
            timer = loop.call_at(first, check, first, False)
            try:
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, self.framing, self.protocol, s.max_reply_size,
                                               s.stream_threshold),
                    self.host, self.port, ssl=self.ssl,
                    server_hostname=self.server_hostname if self.ssl else None)
            finally:
                timer.cancel()
        return conn

    def _acquire_timeout(self, w: Waiter) -> None:
        self.stats["acquire_timeouts"] += 1
        w.timer = None
        w.fire(None, UpstreamError(
            f"no connection to {self.label} within acquire_timeout "
            f"{self.settings.acquire_timeout * 1000:.0f}ms ({self.busy()} busy, {self.connecting} connecting, "
            f"max_connections {self.settings.max_connections})",
            written=False, timeout=True, endpoint_fault=False))

    def _evict(self) -> None:
        self._sweep = None
        limit = monotonic() - self.settings.idle_timeout
        idle = self.idle
        # LIFO: the oldest idle connections sit at the front.
        while idle and idle[0].idle_since <= limit:
            conn = idle.pop(0)
            self.stats["evicted"] += 1
            conn.abandon()
        if idle:
            delay = max(idle[0].idle_since - limit, 0.05)
            self._sweep = self.loop.call_later(delay, self._evict)

    def close(self) -> None:
        """Close idle connections now; busy ones close when their exchange ends."""
        self.closed = True
        self.warnings.say_held(log, "before its pool closed")
        if self._sweep is not None:
            self._sweep.cancel()
        for conn in list(self.idle):
            conn.abandon()
        self.idle.clear()
        while self.waiters:
            self.waiters.popleft().fire(None, UpstreamError(f"pool for {self.label} closed", written=False,
                                                            endpoint_fault=False))

    def busy(self) -> int:
        """Connections lent to a call now (open, not connecting, not idle)."""
        return self.open - self.connecting - len(self.idle)

    def snapshot(self) -> dict:
        return {"endpoint": self.label, "framing": self.framing.value, "protocol": self.protocol.value,
                "open": self.open, "idle": len(self.idle), "connecting": self.connecting,
                "busy": self.busy(), "waiting": len(self.waiters),
                **self.stats}
