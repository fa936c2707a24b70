"""Time sources: the real monotonic clock, and a manual one for policy tests.

Policy objects (retry budget, breaker, balancer) take a clock (a callable
returning seconds) so tests advance time instead of sleeping.
"""

from __future__ import annotations

import time

monotonic = time.monotonic
monotonic_ns = time.monotonic_ns

# A deadline timer that fires later than this after its time means the event loop itself was
# stalled (a slow callback, a GC pause, the GIL held by another thread). libuv runs due timers
# before it polls for I/O, so what arrived during the stall (a reply, a connect's completion)
# has not been seen yet: the deadline code looks once more before it gives up (proxy.pool,
# proxy.pipeline).
STALL_GRACE = 0.005


class ManualClock:
    """A clock that only moves when told to: `clock()` → seconds, `clock.advance(s)`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
