"""A cluster at run time: its endpoints, balancer, pools, and framing.

`pick()` filters endpoints whose breaker is open or whose active health check
fails (unless more than `max_open_percent` are out: then the cluster panics
and ignores health), and those still waiting for their first health check
(`pending`: counted neither in nor out, used, before any panic, only when no
checked endpoint may take the call), then asks the balancer (`_sort`).
`pool()` returns the pool for (endpoint, framing, protocol); TLS is the
cluster's own, so the key is complete. Each pool tells
its endpoint of its connects (`_connect_hooks`): one in progress counts in
`outstanding`, one that fails counts against the endpoint's breaker.

`set_endpoints()` is how discovery (`proxy.discovery`) changes the set: kept
endpoints keep their pools, counters, latency estimate and breaker; a removed
endpoint is never picked again, its idle connections close now and busy ones
when their exchange ends, and calls still waiting for one of its connections
are served before its pools close. No call in flight fails because of a change.

`retire()` is how a reload replaces the whole cluster: discovery stops now, and
`in_use()` tells the composition root (`proxy.server`) when no call is in flight
on it any more, so its pools close only then (a waiter or a retry of a call
that started before the reload still gets a connection).
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_mod
from typing import Callable, Sequence

from proxy.balancer import Balancer
from proxy.breaker import CLOSED, panicking
from proxy.codec import Framing, Protocol
from proxy.endpoint import Endpoint
from proxy.pool import Pool, PoolSettings

log = logging.getLogger(__name__)


def _connect_hooks(endpoint: Endpoint):
    """A pool's connects, as its endpoint sees them: one in progress is load (`outstanding`, what
    least_request and peak_ewma weigh: a connect that hangs, to a blackholed address, must not
    look idle), and one that failed is the endpoint's failure, counted by its breaker (and as a
    penalty in its latency estimate, peak_ewma's) here and only here, whether or not the call
    that wanted it still waits (a per-try or route timeout shorter than connect_timeout gives up
    first, blaming nobody). So is a connection whose TLS
    the server refused after oneways went out on it (`refused`): no call is there to be told."""
    def start() -> None:
        endpoint.outstanding += 1

    def end(ok: bool | None) -> None:
        endpoint.outstanding -= 1
        if ok is False:
            refused()

    def refused() -> None:  # (also a connection whose TLS the server refused: a connect that failed, late)
        if endpoint.breaker is not None:
            endpoint.breaker.record(False, 0)
        # peak_ewma's estimate: a connect refused at once must not make the endpoint look fast
        # (never measured, it would cost 0 and win every draw it is in: with the breakers
        # ignored in a panic, nearly every call went to the dead endpoints)
        endpoint.ewma.fail()

    return start, end, refused


ENDPOINT_STATES = ("available", "ejected", "failing_health_check", "pending_health_check")


def seen_state(ep: Endpoint) -> str:
    """What a pick would make of `ep` now (one of ENDPOINT_STATES), changing nothing: a pending
    endpoint whose breaker opened is judged out, as `Cluster._sort` judges it."""
    allowed = ep.breaker is None or ep.breaker.would_allow()
    if ep.pending and allowed:
        return "pending_health_check"
    if not ep.healthy and not ep.pending:
        return "failing_health_check"
    return "available" if allowed else "ejected"


def _allows(breaker) -> bool:
    return breaker.allows()


def _would_allow(breaker) -> bool:
    return breaker.would_allow()


class Cluster:
    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, endpoints: Sequence[Endpoint],
                 balancer: Balancer, pool_settings: PoolSettings, framing: Framing | None = None,
                 protocol: Protocol | None = None, ssl: ssl_mod.SSLContext | None = None,
                 server_name: str | None = None, max_open_percent: float = 50.0) -> None:
        self.name = name
        self.loop = loop
        self.endpoints: list[Endpoint] = list(endpoints)
        self.balancer = balancer
        self.tracks_latency = balancer.name == "peak_ewma"  # only then is each reply's latency fed
        self.pool_settings = pool_settings
        self.framing = framing
        self.protocol = protocol
        self.ssl = ssl
        self.server_name = server_name
        self.max_open_percent = max_open_percent
        self.panicking = False
        self.stats = {"calls": 0, "no_endpoint": 0, "endpoint_changes": 0, "retries": 0,
                      "retries_refused_budget": 0, "retries_refused_limit": 0}
        self.discovery = None     # a proxy.discovery source, started by start()
        self.budget = None        # proxy.retry.RetryBudget (proxy.resilience.attach)
        self.limits = None        # proxy.retry.ConcurrencyLimits (proxy.resilience.attach)
        # Called with each endpoint discovery adds (e.g. to give it a breaker); static
        # endpoints are set up where the cluster is built.
        self.endpoint_setup: Callable[[Endpoint], None] | None = None
        self.checker = None       # proxy.health.HealthChecker, while one runs: adopts added endpoints
        self._retiring: set[Pool] = set()
        self._retire_timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """Lifecycle: the first discovery round (bounded), then its refresh loop as a task."""
        if self.discovery is not None:
            await self.discovery.start()

    def pick(self, exclude=()) -> Endpoint | None:
        """An endpoint for the next attempt; `exclude` (endpoints already tried by this call)
        is honoured while any other endpoint may take the call."""
        eps = self.endpoints
        if not eps:
            self.stats["no_endpoint"] += 1
            return None
        for ep in eps:  # the common case, every endpoint healthy with a closed breaker: no copy
            if not ep.healthy or (ep.breaker is not None and ep.breaker.state is not CLOSED):
                eps = self._usable(eps)
                break
        else:
            if self.panicking:
                self._usable(eps)  # (leaves panic)
        if not eps:
            return None
        if exclude:
            others = [ep for ep in eps if ep not in exclude]
            if others:
                eps = others
        self.stats["calls"] += 1
        return self.balancer.pick(eps)

    def why_no_endpoint(self) -> str:
        """Why `pick` found none, for the caller's error (not on the hot path): no endpoints (and
        what discovery last said), or how many are out and why; looking changes no breaker."""
        eps = self.endpoints
        if not eps:
            d = self.discovery
            said = f"; {d.kind} discovery: {d.last_error}" if d is not None and d.last_error else ""
            return f"cluster '{self.name}' has no endpoints{said}"
        ejected = sum(1 for ep in eps if ep.breaker is not None and not ep.breaker.would_allow())
        unhealthy = sum(1 for ep in eps if not ep.healthy and not ep.pending)
        pending = sum(1 for ep in eps if ep.pending)
        waiting = f", {pending} waiting for their first health check" if pending else ""
        return (f"no endpoint available in cluster '{self.name}': {len(eps)} endpoint(s), "
                f"{ejected} ejected (breaker open), {unhealthy} failing health checks{waiting}")

    def tls_name(self, host: str) -> str:
        """The name TLS sends (SNI) and checks the certificate against: `tls.server_name`, else the
        endpoint's host, without the trailing dot of a fully qualified name (SNI never has one)."""
        return (self.server_name or host).rstrip(".")

    def renew_tls(self, ssl: ssl_mod.SSLContext) -> None:
        """A reload read this cluster's TLS files again: new connections use `ssl` (open ones
        keep the session they have)."""
        self.ssl = ssl
        for endpoint in self.endpoints:
            for pool in endpoint.pools.values():
                pool.ssl = ssl

    def pool(self, endpoint: Endpoint, framing: Framing, protocol: Protocol) -> Pool:
        key = (framing, protocol)
        pool = endpoint.pools.get(key)
        if pool is None:
            pool = endpoint.pools[key] = Pool(
                self.loop, endpoint.host, endpoint.port, framing, protocol, self.pool_settings,
                ssl=self.ssl, server_hostname=self.tls_name(endpoint.host))
            pool.on_connect_start, pool.on_connect_end, pool.on_refused = _connect_hooks(endpoint)
        return pool

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Replace the endpoint set (discovery): kept endpoints keep their pools and counters."""
        old = {ep.key: ep for ep in self.endpoints}
        new: list[Endpoint] = []
        for ep in endpoints:
            cur = old.pop(ep.key, None)
            if cur is not None:
                cur.weight = ep.weight
                new.append(cur)
            else:
                if self.endpoint_setup is not None:
                    self.endpoint_setup(ep)
                if self.checker is not None:
                    self.checker.adopt(ep)
                new.append(ep)
        self.endpoints = new
        self.stats["endpoint_changes"] += 1
        for gone in old.values():
            gone.removed = True
            for pool in gone.pools.values():
                self._retire(pool)

    def _retire(self, pool: Pool) -> None:
        """Close a removed endpoint's pool once no call waits for one of its connections.

        Pool.close() would fail its waiters ("not sent"); they were promised a connection
        (a busy one is released to them, or their acquire_timeout runs as usual).
        """
        if any(not w.done for w in pool.waiters):
            self._retiring.add(pool)
            if self._retire_timer is None:
                self._retire_timer = self.loop.call_later(0.05, self._retire_pending)
        else:
            self._retiring.discard(pool)
            pool.close()  # idle connections now; busy ones once their exchange ends

    def _retire_pending(self) -> None:
        self._retire_timer = None
        for pool in list(self._retiring):
            self._retire(pool)

    def retire(self) -> None:
        """A reload replaced this cluster: stop discovery; its pools stay open for the calls
        still on it (`in_use`) until `close()`."""
        if self.discovery is not None:
            self.discovery.close()

    def in_use(self) -> bool:
        """A call is in flight on this cluster (its limits count it from admission to its reply,
        retries included) or waits for one of its pools' connections."""
        if self.limits is not None and self.limits.requests > 0:
            return True
        pools = [p for ep in self.endpoints for p in ep.pools.values()] + list(self._retiring)
        return any(not w.done for p in pools for w in p.waiters)

    def close(self) -> None:
        if self.discovery is not None:
            self.discovery.close()
        if self._retire_timer is not None:
            self._retire_timer.cancel()
            self._retire_timer = None
        for pool in self._retiring:
            pool.close()
        self._retiring.clear()
        for ep in self.endpoints:
            for pool in ep.pools.values():
                pool.close()

    def _usable(self, eps: list[Endpoint]) -> list[Endpoint]:
        """The endpoints a pick may use when some may be out (health check failing, breaker
        open) or not yet checked (`pending`); keeps `panicking` current (`_sort`)."""
        healthy, pending, out, judged = self._sort(eps, _allows)
        panic = out > 0 and bool(healthy or not pending) and panicking(out, judged, self.max_open_percent)
        if panic != self.panicking:
            self.panicking = panic
            if panic:
                log.warning("cluster %s panics: %d of %d endpoints out (breaker open or health check "
                            "failing; more than %g%%); ignoring health",
                            self.name, out, judged, self.max_open_percent)
            else:
                log.info("cluster %s leaves panic", self.name)
        return eps if panic else (healthy or pending)

    @staticmethod
    def _sort(eps: list[Endpoint], allows) -> tuple[list[Endpoint], list[Endpoint], int, int]:
        """(checked endpoints that are in, pending ones whose breaker allows, endpoints out,
        endpoints judged). A pick uses the first list; if it is empty, the second (unknown beats
        known bad); it panics (uses all, health ignored) when more than `max_open_percent` of
        the judged endpoints are out, unless only pending ones are left to use. A pending
        endpoint is judged only once its breaker is open: waiting for a first check, it counts
        neither in nor out (Envoy's excluded hosts: a scale-up does not panic a cluster).
        `allows(breaker)`: whether it lets a call through (`Breaker.allows` for a pick, which
        may move it to half-open; `would_allow` for a look)."""
        healthy: list[Endpoint] = []
        pending: list[Endpoint] = []
        out = judged = 0
        for ep in eps:
            if ep.pending:
                if ep.breaker is None or allows(ep.breaker):
                    pending.append(ep)
                    continue
            elif ep.healthy and (ep.breaker is None or allows(ep.breaker)):
                healthy.append(ep)
                judged += 1
                continue
            out += 1
            judged += 1
        return healthy, pending, out, judged

    def snapshot_panicking(self) -> bool:
        """Whether a pick now would find the cluster panicking, changing nothing (`snapshot`)."""
        healthy, pending, out, judged = self._sort(self.endpoints, _would_allow)
        return out > 0 and bool(healthy or not pending) and panicking(out, judged, self.max_open_percent)

    def snapshot(self) -> dict:
        """What /stats shows, as of now and changing nothing: looking is not a pick (no breaker
        goes half-open, no panic is entered or left, nothing logged, because it was looked at)."""
        return {
            "name": self.name, "panicking": self.snapshot_panicking(),
            **self.stats,
            "discovery": self.discovery.snapshot() if self.discovery is not None else {"kind": "static"},
            "endpoints": [
                {"address": ep.label, "weight": ep.weight, "outstanding": ep.outstanding,
                 "breaker": ep.breaker.seen_state().value if ep.breaker is not None else "none",
                 "pools": [p.snapshot() for p in ep.pools.values()]}
                for ep in self.endpoints],
        }
