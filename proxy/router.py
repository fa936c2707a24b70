"""Routes: which cluster a call goes to. First match wins; a route without a match is the default.

Match kinds, all of a route's tests must hold (then `invert` flips the result):
    method    exact name, prefix (`get_*`) or any glob (`[gs]et_?ser`), on the bare name
    service   the multiplexed service (the `Svc` of `Svc:method`); a plain call has none
    header    THeader info headers: exact value, regex (full match), or present / absent
A route names one cluster or weighted clusters (canary splits, picked with the
injected RNG). `strip_service` is applied by the pipeline when it writes the
request (`proxy.codec.rename.strip_service`).

Hot path: a route's name tests depend only on the message name, so the router
keeps, per name (bounded), what is left to decide: the routes whose outcome
depends on headers, in order, and the route that wins if none of them does.
Without header routes that is one dict lookup.
"""

from __future__ import annotations

import fnmatch
import random as random_mod
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import re2

_CACHE_MAX = 4096
_CACHE_NAME_MAX = 256  # longer names (a real method has none) are planned each time, not kept


@dataclass(frozen=True, slots=True)
class HeaderMatch:
    """One THeader header test: exactly one of exact, regex or present is set."""

    name: str
    exact: str | None = None
    regex: Any = None  # compile_regex's
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


def compile_regex(pattern: str):
    """A header regex, compiled by RE2 (google-re2), as Envoy's `safe_regex`: matching takes time
    linear in the value. Python's backtracking `re` would let one client's header stall the
    whole proxy: `(a+)+` against 28 a's and a '!' held the loop 13 s. RE2 has no backreferences
    or lookaround; anything it cannot compile raises ValueError, with what it said."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as e:
        why = e.args[0] if e.args else e
        if isinstance(why, bytes):
            why = why.decode("utf-8", "replace")
        raise ValueError(f"invalid regex (RE2 syntax, as Envoy's safe_regex): {why}") from None


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # (the error is ours to say, at its key: not a line on stderr)


def method_matcher(pattern: str) -> Callable[[str], bool]:
    """Exact name, a prefix (`get_*`), or any other glob (`*_v2`, `[gs]et_user`); case-sensitive."""
    if not any(c in pattern for c in "*?["):
        return pattern.__eq__
    if pattern.endswith("*") and not any(c in pattern[:-1] for c in "*?["):
        prefix = pattern[:-1]
        return lambda name: name.startswith(prefix)
    rx = re.compile(fnmatch.translate(pattern))  # translate() anchors at the end; match() at the start
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

    def name_matches(self, service: str | None, method: str) -> bool:
        """The method and service tests only (before `invert`)."""
        if self.method is not None and not self.method(method):
            return False
        return self.service is None or service == self.service

    def matches(self, service: str | None, method: str, headers: dict[str, str]) -> bool:
        ok = self.name_matches(service, method) and all(h(headers) for h in self.headers)
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
        for c, w in zip(reversed(clusters), reversed(self.weights)):  # float rounding at the top end
            if w:
                return c
        return clusters[-1]


def _split(name: str) -> tuple[str | None, str]:
    i = name.find(":")
    return (name[:i], name[i + 1:]) if i >= 0 else (None, name)


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        # name -> (routes still to test on headers, in order; the route if none matches)
        self._cache: dict[str, tuple[tuple[Route, ...], Route | None]] = {}

    def route(self, msg) -> Route | None:
        name = msg.name
        plan = self._cache.get(name)
        if plan is None:
            plan = self._plan(name)
        pending, fallback = plan
        if pending:
            headers = msg.headers
            for r in pending:
                if all(h(headers) for h in r.headers) != r.invert:
                    return r
        return fallback

    def _plan(self, name: str) -> tuple[tuple[Route, ...], Route | None]:
        """What the name alone decides. A header route whose name tests fail is settled too:
        it matches exactly when inverted."""
        service, method = _split(name)
        pending: list[Route] = []
        fallback = None
        for r in self.routes:
            name_ok = r.name_matches(service, method)
            if r.headers and name_ok:
                pending.append(r)
                continue
            if name_ok != r.invert:
                fallback = r
                break
        plan = (tuple(pending), fallback)
        if len(name) <= _CACHE_NAME_MAX:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[name] = plan
        return plan

    def match(self, service: str | None, method: str, headers: dict[str, str]) -> Route | None:
        """The plain first-match scan (what `route` computes, without the cache)."""
        for r in self.routes:
            if r.matches(service, method, headers):
                return r
        return None
