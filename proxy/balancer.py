"""Load balancers: pure picks over a cluster's endpoints, with the RNG passed in.

Every balancer sees only endpoints that may take traffic (the cluster filters
out open breakers first, unless it panics). Weights come from config or
discovery.

- round_robin: smooth weighted round robin (nginx's), deterministic.
- random: weighted random.
- least_request: power of two choices over outstanding requests (weighted:
  outstanding / weight); never picks the busier of its two candidates.
- peak_ewma: P2C over a peak-sensitive moving average of latency × (outstanding + 1),
  as in Finagle and linkerd.
"""

from __future__ import annotations

import random as random_mod
from typing import Callable, Sequence

from proxy.endpoint import Endpoint


class Balancer:
    name = "?"

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        raise NotImplementedError


class RoundRobin(Balancer):
    name = "round_robin"

    def __init__(self, rng: random_mod.Random | None = None, clock=None) -> None:
        self._current: dict[int, int] = {}

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        total = 0
        best = None
        best_w = -1 << 62
        cur = self._current
        for ep in endpoints:
            k = id(ep)
            w = cur.get(k, 0) + ep.weight
            cur[k] = w
            total += ep.weight
            if w > best_w:
                best_w = w
                best = ep
        cur[id(best)] -= total
        if len(cur) > 4 * len(endpoints):  # endpoints came and went: forget stale ones
            live = {id(ep) for ep in endpoints}
            for k in [k for k in cur if k not in live]:
                del cur[k]
        return best


class Random(Balancer):
    name = "random"

    def __init__(self, rng: random_mod.Random | None = None, clock=None) -> None:
        self.rng = rng or random_mod.Random()

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        return _weighted_choice(endpoints, self.rng)


def _weighted_choice(endpoints: Sequence[Endpoint], rng: random_mod.Random) -> Endpoint:
    total = 0
    for ep in endpoints:
        total += ep.weight
    x = rng.random() * total
    for ep in endpoints:
        x -= ep.weight
        if x < 0:
            return ep
    return endpoints[-1]


def _two(endpoints: Sequence[Endpoint], rng: random_mod.Random) -> tuple[Endpoint, Endpoint]:
    """Two distinct candidates, each drawn by weight."""
    a = _weighted_choice(endpoints, rng)
    for _ in range(4):
        b = _weighted_choice(endpoints, rng)
        if b is not a:
            return a, b
    i = endpoints.index(a)
    return a, endpoints[(i + 1 + rng.randrange(len(endpoints) - 1)) % len(endpoints)]


class LeastRequest(Balancer):
    name = "least_request"

    def __init__(self, rng: random_mod.Random | None = None, clock=None) -> None:
        self.rng = rng or random_mod.Random()

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        a, b = _two(endpoints, self.rng)
        la = a.outstanding / a.weight
        lb = b.outstanding / b.weight
        if la == lb:
            return a
        return a if la < lb else b


class PeakEwma(Balancer):
    """Cost = latency EWMA (peak-sensitive) × (outstanding + 1) / weight; P2C on cost."""

    name = "peak_ewma"

    def __init__(self, rng: random_mod.Random | None = None, clock: Callable[[], float] | None = None) -> None:
        self.rng = rng or random_mod.Random()

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        a, b = _two(endpoints, self.rng)
        ca = a.ewma.cost(a.outstanding) / a.weight
        cb = b.ewma.cost(b.outstanding) / b.weight
        return a if ca <= cb else b


BALANCERS = {cls.name: cls for cls in (RoundRobin, Random, LeastRequest, PeakEwma)}


def make_balancer(name: str, rng: random_mod.Random | None = None, clock=None) -> Balancer:
    return BALANCERS[name](rng=rng, clock=clock)
