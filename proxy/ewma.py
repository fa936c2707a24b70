"""Peak-sensitive EWMA of latency (Finagle's and linkerd's peak EWMA), with an injected clock.

    observe(rtt):  rtt above the (decayed) estimate → the estimate jumps to rtt at once;
                   otherwise it moves toward rtt, weighted by the time since the last sample:
                   v = v·w + rtt·(1 − w), w = exp(−Δt / tau)
    cost(load):    the estimate decayed to now (it drifts toward 0 while no samples come, so
                   an endpoint avoided for being slow is probed again) × (load + 1), load
                   being outstanding requests (per unit of weight); an endpoint with no
                   sample yet costs 0 while idle and `penalty + load` once it has work (it is
                   tried, but not flooded).
    fail():        a failure that measured nothing (a connect refused at once) is a sample of
                   `penalty`: the endpoint is avoided, and probed again as that decays (as
                   Finagle's and linkerd's balancers charge a failure, not reward its speed).
"""

from __future__ import annotations

import math
from typing import Callable


class PeakEwmaEstimator:
    __slots__ = ("value", "stamp", "tau", "clock", "penalty")

    def __init__(self, clock: Callable[[], float], tau: float = 10.0, initial: float = 0.0,
                 penalty: float = 1.0) -> None:
        self.value = initial
        self.stamp = clock()
        self.tau = tau
        self.clock = clock
        self.penalty = penalty  # seconds: the cost of an unmeasured endpoint with work queued

    def _decayed(self, now: float) -> tuple[float, float]:
        w = math.exp(-max(now - self.stamp, 0.0) / self.tau)
        return self.value * w, w

    def observe(self, rtt: float) -> None:
        now = self.clock()
        decayed, w = self._decayed(now)
        if rtt > decayed:
            self.value = rtt
        else:
            self.value = decayed + rtt * (1 - w)
        self.stamp = now

    def fail(self) -> None:
        self.observe(self.penalty)

    def estimate(self) -> float:
        """The latency estimate now (seconds); 0 before the first sample."""
        return self._decayed(self.clock())[0]

    def cost(self, load: float) -> float:
        v = self._decayed(self.clock())[0]
        if v == 0.0 and load:
            return self.penalty + load
        return v * (load + 1)
