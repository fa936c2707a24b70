"""Load balancers: pure picks over a cluster's endpoints, with the RNG passed in.

Every balancer sees only endpoints that may take traffic (the cluster filters
out open breakers first, unless it panics). Weights come from config or
discovery (integers >= 1).

- round_robin: smooth weighted round robin (nginx's): deterministic, each
  endpoint gets exactly its share of every `sum(weights)` picks, spread out.
- random: weighted random.
- least_request: power of two choices over outstanding requests (`outstanding`:
  requests written and awaiting their reply, plus connects in progress, which
  `proxy.cluster` counts so that an endpoint whose connects hang does not look
  idle). The two candidates are drawn by weight without replacement; the one
  with fewer outstanding requests per unit of weight wins (a tie goes to the first
  drawn, so an idle cluster is served in proportion to weights).
- peak_ewma: the same P2C over cost = peak-sensitive latency EWMA ×
  (1 + outstanding / weight), as in Finagle and linkerd (`proxy.ewma`) with
  the load taken per unit of weight; a failure (a refused connect, a reset)
  is charged as a penalty sample, not measured as fast. Two idle endpoints of
  equal latency tie (the first drawn, by weight, wins), but measured latencies
  are rarely equal: at low load the faster endpoint takes most calls, whatever
  the weights, which then only weigh the draw and the load.

Weights and P2C: candidates are drawn by weight, loads compared per unit of
weight, so an idle cluster is served exactly in proportion to weights and a
loaded one (8+ calls in flight) within a point or so (tests/test_balancer.py).
With only 2-4 calls in flight a light endpoint gains a few points: an idle
endpoint always looks less loaded than a busy one, whatever their weights.

`pick_two` and `p2c` are the pure parts: the candidates a seeded RNG draws,
and which of two loads wins. Tests replay the RNG to check that P2C never
picks the busier of its two candidates.
"""

from __future__ import annotations

import random as random_mod
from typing import Callable, Sequence, TypeVar

from proxy.endpoint import Endpoint

T = TypeVar("T")


def weighted_choice(endpoints: Sequence[T], rng: random_mod.Random, skip: T | None = None) -> T:
    """One endpoint drawn with probability weight / total (`skip` excluded)."""
    total = 0
    for ep in endpoints:
        if ep is not skip:
            total += ep.weight
    x = rng.random() * total
    last = None
    for ep in endpoints:
        if ep is skip:
            continue
        x -= ep.weight
        if x < 0:
            return ep
        last = ep
    return last  # float rounding at the very top end


def pick_two(endpoints: Sequence[T], rng: random_mod.Random) -> tuple[T, T]:
    """Two distinct candidates drawn by weight without replacement (needs 2+ endpoints)."""
    a = weighted_choice(endpoints, rng)
    return a, weighted_choice(endpoints, rng, skip=a)


def p2c(a: T, b: T, load_a: float, load_b: float) -> T:
    """The less loaded of two candidates; `a` on a tie."""
    return b if load_b < load_a else a


class Balancer:
    name = "?"

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        raise NotImplementedError


class RoundRobin(Balancer):
    name = "round_robin"

    def __init__(self, rng: random_mod.Random | None = None, clock=None) -> None:
        self._current: dict[Endpoint, int] = {}

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        cur = self._current
        total = 0
        best = endpoints[0]
        best_w = None
        for ep in endpoints:
            w = cur.get(ep, 0) + ep.weight
            cur[ep] = w
            total += ep.weight
            if best_w is None or w > best_w:
                best_w = w
                best = ep
        cur[best] -= total
        if len(cur) > 2 * len(endpoints) + 8:
            # Endpoints came and went (discovery) or sit behind open breakers: forget them;
            # one coming back starts from zero, which only shifts where it enters the cycle.
            live = set(endpoints)
            for ep in [ep for ep in cur if ep not in live]:
                del cur[ep]
        return best


class Random(Balancer):
    name = "random"

    def __init__(self, rng: random_mod.Random | None = None, clock=None) -> None:
        self.rng = rng or random_mod.Random()

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        return weighted_choice(endpoints, self.rng)


class LeastRequest(Balancer):
    name = "least_request"

    def __init__(self, rng: random_mod.Random | None = None, clock=None) -> None:
        self.rng = rng or random_mod.Random()

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        a, b = pick_two(endpoints, self.rng)
        return p2c(a, b, a.outstanding / a.weight, b.outstanding / b.weight)


class PeakEwma(Balancer):
    """P2C on cost = latency EWMA (peak-sensitive) × (1 + outstanding / weight)."""

    name = "peak_ewma"

    def __init__(self, rng: random_mod.Random | None = None, clock: Callable[[], float] | None = None) -> None:
        self.rng = rng or random_mod.Random()

    def pick(self, endpoints: Sequence[Endpoint]) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        a, b = pick_two(endpoints, self.rng)
        return p2c(a, b, a.ewma.cost(a.outstanding / a.weight), b.ewma.cost(b.outstanding / b.weight))


BALANCERS = {cls.name: cls for cls in (RoundRobin, Random, LeastRequest, PeakEwma)}


def make_balancer(name: str, rng: random_mod.Random | None = None, clock=None) -> Balancer:
    return BALANCERS[name](rng=rng, clock=clock)
