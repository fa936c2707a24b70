"""Attach a cluster's resilience state: retry budget, concurrency limits, per-endpoint breakers.

Breaker transitions are logged once with their reason and counted per
cluster (`transitions` in /stats). Endpoints added later by discovery get a
breaker through the cluster's `endpoint_setup` hook.
"""

from __future__ import annotations

import logging
from typing import Callable

from proxy import config as cfgmod
from proxy.breaker import Breaker
from proxy.retry import ConcurrencyLimits, RetryBudget

log = logging.getLogger(__name__)


def attach(cluster, settings: cfgmod.Cluster, clock: Callable[[], float]) -> None:
    cluster.budget = RetryBudget.from_config(settings.retry_budget, clock)
    cluster.limits = ConcurrencyLimits(settings.limits)
    cluster.stats.setdefault("breaker_transitions", 0)

    def give_breaker(ep) -> None:
        def on_transition(old, new, reason: str) -> None:
            cluster.stats["breaker_transitions"] += 1
            log.warning("breaker of %s in cluster %s: %s -> %s (%s)", ep.label, cluster.name,
                        old.value, new.value, reason)
        ep.breaker = Breaker(settings.circuit_breaker, clock, on_transition)

    for ep in cluster.endpoints:
        give_breaker(ep)
    cluster.endpoint_setup = give_breaker
