"""The pool's one queue of waiters, on real sockets: a connection goes to the call that has waited
longest, whichever call's connect opened it.

A connect can be made to hang: a listener whose accept queue is full (listen(0) and one
connection not accepted) drops SYNs, and the client's kernel sends its SYN again only after
about a second. Accepting the queued connection then lets the next connect through at once, so
the connect started second ends first.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvloop

from proxy.codec import Framing, Protocol
from proxy.pool import Pool, PoolSettings


class Blocked:
    """A listener whose next connect hangs (its accept queue is full) until `open_up()`."""

    def __init__(self) -> None:
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(0)
        self.port = self.ls.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.filler = socket.create_connection(("127.0.0.1", self.port))  # fills the queue

    def open_up(self) -> None:
        """Take what the queue holds: the next SYN gets through (one sent earlier waits for its
        kernel to send it again)."""
        self.ls.setblocking(False)
        while True:
            try:
                self.accepted.append(self.ls.accept()[0])
            except BlockingIOError:
                return

    def close(self) -> None:
        for s in (self.filler, self.ls, *self.accepted):
            s.close()


def _run(body, **settings):
    """Run `body(pool, blocked, record)` on a uvloop loop; `record(name)` is an acquire callback
    that logs (name, conn, error, seconds since the start) into the list it returns with."""
    blocked = Blocked()

    async def main():
        loop = asyncio.get_running_loop()
        pool = Pool(loop, "127.0.0.1", blocked.port, Framing.FRAMED, Protocol.BINARY, PoolSettings(**settings))
        log: list = []
        t0 = time.monotonic()

        def record(name):
            return lambda conn, err: log.append((name, conn, err, time.monotonic() - t0))

        try:
            return await body(pool, blocked, record, log)
        finally:
            pool.close()

    try:
        return uvloop.run(main())
    finally:
        blocked.close()


async def _until(cond, within: float = 6.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def test_first_connection_goes_to_the_first_waiter_and_the_second_follows_on_it():
    """Two calls back to back (a oneway, then a call) while the pool connects: the second
    connect ends first. Its connection serves the first call; released, it serves the second:
    they leave in the order they came, on one connection, and neither waits for the hung SYN."""

    async def body(pool, blocked, record, log):
        pool.acquire(record("first"))
        await asyncio.sleep(0.1)          # its SYN was dropped: the kernel resends it in ~1 s
        blocked.open_up()
        pool.acquire(record("second"))
        await _until(lambda: log)
        ((name, conn, err, at),) = log
        assert (name, err) == ("first", None) and at < 0.8, log  # not ~1 s: its own SYN's resend
        blocked.open_up()                 # (the second's connection filled the queue again)
        pool.release(conn)                # (a oneway: free once written)
        await _until(lambda: len(log) == 2)
        assert log[1][:3] == ("second", conn, None), log
        pool.release(conn)
        await _until(lambda: len(pool.idle) == 2)  # the hung connect ended too: kept idle
        return pool.snapshot()

    snap = _run(body, connect_timeout=5.0)
    assert (snap["open"], snap["idle"], snap["connecting"], snap["waiting"]) == (2, 2, 0, 0), snap


def test_a_failed_connect_is_for_the_waiter_left_counting_on_it():
    """The second connect serves the first waiter; the first connect then times out: the
    second waiter, which now counts on it, gets that error (and the served call keeps its
    connection)."""

    async def body(pool, blocked, record, log):
        pool.acquire(record("first"))
        await asyncio.sleep(0.05)
        blocked.open_up()
        pool.acquire(record("second"))
        await _until(lambda: len(log) == 2, within=3.0)
        return log, pool.snapshot()

    log, snap = _run(body, connect_timeout=0.4)
    (first, second) = log
    assert first[0] == "first" and first[1] is not None and first[2] is None, log
    assert second[0] == "second" and second[1] is None, log
    assert second[2].message.endswith("timed out after 400ms") and second[2].timeout, second[2].message
    assert (snap["open"], snap["connecting"], snap["waiting"]) == (1, 0, 0), snap


def test_a_waiter_served_by_a_release_leaves_its_connect_to_the_pool():
    """A call waits for its own (hung) connect; a busy connection comes free first and serves it.
    Its connect, when it ends, is nobody's: the connection goes idle; no second callback."""

    async def body(pool, blocked, record, log):
        blocked.open_up()
        pool.acquire(record("busy"))
        await _until(lambda: log)
        busy = log[0][1]                  # (its connection, not accepted, fills the queue again)
        pool.acquire(record("waiting"))
        await asyncio.sleep(0.1)          # its SYN was dropped
        assert len(log) == 1
        pool.release(busy)
        await _until(lambda: len(log) == 2)
        assert log[1][:3] == ("waiting", busy, None), log
        blocked.open_up()
        await _until(lambda: len(pool.idle) == 1 and pool.connecting == 0)
        await asyncio.sleep(0.05)
        assert len(log) == 2, log
        return pool.idle[0] is not busy

    assert _run(body, connect_timeout=5.0)


@pytest.mark.parametrize("then", ["connect", "close"])
def test_connect_failures_held_back_are_counted_when_no_more_will_come(caplog, then):
    """Refused connects within WARN_EVERY make one log line; once a connect succeeds (the endpoint
    is back), or the pool closes, the count of those held back is said: it would otherwise wait
    for a next failure that may never come."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connects are refused

        async def main():
            loop = asyncio.get_running_loop()
            pool = Pool(loop, "127.0.0.1", port, Framing.FRAMED, Protocol.BINARY, PoolSettings())
            try:
                for _ in range(4):
                    got = loop.create_future()
                    pool.acquire(lambda conn, err: got.set_result((conn, err)))
                    conn, err = await got
                    assert conn is None and "refused" in err.message, err
                if then == "connect":
                    probe.listen(8)
                    got = loop.create_future()
                    pool.acquire(lambda conn, err: got.set_result((conn, err)))
                    conn, err = await got
                    assert err is None and conn is not None
            finally:
                pool.close()

        with caplog.at_level("WARNING", logger="proxy.pool"):
            uvloop.run(main())
    when = "before a connect succeeded" if then == "connect" else "before its pool closed"
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy.pool"]
    assert lines == [f"connect to 127.0.0.1:{port} failed: Connection refused",
                     f"connect to 127.0.0.1:{port} failed: Connection refused: 3 more times since the "
                     f"last such line, {when}"], lines


def test_a_connection_closed_before_the_connect_resumed_is_a_failed_connect():
    """An upstream that writes at once (a banner, another protocol on that port): the proxy
    closes a connection that talks unasked. When that happens before the pool's connect task
    resumes (the loop busy), the connection was handed to the waiter closed, answered "may have
    run" though nothing was written, and counted in `open` for good (every slot leaked, every call
    then waited out acquire_timeout). Now: a failed connect, "not sent", the slot freed."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(8)
        port = ls.getsockname()[1]

        def serve():
            c, _ = ls.accept()
            with c:
                c.sendall(b"220 hello\r\n")
                time.sleep(1)

        server = threading.Thread(target=serve, daemon=True)
        server.start()

        async def main():
            loop = asyncio.get_running_loop()
            pool = Pool(loop, "127.0.0.1", port, Framing.FRAMED, Protocol.BINARY,
                        PoolSettings(max_connections=1, connect_timeout=2.0))
            got = loop.create_future()
            pool.acquire(lambda conn, err: got.set_result((conn, err)))
            loop.call_soon(time.sleep, 0.3)  # the loop busy: the banner is read before the task resumes
            conn, err = await got
            snap = pool.snapshot()
            pool.close()
            return conn, err, snap

        conn, err, snap = uvloop.run(main())
        server.join(3)
    assert conn is None and err is not None and not err.written, (conn, err)
    assert err.message == (f"connect to 127.0.0.1:{port} failed: the upstream closed the new connection "
                           "before any request (it sent bytes unasked, or reset it)"), err.message
    assert (snap["open"], snap["busy"], snap["connect_failures"]) == (0, 0, 1), snap


def test_a_failed_connect_frees_its_slot_for_a_call_waiting_for_a_release():
    """max_connections 1: the first call's connect hangs and times out (400 ms); the second call,
    waiting for a connection to come free, gets the freed slot's connect at once, not an
    acquire_timeout error naming a busy connection that does not exist."""

    async def body(pool, blocked, record, log):
        pool.acquire(record("first"))
        await asyncio.sleep(0.05)
        pool.acquire(record("second"))   # the pool is full: it waits for a release
        await asyncio.sleep(0.1)
        blocked.open_up()                # the next connect gets through
        await _until(lambda: len(log) == 2, within=3.0)
        return log

    log = _run(body, max_connections=1, connect_timeout=0.4, acquire_timeout=2.0)
    (first, second) = log
    assert first[0] == "first" and first[2] is not None and first[2].message.endswith("timed out after 400ms")
    assert second[0] == "second" and second[2] is None and second[1] is not None, second
    assert second[3] < 1.5, second  # not acquire_timeout (2 s)


def test_a_host_the_resolver_cannot_encode_fails_the_connect():
    """A host IDNA cannot encode (`create_connection` raises UnicodeError, neither OSError nor
    SSLError) was taken for a cancellation: the waiter never answered, the slot leaked. (Config
    refuses such names now; a resolver or discovery could still hand one over.)"""

    async def main():
        loop = asyncio.get_running_loop()
        pool = Pool(loop, "a" * 64 + ".local", 9, Framing.FRAMED, Protocol.BINARY, PoolSettings())
        got = loop.create_future()
        pool.acquire(lambda conn, err: got.set_result((conn, err)))
        conn, err = await asyncio.wait_for(got, 5)
        snap = pool.snapshot()
        pool.close()
        return conn, err, snap

    conn, err, snap = uvloop.run(main())
    assert conn is None and err is not None and not err.written and "failed: " in err.message, err
    assert (snap["open"], snap["connect_failures"]) == (0, 1), snap


def test_a_connection_past_max_age_closes_when_its_call_ends_and_the_next_call_gets_a_new_one():
    """pool.max_age: calls within the age share one connection; one past it finishes on it
    (never cut mid-call), then the connection closes and the next call opens another: what
    spreads calls again over the pods behind one Service address. Without it: one connection
    for ever."""
    from harness import Proxy, ThriftServer, client, config_text

    up = ThriftServer()
    try:
        text = config_text([up.address], extra_cluster="\n    pool: {max_age: 1s}")  # (5 lookups: well within 0.9 s)
        with Proxy(text) as p, client(p.port()) as c:
            assert [c.lookup(f"k{i}") for i in range(5)] == [f"upstream:k{i}" for i in range(5)]
            (endpoint,) = p.server.clusters["up"].endpoints
            (pool,) = endpoint.pools.values()
            assert up.connections == 1
            assert c.sleep(1100) == 1100  # outlives its connection's age: answered all the same
            assert pool.stats["aged_out"] == 1
            assert c.lookup("after") == "upstream:after"
            assert up.connections == 2 and pool.stats["connects"] == 2
    finally:
        up.stop()


def test_max_age_is_cut_by_up_to_a_tenth_so_a_pools_connections_do_not_all_go_at_once():
    """Each connection's deadline is its connect time plus max_age less up to AGE_JITTER of it."""
    from proxy.pool import AGE_JITTER
    from proxy.upstream import UpstreamConnection

    async def main():
        loop = asyncio.get_running_loop()
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(64)
        pool = Pool(loop, "127.0.0.1", ls.getsockname()[1], Framing.FRAMED, Protocol.BINARY,
                    PoolSettings(max_connections=64, max_age=100.0))
        got: list[UpstreamConnection] = []
        for _ in range(40):
            fut = loop.create_future()
            pool.acquire(lambda conn, err: fut.set_result((conn, err)))
            conn, err = await fut
            assert err is None
            got.append(conn)
        now = time.monotonic()
        ages = [conn.expires - now for conn in got]
        pool.close()
        for conn in got:
            conn.abandon()
        ls.close()
        return ages

    ages = uvloop.run(main())
    assert all(100 * (1 - AGE_JITTER) - 1 <= a <= 100 for a in ages), ages
    assert max(ages) - min(ages) > 2  # spread (40 draws within one tenth of 100 s)
