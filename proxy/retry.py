"""Retry policy: which failed attempts may be retried, the retry budget, backoff, limits.

Owns: the per-route decision (`RetryPolicy.decide`), the per-cluster retry
budget (`RetryBudget`), backoff delays (`backoff`), the per-cluster
concurrency counters (`ConcurrencyLimits`), and the sliding time window the
budget and the breaker share (`SlidingCounts`). Pure: no asyncio, no
sockets, no sleeping; the clock (seconds) and the RNG are injected. Leaves to
the pipeline: timers, picking another endpoint, and the order of the checks:

    attempt ended with `outcome`
      └─ policy.decide(...)           may this outcome be retried at all?      no → answer
         └─ limits.try_enter_retry()  a retry slot in the cluster?             no → answer
            └─ budget.try_withdraw()  the cluster's budget allows one more?    no → answer
               └─ wait backoff(n, ...), then attempt n+1 (leave_retry() when it ends)

Every client call deposits into its cluster's budget exactly once
(`budget.deposit()`), whether or not it is ever retried; retries do not
deposit. So in any window, attempts ≤ calls + ratio × calls + min_per_second × window.
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Callable, Mapping

from proxy import calls, config
from proxy.window import SlidingCounts


class RetryBudget:
    """Finagle's retry budget, per cluster: retries in the window ≤ ratio × calls + reserve.

    reserve = min_per_second × window, so a quiet cluster can still retry a little.
    Calls and retries expire together as the window slides.
    """

    __slots__ = ("ratio", "reserve", "counts", "exhausted")

    def __init__(self, ratio: float, min_per_second: float, window: float,
                 clock: Callable[[], float]) -> None:
        self.ratio = ratio
        self.reserve = min_per_second * window
        self.counts = SlidingCounts(window, clock)  # (calls, retries)
        self.exhausted = 0  # refused withdrawals, for stats

    @classmethod
    def from_config(cls, settings: config.RetryBudget, clock: Callable[[], float]) -> RetryBudget:
        return cls(settings.ratio, settings.min_per_second, settings.window, clock)

    def deposit(self) -> None:
        """One client call (not one attempt) reached the cluster."""
        self.counts.add(1, 0)

    def _allowed(self) -> float:
        n, retries = self.counts.totals()
        # the epsilon keeps 0.2 × 1000 from landing at 199.99999999999997
        return self.ratio * n + self.reserve - retries + 1e-9

    def try_withdraw(self) -> bool:
        """Spend one retry if the window allows it."""
        if self._allowed() >= 1:
            self.counts.add(0, 1)
            return True
        self.exhausted += 1
        return False

    def balance(self) -> int:
        """Retries the budget would allow right now."""
        return max(0, math.floor(self._allowed()))

    def snapshot(self) -> dict:
        n, retries = self.counts.totals()
        return {"calls": n, "retries": retries, "balance": self.balance(), "exhausted": self.exhausted}


def backoff(attempt: int, base: float, max: float, rng) -> float:
    """Delay before the retry that follows failed attempt `attempt` (1-based): full jitter.

    uniform(0, min(max, base × 2^(attempt−1))); `rng` has `.random()` (random.Random).
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    cap = max if attempt > 60 else min(max, base * 2.0 ** (attempt - 1))
    return rng.random() * cap


# Outcomes a retry may follow, and whether the request may already have run.
_NEVER_RAN = frozenset({calls.NOT_SENT})
_MAY_HAVE_RUN = frozenset({calls.MAY_HAVE_RUN, calls.TIMEOUT, calls.APP_EXCEPTION})


class RetryPolicy:
    """A route's retry rules (`config.Retry` + `retry_buffer`): may this failed attempt be retried?

    `exception_ids` resolves `on_exceptions` names: method → {exception name:
    result field id}, from the listener's IDL. Per method, because the same
    exception may sit at a different field id in each method's result.
    Field ids listed as numbers apply to every method. A name that no method
    declares is a configuration error (ValueError).
    """

    __slots__ = ("attempts", "retry_buffer", "backoff_base", "backoff_max", "_all_methods",
                 "_idempotent", "_ids", "_named")

    def __init__(self, retry: config.Retry, retry_buffer: int,
                 exception_ids: Mapping[str, Mapping[str, int]] | None = None) -> None:
        self.attempts = retry.attempts
        self.retry_buffer = retry_buffer
        self.backoff_base = retry.backoff.base
        self.backoff_max = retry.backoff.max
        idem = retry.idempotent
        self._all_methods = idem is True
        self._idempotent = (re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in idem))
                            if isinstance(idem, tuple) and idem else None)
        self._ids = frozenset(e for e in retry.on_exceptions if isinstance(e, int))
        names = {e for e in retry.on_exceptions if isinstance(e, str)}
        self._named: dict[str, frozenset[int]] = {}
        if names:
            if not exception_ids:
                raise ValueError(f"on_exceptions names {sorted(names)} need the listener's idl")
            seen: set[str] = set()
            for method, declared in exception_ids.items():
                ids = frozenset(fid for name, fid in declared.items() if name in names)
                seen.update(name for name in declared if name in names)
                if ids:
                    self._named[method] = ids
            if names - seen:
                raise ValueError(f"on_exceptions: {sorted(names - seen)} declared by no method in the idl")

    def idempotent(self, method: str) -> bool:
        """`idempotent: true`, or the bare method name matches one of its globs (case-sensitive)."""
        return self._all_methods or (self._idempotent is not None
                                     and self._idempotent.match(method) is not None)

    def decide(self, outcome: str, attempt_number: int, method: str, request_size: int,
               result_field: int | None = None) -> tuple[bool, str]:
        """(retry?, reason) after attempt `attempt_number` (1-based) ended with `outcome`.

        A yes gives the outcome as the reason (it becomes the next attempt's
        retry reason); a no says why. The budget and the retry limit are
        checked after this, by the pipeline.
        """
        if outcome == calls.DECLARED_EXCEPTION:
            if result_field is None or not (result_field in self._ids
                                             or result_field in self._named.get(method, ())):
                return False, f"exception {result_field} not in on_exceptions"
        elif outcome not in _NEVER_RAN and outcome not in _MAY_HAVE_RUN:
            return False, f"{outcome} is not retried"
        if attempt_number >= self.attempts:
            return False, f"attempts exhausted ({attempt_number} of {self.attempts})"
        if request_size > self.retry_buffer:
            return False, f"request larger than retry_buffer ({request_size} > {self.retry_buffer} bytes)"
        if outcome not in _NEVER_RAN and not self.idempotent(method):
            return False, f"{outcome}: '{method}' is not idempotent"
        return True, outcome

    def backoff(self, attempt_number: int, rng) -> float:
        """The delay before the retry after attempt `attempt_number`, with this route's bounds."""
        return backoff(attempt_number, self.backoff_base, self.backoff_max, rng)


class ConcurrencyLimits:
    """A cluster's `limits`: counters that fail fast (the caller answers "not sent").

    max_pending  calls waiting for a pool connection (0 = none may wait)
    max_requests calls in flight in the cluster
    max_retries  retries in flight (0 = no retries)
    Each successful try_enter_* must be paired with its leave_*.
    """

    __slots__ = ("max_pending", "max_requests", "max_retries", "pending", "requests", "retries",
                 "overflow")

    def __init__(self, limits: config.Limits) -> None:
        self.max_pending = limits.max_pending
        self.max_requests = limits.max_requests
        self.max_retries = limits.max_retries
        self.pending = self.requests = self.retries = 0
        self.overflow = {"pending": 0, "requests": 0, "retries": 0}  # refusals, for stats

    def try_enter_request(self) -> bool:
        if self.requests >= self.max_requests:
            self.overflow["requests"] += 1
            return False
        self.requests += 1
        return True

    def leave_request(self) -> None:
        if self.requests <= 0:
            raise RuntimeError("leave_request() without try_enter_request()")
        self.requests -= 1

    def try_enter_pending(self) -> bool:
        if self.pending >= self.max_pending:
            self.overflow["pending"] += 1
            return False
        self.pending += 1
        return True

    def leave_pending(self) -> None:
        if self.pending <= 0:
            raise RuntimeError("leave_pending() without try_enter_pending()")
        self.pending -= 1

    def try_enter_retry(self) -> bool:
        if self.retries >= self.max_retries:
            self.overflow["retries"] += 1
            return False
        self.retries += 1
        return True

    def leave_retry(self) -> None:
        if self.retries <= 0:
            raise RuntimeError("leave_retry() without try_enter_retry()")
        self.retries -= 1

    def snapshot(self) -> dict:
        return {"pending": self.pending, "max_pending": self.max_pending,
                "requests": self.requests, "max_requests": self.max_requests,
                "retries": self.retries, "max_retries": self.max_retries,
                "overflow": dict(self.overflow)}
