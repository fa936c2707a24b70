"""Hop histograms and call counters: a few integer increments per call, Prometheus text on scrape.

Owns: the project's own histogram buckets per (service, method, hop), the SERVER total latency
and call counters per outcome, the method-label cap, and the Prometheus exposition (built only
when `/metrics` is scraped). Leaves to others: taking the timestamps (listener, pipeline),
serving HTTP (admin), spans (`proxy.telemetry`).

Why not the OpenTelemetry metrics SDK: its `Histogram.record` costs ~8-11 µs per call per hop
here, more than the whole forward. Here a sample is a `bisect` on fixed integer bounds (ns) and
one list increment; `record(call)` reads a finished call's timestamps once.

    metrics = Metrics()
    users = metrics.service("UserService", known_methods=("get_user", "put_user"))
    users.record(call)                  # on the loop, once the call is over (reply acknowledged)
    metrics.watch_exporter(queue)       # the export queue's drops and size, read on scrape
    body = metrics.exposition()         # bytes, Prometheus text format 0.0.4

Metrics (all durations in seconds; buckets `BUCKETS`, 25 µs ... 30 s):

    thrift_sidecar_hop_duration_seconds{service,method,hop}   histogram: one sample per hop per
        call (attempt hops `acquire`, `write_upstream`, `service_time`, `read_response` and
        `backoff` once per attempt/retry); a hop whose timestamps are missing is not sampled.
        The same hops, from the same timestamps, as the call's spans (`proxy.telemetry`): `queued`
        only for a reply that waited behind an earlier pipelined one (also a large reply held
        unread for its turn: as long as it was held, and `read_response` the rest; a call may
        then have two `queued` samples, where `hops` sums its spans per call);
        `write_response` from the first reply byte written (a streamed reply's overlaps `read_response`)
    thrift_sidecar_call_duration_seconds{service,method}      histogram: the SERVER span, first
        request byte → the client has the reply, none of it left unsent (oneway: → request written upstream)
    thrift_sidecar_calls_total{service,method,outcome}        counter: outcome as in `proxy.calls`
        (success, declared_exception, app_exception, not_sent, may_have_run, timeout,
        bad_request, no_route)
    thrift_sidecar_replies_not_delivered_total{service,method,reason}   counter: calls whose answer
        never reached their client, whatever their outcome (counted in calls_total too): `not_delivered`
        (its connection broke, or the proxy closed it, with the reply unsent), `client_never_read`
        (not acknowledged within the cap, or the client left while an earlier reply was due)
    thrift_sidecar_spans_dropped_total{reason}                counter: calls whose spans were not
        exported: `queue_full` (the export queue was full), `export_failed` (the exporter said so)
    thrift_sidecar_spans_rejected_total                       counter: spans (not calls) the collector
        rejected in exports it accepted (OTLP partial_success)
    thrift_sidecar_span_queue_size                            gauge: calls waiting for export
    thrift_sidecar_span_queue_capacity                        gauge: the export queue's bound

Per cluster, read from the clusters when scraped (`watch_clusters`; what `/stats` shows, looked
at without changing anything: no breaker goes half-open because it was scraped):

    thrift_sidecar_cluster_endpoints{cluster,state}           gauge: endpoints by what a pick makes
        of them: `available`, `ejected` (breaker open), `failing_health_check`,
        `pending_health_check` (joined, first check not answered yet)
    thrift_sidecar_cluster_panicking{cluster}                 gauge: 1 while too many are out (health ignored)
    thrift_sidecar_upstream_connections{cluster,state}        gauge: pooled connections `busy`, `idle`,
        `connecting`
    thrift_sidecar_breaker_transitions_total{cluster}         counter: breaker state changes
    thrift_sidecar_health_checks_total{cluster,result}        counter: active checks `passed` / `failed`
    thrift_sidecar_retries_total{cluster}                     counter: retries made
    thrift_sidecar_retries_refused_total{cluster,reason}      counter: retries not made: `budget`
        (the retry budget was spent), `limit` (max_retries in flight)
    thrift_sidecar_cluster_overflow_total{cluster,limit}      counter: calls or retries the cluster's
        `limits` refused: `requests` (max_requests in flight), `pending` (max_pending waiting for a
        connection), `retries` (max_retries in flight)

(The counters go on across a reload that rebuilds a cluster.)

Per listener, read when scraped (`watch_listeners`; a listener a reload removed is gone from the page):

    thrift_sidecar_client_connections{listener}               gauge: client connections open
    thrift_sidecar_listener_connections_total{listener,result} counter: `accepted`, `refused`
        (max_connections open: closed at once, unanswered)
    thrift_sidecar_listener_events_total{listener,event}      counter: `protocol_error` (a bad request),
        `read_timeout` (request_read_timeout), `idle_closed` (idle_timeout), `write_stall` (a client
        that read no reply byte for request_read_timeout: closed)

A (service, method) label set is one series whichever listener its calls came through (two
listeners that both take a multiplexed `Svc:method` count in the same one: Prometheus leaves a
repeated series undefined). The page is built in pieces of about `PIECE_LINES` lines
(`exposition_async` lets the loop run between them: 100 methods' hops are ~16,000 lines, ~140 ms
to format at once).

Method labels are capped per service: the known methods (config/IDL) plus the first
`max_methods` other names that a route took; every later name counts under `_OTHER`, so clients
sending random method names cannot grow the label set (nor this module's memory). So does a
name no route took (outcome `no_route`, or a `bad_request`), a name longer than `proxy.logs.MAX_NAME`
characters, and one spelled as a reserved label: a client cannot use up the cap, or make a
page of megabytes, without the proxy forwarding its calls. A request that never framed (bad
request) counts under `_INVALID`.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from proxy import spans
from proxy.calls import (BAD_REQUEST, DECLARED_EXCEPTION, MAY_HAVE_RUN, NO_ROUTE, NOT_DELIVERED, NOT_SENT,
                         SUCCESS)
from proxy.cluster import ENDPOINT_STATES, seen_state
from proxy.codec.twins import load, pure_forced
from proxy.logs import MAX_NAME

__all__ = ["BUCKETS", "Metrics", "ServiceMetrics", "call_end", "call_outcome", "failure_type", "is_failure",
           "OTHER", "INVALID"]

# Bucket upper bounds, seconds (Prometheus `le`); +Inf is implied.
BUCKETS = (0.000025, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
           0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
_BOUNDS_NS = tuple(round(b * 1e9) for b in BUCKETS)
_NB = len(BUCKETS) + 1  # + the +Inf bucket

OTHER = "_OTHER"
INVALID = "_INVALID"
MAX_METHODS = 100
_NOT_ADMITTED = frozenset((NO_ROUTE, BAD_REQUEST))  # what no route took counts under _OTHER
PIECE_LINES = 256  # lines of the Prometheus page formatted between two turns of the loop (~2 ms)
# reasons of replies_not_delivered_total: NOT_DELIVERED (proxy.calls: also the call's error_type) and
CLIENT_NEVER_READ = "client_never_read"

# Hop indexes into MethodStats.hops (the order of `spans.HOPS`).
_HOP_INDEX = {name: i for i, name in enumerate(spans.HOPS)}
_READ_REQUEST = _HOP_INDEX[spans.READ_REQUEST]
_ACQUIRE = _HOP_INDEX[spans.ACQUIRE]
_WRITE_UPSTREAM = _HOP_INDEX[spans.WRITE_UPSTREAM]
_SERVICE_TIME = _HOP_INDEX[spans.SERVICE_TIME]
_READ_RESPONSE = _HOP_INDEX[spans.READ_RESPONSE]
_BACKOFF = _HOP_INDEX[spans.BACKOFF]
_QUEUED = _HOP_INDEX[spans.QUEUED]
_WRITE_RESPONSE = _HOP_INDEX[spans.WRITE_RESPONSE]

_OK_OUTCOMES = frozenset((SUCCESS, DECLARED_EXCEPTION))


def _compiled():
    _hops = None if pure_forced() else load("proxy._hops")
    if _hops is None:
        return None
    _hops.bind(_BOUNDS_NS, _READ_REQUEST, _ACQUIRE, _WRITE_UPSTREAM, _SERVICE_TIME, _READ_RESPONSE,
               _BACKOFF, _QUEUED, _WRITE_RESPONSE, pure_record_hops)
    return _hops.record_hops


# --------------------------------------------------------------------------------------------
# Reading a finished call (shared with proxy.telemetry)


def call_outcome(call) -> str:
    """The call's outcome: its own, else its last attempt's, else derived from the error rule."""
    outcome = call.outcome
    if outcome is not None:
        return outcome
    attempts = call.attempts
    if attempts and attempts[-1].outcome is not None:
        return attempts[-1].outcome
    if call.error is not None:
        if call.msg is None:
            return "bad_request"
        if call.route is None:
            return "no_route"
        return MAY_HAVE_RUN if call.written else NOT_SENT
    return SUCCESS


def is_failure(call, outcome: str | None = None) -> bool:
    """The proxy answered with its own error, the call ended other than success/declared, or its
    client never read the reply (`never_read`: the reply never reached it, whatever the outcome)."""
    if call.error is not None or call.never_read:
        return True
    # call.outcome first: call_outcome's own first answer, without the call (a plain success)
    return (outcome or call.outcome or call_outcome(call)) not in _OK_OUTCOMES


def failure_type(call, outcome: str) -> str | None:
    """What a failed call's `error.type` is (spans, and the access log's `error_type`): its own
    error_type (e.g. not_delivered), else its outcome; `client_never_read` when its only failure
    is that nobody read the reply. None: the call did not fail."""
    if not is_failure(call, outcome):
        return None
    error_type = call.error_type or outcome
    if call.never_read and error_type in _OK_OUTCOMES:
        return CLIENT_NEVER_READ
    return error_type


def call_end(call) -> int:
    """When the SERVER span ends: the client acknowledged the reply, else the best we know."""
    end = call.t_acked or call.t_handed or call.t_write or call.t_done
    if end:
        return end
    for a in reversed(call.attempts):
        end = a.t_reply or a.t_written or a.t_acquired or a.t_acquire
        if end:
            return end
    return call.t_framed or call.t_start


def hop_samples(call) -> list[tuple[int, int]]:
    """(hop index, duration ns) for each hop of a finished call whose two timestamps are there
    and in order, attempts and backoffs one each: the rule `pure_record_hops` and the access
    log share (the compiled `proxy._hops.record_hops` takes it inline)."""
    out: list[tuple[int, int]] = []
    sample = out.append
    t0, t1 = call.t_start, call.t_framed
    if t0:
        if t1 >= t0:
            sample((_READ_REQUEST, t1 - t0))
        t2 = call.t_admitted  # a request held back at max_inflight: it waited behind earlier calls
        if t2 and t1 and t2 > t1:
            sample((_QUEUED, t2 - t1))
    for a in call.attempts:
        t0, t1 = a.t_acquire, a.t_acquired
        if not t0:
            continue
        if not t1:  # never got a connection (pool wait or connect failed, timed out, given up):
            t1 = a.t_reply or call.t_done  # it waited until the attempt ended
            if t1 >= t0:
                sample((_ACQUIRE, t1 - t0))
            continue
        if not t1 >= t0:
            continue
        sample((_ACQUIRE, t1 - t0))
        t0 = a.t_written
        if not t0 >= t1:
            continue
        sample((_WRITE_UPSTREAM, t0 - t1))
        first = a.t_first_reply or a.t_reply
        if not first >= t0:
            continue
        sample((_SERVICE_TIME, first - t0))
        t0, t1 = a.t_first_reply, a.t_reply
        if t0 and t1 >= t0:
            held = a.held_ns
            if held > 0:  # a large reply held unread for its turn: that wait is queued, not reading
                r0 = min(t0 + held, t1)
                sample((_QUEUED, r0 - t0))
                t0 = r0
            sample((_READ_RESPONSE, t1 - t0))
    for t0, t1 in call.backoffs:
        if t0 and t1 >= t0:
            sample((_BACKOFF, t1 - t0))
    t0, t1 = call.t_done, call.t_write
    if call.waited and t0 and t1 > t0:  # as the span: only a reply that waited behind an earlier one
        sample((_QUEUED, t1 - t0))
    t0 = t1 or t0  # from t_write (a streamed reply's is before t_done), else t_done
    t1 = call.t_acked or call.t_handed
    if t0 and t1 >= t0:
        sample((_WRITE_RESPONSE, t1 - t0))
    return out


def hop_totals(call) -> list[int | None]:
    """Per hop (the order of `spans.HOPS`): its durations summed (ns), None where it has none."""
    totals: list[int | None] = [None] * len(spans.HOPS)
    for hop, d in hop_samples(call):
        was = totals[hop]
        totals[hop] = d if was is None else was + d
    return totals


def pure_record_hops(hops: list[list[int]], sums: list[int], call) -> None:
    """One sample per hop of a finished call (`hop_samples`): `hops[hop]` gets one more in the
    bucket of its duration, `sums[hop]` the duration (ns). The reference for the compiled
    `proxy._hops.record_hops` (tests/test_metrics.py)."""
    for hop, d in hop_samples(call):
        hops[hop][bisect_left(_BOUNDS_NS, d)] += 1
        sums[hop] += d


CompiledRecordHops = _compiled()
record_hops = CompiledRecordHops or pure_record_hops
HOPS_IMPL = "c" if CompiledRecordHops is not None else "python"


# --------------------------------------------------------------------------------------------
# Storage


class MethodStats:
    """One (service, method) label set: hop and total buckets, counters per outcome."""

    __slots__ = ("service", "method", "hops", "hop_sums", "total", "total_sum", "outcomes", "undelivered")

    def __init__(self, service: str, method: str) -> None:
        self.service = service
        self.method = method
        self.hops = [[0] * _NB for _ in spans.HOPS]  # per hop: non-cumulative bucket counts
        self.hop_sums = [0] * len(spans.HOPS)         # ns
        self.total = [0] * _NB
        self.total_sum = 0
        self.outcomes: dict[str, int] = {}
        self.undelivered: dict[str, int] = {}  # reason → calls whose answer never reached the client


class LabelSets:
    """Every (service, method) label set once, shared by all services' metrics."""

    def __init__(self) -> None:
        self.by_label: dict[tuple[str, str], MethodStats] = {}
        self.stats: list[MethodStats] = []  # in creation order

    def get(self, service: str, method: str) -> MethodStats:
        st = self.by_label.get((service, method))
        if st is None:
            st = self.by_label[(service, method)] = MethodStats(service, method)
            self.stats.append(st)
        return st


class ServiceMetrics:
    """The metrics of one service (listener): `record(call)` once per finished call."""

    def __init__(self, service: str, known_methods: Iterable[str] = (), max_methods: int = MAX_METHODS,
                 labels: LabelSets | None = None) -> None:
        self.service = service
        self.max_methods = max_methods
        self.by_name: dict[str, MethodStats] = {}  # wire name (maybe `Svc:method`) → its stats
        self._sets = labels if labels is not None else LabelSets()
        self._mine: dict[tuple[str, str], MethodStats] = {}  # the label sets it counts in
        self._seen = 0                             # unknown names admitted so far
        self.other = self._stats_for(service, OTHER)
        self.invalid = self._stats_for(service, INVALID)
        self.add_known(known_methods)

    def add_known(self, methods: Iterable[str]) -> None:
        """Methods from config/IDL: always their own label, not counted against the cap."""
        for name in methods:
            if name not in self.by_name:
                self.by_name[name] = self._stats_for(*self._label(name))

    def _label(self, name: str) -> tuple[str, str]:
        i = name.find(":")
        return (name[:i], name[i + 1:]) if i >= 0 else (self.service, name)

    def _stats_for(self, service: str, method: str) -> MethodStats:
        st = self._mine.get((service, method))
        if st is None:
            st = self._mine[(service, method)] = self._sets.get(service, method)
        return st

    def _admit(self, name: str, outcome: str) -> MethodStats:
        if self._seen >= self.max_methods or outcome in _NOT_ADMITTED or len(name) > MAX_NAME:
            return self.other  # not remembered: random names must not grow anything
        service, method = self._label(name)
        if method == OTHER or method == INVALID:
            return self.other
        self._seen += 1
        st = self.by_name[name] = self._stats_for(service, method)
        return st

    def record(self, call, end: int = 0) -> None:
        """Count one finished call: its hops, its total, its outcome. About 1.5 µs (compiled hops).
        `end`: `call_end(call)` if the caller has it already."""
        msg = call.msg
        outcome = call_outcome(call)
        if msg is None:
            st = self.invalid
        else:
            st = self.by_name.get(msg.name)
            if st is None:
                st = self._admit(msg.name, outcome)
        record_hops(st.hops, st.hop_sums, call)
        d = (end or call_end(call)) - call.t_start
        if d >= 0:
            st.total[bisect_left(_BOUNDS_NS, d)] += 1
            st.total_sum += d
        oc = st.outcomes
        oc[outcome] = oc.get(outcome, 0) + 1
        if call.never_read or (call.error is not None and call.error_type == NOT_DELIVERED):
            why = NOT_DELIVERED if call.error_type == NOT_DELIVERED else CLIENT_NEVER_READ
            st.undelivered[why] = st.undelivered.get(why, 0) + 1

    def label_count(self) -> int:
        return len(self._mine)


# --------------------------------------------------------------------------------------------
# Exposition


_LE = [repr(b) for b in BUCKETS] + ["+Inf"]


def _buckets(counts: list[int]) -> list[tuple[str, int]]:
    out = []
    acc = 0
    for le, c in zip(_LE, counts):
        acc += c
        out.append((le, acc))
    return out


def _hop_family(stats: list[MethodStats]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily("thrift_sidecar_hop_duration_seconds",
                                "Per-hop latency of calls through the sidecar (hops as in the span tree).",
                                labels=("service", "method", "hop"))
    for st in stats:
        for i, name in enumerate(spans.HOPS):
            counts = list(st.hops[i])
            if any(counts):
                fam.add_metric((st.service, st.method, name), _buckets(counts), st.hop_sums[i] / 1e9)
    return fam


def _total_family(stats: list[MethodStats]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily("thrift_sidecar_call_duration_seconds",
                                "Call latency: first request byte to the client having every reply byte (none left unsent).",
                                labels=("service", "method"))
    for st in stats:
        counts = list(st.total)
        if any(counts) or any(any(h) for h in st.hops):
            fam.add_metric((st.service, st.method), _buckets(counts), st.total_sum / 1e9)
    return fam


def _counts_family(name: str, text: str, label: str, counts: Callable[[MethodStats], dict]) -> Callable:
    """A builder of the counter family `name`: one series per key of each label set's `counts`."""
    def build(stats: list[MethodStats]) -> CounterMetricFamily:
        fam = CounterMetricFamily(name, text, labels=("service", "method", label))
        for st in stats:
            for key, n in list(counts(st).items()):
                fam.add_metric((st.service, st.method, key), n)
        return fam
    return build


_calls_family = _counts_family("thrift_sidecar_calls_total", "Calls by outcome.", "outcome",
                               lambda st: st.outcomes)
_undelivered_family = _counts_family(
    "thrift_sidecar_replies_not_delivered_total",
    "Calls whose answer never reached their client (also in calls_total, by their outcome).", "reason",
    lambda st: st.undelivered)


def _histogram_lines(st: MethodStats) -> int:
    return (_NB + 2) * (1 + sum(1 for h in st.hops if any(h)))  # (a rough count: sizes the pieces)


# Per-label-set families: how each is built from some label sets, and about how many lines one adds.
_SERIES_FAMILIES: tuple[tuple[Callable, Callable[[MethodStats], int]], ...] = (
    (_hop_family, _histogram_lines),
    (_total_family, lambda st: _NB + 2),
    (_calls_family, lambda st: len(st.outcomes)),
    (_undelivered_family, lambda st: len(st.undelivered)),
)


def _export_families(q) -> list:
    """The span export queue's counters and gauges (zero when nothing exports)."""
    dropped = CounterMetricFamily("thrift_sidecar_spans_dropped_total",
                                  "Calls whose spans were not exported.", labels=("reason",))
    size = GaugeMetricFamily("thrift_sidecar_span_queue_size", "Calls waiting for span export.")
    cap = GaugeMetricFamily("thrift_sidecar_span_queue_capacity", "Bound of the span export queue.")
    rejected = CounterMetricFamily("thrift_sidecar_spans_rejected_total",
                                   "Spans the trace collector rejected in accepted exports (OTLP partial_success).")
    rejected.add_metric((), getattr(getattr(q, "exporter", None), "rejected_spans", 0))
    dropped.add_metric(("queue_full",), q.dropped if q is not None else 0)
    dropped.add_metric(("export_failed",), q.failed if q is not None else 0)
    size.add_metric((), q.size if q is not None else 0)
    cap.add_metric((), q.capacity if q is not None else 0)
    return [dropped, rejected, size, cap]


class _ClusterRow(NamedTuple):
    """A cluster's numbers for /metrics, all read at one moment."""
    name: str
    states: dict
    panicking: bool
    busy: int
    idle: int
    connecting: int
    transitions: int
    retries: int
    refused_budget: int
    refused_limit: int
    checks: tuple[int, int] | None  # (passed, failed); None: not health-checked
    overflow: dict  # the limits' refusals by kind (requests, pending, retries)


def _cluster_rows(clusters: Iterable) -> list[_ClusterRow]:
    """`clusters`: (Cluster, its HealthChecker or None) pairs, as they are now."""
    rows = []
    for cluster, checker in clusters:
        states = dict.fromkeys(ENDPOINT_STATES, 0)
        busy = idle = connecting = 0
        for ep in list(cluster.endpoints):
            states[seen_state(ep)] += 1
            for pool in list(ep.pools.values()):
                busy += pool.busy()
                idle += len(pool.idle)
                connecting += pool.connecting
        stats = cluster.stats
        checks = None
        if checker is not None:
            st = checker.stats
            checks = (st["checks"] - st["failures"], st["failures"])
        limits = cluster.limits
        overflow = dict(limits.overflow) if limits is not None else dict.fromkeys(OVERFLOWS, 0)
        rows.append(_ClusterRow(cluster.name, states, cluster.snapshot_panicking(), busy, idle, connecting,
                                stats.get("breaker_transitions", 0), stats["retries"],
                                stats["retries_refused_budget"], stats["retries_refused_limit"], checks,
                                overflow))
    return rows


def _endpoints_family(rows: list[_ClusterRow]):
    f = GaugeMetricFamily("thrift_sidecar_cluster_endpoints",
                          "Endpoints of a cluster by what a pick makes of them.", labels=("cluster", "state"))
    for r in rows:
        for state, n in r.states.items():
            f.add_metric((r.name, state), n)
    return f


def _panicking_family(rows: list[_ClusterRow]):
    f = GaugeMetricFamily("thrift_sidecar_cluster_panicking",
                          "1 while more endpoints are out than max_open_percent (health ignored).",
                          labels=("cluster",))
    for r in rows:
        f.add_metric((r.name,), 1 if r.panicking else 0)
    return f


def _connections_family(rows: list[_ClusterRow]):
    f = GaugeMetricFamily("thrift_sidecar_upstream_connections", "Pooled upstream connections.",
                          labels=("cluster", "state"))
    for r in rows:
        f.add_metric((r.name, "busy"), r.busy)
        f.add_metric((r.name, "idle"), r.idle)
        f.add_metric((r.name, "connecting"), r.connecting)
    return f


def _transitions_family(rows: list[_ClusterRow]):
    f = CounterMetricFamily("thrift_sidecar_breaker_transitions",
                            "Circuit breaker state changes of a cluster's endpoints.", labels=("cluster",))
    for r in rows:
        f.add_metric((r.name,), r.transitions)
    return f


def _checks_family(rows: list[_ClusterRow]):
    f = CounterMetricFamily("thrift_sidecar_health_checks", "Active health checks by result.",
                            labels=("cluster", "result"))
    for r in rows:
        if r.checks is not None:
            f.add_metric((r.name, "passed"), r.checks[0])
            f.add_metric((r.name, "failed"), r.checks[1])
    return f


def _retries_family(rows: list[_ClusterRow]):
    f = CounterMetricFamily("thrift_sidecar_retries", "Retries made (attempts after a call's first).",
                            labels=("cluster",))
    for r in rows:
        f.add_metric((r.name,), r.retries)
    return f


def _refused_family(rows: list[_ClusterRow]):
    f = CounterMetricFamily("thrift_sidecar_retries_refused",
                            "Retries a route wanted that were not made: the retry budget was spent or "
                            "max_retries were in flight.", labels=("cluster", "reason"))
    for r in rows:
        f.add_metric((r.name, "budget"), r.refused_budget)
        f.add_metric((r.name, "limit"), r.refused_limit)
    return f


OVERFLOWS = ("requests", "pending", "retries")


def _overflow_family(rows: list[_ClusterRow]):
    f = CounterMetricFamily("thrift_sidecar_cluster_overflow",
                            "Calls or retries the cluster's limits refused: max_requests in flight, "
                            "max_pending waiting for a connection, max_retries in flight.",
                            labels=("cluster", "limit"))
    for r in rows:
        for kind in OVERFLOWS:
            f.add_metric((r.name, kind), r.overflow.get(kind, 0))
    return f


_CLUSTER_FAMILIES = (_endpoints_family, _panicking_family, _connections_family, _transitions_family,
                     _checks_family, _retries_family, _refused_family, _overflow_family)
_CLUSTERS_PER_PIECE = PIECE_LINES // len(ENDPOINT_STATES)  # (the most lines a cluster has in a family)


def _cluster_families(clusters: Iterable) -> list:
    """`clusters`: (Cluster, its HealthChecker or None) pairs, as they are now."""
    rows = _cluster_rows(clusters)
    return [build(rows) for build in _CLUSTER_FAMILIES]


LISTENER_EVENTS = (("protocol_error", "protocol_errors"), ("read_timeout", "read_timeouts"),
                   ("idle_closed", "idle_closed"), ("write_stall", "write_stalls"))


def _listener_families(listeners: Iterable) -> list:
    """`listeners`: (name, ListenerState) pairs, as they are now."""
    rows = [(name, len(state.connections), dict(state.stats)) for name, state in listeners]
    open_ = GaugeMetricFamily("thrift_sidecar_client_connections", "Client connections open.",
                              labels=("listener",))
    made = CounterMetricFamily("thrift_sidecar_listener_connections",
                               "Client connections accepted, or refused at max_connections (closed unanswered).",
                               labels=("listener", "result"))
    events = CounterMetricFamily("thrift_sidecar_listener_events",
                                 "Client connections' bad requests, request_read_timeout and idle_timeout "
                                 "closes, and write stalls.", labels=("listener", "event"))
    for name, n, stats in rows:
        open_.add_metric((name,), n)
        made.add_metric((name, "accepted"), stats["accepted"])
        made.add_metric((name, "refused"), stats["refused"])
        for event, key in LISTENER_EVENTS:
            events.add_metric((name, event), stats[key])
    return [open_, made, events]


class _Families:
    """Some metric families, as prometheus_client's `generate_latest` takes a registry."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families


class _Collector:
    """The whole page at once, for prometheus_client's registry: the reference `Metrics.pieces`
    is checked against (tests/test_metrics.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # no registration-time collect (names are fixed; nothing to check)

    def collect(self):
        stats = list(self.metrics.labels.stats)
        for build, _lines in _SERIES_FAMILIES:
            yield build(stats)
        yield from _export_families(self.metrics.export_queue)
        yield from _cluster_families(self.metrics.clusters())
        yield from _listener_families(self.metrics.listeners())


class Metrics:
    """All services' metrics and their private Prometheus registry (no global state)."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.services: dict[str, ServiceMetrics] = {}
        self.labels = LabelSets()  # every service's label sets, each once
        self.export_queue = None  # anything with .dropped, .failed, .size, .capacity
        self.clusters: Callable[[], Iterable] = tuple  # (Cluster, HealthChecker | None) pairs, now
        self.listeners: Callable[[], Iterable] = tuple  # (name, ListenerState) pairs, now
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def service(self, name: str, known_methods: Iterable[str] = (), max_methods: int = MAX_METHODS) -> ServiceMetrics:
        """The metrics of a service; the same object for the same name (survives reloads)."""
        svc = self.services.get(name)
        if svc is None:
            svc = self.services[name] = ServiceMetrics(name, known_methods, max_methods, self.labels)
        else:
            svc.add_known(known_methods)
        return svc

    def watch_exporter(self, queue) -> None:
        self.export_queue = queue

    def watch_listeners(self, listeners: Callable[[], Iterable]) -> None:
        """`listeners()`: the current (name, ListenerState) pairs, asked at each scrape."""
        self.listeners = listeners

    def watch_clusters(self, clusters: Callable[[], Iterable]) -> None:
        """`clusters()`: the current (Cluster, HealthChecker | None) pairs, asked at each scrape."""
        self.clusters = clusters

    def pieces(self) -> Iterator[bytes]:
        """The Prometheus text page in pieces of about PIECE_LINES lines, each formatted (by
        prometheus_client) when asked for: a family with many series is split between them,
        its HELP and TYPE lines in its first piece only. Joined, they are the page the
        registry formats at once, if nothing was recorded in between."""
        stats = list(self.labels.stats)
        for build, lines in _SERIES_FAMILIES:
            first = True
            chunk: list[MethodStats] = []
            n = 0
            for st in stats:
                chunk.append(st)
                n += lines(st)
                if n >= PIECE_LINES:
                    yield _format(build(chunk), first)
                    first = False
                    chunk = []
                    n = 0
            if chunk or first:
                yield _format(build(chunk), first)
        rows = _cluster_rows(self.clusters())  # (read at once: pieces of one moment)
        listeners = _listener_families(self.listeners())
        yield generate_latest(_Families(_export_families(self.export_queue)))
        for build in _CLUSTER_FAMILIES:  # (a family's lines stay together: chunks within it)
            for i in range(0, max(len(rows), 1), _CLUSTERS_PER_PIECE):
                yield _format(build(rows[i:i + _CLUSTERS_PER_PIECE]), i == 0)
        yield generate_latest(_Families(listeners))

    def exposition(self) -> bytes:
        """The Prometheus text page (built now, from the buckets)."""
        return b"".join(self.pieces())

    async def exposition_async(self) -> bytes:
        """The page, the loop running other work between its pieces (a scrape must not hold
        calls up: formatting costs ~8 µs a line)."""
        out = []
        for piece in self.pieces():
            out.append(piece)
            await asyncio.sleep(0)
        return b"".join(out)


def _format(family, first: bool) -> bytes:
    text = generate_latest(_Families([family]))
    return text if first else text.split(b"\n", 2)[2]  # (its HELP and TYPE went out already)
