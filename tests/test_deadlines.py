"""proxy.deadlines.DeadlineQueue on a real uvloop loop: deadlines fire in order and on time,
cancelled ones never, an out-of-order one on its own timer, a failing callback does not stop
the rest, and answered calls leave nothing queued behind a slow one."""

from __future__ import annotations

import asyncio
import threading

import uvloop

from proxy.deadlines import EARLY, ORDER_SLACK, DeadlineQueue
from harness import Proxy, ThriftServer, client, config_text


def _run(coro_fn):
    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn(loop))
    finally:
        loop.close()


def test_deadlines_fire_in_order_at_their_time_and_cancelled_ones_never():
    async def go(loop):
        q = DeadlineQueue(loop)
        fired = []
        t0 = loop.time()
        handles = [q.set(t0 + 0.05 * (i + 1), lambda i=i: fired.append((i, loop.time()))) for i in range(6)]
        handles[1].cancel()
        handles[4].cancel()
        assert handles[2].when() == t0 + 0.15
        await asyncio.sleep(0.45)
        return t0, fired, len(q)

    t0, fired, left = _run(go)
    assert [i for i, _ in fired] == [0, 2, 3, 5]
    for i, at in fired:
        due = t0 + 0.05 * (i + 1)
        assert at >= due - EARLY, (i, at - due)
    assert left == 0


def test_a_deadline_earlier_than_the_queue_s_tail_fires_at_its_own_time():
    """One deadline 1 s out, then one 50 ms out (a client's shorter timeout): the second must
    not wait behind the first."""
    async def go(loop):
        q = DeadlineQueue(loop)
        fired = []
        t0 = loop.time()
        q.set(t0 + 1.0, lambda: fired.append("late"))
        q.set(t0 + 0.05, lambda: fired.append(("early", loop.time() - t0)))
        await asyncio.sleep(0.3)
        return fired

    fired = _run(go)
    assert len(fired) == 1 and fired[0][0] == "early" and fired[0][1] < 0.3, fired


def test_deadlines_within_the_order_slack_share_the_queue_and_fire_at_most_that_late():
    async def go(loop):
        q = DeadlineQueue(loop)
        fired = {}
        t0 = loop.time()
        q.set(t0 + 0.1, lambda: fired.setdefault("a", loop.time()))
        q.set(t0 + 0.1 - ORDER_SLACK / 2, lambda: fired.setdefault("b", loop.time()))
        queued = len(q)
        await asyncio.sleep(0.3)
        return t0, queued, fired

    t0, queued, fired = _run(go)
    assert queued == 2
    assert set(fired) == {"a", "b"}
    # (b's time is before a's; it fires with a, within ORDER_SLACK of its own, plus the loop's ms)
    assert fired["b"] >= t0 + 0.1 - ORDER_SLACK / 2 - EARLY


def test_a_failing_callback_is_reported_and_the_rest_still_fire():
    async def go(loop):
        errors = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        q = DeadlineQueue(loop)
        fired = []
        t0 = loop.time()

        def boom():
            raise RuntimeError("boom")

        q.set(t0 + 0.02, boom)
        q.set(t0 + 0.02, lambda: fired.append(1))
        q.set(t0 + 0.04, lambda: fired.append(2))
        await asyncio.sleep(0.2)
        return errors, fired

    errors, fired = _run(go)
    assert fired == [1, 2]
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)


def test_a_callback_may_set_the_next_deadline():
    async def go(loop):
        q = DeadlineQueue(loop)
        fired = []

        def again(n):
            fired.append(n)
            if n < 3:
                q.set(loop.time() + 0.02, again, n + 1)

        q.set(loop.time() + 0.02, again, 1)
        await asyncio.sleep(0.3)
        return fired

    assert _run(go) == [1, 2, 3]


class _CountingLoop:
    """The loop, counting the timers `call_at` armed that have not run yet."""

    def __init__(self, loop) -> None:
        self.loop = loop
        self.live = 0
        self.most = 0

    def call_at(self, at, callback, *args):
        def run():
            self.live -= 1
            callback(*args)
        self.live += 1
        self.most = max(self.most, self.live)
        return self.loop.call_at(at, run)

    def __getattr__(self, name):
        return getattr(self.loop, name)


def test_callbacks_that_set_deadlines_leave_one_loop_timer():
    """Deadlines every 20 ms, each callback setting another 100 ms out, while later ones are
    still queued: the queue holds one loop timer throughout. Before: a deadline set during a
    fire armed a timer, and the fire armed another for the queue's head; each such chain then
    re-armed itself for as long as the queue was never empty (fires per second grew)."""
    async def go(loop):
        counting = _CountingLoop(loop)
        q = DeadlineQueue(counting)
        fired = []
        t0 = loop.time()

        def again(n):
            fired.append(n)
            if n < 30:
                q.set(loop.time() + 0.1, again, n + 5)

        for i in range(5):
            q.set(t0 + 0.02 * (i + 1), again, i)
        await asyncio.sleep(0.9)
        return counting.most, fired

    most, fired = _run(go)
    assert sorted(fired) == list(range(35)), fired
    assert most == 1, f"{most} loop timers at once"


def test_many_deadlines_due_at_once_fire_in_one_pass():
    """30,000 answered calls' deadlines cancelled from the front, then 40,000 due at once (the
    loop stalled): they fire in order, in linear time (one pass; a scan of the dict's front per
    deadline was quadratic: ~550 ms here)."""
    async def go(loop):
        q = DeadlineQueue(loop)
        fired = []
        t0 = loop.time()
        gone = [q.set(t0 + 0.01, fired.append, -1) for _ in range(30_000)]
        for d in gone:
            d.cancel()
        for i in range(40_000):
            q.set(t0 + 0.01, fired.append, i)
        import time
        time.sleep(0.05)  # (the loop stalls: all of them are due when it runs timers again)
        cpu0 = time.process_time()
        await asyncio.sleep(0.05)
        return fired, time.process_time() - cpu0

    fired, cpu = _run(go)
    assert fired == list(range(40_000))
    assert cpu < 0.25, f"{cpu * 1000:.0f} ms of CPU to fire 40,000 deadlines"


def test_answered_calls_leave_nothing_queued_behind_a_slow_one():
    """A slow call holds the head of its route's deadline queue; 50 quick calls after it
    are answered and leave it at once (a dict delete), so the queue holds one deadline, not 51
    (a queue that only dropped answered deadlines as the head fell due would hold them all for
    the whole route timeout)."""
    up = ThriftServer()
    try:
        text = config_text([up.address]).replace("      - cluster: up", "      - cluster: up\n        timeout: 30s")
        with Proxy(text) as p, client(p.port()) as quick:
            pipeline = p.server.listeners["test"].pipeline
            slow = client(p.port(), timeout=10)
            with slow:
                t = threading.Thread(target=slow.sleep, args=(3000,))
                t.start()
                for i in range(50):
                    assert quick.echo(b"x") == b"x"
                queued = p.call(lambda: sum(len(q) for q in pipeline._deadlines.values()))
                assert t.is_alive(), "the slow call ended before the quick ones: nothing measured"
                t.join()
            after = p.call(lambda: sum(len(q) for q in pipeline._deadlines.values()))
    finally:
        up.stop()
    assert queued == 1, queued
    assert after == 0
