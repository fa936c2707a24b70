"""Breaker policy on a manual clock: transitions and their reasons, open time, probes, windows, panic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from proxy import calls, config
from proxy.breaker import (CLOSED, EDGES, HALF_OPEN, OPEN, Breaker, State, classify_for_breaker,
                           panicking)
from proxy.clock import ManualClock


def make(**kw):
    clock = ManualClock()
    seen: list[tuple[State, State, str]] = []
    b = Breaker(config.CircuitBreaker(**kw), clock, lambda old, new, why: seen.append((old, new, why)))
    return b, clock, seen


def run(b: Breaker, clock: ManualClock, steps) -> None:
    """A tiny script: ("fail", n) / ("ok", n) picked and recorded, ("advance", s),
    ("allows", expected), ("pick",), ("release",), ("record", ok)."""
    tokens = []  # probe tokens of ("pick",)s not yet ended, oldest first
    for step in steps:
        op = step[0]
        if op in ("fail", "ok"):
            for _ in range(step[1]):
                b.record(op == "ok", b.on_pick())
        elif op == "advance":
            clock.advance(step[1])
        elif op == "allows":
            assert b.allows() is step[1], step
        elif op == "pick":
            tokens.append(b.on_pick())
        elif op == "release":
            b.release(tokens.pop(0) if tokens else 0)
        elif op == "record":
            b.record(step[1], tokens.pop(0) if tokens else 0)
        else:
            raise AssertionError(op)


TABLE = [
    ("consecutive failures open",
     dict(consecutive_failures=5), [("fail", 5)],
     [(CLOSED, OPEN, "5 consecutive failures")], OPEN),
    ("a success resets the run",
     dict(consecutive_failures=5), [("fail", 4), ("ok", 1), ("fail", 4)],
     [], CLOSED),
    ("failure rate opens once min_calls were seen",
     dict(consecutive_failures=0, failure_rate=0.5, min_calls=8, window=10.0),
     [("fail", 1), ("ok", 1)] * 3 + [("ok", 1), ("fail", 1)],
     [(CLOSED, OPEN, "failure rate 50% over 10s (8 calls)")], OPEN),
    ("failure rate below the threshold stays closed",
     dict(consecutive_failures=0, failure_rate=0.5, min_calls=8),
     [("fail", 1), ("ok", 2)] * 10,
     [], CLOSED),
    ("failure rate names its share",
     dict(consecutive_failures=0, failure_rate=0.6, min_calls=8, window=10.0),
     [("ok", 3), ("fail", 5)],
     [(CLOSED, OPEN, "failure rate 62% over 10s (8 calls)")], OPEN),
    ("open time elapses lazily, on allows()",
     dict(consecutive_failures=2, open_for=5.0), [("fail", 2), ("advance", 5.0)],
     [(CLOSED, OPEN, "2 consecutive failures")], OPEN),
    ("open → half-open when asked after the open time",
     dict(consecutive_failures=2, open_for=5.0),
     [("fail", 2), ("advance", 4.999), ("allows", False), ("advance", 0.001), ("allows", True)],
     [(CLOSED, OPEN, "2 consecutive failures"), (OPEN, HALF_OPEN, "open time 5s elapsed")],
     HALF_OPEN),
    ("a probe success closes",
     dict(consecutive_failures=2, open_for=5.0),
     [("fail", 2), ("advance", 5.0), ("allows", True), ("ok", 1)],
     [(CLOSED, OPEN, "2 consecutive failures"), (OPEN, HALF_OPEN, "open time 5s elapsed"),
      (HALF_OPEN, CLOSED, "probe succeeded")], CLOSED),
    ("a probe failure reopens",
     dict(consecutive_failures=2, open_for=5.0),
     [("fail", 2), ("advance", 5.0), ("allows", True), ("fail", 1)],
     [(CLOSED, OPEN, "2 consecutive failures"), (OPEN, HALF_OPEN, "open time 5s elapsed"),
      (HALF_OPEN, OPEN, "probe failed")], OPEN),
    ("three probes must succeed",
     dict(consecutive_failures=1, open_for=5.0, half_open_probes=3),
     [("fail", 1), ("advance", 5.0), ("allows", True), ("ok", 2)],
     [(CLOSED, OPEN, "1 consecutive failure"), (OPEN, HALF_OPEN, "open time 5s elapsed")],
     HALF_OPEN),
    ("three probes succeeded",
     dict(consecutive_failures=1, open_for=5.0, half_open_probes=3),
     [("fail", 1), ("advance", 5.0), ("allows", True), ("ok", 3)],
     [(CLOSED, OPEN, "1 consecutive failure"), (OPEN, HALF_OPEN, "open time 5s elapsed"),
      (HALF_OPEN, CLOSED, "3 probes succeeded")], CLOSED),
    ("results arriving while open change nothing",
     dict(consecutive_failures=1, open_for=5.0),
     [("fail", 1), ("record", True), ("record", False), ("advance", 4.0), ("allows", False)],
     [(CLOSED, OPEN, "1 consecutive failure")], OPEN),
    ("both rules off: never opens",
     dict(consecutive_failures=0, failure_rate=0.0, min_calls=1), [("fail", 500)],
     [], CLOSED),
]


@pytest.mark.parametrize("name,kw,steps,want,final", TABLE, ids=[t[0] for t in TABLE])
def test_transitions(name, kw, steps, want, final):
    b, clock, seen = make(**kw)
    run(b, clock, steps)
    assert seen == want
    assert b.state is final
    assert b.state_name == final.value


def test_open_time_grows_per_consecutive_opening_and_caps():
    b, clock, seen = make(consecutive_failures=1, open_for=5.0, max_open_for=60.0)
    lengths = []
    b.record(False, 0)
    for _ in range(7):
        start = clock()
        lengths.append(b.open_until - start)
        assert b.opened_count == len(lengths)
        clock.advance(lengths[-1] - 0.001)
        assert b.allows() is False
        clock.advance(0.001)
        assert b.allows() is True
        b.record(False, b.on_pick())  # probe failed: open again, longer
    assert lengths == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert [why for _, _, why in seen if why.startswith("open time")] == [
        "open time 5s elapsed", "open time 10s elapsed", "open time 20s elapsed",
        "open time 40s elapsed", "open time 1m elapsed", "open time 1m elapsed", "open time 1m elapsed"]
    assert b.opened_total == 8


def test_closing_resets_the_growth():
    b, clock, _ = make(consecutive_failures=1, open_for=5.0)
    b.record(False, 0)
    clock.advance(5.0); b.allows(); b.record(False, b.on_pick())   # 2nd opening: 10s
    assert b.open_until - clock() == 10.0
    clock.advance(10.0); b.allows(); b.record(True, b.on_pick())   # closed
    assert (b.state, b.opened_count) == (CLOSED, 0)
    b.record(False, 0)
    assert b.open_until - clock() == 5.0


def test_half_open_admits_at_most_the_probe_count():
    b, clock, _ = make(consecutive_failures=1, open_for=1.0, half_open_probes=2)
    b.record(False, 0)
    clock.advance(1.0)
    assert b.allows() is True
    p1 = b.on_pick()
    assert p1 == 1                    # a slot of the first HALF_OPEN period
    assert b.allows() is True
    p2 = b.on_pick()
    assert p2 == 1
    assert b.allows() is False        # two probes in flight
    b.release(p1)                     # one ended without a verdict
    assert b.allows() is True
    b.record(True, p2)                # the other succeeded: 1 of 2
    assert (b.state, b.probes, b.probe_successes) == (HALF_OPEN, 0, 1)
    b.record(True, b.on_pick())
    assert b.state is CLOSED
    assert b.on_pick() == 0           # closed: no slot taken


def test_allows_reserves_nothing():
    b, clock, _ = make(consecutive_failures=1, open_for=1.0, half_open_probes=1)
    b.record(False, 0)
    clock.advance(1.0)
    for _ in range(10):
        assert b.allows() is True
    b.on_pick()
    assert b.allows() is False


def test_failure_rate_window_expiry():
    # 10 one-second slices; 6 failures at t0 expire once their slice leaves the window
    b, clock, seen = make(consecutive_failures=0, failure_rate=0.5, min_calls=10, window=10.0)
    run(b, clock, [("fail", 6)])
    clock.advance(10.0)               # the failures' slice has left
    run(b, clock, [("ok", 4)])
    assert b.window.totals() == (4, 0)
    run(b, clock, [("fail", 5)])      # 9 calls < min_calls
    assert seen == []
    run(b, clock, [("ok", 1)])        # 10 calls, 5 failed: 50% ≥ 50% — a success can complete the count
    assert seen == [(CLOSED, OPEN, "failure rate 50% over 10s (10 calls)")]


def test_failure_rate_counts_inside_the_window():
    b, clock, seen = make(consecutive_failures=0, failure_rate=0.5, min_calls=10, window=10.0)
    run(b, clock, [("fail", 5)])
    clock.advance(8.0)                # still inside
    run(b, clock, [("ok", 4)])
    assert seen == []
    run(b, clock, [("ok", 1)])
    assert seen == [(CLOSED, OPEN, "failure rate 50% over 10s (10 calls)")]


def test_min_calls_gates_the_rate():
    b, clock, seen = make(consecutive_failures=0, failure_rate=0.5, min_calls=20)
    run(b, clock, [("fail", 19)])
    assert b.state is CLOSED and seen == []
    run(b, clock, [("fail", 1)])
    assert seen == [(CLOSED, OPEN, "failure rate 100% over 10s (20 calls)")]


def test_closing_resets_the_window():
    b, clock, seen = make(consecutive_failures=3, failure_rate=0.5, min_calls=4, open_for=1.0)
    run(b, clock, [("ok", 1), ("fail", 3)])   # consecutive rule wins, window holds 4 calls
    assert seen[-1] == (CLOSED, OPEN, "3 consecutive failures")
    run(b, clock, [("advance", 1.0), ("allows", True), ("ok", 1)])
    assert b.state is CLOSED and b.window.totals() == (0, 0)
    run(b, clock, [("fail", 1)])              # 1 call: below min_calls again
    assert b.state is CLOSED


def test_snapshot():
    b, clock, _ = make(consecutive_failures=2, open_for=5.0)
    b.record(False, 0)
    b.record(False, 0)
    clock.advance(2.0)
    assert b.snapshot() == {"state": "open", "opened_count": 1, "opened_total": 1, "open_for_s": 3.0,
                            "consecutive_failures": 0, "window_calls": 2, "window_failures": 2,
                            "probes": 0}


# classification -------------------------------------------------------------

@pytest.mark.parametrize("outcome,fault,want", [
    (calls.SUCCESS, True, True),
    (calls.DECLARED_EXCEPTION, True, True),
    (calls.APP_EXCEPTION, True, False),
    (calls.MAY_HAVE_RUN, True, False),
    (calls.TIMEOUT, True, False),
    (calls.NOT_SENT, True, False),
    (calls.NOT_SENT, False, None),
    (calls.SUCCESS, False, True),
    (calls.TIMEOUT, False, False),
    (calls.BAD_REQUEST, True, None),
    (calls.NO_ROUTE, True, None),
    ("something_else", True, None),
])
def test_classify_for_breaker(outcome, fault, want):
    assert classify_for_breaker(outcome, endpoint_fault=fault) is want


# panic ------------------------------------------------------------------------

@pytest.mark.parametrize("open_count,total,pct,want", [
    (0, 0, 50, False),
    (0, 3, 50, False),
    (1, 3, 50, False),     # 33%
    (2, 4, 50, False),     # exactly 50%: not more
    (3, 5, 50, True),      # 60%
    (2, 3, 50, True),
    (3, 3, 100, False),    # 100 never panics
    (1, 10, 0, True),      # 0: any open endpoint
    (0, 10, 0, False),
    (1, 3, 33.3, True),
    (1, 3, 33.4, False),
])
def test_panicking(open_count, total, pct, want):
    assert panicking(open_count, total, pct) is want


# properties ---------------------------------------------------------------------

OUTCOMES = [calls.SUCCESS, calls.DECLARED_EXCEPTION, calls.APP_EXCEPTION, calls.MAY_HAVE_RUN,
            calls.TIMEOUT, calls.NOT_SENT, calls.BAD_REQUEST]
REASONS = {
    (CLOSED, OPEN): ("consecutive failure", "failure rate "),
    (OPEN, HALF_OPEN): ("open time ",),
    (HALF_OPEN, CLOSED): ("probe succeeded", "probes succeeded"),
    (HALF_OPEN, OPEN): ("probe failed",),
}
breaker_settings = st.builds(
    config.CircuitBreaker,
    consecutive_failures=st.integers(0, 6), failure_rate=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    window=st.sampled_from([1.0, 10.0]), min_calls=st.integers(1, 8),
    open_for=st.sampled_from([0.5, 5.0]), max_open_for=st.sampled_from([40.0]),
    half_open_probes=st.integers(1, 3))


def open_time(s: config.CircuitBreaker, n: int) -> float:
    return min(s.max_open_for, s.open_for * 2 ** (n - 1))


@settings(max_examples=300, deadline=None)
@given(s=breaker_settings,
       events=st.lists(st.tuples(st.sampled_from(OUTCOMES), st.booleans(),
                                 st.sampled_from([0.0, 0.01, 0.3, 1.0, 4.0, 20.0, 100.0])),
                       max_size=120))
def test_random_outcome_sequences(s, events):
    """Drive the breaker as the pipeline does; check it against an independent model of its edges."""
    clock = ManualClock()
    seen = []
    b = Breaker(s, clock, lambda old, new, why: seen.append((old, new, why, clock())))
    for outcome, fault, dt in events:
        clock.advance(dt)
        before, n_seen = b.state, len(seen)
        if b.state is OPEN and clock() < b.open_until:
            assert b.allows() is False
            assert b.state is OPEN and len(seen) == n_seen
            continue
        if not b.allows():
            assert b.state is HALF_OPEN and b.probes >= s.half_open_probes
            continue
        probe = b.on_pick()
        verdict = classify_for_breaker(outcome, fault)
        if verdict is None:
            b.release(probe)
        else:
            b.record(verdict, probe)
        assert b.state in (CLOSED, OPEN, HALF_OPEN)
        new = seen[n_seen:]
        assert len(new) <= 2                          # allows() may add OPEN → HALF_OPEN first
        for old, nw, why, _ in new:
            assert (old, nw) in EDGES
            assert any(r in why for r in REASONS[(old, nw)])
        if new:
            assert new[0][0] is before and new[-1][1] is b.state
        else:
            assert b.state is before
        if new and new[-1][1] is OPEN:
            assert b.open_until == clock() + open_time(s, b.opened_count)
        if b.state is CLOSED:
            assert b.opened_count == 0
    # the transitions form one chain, starting closed
    states = [CLOSED] + [nw for _, nw, _, _ in seen]
    assert [old for old, _, _, _ in seen] == states[:-1]
    assert states[-1] is b.state


class BreakerMachine(RuleBasedStateMachine):
    """Any interleaving of clock, allows, picks and results keeps the drawn state machine."""

    @initialize(s=breaker_settings)
    def setup(self, s):
        self.s = s
        self.clock = ManualClock()
        self.seen: list = []
        self.b = Breaker(s, self.clock, lambda old, new, why: self.seen.append((old, new, why)))
        self.inflight: list[int] = []  # the probe tokens of calls picked and not ended
        self.prev_state = CLOSED
        self.checked = 0

    @rule(dt=st.sampled_from([0.0, 0.05, 0.5, 2.5, 5.0, 30.0, 200.0]))
    def advance(self, dt):
        self.clock.advance(dt)

    @rule()
    def ask(self):
        opened = self.b.state is OPEN and self.clock() < self.b.open_until
        allowed = self.b.allows()
        if opened:
            assert allowed is False

    @rule()
    def pick(self):                 # also a panic pick: the cluster may ignore allows()
        self.inflight.append(self.b.on_pick())

    @precondition(lambda self: self.inflight)
    @rule(ok=st.booleans(), which=st.integers(min_value=0))
    def finish(self, ok, which):
        self.b.record(ok, self.inflight.pop(which % len(self.inflight)))

    @precondition(lambda self: self.inflight)
    @rule(which=st.integers(min_value=0))
    def release(self, which):
        self.b.release(self.inflight.pop(which % len(self.inflight)))

    @invariant()
    def probes_are_this_periods_calls_in_flight(self):
        if not hasattr(self, "b"):
            return
        b = self.b
        if b.state is HALF_OPEN:
            assert b.probes == sum(1 for t in self.inflight if t == b.opened_total)
        else:
            assert b.probes == 0

    @invariant()
    def one_callback_per_change_along_the_edges(self):
        if not hasattr(self, "b"):
            return
        new = self.seen[self.checked:]
        self.checked = len(self.seen)
        assert self.b.state in (CLOSED, OPEN, HALF_OPEN)
        assert len(new) == (0 if self.b.state is self.prev_state else 1)
        for old, nw, why in new:
            assert (old, nw) == (self.prev_state, self.b.state)
            assert (old, nw) in EDGES
            assert any(r in why for r in REASONS[(old, nw)])
        self.prev_state = self.b.state

    @invariant()
    def open_respects_open_until(self):
        if not hasattr(self, "b"):
            return
        b = self.b
        if b.state is OPEN:
            assert b.opened_count >= 1
            assert b.open_time == open_time(self.s, b.opened_count)
            if self.clock() < b.open_until:
                assert b.allows() is False and b.state is OPEN
        elif b.state is CLOSED:
            assert b.probes == 0
        assert b.probes >= 0


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_a_call_picked_while_closed_frees_no_probe_slot_when_it_ends_half_open():
    """A call picked while CLOSED that ends in HALF_OPEN counts as a probe result but holds no
    probe slot: ending, it must not free the real probe's slot (before: a third call was
    admitted with half_open_probes 1 and a probe still in flight)."""
    b, clock, _ = make(consecutive_failures=1, open_for=1.0, half_open_probes=1)
    old = b.on_pick()
    assert old == 0                   # closed: the old call takes no slot
    b.record(False, 0)                # another call fails: open
    clock.advance(1.0)
    assert b.allows() is True
    probe = b.on_pick()               # the probe
    assert probe
    assert b.allows() is False
    b.release(old)                    # the old call ends without a verdict
    assert (b.state, b.probes) == (HALF_OPEN, 1)
    assert b.allows() is False        # still one probe in flight
    b.record(True, probe)             # the probe succeeds
    assert b.state is CLOSED


def test_a_probe_of_an_earlier_half_open_period_frees_no_slot_of_this_one():
    """Probe 1 is slow; probe 2 fails (open again); the next period admits probes 3 and 4.
    Probe 1 ending then must not free one of their slots (before: a fifth call was admitted,
    three probes in flight with half_open_probes 2)."""
    b, clock, _ = make(consecutive_failures=1, open_for=1.0, half_open_probes=2)
    b.record(False, 0)
    clock.advance(1.0)
    assert b.allows()
    p1, p2 = b.on_pick(), b.on_pick()
    b.record(False, p2)               # open again (2 s)
    clock.advance(2.0)
    assert b.allows()
    p3, p4 = b.on_pick(), b.on_pick()
    assert p3 == p4 != p1
    assert not b.allows()             # two probes in flight
    b.release(p1)                     # the stale one ends without a verdict
    assert (b.state, b.probes) == (HALF_OPEN, 2)
    assert not b.allows()
    b.record(True, p3)
    assert (b.state, b.probes) == (HALF_OPEN, 1)
