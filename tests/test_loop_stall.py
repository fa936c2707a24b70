"""Deadlines on a real uvloop loop: a stall of the proxy's own loop is not the upstream's slowness.

libuv runs due timers before it polls for I/O, so after the loop itself was stalled (a slow
callback, a GC pause, another thread holding the GIL) a plain deadline timer fires before the
completion of a connect that succeeded meanwhile, or before the reply that arrived meanwhile is
read: a healthy endpoint's call counts as timed out (and against its breaker). proxy.pool extends
a connect deadline passed that late, once; proxy.pipeline looks at I/O once more before a route
or per-try timeout stands (clock.STALL_GRACE).
"""

from __future__ import annotations

import asyncio
import socket
import time

import uvloop

from harness import Proxy, ThriftServer, client, config_text, wait_for
from proxy.codec import Framing, Protocol
from proxy.pool import Pool, PoolSettings


def _acquire_with_stall(port: int, stall: float, connect_timeout: float = 0.25):
    """Acquire a new connection, stall the loop for `stall` s right after the connect starts:
    (connection, error, seconds until the callback)."""

    async def main():
        loop = asyncio.get_running_loop()
        pool = Pool(loop, "127.0.0.1", port, Framing.FRAMED, Protocol.BINARY,
                    PoolSettings(connect_timeout=connect_timeout))
        got = loop.create_future()
        t0 = time.monotonic()
        pool.acquire(lambda conn, err: got.set_result((conn, err)))
        await asyncio.sleep(0)  # the pool's connect task starts (its deadline armed)...
        await asyncio.sleep(0)  # ...and the connect itself
        time.sleep(stall)       # the loop is stalled
        conn, err = await got
        took = time.monotonic() - t0
        pool.close()
        return conn, err, took

    return uvloop.run(main())


def test_connect_that_completed_during_a_loop_stall_is_not_a_timeout():
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(8)
        conn, err, took = _acquire_with_stall(ls.getsockname()[1], stall=0.5)
    assert err is None and conn is not None, err and err.message
    assert took < 2.0


def test_connect_that_hangs_still_times_out_stall_or_not():
    """A listener whose accept queue is full drops SYNs: the connect hangs."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(0)
        port = ls.getsockname()[1]
        fillers = []
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        time.sleep(0.1)
        try:
            for stall in (0.0, 0.5):
                conn, err, took = _acquire_with_stall(port, stall=stall, connect_timeout=0.2)
                assert conn is None and err is not None
                assert err.message == f"connect to 127.0.0.1:{port} timed out after 200ms" and err.timeout
                # no stall: the deadline itself; a stall: extended once, by at most connect_timeout
                # (after the stall, libuv's first poll still waits on its pre-stall clock)
                assert 0.19 <= took <= stall + 3 * 0.2 + 1.0, (stall, took)
        finally:
            for c in fillers:
                c.close()


def _stall_proxy_loop(p: Proxy, seconds: float) -> None:
    """Stall the proxy's loop inside an I/O callback (as a slow data_received, or another thread
    holding the GIL, would): the next loop iteration runs its due timers before it polls again."""
    r, w = socket.socketpair()

    def stall() -> None:
        p.loop.remove_reader(r.fileno())
        r.recv(1)
        time.sleep(seconds)
        r.close()

    p.loop.call_soon_threadsafe(p.loop.add_reader, r.fileno(), stall)
    time.sleep(0.01)
    w.send(b"x")
    w.close()


def test_reply_that_arrived_during_a_loop_stall_beats_the_route_timeout():
    """The upstream answers in 100 ms; the proxy's loop stalls from then past the 300 ms route
    deadline. The reply is in its socket when the stall ends: the client gets it, not a timeout."""
    up = ThriftServer()
    up.handler.sleep_ms = 100
    text = config_text([up.address]).replace("      - cluster: up\n", "      - cluster: up\n        timeout: 300ms\n")
    try:
        with Proxy(text) as p, client(p.port()) as c:
            assert c.lookup("warm") == "upstream:warm"  # the connection is pooled
            stats = p.server.listeners["test"].pipeline.stats
            results = []
            t = __import__("threading").Thread(target=lambda: results.append(c.lookup("a")))
            t.start()
            wait_for(lambda: up.handler.calls >= 2, 5, "the call upstream")
            _stall_proxy_loop(p, 0.6)
            t.join(10)
            assert results == ["upstream:a"], results
            assert stats["timeouts"] == 0
    finally:
        up.stop()


def test_route_timeout_still_fires_after_a_loop_stall():
    """No reply at all: the timeout stands, about one I/O poll after the stall."""
    up = ThriftServer()
    up.handler.sleep_ms = 2000
    text = config_text([up.address]).replace("      - cluster: up\n", "      - cluster: up\n        timeout: 300ms\n")
    try:
        with Proxy(text) as p, client(p.port()) as c:
            errors = []

            def call() -> None:
                t0 = time.monotonic()
                try:
                    c.lookup("a")
                except Exception as e:  # noqa: BLE001 - the timeout is the point
                    errors.append((getattr(e, "message", str(e)), time.monotonic() - t0))

            t = __import__("threading").Thread(target=call)
            t.start()
            wait_for(lambda: up.handler.calls >= 1, 5, "the call upstream")
            _stall_proxy_loop(p, 0.6)
            t.join(10)
    finally:
        up.stop()
    ((message, took),) = errors
    assert "route timeout 300ms" in message
    assert 0.29 <= took < 1.5, took


def test_a_connect_cancelled_after_it_completed_is_uncounted_once():
    """The deadline can cancel a connect whose connection was just made (the same loop turn):
    uvloop then closes it and its connection_lost runs. The pool's connect path uncounts that
    connection; connection_lost must not do it again (the pool would then open one too many)."""
    from proxy.upstream import UpstreamConnection

    async def main():
        loop = asyncio.get_running_loop()
        pool = Pool(loop, "127.0.0.1", 9, Framing.FRAMED, Protocol.BINARY, PoolSettings())
        pool.open = 1  # as _connect counts a connect in progress
        conn = UpstreamConnection(pool, Framing.FRAMED, Protocol.BINARY, 1 << 20)
        conn.connection_lost(None)  # closed before the pool owned it
        unowned = pool.open
        owned = UpstreamConnection(pool, Framing.FRAMED, Protocol.BINARY, 1 << 20)
        owned.owned = True
        owned.connection_lost(None)
        return unowned, pool.open

    assert uvloop.run(main()) == (1, 0)
