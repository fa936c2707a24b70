"""Peak-sensitive EWMA of latency (Finagle/linkerd's peak EWMA), with an injected clock."""

from __future__ import annotations

import math
from typing import Callable


class PeakEwmaEstimator:
    """Peak-sensitive EWMA of latency: jumps up at once, decays with time constant `tau`."""

    __slots__ = ("value", "stamp", "tau", "clock", "penalty")

    def __init__(self, clock: Callable[[], float], tau: float = 10.0, initial: float = 0.0,
                 penalty: float = 1.0) -> None:
        self.value = initial
        self.stamp = clock()
        self.tau = tau
        self.clock = clock
        self.penalty = penalty  # cost of an endpoint with no samples and work queued (seconds)

    def observe(self, rtt: float) -> None:
        now = self.clock()
        if rtt > self.value:
            self.value = rtt
        else:
            w = math.exp(-(now - self.stamp) / self.tau)
            self.value = self.value * w + rtt * (1 - w)
        self.stamp = now

    def cost(self, outstanding: int) -> float:
        now = self.clock()
        w = math.exp(-(now - self.stamp) / self.tau)
        v = self.value * w
        if v == 0.0 and outstanding:
            return self.penalty + outstanding
        return v * (outstanding + 1)
