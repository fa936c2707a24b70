"""The per-endpoint circuit breaker — also the cluster's outlier ejection — and panic.

Owns: one endpoint's health state and its transitions; which attempt
outcomes speak about the endpoint (`classify_for_breaker`); the panic rule
(`panicking`). Pure: no asyncio, no sockets, no sleeping; time comes from an
injected clock (seconds). Leaves to others: picking (balancer, cluster),
logging and counting transitions (the `on_transition` callback's owner),
active health checks (`proxy.health`: a separate filter, `Endpoint.healthy`,
that never calls `record`; a failing check takes the endpoint out at once
and a passing one brings it back, without touching this state machine).

                consecutive_failures in a row, or failure rate
                ≥ failure_rate over window (once min_calls were seen)
    ┌────────┐                                                 ┌──────┐
    │ CLOSED │────────────────────────────────────────────────►│ OPEN │
    └────────┘                                                 └──────┘
        ▲                                                        │   ▲
        │                   open time elapsed (noticed lazily,   │   │ any probe
        │                   when allows() is asked)              ▼   │ failed
        │ half_open_probes probes succeeded                  ┌───────────┐
        └────────────────────────────────────────────────────│ HALF_OPEN │
                                                             └───────────┘

Open time of the n-th consecutive opening: min(max_open_for, open_for × 2^(n−1)),
so 5s, 10s, 20s, ... A return to CLOSED resets n and the failure window.
HALF_OPEN admits at most `half_open_probes` concurrent probes.

Contract with the data path, per attempt on this endpoint:

    allows()      may the balancer pick it? (reserves nothing; may move OPEN → HALF_OPEN)
    (`seen_state()` and `would_allow()` say the same as of now and change nothing: for /stats)
    on_pick()     the call is being sent here (in HALF_OPEN this takes a probe slot)
    then exactly one of
    record(ok, probe)  the attempt ended and its outcome says something about the endpoint
    release(probe)     it ended with no such outcome (classify_for_breaker gave None, cancelled)
    (`probe`: what on_pick() returned for it: 0, no slot, else the HALF_OPEN period whose slot
    it holds; a slot is freed only in its own period, since every transition frees them all)

Failed connects are the exception: the pool reports each one (through
`proxy.cluster`) as `record(False, 0)` when it fails, whether or not
the attempt that wanted it still waits (a per-try or route timeout shorter
than connect_timeout stops waiting first); the attempt itself then ends with
`release(probe)` (its error says endpoint_fault=False), so each failed
connect counts exactly once.

Results are counted in the state they arrive in: in OPEN they are ignored
(stale calls, or picks made while the cluster panics); a call that outlived a
whole open period and ends in HALF_OPEN counts as a probe, but frees no probe
slot: only a call that took one in this HALF_OPEN period does (else more than
`half_open_probes` could be in flight: a probe of an earlier period, still out
when its period ended, would free a slot of this one).
"""

from __future__ import annotations

import enum
from typing import Callable

from proxy import calls, config
from proxy.codec.wire import AppErrorType
from proxy.window import SlidingCounts
from proxy.units import format_duration


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


CLOSED, OPEN, HALF_OPEN = State.CLOSED, State.OPEN, State.HALF_OPEN

# The edges drawn above; nothing else may happen.
EDGES = frozenset({(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED), (HALF_OPEN, OPEN)})

Transition = Callable[[State, State, str], None]

_MAX_DOUBLINGS = 60  # 2^60 × any positive open_for is past every max_open_for


class Breaker:
    """One endpoint's breaker; see the module docstring for the state machine."""

    __slots__ = ("settings", "clock", "on_transition", "state", "state_name", "opened_count", "open_until",
                 "open_time", "consecutive", "window", "probes", "probe_successes", "opened_total")

    def __init__(self, settings: config.CircuitBreaker, clock: Callable[[], float],
                 on_transition: Transition | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.on_transition = on_transition
        self.state = CLOSED
        self.state_name = CLOSED.value  # the state's name, kept with it (read per call)
        self.opened_count = 0          # consecutive openings since the last CLOSED (drives open time)
        self.opened_total = 0          # every opening, for stats
        self.open_until = 0.0          # clock time when OPEN may become HALF_OPEN
        self.open_time = 0.0           # length of the current (or last) open period
        self.consecutive = 0           # failures in a row while CLOSED
        self.window = SlidingCounts(settings.window, clock)  # (calls, failures) while CLOSED
        self.probes = 0                # probe calls in flight (HALF_OPEN)
        self.probe_successes = 0

    # the data path's calls ---------------------------------------------------

    def allows(self) -> bool:
        """May the balancer pick this endpoint now? Reserves nothing."""
        state = self.state
        if state is CLOSED:
            return True
        if state is OPEN:
            if self.clock() < self.open_until:
                return False
            self._go(HALF_OPEN, f"open time {format_duration(self.open_time)} elapsed")
        return self.probes < self.settings.half_open_probes

    def seen_state(self) -> State:
        """The state a pick would find now, changing nothing (for /stats: looking is not a pick).
        OPEN past its open time reads HALF_OPEN; the next pick makes it so."""
        if self.state is OPEN and self.clock() >= self.open_until:
            return HALF_OPEN
        return self.state

    def would_allow(self) -> bool:
        """`allows()` as of now, changing nothing."""
        state = self.seen_state()
        if state is CLOSED:
            return True
        if state is OPEN:
            return False
        return (0 if self.state is OPEN else self.probes) < self.settings.half_open_probes

    def on_pick(self) -> int:
        """A call is sent here. Returns its probe token: the HALF_OPEN period whose probe slot
        it took (the opening's number, ≥ 1), or 0 when it took none."""
        if self.state is HALF_OPEN:
            self.probes += 1
            return self.opened_total
        return 0

    def release(self, probe: int) -> None:
        """A picked call ended without an outcome about this endpoint: free its probe slot
        (`probe`: its on_pick() token), if it is this period's."""
        if probe and probe == self.opened_total and self.state is HALF_OPEN and self.probes > 0:
            self.probes -= 1

    def record(self, success: bool, probe: int) -> None:
        """A picked call ended; `success` as `classify_for_breaker` says (never None here);
        `probe`: its on_pick() token; this period's slot is freed."""
        state = self.state
        if state is CLOSED:
            if success and not self.consecutive and not self.window.b:
                self.window.add(1)  # the common case: nothing to count towards opening
                return
            self._record_closed(success)
        elif state is HALF_OPEN:
            if probe and probe == self.opened_total and self.probes > 0:
                self.probes -= 1
            if not success:
                self._open("probe failed")
                return
            self.probe_successes += 1
            need = self.settings.half_open_probes
            if self.probe_successes >= need:
                self._close("probe succeeded" if need == 1 else f"{need} probes succeeded")
        # OPEN: a stale call or a panic pick; the open time decides, not this result

    def inherit(self, old: Breaker) -> None:
        """A reload rebuilt this endpoint's cluster: go on from `old`'s ejection. An open endpoint
        stays out until its open time ends, the next opening still doubles, a half-open one
        still needs its probes (none in flight here: those calls report to `old`). The failure
        window starts empty (its length may have changed); the run of failures goes on."""
        self.state = old.state
        self.state_name = old.state_name
        self.opened_count = old.opened_count
        self.opened_total = old.opened_total
        self.open_until = old.open_until
        self.open_time = old.open_time
        self.consecutive = old.consecutive

    # transitions ---------------------------------------------------------------

    def _record_closed(self, success: bool) -> None:
        s = self.settings
        self.window.add(1, 0 if success else 1)
        if success:
            self.consecutive = 0
        else:
            self.consecutive += 1
            if s.consecutive_failures and self.consecutive >= s.consecutive_failures:
                n = self.consecutive
                self._open(f"{n} consecutive failure{'s' if n != 1 else ''}")
                return
        if s.failure_rate > 0 and self.window.b:  # (b counts failures not yet expired, and more)
            n, failed = self.window.totals()
            if n >= s.min_calls and failed and failed >= s.failure_rate * n:
                self._open(f"failure rate {100 * failed / n:.0f}% over "
                           f"{format_duration(s.window)} ({n} calls)")

    def _open(self, reason: str) -> None:
        s = self.settings
        self.opened_count += 1
        self.opened_total += 1
        self.open_time = min(s.max_open_for,
                             s.open_for * 2.0 ** min(self.opened_count - 1, _MAX_DOUBLINGS))
        self.open_until = self.clock() + self.open_time
        self.consecutive = 0
        self._go(OPEN, reason)

    def _close(self, reason: str) -> None:
        self.opened_count = 0
        self.consecutive = 0
        self.window.reset()
        self._go(CLOSED, reason)

    def _go(self, new: State, reason: str) -> None:
        old = self.state
        self.state = new
        self.state_name = new.value
        self.probes = 0
        self.probe_successes = 0
        if self.on_transition is not None:
            self.on_transition(old, new, reason)

    def snapshot(self) -> dict:
        calls_, failures = self.window.totals()
        return {"state": self.seen_state().value, "opened_count": self.opened_count,
                "opened_total": self.opened_total,
                "open_for_s": round(max(0.0, self.open_until - self.clock()), 3)
                if self.state is OPEN else 0.0,
                "consecutive_failures": self.consecutive, "window_calls": calls_,
                "window_failures": failures, "probes": self.probes}


# What an attempt's outcome says about its endpoint ------------------------------

_SUCCESS = frozenset({calls.SUCCESS, calls.DECLARED_EXCEPTION})
_FAILURE = frozenset({calls.APP_EXCEPTION, calls.MAY_HAVE_RUN, calls.TIMEOUT})


# TApplicationException types a server answers with because of the request it was given: a
# method it does not have, a message type or name it cannot take, arguments it cannot read, a
# transform, protocol or client type it does not speak. Like a declared exception they say
# nothing about the endpoint's health, so one client calling a method no server has cannot open
# every endpoint's breaker (Envoy's thrift_proxy counts them as failures). The others count as
# failures: UNKNOWN (0), BAD_SEQUENCE_ID, MISSING_RESULT, INTERNAL_ERROR (its handler raised),
# types past 10 (fbthrift's LOADSHEDDING, TIMEOUT, ...) and a type the reply does not show.
REQUEST_FAULTS = frozenset({AppErrorType.UNKNOWN_METHOD, AppErrorType.INVALID_MESSAGE_TYPE,
                            AppErrorType.WRONG_METHOD_NAME, AppErrorType.PROTOCOL_ERROR,
                            AppErrorType.INVALID_TRANSFORM, AppErrorType.INVALID_PROTOCOL,
                            AppErrorType.UNSUPPORTED_CLIENT_TYPE})


def classify_for_breaker(outcome: str, endpoint_fault: bool = True) -> bool | None:
    """True = success, False = failure, None = says nothing about the endpoint.

    A declared exception is the service answering as designed: success.
    NOT_SENT is a failure only when the endpoint caused it and it is not
    counted elsewhere: pass `endpoint_fault=False` when the proxy itself
    refused before touching the endpoint (a `limits` counter full, the retry
    budget spent, the client gone) and for a failed connect (refused, timed
    out, TLS failed), which its pool already counted (see the module
    docstring) — those give None. Outcomes that are not an upstream attempt's
    (bad_request, no_route, unknown) give None.
    """
    if outcome in _SUCCESS:
        return True
    if outcome in _FAILURE:
        return False
    if outcome == calls.NOT_SENT:
        return False if endpoint_fault else None
    return None


def panicking(open_count: int, total: int, max_open_percent: float) -> bool:
    """More than `max_open_percent` of a cluster's endpoints open → ignore health.

    100 never panics; 0 panics as soon as one endpoint is open (health is then
    always ignored). No endpoints: nothing to panic about.
    """
    return total > 0 and open_count * 100 > max_open_percent * total
