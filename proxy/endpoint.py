"""An upstream endpoint: address, weight, load counters, and its pools.

The balancer reads `outstanding` and `ewma`; the cluster skips an endpoint
whose breaker (resilience) refuses or whose health check (health) fails, and
one that joined a health-checked cluster until its first check (`pending`).
Pools are keyed by (framing, protocol) here — the endpoint and TLS are the
endpoint's own — so the full pool key is (endpoint, framing, protocol, TLS).
"""

from __future__ import annotations

from time import monotonic

from proxy.ewma import PeakEwmaEstimator


class Endpoint:
    __slots__ = ("host", "port", "weight", "outstanding", "ewma", "pools", "removed", "label",
                 "breaker", "healthy", "pending", "streak", "calls", "failures")

    def __init__(self, host: str, port: int, weight: int = 1, clock=monotonic) -> None:
        self.host = host
        self.port = port
        self.weight = weight
        self.outstanding = 0
        self.ewma = PeakEwmaEstimator(clock)
        self.pools: dict = {}
        self.removed = False
        self.label = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.breaker = None
        self.healthy = True          # False while active health checks fail (proxy.health)
        self.pending = False         # True (and healthy False) until its first health check answers
        self.streak = 0              # health checks in a row that disagree with `healthy`
        self.calls = 0
        self.failures = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.port)

    def __repr__(self) -> str:
        return f"Endpoint({self.label}, w={self.weight}, out={self.outstanding})"
