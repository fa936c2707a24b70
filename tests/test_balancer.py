"""Balancers as pure picks: seeded RNG, manual clock, no sockets.

Tolerances (100k seeded picks; shares are fractions of all picks):
- round_robin: exact (smooth WRR gives each endpoint exactly its weight's share).
- random, and least_request / peak_ewma on an idle cluster (a P2C tie goes to the
  first candidate, drawn by weight): within 0.006 of weight/total. The binomial
  standard deviation is at most 0.0016 at 100k picks, so that is > 3.5 sd.
- least_request / peak_ewma under a closed-loop load (20 in flight, completions
  at random, equal latencies): within 0.015 — P2C balances load per unit of
  weight, which matches weights on average.
P2C property: over any loads, weights and seed, the pick is never the busier of
the two candidates that seed draws (the RNG is replayed to know them).
"""

from __future__ import annotations

import logging
import math
import random

import pytest

from proxy.breaker import CLOSED, OPEN
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.balancer import BALANCERS, LeastRequest, PeakEwma, RoundRobin, make_balancer, pick_two
from proxy.clock import ManualClock
from proxy.cluster import Cluster
from proxy.endpoint import Endpoint
from proxy.ewma import PeakEwmaEstimator
from proxy.pool import PoolSettings

N = 100_000
WEIGHTS = [1, 2, 3, 4]


def endpoints(weights, clock=None):
    clock = clock or ManualClock()
    return [Endpoint(f"10.0.0.{i}", 9090, w, clock=clock) for i, w in enumerate(weights)]


def shares(counts: dict, eps) -> list[float]:
    total = sum(counts.values())
    return [counts.get(ep, 0) / total for ep in eps]


def expected(weights) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("name", sorted(BALANCERS) + ["peak_ewma/measured"])
def test_idle_distribution_honours_weights(name):
    eps = endpoints(WEIGHTS)
    if name == "peak_ewma/measured":   # equal latencies measured: idle endpoints still tie
        name = "peak_ewma"
        for ep in eps:
            ep.ewma.observe(0.004)
    b = make_balancer(name, rng=random.Random(1234))
    counts: dict = {}
    for _ in range(N):
        ep = b.pick(eps)
        counts[ep] = counts.get(ep, 0) + 1
    got = shares(counts, eps)
    if name == "round_robin":
        assert got == expected(WEIGHTS)
    else:
        assert got == pytest.approx(expected(WEIGHTS), abs=0.006), got


@pytest.mark.parametrize("name,tol", [("least_request", 0.015), ("peak_ewma", 0.015),
                                      ("random", 0.006), ("round_robin", 0.0001)])
def test_loaded_distribution_honours_weights(name, tol):
    clock = ManualClock()
    eps = endpoints(WEIGHTS, clock)
    b = make_balancer(name, rng=random.Random(99))
    done = random.Random(5)
    inflight: list = []
    counts: dict = {}
    for _ in range(N):
        ep = b.pick(eps)
        ep.outstanding += 1
        counts[ep] = counts.get(ep, 0) + 1
        inflight.append(ep)
        if len(inflight) >= 20:
            j = done.randrange(len(inflight))
            inflight[j], inflight[-1] = inflight[-1], inflight[j]
            ep = inflight.pop()
            ep.outstanding -= 1
            clock.advance(0.001)
            ep.ewma.observe(0.010)
    assert shares(counts, eps) == pytest.approx(expected(WEIGHTS), abs=tol)


def test_round_robin_is_smooth():
    a, b, c = endpoints([5, 1, 1])
    rr = RoundRobin()
    seq = [rr.pick([a, b, c]) for _ in range(14)]
    assert seq == [a, a, b, a, c, a, a] * 2   # nginx's smooth order: no run of five a's


def test_round_robin_follows_a_changing_set():
    eps = endpoints([1, 1, 1, 1])
    rr = RoundRobin()
    for _ in range(100):
        rr.pick(eps)
    fewer = eps[:2]
    seen = [rr.pick(fewer) for _ in range(100)]
    assert seen.count(eps[0]) == seen.count(eps[1]) == 50
    assert len(rr._current) <= 2 * 4 + 8


def test_pick_two_is_distinct_and_weighted():
    eps = endpoints([1, 9])
    rng = random.Random(3)
    firsts = 0
    for _ in range(20_000):
        a, b = pick_two(eps, rng)
        assert a is not b
        firsts += a is eps[1]
    assert firsts / 20_000 == pytest.approx(0.9, abs=0.01)


@settings(max_examples=500, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 5)), min_size=2, max_size=8),
       seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["least_request", "peak_ewma"]),
       rtts=st.lists(st.floats(0.0001, 0.5), min_size=8, max_size=8))
def test_p2c_never_picks_the_busier_candidate(loads, seed, kind, rtts):
    clock = ManualClock()
    eps = endpoints([w for _, w in loads], clock)
    for ep, (out, _), rtt in zip(eps, loads, rtts):
        ep.outstanding = out
        if kind == "peak_ewma" and out % 3:   # some endpoints never measured
            ep.ewma.observe(rtt)
    clock.advance(0.5)
    if kind == "least_request":
        def load(ep):
            return ep.outstanding / ep.weight
        bal = LeastRequest(rng=random.Random(seed))
    else:
        def load(ep):
            return ep.ewma.cost(ep.outstanding / ep.weight)
        bal = PeakEwma(rng=random.Random(seed))
    a, b = pick_two(eps, random.Random(seed))   # the same draws the balancer will make
    picked = bal.pick(eps)
    assert picked in (a, b)
    other = b if picked is a else a
    assert load(picked) <= load(other)


def test_peak_ewma_avoids_a_slow_endpoint():
    clock = ManualClock()
    eps = endpoints([1, 1, 1], clock)
    b = PeakEwma(rng=random.Random(1))
    rtt = {eps[0]: 0.001, eps[1]: 0.001, eps[2]: 0.021}
    counts = {ep: 0 for ep in eps}
    for _ in range(10_000):
        ep = b.pick(eps)
        counts[ep] += 1
        clock.advance(0.0005)
        ep.ewma.observe(rtt[ep])
    assert counts[eps[2]] / 10_000 < 0.05, counts


def test_a_failure_costs_the_penalty_then_decays():
    clock = ManualClock()
    e = PeakEwmaEstimator(clock, tau=10.0, penalty=1.0)
    e.observe(0.002)
    e.fail()                             # a connect refused at once: not a fast sample
    assert e.cost(0) == 1.0
    clock.advance(50.0)                  # avoided, then probed again as it decays (e^-5)
    assert e.estimate() == pytest.approx(1.0 * 0.0067379, rel=1e-4)


def test_ewma_jumps_on_a_peak_and_decays_with_time():
    clock = ManualClock()
    e = PeakEwmaEstimator(clock, tau=10.0)
    assert e.cost(0) == 0.0
    assert e.cost(2) == 1.0 + 2          # unmeasured with work queued: the penalty
    e.observe(0.010)
    assert e.estimate() == 0.010
    e.observe(0.100)                     # a peak is taken at once
    assert e.estimate() == 0.100
    clock.advance(10.0)                  # one tau later, with no sample: e^-1 of it
    assert e.estimate() == pytest.approx(0.100 * 0.36788, rel=1e-4)
    assert e.cost(3) == pytest.approx(4 * 0.100 * 0.36788, rel=1e-4)
    e.observe(0.010)                     # below the estimate: v·w + rtt·(1 − w), w = e^-1
    assert e.estimate() == pytest.approx(0.100 * 0.36788 + 0.010 * 0.63212, rel=1e-4)


def test_ewma_low_samples_pull_down_over_time():
    clock = ManualClock()
    e = PeakEwmaEstimator(clock, tau=1.0)
    e.observe(0.050)
    for _ in range(5000):
        clock.advance(0.001)
        e.observe(0.001)
    assert e.estimate() == pytest.approx(0.001 + 0.049 * math.exp(-5), rel=1e-3)  # 5 tau later


class FakeBreaker:
    def __init__(self, open_: bool) -> None:
        self.open = open_
        self.state = OPEN if open_ else CLOSED  # what Cluster.pick's fast path reads
        self.state_name = self.state.value

    def allows(self) -> bool:
        return not self.open


def make_cluster(eps, name="round_robin"):
    return Cluster("c", None, eps, make_balancer(name, rng=random.Random(1)), PoolSettings(),
                   max_open_percent=50)


def test_cluster_skips_open_breakers_before_the_pick():
    eps = endpoints([1, 1, 1, 1])
    eps[1].breaker = FakeBreaker(True)
    c = make_cluster(eps)
    picked = {c.pick() for _ in range(100)}
    assert picked == {eps[0], eps[2], eps[3]} and not c.panicking


def test_cluster_panics_when_too_many_are_open():
    eps = endpoints([1, 1, 1, 1])
    for ep in eps[:3]:
        ep.breaker = FakeBreaker(True)
    c = make_cluster(eps)
    picked = {c.pick() for _ in range(100)}
    assert c.panicking and picked == set(eps)   # 75% open > 50%: health is ignored
    for ep in eps:
        ep.breaker = None
    c.pick()
    assert not c.panicking


def test_cluster_without_endpoints_picks_none():
    c = make_cluster([])
    assert c.pick() is None and c.stats["no_endpoint"] == 1


def test_looking_at_a_cluster_changes_no_breaker_and_no_panic(caplog):
    """/stats (Cluster.snapshot) shows what a pick would find now, without being a pick: an
    open breaker past its open time reads half_open but stays OPEN until a pick comes (no
    transition, no log line, no reset probe count), and panic is shown, not entered. Before,
    a scrape moved breakers to HALF_OPEN and entered panic, so whether a late call's result
    closed an ejected endpoint depended on someone having looked."""
    from proxy import config
    from proxy.breaker import HALF_OPEN, Breaker
    clock = ManualClock()
    moves = []
    eps = endpoints([1, 1, 1, 1])
    for ep in eps:
        ep.breaker = Breaker(config.CircuitBreaker(consecutive_failures=1, open_for=1.0), clock,
                             lambda old, new, why: moves.append((old, new)))
    c = make_cluster(eps)
    for ep in eps[:3]:
        ep.breaker.record(False, ep.breaker.on_pick())
    assert [m[1] for m in moves] == [OPEN] * 3
    caplog.clear()
    snap = c.snapshot()
    assert snap["panicking"] and not c.panicking, "panic shown, not entered"
    assert [e["breaker"] for e in snap["endpoints"]] == ["open"] * 3 + ["closed"]
    clock.advance(1.5)
    snap = c.snapshot()
    assert [e["breaker"] for e in snap["endpoints"]] == ["half_open"] * 3 + ["closed"]
    assert not snap["panicking"]  # (three probes may go: none is out)
    assert all(ep.breaker.state is OPEN for ep in eps[:3]) and len(moves) == 3
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    c.pick()  # a pick is what moves them
    assert all(ep.breaker.state is HALF_OPEN for ep in eps[:3]) and len(moves) == 6


@pytest.mark.parametrize("case", ["known_bad_and_pending", "all_pending_all_open", "panic_with_pending",
                                  "healthy_and_pending", "all_pending"])
def test_endpoints_waiting_for_their_first_check_are_used_before_any_panic(case, caplog):
    """Pending endpoints (their first health check not answered yet) count neither in nor out,
    and a pick uses them only when no checked endpoint may take the call, before panicking:
    unknown beats known bad. A pending endpoint whose breaker is open is judged (out). /stats
    (snapshot) says what a pick would find."""
    from proxy import config
    from proxy.breaker import Breaker
    clock = ManualClock()
    # (healthy, pending, breaker open) per endpoint; then what a pick may return, and panic
    table = {
        "known_bad_and_pending": ([(False, False, False), (False, True, False)], {1}, False),
        "all_pending_all_open": ([(False, True, True), (False, True, True)], {0, 1}, True),
        "panic_with_pending": ([(True, False, False)] + [(False, False, False)] * 3 + [(False, True, False)] * 2,
                               set(range(6)), True),
        "healthy_and_pending": ([(True, False, False)] * 3 + [(False, True, False)], {0, 1, 2}, False),
        "all_pending": ([(False, True, False)] * 3, {0, 1, 2}, False),
    }
    shape, want, panic = table[case]
    eps = endpoints([1] * len(shape))
    for ep, (healthy, pending, open_) in zip(eps, shape):
        ep.healthy, ep.pending = healthy, pending
        ep.breaker = Breaker(config.CircuitBreaker(consecutive_failures=1, open_for=60.0), clock)
        if open_:
            ep.breaker.record(False, ep.breaker.on_pick())
    c = make_cluster(eps)
    assert c.snapshot()["panicking"] is panic
    with caplog.at_level(logging.WARNING, logger="proxy.cluster"):
        picked = {eps.index(c.pick()) for _ in range(200)}
    assert picked == want and c.panicking is panic
    if case == "panic_with_pending":  # (judged: the 4 checked ones)
        assert "cluster c panics: 3 of 4 endpoints out" in caplog.text
