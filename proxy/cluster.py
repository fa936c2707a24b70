"""A cluster at run time: its endpoints, balancer, pools, and framing.

`pick()` filters endpoints whose breaker is open (unless more than
`max_open_percent` are open: then the cluster panics and ignores health),
then asks the balancer. `pool()` returns the pool for (endpoint, framing,
protocol); TLS is the cluster's own, so the key is complete.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_mod
from typing import Sequence

from proxy.balancer import Balancer
from proxy.codec import Framing, Protocol
from proxy.endpoint import Endpoint
from proxy.pool import Pool, PoolSettings

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, endpoints: Sequence[Endpoint],
                 balancer: Balancer, pool_settings: PoolSettings, framing: Framing | None = None,
                 protocol: Protocol | None = None, ssl: ssl_mod.SSLContext | None = None,
                 server_name: str | None = None, max_open_percent: float = 50.0) -> None:
        self.name = name
        self.loop = loop
        self.endpoints: list[Endpoint] = list(endpoints)
        self.balancer = balancer
        self.pool_settings = pool_settings
        self.framing = framing
        self.protocol = protocol
        self.ssl = ssl
        self.server_name = server_name
        self.max_open_percent = max_open_percent
        self.panicking = False
        self.stats = {"calls": 0, "no_endpoint": 0}

    def pick(self) -> Endpoint | None:
        eps = self.endpoints
        if not eps:
            self.stats["no_endpoint"] += 1
            return None
        healthy = [ep for ep in eps if ep.breaker is None or ep.breaker.allows()]
        if len(healthy) != len(eps):
            open_pct = 100.0 * (len(eps) - len(healthy)) / len(eps)
            panic = open_pct > self.max_open_percent
            if panic != self.panicking:
                self.panicking = panic
                if panic:
                    log.warning("cluster %s panics: %.0f%% of endpoints open (> %g%%); ignoring health",
                                self.name, open_pct, self.max_open_percent)
                else:
                    log.info("cluster %s leaves panic", self.name)
            if not panic:
                eps = healthy
        elif self.panicking:
            self.panicking = False
            log.info("cluster %s leaves panic", self.name)
        if not eps:
            return None
        self.stats["calls"] += 1
        return self.balancer.pick(eps)

    def pool(self, endpoint: Endpoint, framing: Framing, protocol: Protocol) -> Pool:
        key = (framing, protocol)
        pool = endpoint.pools.get(key)
        if pool is None:
            pool = endpoint.pools[key] = Pool(
                self.loop, endpoint.host, endpoint.port, framing, protocol, self.pool_settings,
                ssl=self.ssl, server_hostname=self.server_name or endpoint.host)
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
                new.append(ep)
        self.endpoints = new
        for gone in old.values():
            gone.removed = True
            for pool in gone.pools.values():
                pool.close()  # idle ones now; busy ones once their exchange ends

    def close(self) -> None:
        for ep in self.endpoints:
            for pool in ep.pools.values():
                pool.close()

    def snapshot(self) -> dict:
        return {
            "name": self.name, "panicking": self.panicking, **self.stats,
            "endpoints": [
                {"address": ep.label, "weight": ep.weight, "outstanding": ep.outstanding,
                 "breaker": ep.breaker.state_name if ep.breaker is not None else "none",
                 "pools": [p.snapshot() for p in ep.pools.values()]}
                for ep in self.endpoints],
        }
