"""Balancer simulation (in the spirit of Finagle's balancersim): simulated time, no sockets.

The proxy's own balancers (`proxy.balancer`) pick among simulated endpoints.
Each endpoint is a small server: `workers` requests served at once, the rest
queue (FIFO), service times drawn from its own distribution, which may change
during the run. Load is open-loop Poisson arrivals, so a balancer that keeps
sending to a slow endpoint builds a queue there and pays for it in the tail.
The EWMA reads the simulated clock; outstanding counts rise at the pick and
fall at the reply, as in the pipeline.

Scenarios (10 endpoints, 4 workers each, ~60% of the cluster's capacity):
    skewed    8 endpoints ~5 ms, one 3x slower, one with a heavy tail (5% of calls 20x)
    changing  all ~5 ms; one endpoint turns 20x slower for the middle third of the run,
              another drifts from 5 ms to 15 ms over the run

    python bench/balancersim.py [--seconds 60] [--rate 4000] [--seed 1]

A benchmark, not a test: it prints a table and decides nothing.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import deque
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.balancer import make_balancer  # noqa: E402
from proxy.clock import ManualClock  # noqa: E402
from proxy.endpoint import Endpoint  # noqa: E402

BALANCERS = ("round_robin", "random", "least_request", "peak_ewma")


def lognormal(median: float, sigma: float = 0.35):
    mu = math.log(median)
    return lambda rng, t: rng.lognormvariate(mu, sigma)


def heavy_tail(median: float, p: float = 0.05, factor: float = 20.0):
    base = lognormal(median)
    return lambda rng, t: base(rng, t) * (factor if rng.random() < p else 1.0)


def degraded(median: float, start: float, end: float, factor: float):
    base = lognormal(median)
    return lambda rng, t: base(rng, t) * (factor if start <= t < end else 1.0)


def drifting(median: float, to: float, seconds: float):
    def sample(rng, t):
        m = median + (to - median) * min(t / seconds, 1.0)
        return rng.lognormvariate(math.log(m), 0.35)
    return sample


def scenario(name: str, seconds: float) -> tuple[list, str]:
    ms = 0.001
    if name == "skewed":
        dists = [lognormal(5 * ms) for _ in range(8)] + [lognormal(15 * ms), heavy_tail(5 * ms)]
        return dists, "ep8: 3x slower; ep9: 5% of calls 20x"
    if name == "changing":
        dists = [lognormal(5 * ms) for _ in range(8)]
        a, b = seconds / 3, 2 * seconds / 3
        dists += [degraded(5 * ms, a, b, 20.0), drifting(5 * ms, 15 * ms, seconds)]
        return dists, f"ep8: 20x slower for t={a:.0f}-{b:.0f}s; ep9: 5 -> 15 ms"
    raise ValueError(name)


class SimEndpoint:
    __slots__ = ("ep", "dist", "workers", "busy", "queue", "served")

    def __init__(self, ep: Endpoint, dist, workers: int) -> None:
        self.ep = ep
        self.dist = dist
        self.workers = workers
        self.busy = 0
        self.queue: deque = deque()
        self.served = 0


def run(balancer: str, scen: str, seconds: float, rate: float, seed: int, workers: int = 4) -> dict:
    clock = ManualClock(0.0)
    dists, _ = scenario(scen, seconds)
    sims = [SimEndpoint(Endpoint(f"10.0.0.{i}", 9090, 1, clock=clock), d, workers) for i, d in enumerate(dists)]
    by_ep = {s.ep: s for s in sims}
    eps = [s.ep for s in sims]
    bal = make_balancer(balancer, rng=random.Random(seed), clock=clock)
    arrivals = random.Random(seed + 1)
    service = random.Random(seed + 2)
    events: list = []  # (time, seq, sim endpoint or None for an arrival, arrival time)
    seq = 0
    latencies: list[float] = []
    heapq.heappush(events, (arrivals.expovariate(rate), 0, None, 0.0))

    def begin(sim: SimEndpoint, now: float, arrived: float) -> None:
        nonlocal seq
        sim.busy += 1
        seq += 1
        heapq.heappush(events, (now + sim.dist(service, now), seq, sim, arrived))

    while events:
        now, _, sim, arrived = heapq.heappop(events)
        clock.now = now
        if sim is None:  # an arrival: pick, then serve or queue
            if now < seconds:
                s = by_ep[bal.pick(eps)]
                s.ep.outstanding += 1
                if s.busy < s.workers:
                    begin(s, now, now)
                else:
                    s.queue.append(now)
                seq += 1
                heapq.heappush(events, (now + arrivals.expovariate(rate), seq, None, 0.0))
            continue
        # a reply
        latency = now - arrived
        latencies.append(latency)
        sim.served += 1
        sim.busy -= 1
        sim.ep.outstanding -= 1
        sim.ep.ewma.observe(latency)
        if sim.queue:
            begin(sim, now, sim.queue.popleft())

    latencies.sort()
    n = len(latencies)

    def q(p: float) -> float:
        return latencies[min(n - 1, int(p * n))] * 1000

    shares = [s.served / n for s in sims]
    return {"n": n, "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "p999": q(0.999),
            "ep8": shares[8], "ep9": shares[9]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds per run")
    ap.add_argument("--rate", type=float, default=4000.0, help="Poisson arrivals per simulated second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scenario", choices=("skewed", "changing"), action="append")
    args = ap.parse_args(argv)
    scens = args.scenario or ["skewed", "changing"]
    print(f"10 endpoints x 4 workers, Poisson {args.rate:.0f}/s for {args.seconds:.0f} simulated s, seed {args.seed}")
    print(f"{'scenario':<9} {'balancer':<14} {'calls':>7} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
          f"{'p99.9 ms':>8} {'ep8 share':>9} {'ep9 share':>9}")
    for scen in scens:
        for name in BALANCERS:
            t0 = perf_counter()
            r = run(name, scen, args.seconds, args.rate, args.seed)
            print(f"{scen:<9} {name:<14} {r['n']:>7} {r['p50']:>7.1f} {r['p90']:>7.1f} {r['p99']:>7.1f} "
                  f"{r['p999']:>8.1f} {r['ep8']:>9.1%} {r['ep9']:>9.1%}", flush=True)
            print(f"  ({perf_counter() - t0:.1f}s wall)", file=sys.stderr)
        print(f"{'':<9} {scenario(scen, args.seconds)[1]}   (an even share is 10.0%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
