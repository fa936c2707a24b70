"""Span shapes: finished calls (synthetic timestamps) → spans, through the real export queue.

Invariants checked for every shape: one SERVER span named `{service}/{method}`, hop names only
from `proxy.spans`, every span inside its parent's interval, parent links by span id, one trace
id, every exported span carries the sampled flag, and the SERVER span's children cover ≥ 95% of
it. Then per shape: what it must show (retry: two CLIENT spans with a backoff between; queued;
oneway: no reply hops; streamed: overlapping read/write and its attributes; ...).
"""

from __future__ import annotations

import random
import time
import timeit
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy import spans
from proxy.calls import DECLARED_EXCEPTION, SUCCESS, TIMEOUT
from proxy.telemetry import QUEUED_MIN_NS, Telemetry

import test_telemetry_fixtures as fx

OFFSET = 1_700_000_000_000_000_000 - fx.BASE  # monotonic BASE ↦ a plausible epoch


def tracing(ratio=1.0, name="sidecar-test"):
    return SimpleNamespace(service_name=name, exporter="none", sample_ratio=ratio)


@pytest.fixture
def memory():
    return InMemorySpanExporter()


@pytest.fixture
def telemetry(memory):
    t = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(1), exporter=memory, interval=0.01)
    yield t
    t.shutdown(2.0)


def export(telemetry, memory, call, service="UserService", listener="users"):
    memory.clear()
    reason = telemetry.finished(call, service, listener)
    assert telemetry.flush(5.0)
    return reason, list(memory.get_finished_spans())


def tree(out):
    server = [s for s in out if s.kind is SpanKind.SERVER]
    assert len(server) == 1
    server = server[0]
    by_id = {s.context.span_id: s for s in out}
    assert len(by_id) == len(out), "span ids must be unique"
    children = {}
    for s in out:
        assert s.context.trace_id == server.context.trace_id
        assert s.context.trace_flags.sampled, "exported copies carry the sampled flag"
        assert s.start_time <= s.end_time, s.name
        if s is server:
            continue
        parent = by_id[s.parent.span_id]
        assert parent.start_time <= s.start_time and s.end_time <= parent.end_time, (s.name, parent.name)
        children.setdefault(parent.context.span_id, []).append(s)
    return server, children


def coverage(parent, kids):
    """Share of the parent's interval covered by the union of its children."""
    iv = sorted((k.start_time, k.end_time) for k in kids)
    covered, cur_s, cur_e = 0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        covered += cur_e - cur_s
    return covered / (parent.end_time - parent.start_time)


def names(kids):
    return [k.name for k in sorted(kids, key=lambda k: (k.start_time, k.end_time))]


def check_common(out):
    allowed = set(spans.HOPS)
    server, children = tree(out)
    for s in out:
        if s.kind in (SpanKind.SERVER, SpanKind.CLIENT):
            assert s.name == server.name
            assert s.attributes[spans.RPC_SYSTEM] == "apache_thrift"
        else:
            assert s.kind is SpanKind.INTERNAL and s.name in allowed, s.name
        assert s.resource.attributes["service.name"] == "sidecar-test"
        assert s.instrumentation_scope.name == spans.INSTRUMENTATION_SCOPE
        assert s.instrumentation_scope.schema_url == spans.SCHEMA_URL
    assert coverage(server, children[server.context.span_id]) >= 0.95
    return server, children


def test_success(telemetry, memory):
    call = fx.call_success()
    reason, out = export(telemetry, memory, call)
    assert reason == spans.SAMPLED_HEAD
    server, children = check_common(out)
    assert server.name == "UserService/get_user"
    assert server.start_time == fx.BASE + OFFSET
    assert server.end_time == call.t_acked + OFFSET
    assert server.parent is None
    assert server.status.status_code is StatusCode.UNSET
    a = server.attributes
    assert a[spans.RPC_SERVICE] == "UserService" and a[spans.RPC_METHOD] == "get_user"
    assert a[spans.PEER_ADDRESS] == "127.0.0.1" and a[spans.PEER_PORT] == 51515
    assert a[spans.OUTCOME] == SUCCESS and a[spans.ATTEMPTS] == 1
    assert a[spans.REQUEST_SIZE] == 120 and a[spans.REPLY_SIZE] == 300
    assert a[spans.SEQID] == 7 and a[spans.LISTENER] == "users"
    assert a[spans.SAMPLED_BY] == "head" and a[spans.NEW_TRACE] is True
    assert spans.ERROR_TYPE not in a and spans.STREAMED not in a
    kids = children[server.context.span_id]
    assert names(kids) == ["read_request", "UserService/get_user", "write_response"]
    client = [k for k in kids if k.kind is SpanKind.CLIENT][0]
    ca = client.attributes
    assert ca[spans.SERVER_ADDRESS] == "127.0.0.1" and ca[spans.SERVER_PORT] == 9191
    assert ca[spans.ATTEMPT] == 1 and ca[spans.BREAKER_STATE] == "closed"
    assert ca[spans.OUTCOME] == SUCCESS and spans.RETRY_REASON not in ca
    hops = children[client.context.span_id]
    assert names(hops) == ["acquire", "write_upstream", "service_time", "read_response"]
    assert coverage(client, hops) >= 0.999
    service_time = [h for h in hops if h.name == "service_time"][0]
    assert service_time.end_time - service_time.start_time == fx.ms(10)
    write = [k for k in kids if k.name == "write_response"][0]
    assert write.attributes[spans.HANDED_MS] == pytest.approx(0.01)
    assert spans.CLIENT_NEVER_READ not in write.attributes
    assert "queued" not in names(kids)  # written 5 µs after it was ready: no wait in line


def test_declared_exception_is_not_a_failure(telemetry, memory):
    call = fx.call_declared()
    assert Telemetry(tracing(0.0), exporter=None).should_export(call) is None
    _, out = export(telemetry, memory, call)
    server, children = check_common(out)
    assert server.attributes[spans.OUTCOME] == DECLARED_EXCEPTION
    assert server.status.status_code is StatusCode.UNSET
    client = [s for s in out if s.kind is SpanKind.CLIENT][0]
    assert client.status.status_code is StatusCode.UNSET
    assert client.attributes[spans.OUTCOME] == DECLARED_EXCEPTION


def test_retry_with_backoff(telemetry, memory):
    _, out = export(telemetry, memory, fx.call_retry())
    server, children = check_common(out)
    kids = sorted(children[server.context.span_id], key=lambda k: k.start_time)
    assert [k.name for k in kids] == ["read_request", "UserService/get_user", "backoff",
                                      "UserService/get_user", "write_response"]
    c1, backoff, c2 = kids[1], kids[2], kids[3]
    assert c1.kind is c2.kind is SpanKind.CLIENT
    assert c1.end_time <= backoff.start_time and backoff.end_time <= c2.start_time
    assert backoff.end_time - backoff.start_time == fx.ms(25)
    assert c1.attributes[spans.ATTEMPT] == 1 and c2.attributes[spans.ATTEMPT] == 2
    assert c1.attributes[spans.SERVER_PORT] == 9191 and c2.attributes[spans.SERVER_PORT] == 9192
    assert c1.status.status_code is StatusCode.ERROR and c1.attributes[spans.ERROR_TYPE] == TIMEOUT
    assert c2.attributes[spans.RETRY_REASON] == TIMEOUT and spans.RETRY_REASON not in c1.attributes
    assert c2.status.status_code is StatusCode.UNSET
    assert names(children[c1.context.span_id]) == ["acquire", "write_upstream", "service_time"]
    assert server.attributes[spans.ATTEMPTS] == 2 and server.status.status_code is StatusCode.UNSET


def test_timeout(memory):
    t = Telemetry(tracing(0.0), clock_offset_ns=OFFSET, rng=random.Random(2), exporter=memory, interval=0.01)
    try:
        call = fx.call_timeout()
        reason, out = export(t, memory, call)
        assert reason == spans.SAMPLED_FAILED  # not head-sampled at ratio 0, kept because it failed
        server, children = check_common(out)
        assert server.status.status_code is StatusCode.ERROR
        a = server.attributes
        assert a[spans.ERROR_TYPE] == "timeout" and a[spans.OUTCOME] == TIMEOUT
        assert a[spans.ERROR_MESSAGE].startswith("may have run")
        assert a[spans.SAMPLED_BY] == "failed"
        client = [s for s in out if s.kind is SpanKind.CLIENT][0]
        hops = children[client.context.span_id]
        assert names(hops) == ["acquire", "write_upstream", "service_time"]  # no reply was read
        st = [h for h in hops if h.name == "service_time"][0]
        assert st.end_time - st.start_time > fx.ms(1999)
    finally:
        t.shutdown(2.0)


def test_pipelined_call_that_queued(telemetry, memory):
    call = fx.call_queued()
    _, out = export(telemetry, memory, call)
    server, children = check_common(out)
    kids = children[server.context.span_id]
    assert names(kids) == ["read_request", "UserService/get_user", "queued", "write_response"]
    q = [k for k in kids if k.name == "queued"][0]
    assert q.end_time - q.start_time == fx.ms(40) > QUEUED_MIN_NS
    assert q.start_time == call.t_done + OFFSET


@pytest.mark.parametrize("make, waited", [(fx.call_acquire_timeout, 300), (fx.call_gone_while_waiting, 200)])
def test_attempt_that_never_got_a_connection_shows_acquire(telemetry, memory, make, waited):
    """A pool wait or connect that failed (or that the client left) is the attempt's `acquire`,
    until the attempt ended (t_reply, else the call's t_done). Before: a bare CLIENT span, and
    `hops` blamed the gap on the proxy's own work."""
    call = make()
    _, out = export(telemetry, memory, call)
    server, children = check_common(out)
    (client,) = [s for s in out if s.kind is SpanKind.CLIENT]
    (acquire,) = children[client.context.span_id]
    assert acquire.name == "acquire" and acquire.end_time - acquire.start_time == fx.ms(waited)
    assert acquire.start_time == client.start_time and acquire.end_time == client.end_time
    assert client.attributes[spans.OUTCOME] == "not_sent"


def test_connect_timeout_then_retry_shows_both_acquires(telemetry, memory):
    _, out = export(telemetry, memory, fx.call_connect_timeout_retry())
    server, children = check_common(out)
    c1, c2 = sorted((s for s in out if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    assert names(children[c1.context.span_id]) == ["acquire"]
    (a1,) = children[c1.context.span_id]
    assert a1.end_time - a1.start_time == fx.ms(300)
    assert names(children[c2.context.span_id]) == ["acquire", "write_upstream", "service_time", "read_response"]


def test_oneway(telemetry, memory):
    call = fx.call_oneway()
    _, out = export(telemetry, memory, call)
    server, children = check_common(out)
    assert server.name == "UserService/log_event"
    assert server.attributes[spans.ONEWAY] is True
    assert server.end_time == call.t_done + OFFSET
    assert spans.REPLY_SIZE not in server.attributes
    kids = children[server.context.span_id]
    assert names(kids) == ["read_request", "UserService/log_event"]
    client = [k for k in kids if k.kind is SpanKind.CLIENT][0]
    assert names(children[client.context.span_id]) == ["acquire", "write_upstream"]


def test_streamed_reply(telemetry, memory):
    _, out = export(telemetry, memory, fx.call_streamed())
    server, children = check_common(out)
    a = server.attributes
    assert a[spans.STREAMED] is True
    assert a[spans.CLIENT_PAUSED_MS] == 250.0 and a[spans.UPSTREAM_WAIT_MS] == 12.0
    assert a[spans.REPLY_SIZE] == 15_000_000
    read = [s for s in out if s.name == "read_response"][0]
    write = [s for s in out if s.name == "write_response"][0]
    assert write.start_time < read.end_time  # streamed: the hops overlap
    assert write.end_time > read.end_time


def test_client_never_read(memory):
    """The kernel took the reply at once (t_handed) but the client never read it: the listener
    stops waiting at its cap and stamps t_acked then (never_read). The call is as long as that
    wait, kept at ratio 0 as failed, error.type client_never_read. Before: SERVER and
    write_response ended at t_handed (the call looked fast: 3 ms for a 60 s wait), and at
    ratio 0 such a call was not exported at all."""
    t = Telemetry(tracing(0.0), clock_offset_ns=OFFSET, rng=random.Random(6), exporter=memory, interval=0.01)
    try:
        call = fx.call_never_read()
        assert t.should_export(call) == spans.SAMPLED_FAILED
        reason, out = export(t, memory, call)
        assert reason == spans.SAMPLED_FAILED
        server, _ = check_common(out)
        write = [s for s in out if s.name == "write_response"][0]
        assert write.attributes[spans.CLIENT_NEVER_READ] is True
        assert write.attributes[spans.HANDED_MS] == pytest.approx(0.02)
        assert write.start_time == call.t_write + OFFSET
        assert write.end_time == call.t_acked + OFFSET == server.end_time
        assert write.end_time - write.start_time == fx.ms(60_000)
        a = server.attributes
        assert a[spans.ERROR_TYPE] == spans.ERROR_CLIENT_NEVER_READ and a[spans.SAMPLED_BY] == "failed"
        assert a[spans.OUTCOME] == SUCCESS  # the upstream's answer was fine
        assert server.status.status_code is StatusCode.ERROR
        assert "never read" in server.status.description
        assert spans.ERROR_MESSAGE not in a  # the proxy sent no error of its own
        client = [s for s in out if s.kind is SpanKind.CLIENT][0]
        assert client.status.status_code is StatusCode.UNSET  # the attempt itself was fine
    finally:
        t.shutdown(2.0)


def test_client_never_read_an_error_reply_keeps_its_error_type(telemetry, memory):
    call = fx.call_timeout()
    call.never_read = True
    call.t_acked = call.t_write + fx.ms(60_000)
    _, out = export(telemetry, memory, call)
    server, _ = check_common(out)
    assert server.attributes[spans.ERROR_TYPE] == "timeout"
    assert [s for s in out if s.name == "write_response"][0].attributes[spans.CLIENT_NEVER_READ] is True


def test_traceparent_becomes_the_server_parent(telemetry, memory):
    tid, sid = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    headers = {"traceparent": f"00-{tid:032x}-{sid:016x}-00", "tracestate": "vendor=abc"}
    call = fx.call_success(fx.FakeMsg(headers=headers), slow_call=0.005)
    t = Telemetry(tracing(1.0), clock_offset_ns=OFFSET, rng=random.Random(3), exporter=None)
    call.trace = t.begin(call)
    up = t.upstream_headers(call.attempts[0])
    assert up["traceparent"] == f"00-{tid:032x}-{call.attempts[0].span_id:016x}-00"
    assert up["tracestate"] == "vendor=abc"
    reason, out = export(telemetry, memory, call)
    assert reason == spans.SAMPLED_SLOW  # the client said "not sampled"; 10 ms > slow_call 5 ms
    server, _ = check_common(out)
    assert server.context.trace_id == tid
    assert server.parent.span_id == sid and server.parent.is_remote
    assert server.context.span_id == call.trace.span_id
    assert server.attributes[spans.NEW_TRACE] is False
    assert server.attributes[spans.SAMPLED_BY] == "slow"
    assert server.context.trace_state.get("vendor") == "abc"
    client = [s for s in out if s.kind is SpanKind.CLIENT][0]
    assert client.context.span_id == call.attempts[0].span_id  # what the upstream saw as its parent


def test_export_decision():
    t = Telemetry(tracing(0.0), rng=random.Random(4), exporter=None)
    assert t.should_export(fx.call_success()) is None
    slow = fx.call_success(slow_call=0.005)
    assert t.should_export(slow) == "slow"
    no_route = fx.call_success()
    no_route.route = None
    no_route.t_acked = no_route.t_start + fx.ms(1500)  # default slow_call 1 s
    assert t.should_export(no_route) == "slow"
    assert t.should_export(fx.call_timeout()) == "failed"
    proxy_error = fx.call_success()
    proxy_error.error = "not sent: no endpoint available"
    assert t.should_export(proxy_error) == "failed"
    ctx_call = fx.call_success(fx.FakeMsg(headers={"traceparent": f"00-{1:032x}-{2:016x}-01"}))
    t.begin(ctx_call)
    assert t.should_export(ctx_call) == "head"  # the parent's flag wins over ratio 0
    always = Telemetry(tracing(1.0), rng=random.Random(4), exporter=None)
    assert always.should_export(fx.call_success()) == "head"
    some = Telemetry(tracing(0.25), rng=random.Random(4), exporter=None)
    kept = sum(some.should_export(fx.call_success()) == "head" for _ in range(4000))
    assert 800 < kept < 1200


def test_no_exporter_means_no_queue():
    t = Telemetry(tracing(1.0), exporter=None)
    assert t.queue is None
    assert t.finished(fx.call_success(), "S") is None
    assert t.flush(0.1) and t.shutdown(0.1)


def _cpu_per_call(fn, n: int) -> float:
    """CPU seconds per call of this thread (wall time lies on a shared, loaded machine)."""
    return min(timeit.repeat(fn, number=n, repeat=3, timer=time.thread_time)) / n


def test_build_cost_printed():
    """Benchmark, never a pass/fail: the export thread's CPU per kept call, and the loop's decision."""
    t = Telemetry(tracing(1.0), rng=random.Random(5), exporter=None)
    call, retry = fx.call_success(), fx.call_retry()
    per = _cpu_per_call(lambda: t.build_spans(call, "UserService", "users", "head"), 2000)
    per_retry = _cpu_per_call(lambda: t.build_spans(retry, "UserService", "users", "head"), 2000)
    decide = Telemetry(tracing(0.01), rng=random.Random(5), exporter=None)
    per_decide = _cpu_per_call(lambda: decide.should_export(call), 20000)
    print(f"\nbuild_spans: {per * 1e6:.1f} µs/call (8 spans), {per_retry * 1e6:.1f} µs/call retried "
          f"(13 spans); should_export: {per_decide * 1e6:.2f} µs/call")
