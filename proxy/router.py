"""Routes: first match wins; a route without a match is the default.

Match kinds: method name (exact, prefix `get_*`, or any glob), multiplexed
service name (the `Svc` of `Svc:method`), THeader header values (exact,
regex, present), each optionally inverted. A route names one cluster or
weighted clusters (canary splits, picked with the injected RNG).

Routes that do not look at headers depend only on the message name, so the
router caches name → route (bounded) and the hot path is one dict lookup.
"""

from __future__ import annotations

import fnmatch
import random as random_mod
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

_CACHE_MAX = 4096


@dataclass(frozen=True, slots=True)
class HeaderMatch:
    name: str
    exact: str | None = None
    regex: re.Pattern | None = None
    present: bool | None = None

    def __call__(self, headers: dict[str, str]) -> bool:
        v = headers.get(self.name)
        if self.present is not None:
            return (v is not None) == self.present
        if v is None:
            return False
        if self.exact is not None:
            return v == self.exact
        if self.regex is not None:
            return self.regex.fullmatch(v) is not None
        return True


def method_matcher(pattern: str) -> Callable[[str], bool]:
    """Exact name, or a glob (`get_*`, `*_v2`, `[gs]et_user`)."""
    if not any(c in pattern for c in "*?["):
        return pattern.__eq__
    if pattern.endswith("*") and not any(c in pattern[:-1] for c in "*?["):
        prefix = pattern[:-1]
        return lambda name: name.startswith(prefix)
    rx = re.compile(fnmatch.translate(pattern))
    return lambda name: rx.match(name) is not None


@dataclass(slots=True)
class Route:
    """A compiled route: a match and where calls go, plus per-route call settings."""

    clusters: Sequence[Any]                  # runtime Cluster objects
    weights: Sequence[int] = (1,)
    method: Callable[[str], bool] | None = None
    service: str | None = None
    headers: Sequence[HeaderMatch] = ()
    invert: bool = False
    strip_service: bool = False
    settings: Any = None                     # the route's config (timeout, retry, slow_call, ...)
    rng: random_mod.Random = field(default_factory=random_mod.Random)
    index: int = 0

    def matches(self, service: str | None, method: str, headers: dict[str, str]) -> bool:
        ok = True
        if self.method is not None and not self.method(method):
            ok = False
        elif self.service is not None and service != self.service:
            ok = False
        elif self.headers and not all(h(headers) for h in self.headers):
            ok = False
        return ok != self.invert

    @property
    def is_default(self) -> bool:
        return self.method is None and self.service is None and not self.headers and not self.invert

    def pick_cluster(self):
        clusters = self.clusters
        if len(clusters) == 1:
            return clusters[0]
        x = self.rng.random() * sum(self.weights)
        for c, w in zip(clusters, self.weights):
            x -= w
            if x < 0:
                return c
        return clusters[-1]


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        self._by_headers = any(r.headers for r in self.routes)
        self._cache: dict[str, Route | None] = {}

    def route(self, msg) -> Route | None:
        name = msg.name
        if not self._by_headers:
            try:
                return self._cache[name]
            except KeyError:
                pass
        r = self._match(msg.service, msg.method, msg.headers if self._by_headers else {})
        if not self._by_headers:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[name] = r
        return r

    def _match(self, service: str | None, method: str, headers: dict[str, str]) -> Route | None:
        for r in self.routes:
            if r.matches(service, method, headers):
                return r
        return None
