"""Retry policy on a manual clock: budget, backoff bounds, the decision table, concurrency limits."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from proxy import calls, config
from proxy.clock import ManualClock
from proxy.retry import ConcurrencyLimits, RetryBudget, RetryPolicy, SlidingCounts, backoff


# the retry budget ------------------------------------------------------------------

def budget(ratio=0.2, min_per_second=10.0, window=10.0, start=1000.0):
    clock = ManualClock(start)
    return RetryBudget(ratio, min_per_second, window, clock), clock


@pytest.mark.parametrize("ratio,min_per_second,window,calls_n,wanted,allowed", [
    (0.2, 10.0, 10.0, 1000, 2, 300),   # Finagle's defaults: 20% + 10/s × 10s
    (0.2, 10.0, 10.0, 1000, 1, 300),
    (0.2, 10.0, 10.0, 100, 3, 120),
    (0.5, 0.0, 10.0, 1000, 2, 500),
    (0.0, 5.0, 2.0, 1000, 2, 10),
    (0.0, 0.0, 10.0, 1000, 2, 0),
    (1.0, 1.0, 10.0, 50, 3, 60),
])
def test_budget_under_total_failure(ratio, min_per_second, window, calls_n, wanted, allowed):
    """Every call fails and wants `wanted` retries; calls spread evenly over one window."""
    b, clock = budget(ratio, min_per_second, window)
    retries = 0
    for i in range(calls_n):
        clock.now = 1000.0 + i * window / calls_n
        b.deposit()
        for _ in range(wanted):
            if not b.try_withdraw():
                break
            retries += 1
    assert retries == allowed
    assert abs(retries - (ratio * calls_n + min_per_second * window)) <= 1 or \
        retries == wanted * calls_n
    assert b.balance() == 0 or retries == wanted * calls_n


def test_total_outage_attempts_stay_within_calls_plus_budget():
    """The issue's bound: attempts ≤ calls + ratio × calls + min_per_second × window."""
    b, clock = budget()
    policy = RetryPolicy(config.Retry(attempts=3, idempotent=True), retry_buffer=1 << 20)
    attempts = 0
    for i in range(1000):
        clock.now = 1000.0 + i * 0.01
        b.deposit()
        n = 1
        attempts += 1
        while True:
            retry, _ = policy.decide(calls.NOT_SENT, n, "get_user", 100)
            if not retry or not b.try_withdraw():
                break
            n += 1
            attempts += 1
    assert attempts == 1300


def test_budget_reserve_alone():
    b, _ = budget(ratio=0.2, min_per_second=10.0, window=10.0)
    assert b.balance() == 100
    assert sum(b.try_withdraw() for _ in range(150)) == 100
    assert b.balance() == 0
    assert b.exhausted == 50
    assert b.snapshot() == {"calls": 0, "retries": 100, "balance": 0, "exhausted": 50}


def test_budget_recovers_as_the_window_slides():
    b, clock = budget()
    for _ in range(1000):                 # a burst in the slice [1000, 1001)
        b.deposit()
    assert sum(b.try_withdraw() for _ in range(400)) == 300
    clock.now = 1005.0
    for _ in range(500):
        b.deposit()
    assert b.balance() == 100             # 0.2 × 1500 + 100 − 300
    clock.now = 1009.999                  # the burst's slice is still inside
    assert b.balance() == 100
    clock.now = 1010.0                    # ...and now it left: its calls and retries with it
    assert b.balance() == 200             # 0.2 × 500 + 100
    clock.now = 1015.0
    assert b.balance() == 100             # only the reserve
    assert b.try_withdraw() is True


def test_budget_from_config():
    b = RetryBudget.from_config(config.RetryBudget(ratio=0.5, min_per_second=2.0, window=5.0),
                                ManualClock())
    for _ in range(10):
        b.deposit()
    assert b.balance() == 15


def test_budget_in_every_window_of_a_long_run():
    """100 calls/s for 60 s, each wanting one retry: every 10-slice window gets exactly its budget."""
    b, clock = budget()
    per_slice = {}                        # slice → [calls, retries]
    for i in range(6000):
        clock.now = 1000.0 + i * 0.01
        b.deposit()
        got = b.try_withdraw()
        c = per_slice.setdefault(int(clock.now), [0, 0])
        c[0] += 1
        c[1] += got
    slices = sorted(per_slice)
    for k in range(len(slices) - 9):
        win = [per_slice[s] for s in slices[k:k + 10]]
        n, r = sum(c for c, _ in win), sum(r for _, r in win)
        assert (n, r) == (1000, 300)          # the bound, reached exactly: 0.2 × 1000 + 10 × 10
    # the reserve is spent in a burst as the slice that held the last burst leaves the window
    assert [per_slice[s][1] for s in slices[:12]] == [100, 40] + [20] * 8 + [100, 40]


def test_sliding_counts_slices():
    clock = ManualClock(0.0)
    w = SlidingCounts(10.0, clock)
    w.add(1, 1)
    clock.now = 4.5
    w.add(2, 0)
    assert w.totals() == (3, 1)
    clock.now = 10.0                      # slice 0 left
    assert w.totals() == (2, 0)
    clock.now = 13.999                    # slices 4..13 are the window
    assert w.totals() == (2, 0)
    clock.now = 14.0                      # slice 4 left: 9.5 s after its count was added
    assert w.totals() == (0, 0)
    w.add(5, 5)
    clock.now = 1e6                       # a long jump clears everything at once
    assert w.totals() == (0, 0)
    clock.now = 10.0                      # a clock stepping back writes into the newest slice
    w.add(1, 0)
    assert w.totals() == (1, 0)


# backoff -----------------------------------------------------------------------------

class FixedRng:
    def __init__(self, value):
        self.value = value

    def random(self):
        return self.value


@pytest.mark.parametrize("attempt,base,max_,draw,want", [
    (1, 0.025, 0.25, 0.5, 0.0125),
    (2, 0.025, 0.25, 1.0, 0.05),
    (3, 0.025, 0.25, 1.0, 0.1),
    (4, 0.025, 0.25, 1.0, 0.2),
    (5, 0.025, 0.25, 1.0, 0.25),      # capped
    (5, 0.025, 0.25, 0.0, 0.0),
    (10_000, 0.025, 0.25, 0.5, 0.125),  # no overflow for huge attempt numbers
])
def test_backoff_exact(attempt, base, max_, draw, want):
    assert backoff(attempt, base, max_, FixedRng(draw)) == pytest.approx(want, abs=1e-15)


def test_backoff_rejects_attempt_zero():
    with pytest.raises(ValueError):
        backoff(0, 0.025, 0.25, random.Random(1))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 8, 30])
def test_backoff_bounds_and_mean(seed, attempt):
    rng = random.Random(seed)
    base, max_ = 0.025, 0.25
    cap = min(max_, base * 2 ** (attempt - 1))
    draws = [backoff(attempt, base, max_, rng) for _ in range(4000)]
    assert all(0.0 <= d <= cap for d in draws)
    assert 0.45 * cap <= statistics.fmean(draws) <= 0.55 * cap
    assert max(draws) > 0.95 * cap and min(draws) < 0.05 * cap   # full jitter spans the range


def test_policy_backoff_uses_route_bounds():
    p = RetryPolicy(config.Retry(attempts=3, backoff=config.Backoff(base=0.1, max=0.3)), 0)
    assert p.backoff(1, FixedRng(1.0)) == 0.1
    assert p.backoff(2, FixedRng(1.0)) == 0.2
    assert p.backoff(3, FixedRng(1.0)) == 0.3


# the decision table ---------------------------------------------------------------------

BUFFER = 1000
IDEMPOTENCE = {"true": True, "false": False, "globs": ["get_*", "[gs]et_user"]}
METHODS = ["get_user", "set_user", "delete_user"]     # the globs match the first two
OUTCOMES = [calls.SUCCESS, calls.DECLARED_EXCEPTION, calls.APP_EXCEPTION, calls.NOT_SENT,
            calls.MAY_HAVE_RUN, calls.TIMEOUT, calls.BAD_REQUEST, calls.NO_ROUTE]


def expected(outcome, idem, method, attempt, size, field):
    """The rule, stated once as a table."""
    may_run = {calls.APP_EXCEPTION, calls.MAY_HAVE_RUN, calls.TIMEOUT}
    idempotent = idem == "true" or (idem == "globs" and method in ("get_user", "set_user"))
    if outcome == calls.DECLARED_EXCEPTION:
        if field != 2:                        # on_exceptions: [2]
            return False
        may_run = {outcome}
    elif outcome != calls.NOT_SENT and outcome not in may_run:
        return False
    if attempt >= 3 or size > BUFFER:
        return False
    return outcome == calls.NOT_SENT or idempotent


@pytest.mark.parametrize("idem", list(IDEMPOTENCE))
def test_decision_table(idem):
    """Every outcome × method × attempt number × request size × result field, for one idempotence."""
    # (on_exceptions without idempotent is a config error: the declared exception is then as any)
    p = RetryPolicy(config.Retry(attempts=3, idempotent=IDEMPOTENCE[idem],
                                 on_exceptions=[2] if idem != "false" else []), BUFFER)
    wrong = []
    for case in itertools.product(OUTCOMES, METHODS, [1, 2, 3, 4], [0, BUFFER, BUFFER + 1],
                                  [None, 1, 2]):
        outcome, method, attempt, size, field = case
        retry, reason = p.decide(outcome, attempt, method, size, field)
        want = expected(outcome, idem, method, attempt, size, field)
        if retry is not want or (retry and reason != outcome):
            wrong.append((case, retry, reason))
    assert wrong == []
    # the table is not trivially "no": yes-cases = outcomes × methods × attempts 1-2 × sizes ≤ buffer
    # × fields — not_sent 3×2×2×3 = 36; may-run (3 outcomes) 36 per idempotent method; field 2 4 each
    yes = sum(want for *_, want in [(c, expected(c[0], idem, *c[1:])) for c in itertools.product(
        OUTCOMES, METHODS, [1, 2, 3, 4], [0, BUFFER, BUFFER + 1], [None, 1, 2])])
    assert yes == {"true": 36 + 3 * 36 + 3 * 4, "false": 36, "globs": 36 + 2 * 36 + 2 * 4}[idem]


@pytest.mark.parametrize("args,want", [
    ((calls.NOT_SENT, 1, "delete_user", 10), (True, "not_sent")),
    ((calls.TIMEOUT, 1, "get_user", 10), (True, "timeout")),
    ((calls.TIMEOUT, 1, "delete_user", 10), (False, "timeout: 'delete_user' is not idempotent")),
    ((calls.MAY_HAVE_RUN, 1, "Get_user", 10), (False, "may_have_run: 'Get_user' is not idempotent")),
    ((calls.NOT_SENT, 3, "get_user", 10), (False, "attempts exhausted (3 of 3)")),
    ((calls.NOT_SENT, 1, "get_user", 1001), (False, "request larger than retry_buffer (1001 > 1000 bytes)")),
    ((calls.SUCCESS, 1, "get_user", 10), (False, "success is not retried")),
    ((calls.DECLARED_EXCEPTION, 1, "get_user", 10, 1), (False, "exception 1 not in on_exceptions")),
    ((calls.DECLARED_EXCEPTION, 1, "get_user", 10, 2), (True, "declared_exception")),
    ((calls.DECLARED_EXCEPTION, 1, "get_user", 10, None), (False, "exception None not in on_exceptions")),
])
def test_decision_reasons(args, want):
    p = RetryPolicy(config.Retry(attempts=3, idempotent=["get_*"], on_exceptions=[2]), BUFFER)
    assert p.decide(*args) == want


def test_single_attempt_never_retries():
    p = RetryPolicy(config.Retry(), BUFFER)                 # attempts: 1 by default
    assert p.decide(calls.NOT_SENT, 1, "m", 0) == (False, "attempts exhausted (1 of 1)")


def test_exception_names_resolve_per_method():
    ids = {"get_user": {"NotFound": 1, "Busy": 2}, "put_user": {"Busy": 1, "Invalid": 2},
           "ping": {}}
    p = RetryPolicy(config.Retry(attempts=2, idempotent=True, on_exceptions=["Busy", 7]), BUFFER, ids)
    decide = lambda method, field: p.decide(calls.DECLARED_EXCEPTION, 1, method, 0, field)[0]
    assert [decide("get_user", f) for f in (1, 2, 7)] == [False, True, True]
    assert [decide("put_user", f) for f in (1, 2, 7)] == [True, False, True]
    assert [decide("ping", f) for f in (1, 2, 7)] == [False, False, True]


def test_unresolvable_exception_names_are_loud():
    with pytest.raises(ValueError, match="need the listener's idl"):
        RetryPolicy(config.Retry(attempts=2, idempotent=True, on_exceptions=["Busy"]), BUFFER)
    with pytest.raises(ValueError, match=r"\['Gone'\] declared by no method"):
        RetryPolicy(config.Retry(attempts=2, idempotent=True, on_exceptions=["Busy", "Gone"]), BUFFER,
                    {"m": {"Busy": 1}})


# concurrency limits ------------------------------------------------------------------------

@pytest.mark.parametrize("kind,key", [("request", "requests"), ("pending", "pending"),
                                      ("retry", "retries")])
def test_limits_fail_fast_at_the_max(kind, key):
    lim = ConcurrencyLimits(config.Limits(max_pending=2, max_requests=2, max_retries=2))
    enter, leave = getattr(lim, f"try_enter_{kind}"), getattr(lim, f"leave_{kind}")
    assert [enter() for _ in range(4)] == [True, True, False, False]
    assert lim.overflow[key] == 2
    leave()
    assert enter() is True
    assert enter() is False
    leave(); leave()
    with pytest.raises(RuntimeError):
        leave()
    others = {"requests", "pending", "retries"} - {key}
    assert all(lim.overflow[o] == 0 for o in others)


def test_limits_zero_refuses_everything():
    # (the config refuses max_pending 0, see test_config; the policy itself still means it)
    lim = ConcurrencyLimits(config.Limits.model_construct(max_pending=0, max_requests=1024, max_retries=0))
    assert lim.try_enter_pending() is False
    assert lim.try_enter_retry() is False
    assert lim.try_enter_request() is True
    assert lim.snapshot() == {"pending": 0, "max_pending": 0, "requests": 1, "max_requests": 1024,
                              "retries": 0, "max_retries": 0,
                              "overflow": {"pending": 1, "requests": 0, "retries": 1}}
