"""Per-call deadlines without a loop timer each: `DeadlineQueue`.

A route timeout (or a per-try timeout) is the same for every call on the route, so its calls'
deadlines fall due in about the order they were set. A queue keeps them in that order and holds
one loop timer, for the earliest: setting and cancelling a deadline is a dict insert and a dict
delete (~0.2 µs), where a uvloop `call_at` and its `cancel` cost ~1.2 µs on a running loop, and
~3.5 µs per call in the hot path (bench/hotpath.py, a route with a timeout). A call that is
answered leaves the queue at once, so a slow call at its head holds nothing up behind it.

A deadline earlier than the last one set by more than `ORDER_SLACK` (a client's shorter THeader
`client_timeout`, a request held back before it was handled) gets a loop timer of its own, so
none fires later than its time plus `ORDER_SLACK`; libuv's timers have millisecond resolution
anyway. What `set` returns has the two methods of an `asyncio.TimerHandle` the pipeline uses:
`cancel()` and `when()`.

Owns nothing but the order: the callbacks decide what a deadline means (they see the loop's
time and may set the deadline again, as they do for a timer that fired early or a stalled loop).
"""

from __future__ import annotations

import asyncio
from typing import Callable

_GONE = object()
ORDER_SLACK = 0.001  # s: a deadline this much before the last one set still goes in the queue
EARLY = 0.001        # s: a deadline this close when the timer fires is due (uvloop rounds a
                     # timer's delay to whole milliseconds: it may fire up to 0.5 ms early)


class Deadline:
    """One deadline in a queue: `cancel()` takes it out, `when()` is its loop time."""

    __slots__ = ("queue", "at", "callback", "args")

    def __init__(self, queue: DeadlineQueue, at: float, callback: Callable, args: tuple) -> None:
        self.queue = queue
        self.at = at
        self.callback = callback
        self.args = args

    def cancel(self) -> None:
        self.queue.due.pop(self, None)

    def when(self) -> float:
        return self.at

    def __repr__(self) -> str:
        return f"<Deadline at {self.at:.3f} {getattr(self.callback, '__qualname__', self.callback)}>"


class DeadlineQueue:
    """Deadlines that fall due in about the order they are set, on one loop timer."""

    __slots__ = ("loop", "due", "last", "_timer", "_firing")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.due: dict[Deadline, None] = {}  # in the order set: insertion order is due order
        self.last = 0.0                      # the latest deadline set (the queue's tail)
        self._timer: asyncio.TimerHandle | None = None
        self._firing = False  # in _fire: it arms the timer once its callbacks are done

    def __len__(self) -> int:
        return len(self.due)

    def set(self, at: float, callback: Callable, *args) -> Deadline | asyncio.TimerHandle:
        """`callback(*args)` at loop time `at` (or up to ORDER_SLACK later), unless cancelled."""
        if at < self.last - ORDER_SLACK:
            return self.loop.call_at(at, callback, *args)  # out of order: a timer of its own
        d = Deadline(self, at, callback, args)
        self.due[d] = None
        if at > self.last:
            self.last = at
        if self._timer is None and not self._firing:
            self._arm(at)
        return d

    def _arm(self, at: float) -> None:
        self._timer = self.loop.call_at(at, self._fire)

    def _fire(self) -> None:
        """The timer is due: run every deadline due by now (in order), then arm the one timer
        for the next. (A callback may set deadlines: `set` leaves the arming to this.)"""
        self._timer = None
        due = self.due
        self._firing = True
        try:
            while True:
                now = self.loop.time() + EARLY
                batch = []
                for d in due:  # one pass from the front (not one scan of the front per deadline)
                    if d.at > now:
                        break
                    batch.append(d)
                if not batch:
                    break
                for d in batch:
                    if due.pop(d, _GONE) is _GONE:
                        continue  # cancelled by an earlier callback
                    try:
                        d.callback(*d.args)
                    except (SystemExit, KeyboardInterrupt):
                        raise
                    except BaseException as e:  # as the loop would for a timer of its own: said, and on
                        self.loop.call_exception_handler({
                            "message": f"Exception in deadline callback {d!r}", "exception": e})
        finally:
            self._firing = False
        if due:
            self._arm(next(iter(due)).at)
        else:
            self.last = 0.0  # (empty: any deadline may come next)
