"""Hop metrics: counts equal the calls recorded, read back through prometheus_client's parser.

Invariants: every recorded call adds exactly one sample to `call_duration` and one to
`calls_total`, one to each hop it has timestamps for (attempt hops once per attempt); buckets
are cumulative and end in +Inf = count; the method-label set never exceeds known + cap + the
two fixed labels, whatever names clients send.
"""

from __future__ import annotations

import os
import random
import string
import time
import timeit
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proxy import metrics as metrics_mod
from proxy import otlp, spans
from proxy.calls import NOT_SENT, SUCCESS, TIMEOUT, Attempt, Call
from proxy.metrics import (BUCKETS, INVALID, OTHER, CompiledRecordHops, Metrics, MethodStats, call_outcome,
                           pure_record_hops)

from proxy.telemetry import Telemetry

import test_telemetry_fixtures as fx


def scrape(metrics: Metrics) -> dict:
    """{family name: [(labels, value, sample name)]} from the text page."""
    out = {}
    for fam in text_string_to_metric_families(metrics.exposition().decode()):
        out[fam.name] = [(s.labels, s.value, s.name) for s in fam.samples]
    return out


def series(fams, family, suffix, **labels):
    return [(lab, v) for lab, v, name in fams[family] if name == family + suffix
            and all(lab.get(k) == val for k, val in labels.items())]


def value(fams, family, suffix, **labels):
    (found,) = series(fams, family, suffix, **labels)
    return found[1]


def test_counts_equal_calls_recorded():
    m = Metrics()
    users = m.service("UserService", known_methods=("get_user", "list_users"))
    makers = {"get_user": fx.call_success, "list_users": fx.call_streamed}
    n = {"get_user": 37, "list_users": 5}
    for method, count in n.items():
        for _ in range(count):
            users.record(makers[method]())
    for _ in range(3):
        users.record(fx.call_retry())      # get_user, 2 attempts, 1 backoff
    users.record(fx.call_timeout())        # get_user
    users.record(fx.call_oneway())         # log_event: not known, admitted under the cap
    fams = scrape(m)

    hop = "thrift_sidecar_hop_duration_seconds"
    get_calls = 37 + 3 + 1
    assert value(fams, hop, "_count", method="get_user", hop="read_request") == get_calls
    assert value(fams, hop, "_count", method="get_user", hop="acquire") == 37 + 3 * 2 + 1
    assert value(fams, hop, "_count", method="get_user", hop="read_response") == 37 + 3
    assert value(fams, hop, "_count", method="get_user", hop="backoff") == 3
    assert value(fams, hop, "_count", method="get_user", hop="write_response") == get_calls
    assert value(fams, hop, "_count", method="list_users", hop="write_response") == 5
    assert value(fams, hop, "_count", method="log_event", hop="write_upstream") == 1
    assert not series(fams, hop, "_count", method="log_event", hop="write_response")
    total = "thrift_sidecar_call_duration_seconds"
    assert value(fams, total, "_count", service="UserService", method="get_user") == get_calls
    assert value(fams, total, "_count", method="list_users") == 5
    calls = "thrift_sidecar_calls"
    assert value(fams, calls, "_total", method="get_user", outcome=SUCCESS) == 40
    assert value(fams, calls, "_total", method="get_user", outcome=TIMEOUT) == 1
    assert value(fams, calls, "_total", method="log_event", outcome=SUCCESS) == 1

    # buckets: cumulative, +Inf equals the count; the 10 ms service times land in le=0.01, the
    # failed attempts' waits (3 × 500 ms per-try timeouts, one 2 s route timeout) further up
    buckets = series(fams, hop, "_bucket", method="get_user", hop="service_time")
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0]["le"] == "+Inf" and counts[-1] == 40 + 4
    assert len(buckets) == len(BUCKETS) + 1
    le = {lab["le"]: v for lab, v in buckets}
    assert le["0.005"] == 0 and le["0.01"] == 40 and le["0.5"] == 43 and le["1.0"] == 43 and le["2.0"] == 44
    service_sum = value(fams, hop, "_sum", method="get_user", hop="service_time")
    assert abs(service_sum - (40 * 0.010 + 3 * 0.5 + 1.999799)) < 1e-6


def test_bucket_edges_are_inclusive():
    m = Metrics()
    svc = m.service("S")
    c = fx.call_success()
    c.t_framed = c.t_start + 100_000  # exactly 0.1 ms: le="0.0001"
    svc.record(c)
    c2 = fx.call_success()
    c2.t_framed = c2.t_start + 100_001
    svc.record(c2)
    le = {lab["le"]: v for lab, v in series(scrape(m), "thrift_sidecar_hop_duration_seconds", "_bucket",
                                            hop="read_request")}
    assert le["5e-05"] == 0 and le["0.0001"] == 1 and le["0.0002"] == 2


def test_multiplexed_and_invalid_labels():
    m = Metrics()
    svc = m.service("Gateway", known_methods=("Users:get_user",))
    svc.record(fx.call_success(fx.FakeMsg("Users:get_user")))
    svc.record(fx.call_success(fx.FakeMsg("Orders:get_order")))
    bad = Call(fx.CONN, None, fx.BASE, fx.BASE + 5000)
    bad.error = "bad request: frame too large"
    bad.t_done = bad.t_write = bad.t_framed + 1000
    bad.t_acked = bad.t_write + 10_000
    assert call_outcome(bad) == "bad_request"
    svc.record(bad)
    fams = scrape(m)
    calls = "thrift_sidecar_calls"
    assert value(fams, calls, "_total", service="Users", method="get_user") == 1
    assert value(fams, calls, "_total", service="Orders", method="get_order") == 1
    assert value(fams, calls, "_total", service="Gateway", method=INVALID, outcome="bad_request") == 1


def test_label_cap_under_random_method_names():
    m = Metrics()
    known = ("get_user", "put_user")
    svc = m.service("S", known_methods=known, max_methods=100)
    rng = random.Random(7)
    c = fx.call_success()
    for _ in range(10_000):
        c.msg = fx.FakeMsg("".join(rng.choice(string.ascii_letters) for _ in range(12)))
        svc.record(c)
    c.msg = fx.FakeMsg("get_user")
    svc.record(c)
    assert svc.label_count() == len(known) + 100 + 2  # + _OTHER and _INVALID
    assert len(svc.by_name) == len(known) + 100
    fams = scrape(m)
    methods = {lab["method"] for lab, _, _ in fams["thrift_sidecar_calls"]}
    assert len(methods) == len(known) - 1 + 100 + 1  # put_user never called; _OTHER
    assert value(fams, "thrift_sidecar_calls", "_total", method=OTHER) == 10_000 - 100
    assert value(fams, "thrift_sidecar_calls", "_total", method="get_user") == 1
    assert sum(v for _, v, _ in fams["thrift_sidecar_calls"]) == 10_001


def test_names_no_route_took_or_too_long_for_a_label_count_under_other():
    """Before: any name took a label, so 100 unrouted junk names used up the cap for good (every
    later real method was _OTHER), and 100 names of 64 KiB made a /metrics page of ~460 MB."""
    m = Metrics()
    svc = m.service("S", known_methods=("get_user",), max_methods=100)
    for i in range(150):
        c = fx.call_success(fx.FakeMsg(f"junk{i}"))
        c.outcome = "no_route"
        svc.record(c)
    for name in ("x" * 65_000, "S:" + "y" * 200, OTHER, INVALID, "Other:" + INVALID):
        svc.record(fx.call_success(fx.FakeMsg(name)))
    svc.record(fx.call_success(fx.FakeMsg("new_method")))  # routed: still gets its own label
    assert svc.label_count() == 1 + 2 + 1  # get_user, _OTHER, _INVALID, new_method
    fams = scrape(m)
    assert value(fams, "thrift_sidecar_calls", "_total", method=OTHER, outcome="no_route") == 150
    assert value(fams, "thrift_sidecar_calls", "_total", method=OTHER, outcome="success") == 5
    assert value(fams, "thrift_sidecar_calls", "_total", method="new_method") == 1
    assert len(m.exposition()) < 100_000


def test_two_services_seeing_one_multiplexed_method_expose_it_once():
    """Two listeners (services) both taking `Users:get_user` count in one series: Prometheus
    leaves a repeated series undefined (it kept one listener's and dropped the other's)."""
    m = Metrics()
    plain = m.service("Users", known_methods=("get_user",))
    gateway = m.service("Gateway")
    for _ in range(3):
        plain.record(fx.call_success(fx.FakeMsg("get_user")))
    for _ in range(5):
        gateway.record(fx.call_success(fx.FakeMsg("Users:get_user")))
    page = m.exposition().decode()
    lines = [ln.rsplit(" ", 1)[0] for ln in page.splitlines() if not ln.startswith("#")]
    assert len(lines) == len(set(lines)), "a series is exposed twice"
    fams = scrape(m)
    assert value(fams, "thrift_sidecar_calls", "_total", service="Users", method="get_user") == 8
    assert value(fams, "thrift_sidecar_call_duration_seconds", "_count", service="Users", method="get_user") == 8
    assert value(fams, "thrift_sidecar_hop_duration_seconds", "_count", service="Users", method="get_user",
                 hop="read_request") == 8


def test_answers_that_never_reached_the_client_are_counted_by_reason():
    """A success the client never got is still a success in calls_total (the call's outcome),
    and also counted in replies_not_delivered_total, as the trace says it failed."""
    m = Metrics()
    svc = m.service("S")
    svc.record(fx.call_success(fx.FakeMsg("get")))
    svc.record(fx.call_never_read())
    broke = fx.call_success(fx.FakeMsg("get"))
    broke.never_read = True
    broke.error_type = "not_delivered"
    broke.error = "not delivered: the client's connection broke before it took the reply"
    svc.record(broke)
    fams = scrape(m)
    nd = "thrift_sidecar_replies_not_delivered"
    method = fx.call_never_read().msg.name
    assert value(fams, nd, "_total", method=method, reason="client_never_read") == 1
    assert value(fams, nd, "_total", method="get", reason="not_delivered") == 1
    assert sum(v for _, v, n in fams[nd] if n == nd + "_total") == 2
    assert value(fams, "thrift_sidecar_calls", "_total", method="get", outcome=SUCCESS) == 2


def _busy_metrics(methods: int) -> Metrics:
    m = Metrics()
    for svc_name in ("A", "B"):
        svc = m.service(svc_name)
        for i in range(methods):
            svc.record(fx.call_retry() if i % 3 == 0 else fx.call_success(fx.FakeMsg(f"m{i}")))
            svc.record(fx.call_timeout())
            svc.record(fx.call_never_read())
    return m


def test_the_page_in_pieces_is_the_page_formatted_at_once():
    """`pieces` splits families between series and gives HELP/TYPE once: joined, it is byte for
    byte what prometheus_client formats from the registry in one go; no piece is much over
    PIECE_LINES lines (one label set's histograms at most)."""
    from prometheus_client import generate_latest

    for methods in (0, 1, 40):
        m = _busy_metrics(methods)
        pieces = list(m.pieces())
        assert b"".join(pieces) == generate_latest(m.registry)
        one_set = (len(BUCKETS) + 3) * (len(spans.HOPS) + 1)
        assert max(p.count(b"\n") for p in pieces) <= metrics_mod.PIECE_LINES + one_set + 2
        if methods == 40:
            assert len(pieces) > 20  # (~13,000 lines)


def test_many_clusters_are_formatted_in_pieces_too():
    """300 clusters (every other one health-checked): each cluster family is split between
    pieces of at most PIECE_LINES lines, its lines kept together, and the page joined is what the
    registry formats at once. Before: all cluster families in one piece (1,000 clusters held the
    loop ~130 ms)."""
    from prometheus_client import generate_latest

    from proxy.balancer import make_balancer
    from proxy.clock import ManualClock
    from proxy.cluster import Cluster
    from proxy.endpoint import Endpoint
    from proxy.health import HealthChecker
    from proxy.pool import PoolSettings

    clock = ManualClock()
    pairs = []
    for i in range(300):
        eps = [Endpoint(f"10.0.{i // 250}.{i % 250}", 9090 + j, 1, clock=clock) for j in range(3)]
        c = Cluster(f"c{i}", None, eps, make_balancer("round_robin", rng=random.Random(i)), PoolSettings())
        c.stats["retries"] = i
        checker = None
        if i % 2:
            checker = HealthChecker(c, "ping", 1.0, 1.0)
            checker.stats["checks"], checker.stats["failures"] = 2 * i, i
            eps[0].healthy = False
        pairs.append((c, checker))
    m = Metrics()
    m.watch_clusters(lambda: pairs)
    pieces = list(m.pieces())
    page = generate_latest(m.registry)
    assert b"".join(pieces) == page
    assert b'thrift_sidecar_retries_total{cluster="c299"} 299.0' in page
    assert b'thrift_sidecar_health_checks_total{cluster="c299",result="failed"} 299.0' in page
    assert b'thrift_sidecar_cluster_endpoints{cluster="c1",state="failing_health_check"} 1.0' in page
    cluster_pieces = [p for p in pieces if b'{cluster="' in p]
    assert len(cluster_pieces) >= 7 * 2  # (each of the 7 families in several pieces)
    assert max(p.count(b"\n") for p in cluster_pieces) <= metrics_mod.PIECE_LINES + 2


def test_a_scrape_lets_the_loop_run_between_pieces():
    """The admin's /metrics awaits `exposition_async`: other work runs between its pieces, not
    after the whole page (before: one 140 ms stretch for 100 methods' hops)."""
    from harness import turns_while

    m = _busy_metrics(40)
    pieces = len(list(m.pieces()))
    body, ticks = turns_while(m.exposition_async)
    assert body == m.exposition()
    assert ticks >= pieces - 1


def test_same_service_is_one_object_and_outcomes_are_derived():
    m = Metrics()
    assert m.service("S") is m.service("S", known_methods=("x",))
    assert "x" in m.service("S").by_name
    c = fx.call_success()
    c.outcome = None
    c.attempts[0].outcome = None
    assert call_outcome(c) == SUCCESS
    c.error = "not sent: no endpoint available"
    c.written = False
    assert call_outcome(c) == NOT_SENT


def test_record_cost_printed():
    """Benchmark, never a pass/fail: the loop's CPU per call for the hop histograms."""
    m = Metrics()
    svc = m.service("UserService", known_methods=("get_user",))
    call, retry = fx.call_success(), fx.call_retry()
    for c in (call, retry):
        n = 20_000
        per = min(timeit.repeat(lambda: svc.record(c), number=n, repeat=3, timer=time.thread_time)) / n
        print(f"\nmetrics.record: {per * 1e6:.2f} µs/call ({len(c.attempts)} attempt(s))", end="")
    page = min(timeit.repeat(m.exposition, number=20, repeat=3, timer=time.thread_time)) / 20
    print(f"\nexposition: {page * 1e3:.2f} ms/scrape (1 method)")


# -- the compiled twin of the hop update ---------------------------------------------------------


def test_compiled_hops_are_built():
    """`make test` runs the compiled hop update: a build that silently fell back to pure Python fails here."""
    if os.environ.get("THRIFT_SIDECAR_PURE_PYTHON", "") not in ("", "0"):
        assert metrics_mod.HOPS_IMPL == "python" and metrics_mod.record_hops is pure_record_hops
        return
    assert CompiledRecordHops is not None, (
        "proxy._hops is not built: `pip install -e .` (make deps) compiles proxy/_hops.c "
        "with the system's C compiler; look for the build_ext warning in its output")
    assert metrics_mod.HOPS_IMPL == "c" and metrics_mod.record_hops is CompiledRecordHops


# Timestamps from a small pool, so equal and out-of-order pairs are common (every `>=` is tried at
# its edge), plus 0, the bucket edges, and values the fast path hands to the pure one: negative,
# past 64 bits, floats, bools.
_BASE = 10**12
_pool = st.sampled_from([0, _BASE, _BASE + 1, _BASE + 24_999, _BASE + 25_000, _BASE + 25_001,
                         _BASE + 30 * 10**9, _BASE + 30 * 10**9 + 1, _BASE + 10**6])
_odd = st.sampled_from([-5, -2**63, 2**63 - 1, 2**64, 2**70, 1.5, True])
_ns = _pool | _pool | _pool | _odd
_attempt = st.fixed_dictionaries({**{k: _ns for k in ("t_acquire", "t_acquired", "t_written", "t_first_reply",
                                                     "t_reply")},
                                   "held_ns": st.sampled_from([0, 0, 0, 1, 10**6, 30 * 10**9]) | _odd})
_waited = st.sampled_from([False, True, True, 0, 1, None])  # a plain bool, else the pure path
_call = st.fixed_dictionaries({**{k: _ns for k in ("t_start", "t_framed", "t_admitted", "t_done", "t_write",
                                                   "t_handed", "t_acked")}, "waited": _waited}).flatmap(
    lambda times: st.tuples(st.just(times), st.lists(_attempt, max_size=3), st.lists(st.tuples(_ns, _ns), max_size=2)))


def _make_call(spec) -> Call:
    times, attempts, backoffs = spec
    call = Call(None, fx.FakeMsg(), times["t_start"], times["t_framed"])
    for k, v in times.items():
        setattr(call, k, v)
    for i, at in enumerate(attempts):
        a = Attempt(call, None, i + 1, at["t_acquire"])
        for k, v in at.items():
            setattr(a, k, v)
        call.attempts.append(a)
    call.backoffs = list(backoffs)
    return call


def _record_both(spec, start_sum: int = 0):
    pure, compiled = MethodStats("S", "m"), MethodStats("S", "m")
    for st_ in (pure, compiled):
        st_.hop_sums = [start_sum] * len(st_.hop_sums)
    errors = []
    for fn, st_ in ((pure_record_hops, pure), (CompiledRecordHops, compiled)):
        try:
            fn(st_.hops, st_.hop_sums, _make_call(spec))
            errors.append(None)
        except Exception as e:  # both must fail alike (e.g. a float duration's bucket) or not at all
            errors.append(type(e))
    assert errors[0] == errors[1]
    assert compiled.hops == pure.hops and compiled.hop_sums == pure.hop_sums
    return compiled


@pytest.mark.skipif(CompiledRecordHops is None, reason="proxy._hops not built")
@settings(max_examples=1000, deadline=None)
@given(specs=st.lists(_call, min_size=1, max_size=4), start_sum=st.sampled_from([0, 0, 2**63 - 10**9, 2**64]))
def test_compiled_hop_update_agrees_with_the_pure_one(specs, start_sum):
    for spec in specs:
        _record_both(spec, start_sum)


@pytest.mark.skipif(CompiledRecordHops is None, reason="proxy._hops not built")
def test_compiled_hop_update_agrees_at_each_edge():
    b = _BASE
    one = {"t_acquire": b, "t_acquired": b, "t_written": b, "t_first_reply": b, "t_reply": b}
    times = {"t_start": b, "t_framed": b, "t_done": b, "t_write": b, "t_handed": b, "t_acked": 0}
    st_ = _record_both((times, [one, dict(one)], [(b, b)]))
    # every hop at 0 ns counts, retries twice; not queued: the reply did not wait (as its span)
    assert sum(map(sum, st_.hops)) == 2 + 2 * 4 + 1
    late = dict(one, t_first_reply=b - 1)  # the reply's first byte before the write: no service_time
    _record_both((times, [late], []))
    _record_both((dict(times, t_start=0, t_framed=None), [one], []))  # `t_start and ...`: t_framed unread
    _record_both((times, [dict(one, t_first_reply=0, t_reply=b + 5)], []))  # or t_reply
    _record_both((times, [one], [(2**63 - 1, 2**64)]), start_sum=2**63 - 1)  # sums past 64 bits
    # a streamed reply (first byte written before it was all read) and a reply that waited in line
    st_ = _record_both((dict(times, t_done=b + 10, t_write=b + 4, t_acked=b + 30), [one], []))
    assert st_.hop_sums[metrics_mod._WRITE_RESPONSE] == 26 and not any(st_.hops[metrics_mod._QUEUED])
    st_ = _record_both((dict(times, t_done=b + 10, t_write=b + 14, t_acked=b + 30, waited=True), [one], []))
    assert st_.hop_sums[metrics_mod._QUEUED] == 4 and st_.hop_sums[metrics_mod._WRITE_RESPONSE] == 16
    # a request held back at max_inflight: from framed to admitted is queued too
    st_ = _record_both((dict(times, t_admitted=b + 7), [one], []))
    assert st_.hop_sums[metrics_mod._QUEUED] == 7 and sum(st_.hops[metrics_mod._QUEUED]) == 1
    st_ = _record_both((dict(times, t_done=b + 10, t_write=b + 14, t_acked=b + 30), [one], []))
    assert not any(st_.hops[metrics_mod._QUEUED])  # written at once (not waited): no queued sample
    _record_both((dict(times, t_done=b + 10, t_write=b + 14, waited=1), [one], []))  # not a bool: pure
    _record_both((dict(times, t_done=b + 10, t_write=0, t_handed=b + 30), [one], []))  # from t_done


@pytest.mark.skipif(CompiledRecordHops is None, reason="proxy._hops not built")
def test_compiled_hop_update_survives_attributes_that_change_the_call():
    """Reading an attribute may run Python code; the compiled update holds what it reads."""
    call = fx.call_retry()

    class Shrinking(type(call.attempts[0])):
        __slots__ = ()

        @property
        def t_written(self):
            call.attempts.clear()  # the attempt being read loses its last other reference
            return 0

    victim = call.attempts[0]
    call.attempts[0] = Shrinking.__new__(Shrinking)
    for k in Attempt.__slots__:
        if k != "t_written" and hasattr(victim, k):
            setattr(call.attempts[0], k, getattr(victim, k))
    del victim
    st_ = MethodStats("S", "m")
    CompiledRecordHops(st_.hops, st_.hop_sums, call)
    assert st_.hops[metrics_mod._ACQUIRE] != [0] * len(st_.hops[0])


@pytest.mark.skipif(CompiledRecordHops is None, reason="proxy._hops not built")
def test_what_the_compiled_update_cannot_take_gets_the_pure_ones_answer():
    call = fx.call_retry()
    for hops, sums in [(tuple(MethodStats("S", "m").hops), MethodStats("S", "m").hop_sums),
                       ([[0] * 3] * 8, [0] * 8)]:  # buckets of the wrong size
        errors = []
        for fn in (pure_record_hops, CompiledRecordHops):
            try:
                fn(list(map(list, hops)) if fn is pure_record_hops and isinstance(hops, tuple) else hops, sums, call)
                errors.append(None)
            except Exception as e:
                errors.append(type(e))
        assert errors[0] == errors[1]
    call.backoffs = [[call.t_start, call.t_framed]]  # a list for a pair: pure takes it, so must we
    _same(call)
    call.backoffs = [(1, 2, 3)]
    with pytest.raises(ValueError):
        CompiledRecordHops(MethodStats("S", "m").hops, MethodStats("S", "m").hop_sums, call)


def _same(call):
    pure, compiled = MethodStats("S", "m"), MethodStats("S", "m")
    pure_record_hops(pure.hops, pure.hop_sums, call)
    CompiledRecordHops(compiled.hops, compiled.hop_sums, call)
    assert compiled.hops == pure.hops and compiled.hop_sums == pure.hop_sums


# -- the histograms and the spans tell the same story --------------------------------------------


def _metric_hops(record, call) -> dict[str, tuple[int, int]]:
    """{hop: (samples, sum ns)} that one call adds to the histograms."""
    st_ = MethodStats("S", "m")
    record(st_.hops, st_.hop_sums, call)
    return {name: (sum(st_.hops[i]), st_.hop_sums[i]) for i, name in enumerate(spans.HOPS) if any(st_.hops[i])}


def _span_hops(call) -> dict[str, tuple[int, int]]:
    """{hop: (spans, summed duration ns)} of the same call's span plan (proxy.telemetry)."""
    t = Telemetry(SimpleNamespace(service_name="s", exporter="none", sample_ratio=1.0), exporter=None)
    out: dict[str, tuple[int, int]] = {}
    for name, _sid, _pid, _remote, kind, t0, t1, *_ in t.plan(call, "S")[3]:
        if name in spans.HOPS and kind == otlp.KIND_INTERNAL:
            n, total = out.get(name, (0, 0))
            out[name] = (n + 1, total + t1 - t0)
    return out


def _held_for_its_turn():
    """A 15 MB reply behind a slow pipelined call: held unread 400 ms for its turn, then streamed."""
    c = fx.call_streamed()
    a = c.attempts[0]
    a.held_ns = fx.ms(400)
    c.client_paused_ns += a.held_ns  # (the hold is credited as the client's: Attempt.held_for)
    a.t_reply += a.held_ns
    c.t_write += a.held_ns
    c.t_done, c.t_handed, c.t_acked = a.t_reply, a.t_reply + fx.ms(0.5), a.t_reply + fx.ms(40)
    return c


def _streamed_slow_reader():
    """s5b: a 13.8 MB reply streamed to a client reading for 8.6 s; the upstream sent it in 6.7 s."""
    c = fx.call_streamed()
    a = c.attempts[0]
    a.t_reply = a.t_first_reply + fx.ms(6655)
    c.t_done = a.t_reply
    c.t_acked = c.t_write + fx.ms(8595)
    c.t_handed = c.t_acked - fx.ms(1)
    return c


AGREE = {
    "success": fx.call_success, "declared": fx.call_declared, "retry": fx.call_retry,
    "timeout": fx.call_timeout, "queued": fx.call_queued, "oneway": fx.call_oneway,
    "streamed": fx.call_streamed, "streamed_slow_reader": _streamed_slow_reader, "held": _held_for_its_turn,
    "acquire_timeout": fx.call_acquire_timeout, "connect_timeout_retry": fx.call_connect_timeout_retry,
    "gone_while_waiting": fx.call_gone_while_waiting, "never_read": fx.call_never_read,
}
IMPLS = [pytest.param(pure_record_hops, id="pure"),
         pytest.param(CompiledRecordHops, id="compiled",
                      marks=pytest.mark.skipif(CompiledRecordHops is None, reason="proxy._hops not built"))]


@pytest.mark.parametrize("record", IMPLS)
@pytest.mark.parametrize("shape", sorted(AGREE))
def test_metrics_and_spans_agree_on_every_hop(shape, record):
    """Every hop a call's spans show, its histogram samples show, with the same durations (and no
    other hop). Before: a streamed reply's write_response sample started at t_done (its last byte
    read from the upstream), not at its first byte written, so a slow reader's time went missing
    from the metric (1.9 s vs the span's 8.6 s in a review); and every call had a `queued`
    sample, its span only when the reply waited behind an earlier one."""
    call = AGREE[shape]()
    assert _metric_hops(record, call) == _span_hops(call)


@pytest.mark.parametrize("record", IMPLS)
def test_a_reply_held_for_its_turn_is_queued_not_read_response(record):
    """The hold (first reply byte → its turn) is the wait behind the client's earlier calls:
    `queued`, in the histograms as in the spans; `read_response` is the stream after it. Before:
    read_response took the 400 ms, as if the upstream had been slow to send."""
    call = _held_for_its_turn()
    hops = _metric_hops(record, call)
    assert hops["queued"] == (1, fx.ms(400))
    assert hops["read_response"] == (1, fx.ms(300))
    assert hops == _span_hops(call)


@pytest.mark.parametrize("record", IMPLS)
def test_streamed_reply_write_response_starts_at_its_first_byte_written(record):
    call = _streamed_slow_reader()
    hops = _metric_hops(record, call)
    assert hops["write_response"] == (1, fx.ms(8595))
    assert hops["read_response"] == (1, fx.ms(6655))  # overlaps write_response, as the spans say
    assert "queued" not in hops


@pytest.mark.parametrize("record", IMPLS)
def test_an_attempt_that_never_got_a_connection_has_its_acquire_sample(record):
    """Its wait for the pool (or the connect) lasted until the attempt ended: t_reply, which the
    pipeline stamps when it fails; else the call's t_done (the client left while it waited).
    Before: no sample at all, for the calls whose time went there."""
    assert _metric_hops(record, fx.call_acquire_timeout())["acquire"] == (1, fx.ms(300))
    retried = _metric_hops(record, fx.call_connect_timeout_retry())
    assert retried["acquire"] == (2, fx.ms(300) + fx.ms(0.3))
    assert retried["service_time"][0] == 1 and retried["backoff"] == (1, fx.ms(50))
    assert _metric_hops(record, fx.call_gone_while_waiting()) == {"read_request": (1, fx.ms(0.1)),
                                                                  "acquire": (1, fx.ms(200))}


def test_listener_and_limit_refusals_are_on_the_page():
    """What an overloaded proxy refuses shows in /metrics, not only /stats: a listener at
    max_connections (3) refusing a fourth connection, a bad request, and a cluster's max_pending
    (1) refusing the third of three calls that would wait for its one pooled connection. Before: none of these had
    a series (the lifecycle hunt), and they blurred into calls_total{outcome="not_sent"}."""
    import socket
    import threading

    from thrift.Thrift import TApplicationException

    from harness import Proxy, ThriftServer, client, config_text

    up = ThriftServer()
    up.handler.sleep_ms = 300
    text = config_text([up.address], extra_listener="\n    max_connections: 3",
                       extra_cluster="\n    pool: {max_connections: 1}\n    limits: {max_pending: 1}")
    refused = []
    try:
        with Proxy(text) as p:
            def call() -> None:
                try:
                    with client(p.port()) as c:
                        c.lookup("k")
                except TApplicationException as e:
                    refused.append(e.message)

            held = [socket.create_connection(("127.0.0.1", p.port())) for _ in range(3)]
            time.sleep(0.1)
            with socket.create_connection(("127.0.0.1", p.port())) as s:  # the fourth: refused
                s.settimeout(5)
                try:
                    assert s.recv(1) == b""
                except ConnectionResetError:
                    pass
            for h in held:
                h.close()
            time.sleep(0.1)
            threads = [threading.Thread(target=call) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            with socket.create_connection(("127.0.0.1", p.port())) as s:  # a bad request
                s.sendall(b"\x00\x00\x00\x05hello")
                s.settimeout(5)
                s.recv(4096)
            time.sleep(0.1)
            page = p.call(lambda: p.server.metrics.exposition()).decode()
    finally:
        up.stop()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(page) for s in f.samples}
    assert samples[("thrift_sidecar_listener_connections_total", (("listener", "test"), ("result", "refused")))] >= 1
    assert samples[("thrift_sidecar_listener_connections_total", (("listener", "test"), ("result", "accepted")))] >= 3
    assert samples[("thrift_sidecar_listener_events_total", (("event", "protocol_error"), ("listener", "test")))] == 1
    assert ("thrift_sidecar_client_connections", (("listener", "test"),)) in samples
    pending = samples[("thrift_sidecar_cluster_overflow_total", (("cluster", "up"), ("limit", "pending")))]
    assert pending >= 1 and pending == sum("max_pending" in m for m in refused), (pending, refused)


def test_a_request_read_timeout_is_one_event_not_also_a_protocol_error():
    """Half a request left past request_read_timeout: the client is answered and closed, and
    listener_events_total counts it once, as read_timeout. Before: it counted as protocol_error
    too (the timeout answered through the bad-request path, which counted again), so summing the
    event kinds counted such a connection twice. A malformed request still counts as protocol_error."""
    import socket

    from harness import Proxy, ThriftServer, config_text

    up = ThriftServer()
    text = config_text([up.address], extra_listener="\n    request_read_timeout: 200ms")
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(b"\x00\x00\x00\x40\x80\x01")  # 2 of a 64-byte frame's bytes
                s.settimeout(5)
                answer = b""
                while chunk := s.recv(4096):
                    answer += chunk
            assert b"request_read_timeout" in answer, answer
            with socket.create_connection(("127.0.0.1", p.port())) as s:  # a malformed one
                s.sendall(b"\x00\x00\x00\x05hello")
                s.settimeout(5)
                while s.recv(4096):
                    pass
            time.sleep(0.1)
            page = p.call(lambda: p.server.metrics.exposition()).decode()
    finally:
        up.stop()
    events = {s.labels["event"]: s.value for f in text_string_to_metric_families(page) for s in f.samples
              if s.name == "thrift_sidecar_listener_events_total" and s.labels.get("listener") == "test"}
    assert events.get("read_timeout") == 1 and events.get("protocol_error") == 1, events
