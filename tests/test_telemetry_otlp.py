"""The direct OTLP path: protobuf written from the calls (`proxy.otlp`) and sent (`proxy.otlp_transport`).

Invariant (equivalence): for every span shape telemetry builds, the bytes of
`Telemetry.otlp.request([Telemetry.encode_call(call)])` parse (`ExportTraceServiceRequest.FromString`)
into a message equal to the SDK's `encode_spans(Telemetry.build_spans(call))` — two Telemetry
objects with the same seed and clock offset draw the same span ids. Attribute values of every
type (hypothesis) encode as the SDK encodes them.

Transport: a real gRPC server (generic handler, raw bytes) and a real HTTP server on 127.0.0.1
record what arrives; retries (UNAVAILABLE, 503), give-ups (non-retryable, deadline, shutdown,
nothing listening) return FAILURE without raising.
"""

from __future__ import annotations

import logging
import re
import gzip
import http.server
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from proxy import otlp, spans
from proxy.otlp_transport import GRPC_METHOD, OtlpExporter, Settings
from proxy.telemetry import Telemetry

import test_telemetry_fixtures as fx

OFFSET = 1_700_000_000_000_000_000 - fx.BASE
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"


def tracing(ratio=1.0, name="sidecar-otlp"):
    return SimpleNamespace(service_name=name, exporter="none", sample_ratio=ratio)


def pair(ratio=1.0, seed=7):
    """Two telemetries that draw the same ids: one builds ReadableSpans, one encodes directly."""
    return (Telemetry(tracing(ratio), clock_offset_ns=OFFSET, rng=random.Random(seed), exporter=None),
            Telemetry(tracing(ratio), clock_offset_ns=OFFSET, rng=random.Random(seed), exporter=None))


def with_parent(flags: str, tracestate: str | None = "vendor=abc, other=x", **kw):
    headers = {"traceparent": PARENT.format(flags=flags)}
    if tracestate:
        headers["tracestate"] = tracestate
    return fx.call_success(fx.FakeMsg(headers=headers), **kw)


def shapes(t: Telemetry):
    """(label, call, reason) for every shape the builder makes; begin() sets trace context once."""
    sampled_parent = with_parent("01")
    t.begin(sampled_parent)
    # kept: slow; the client said "not sampled"; an invalid member: the SDK drops the whole state
    slow_unsampled = with_parent("00", "vendor=abc,bad entry", slow_call=0.005)
    t.begin(slow_unsampled)
    failed_unsampled = fx.call_timeout()                  # kept: failed (ratio 0 elsewhere)
    failed_unsampled.msg = fx.FakeMsg(headers={"traceparent": PARENT.format(flags="00")})
    t.begin(failed_unsampled)
    streamed = fx.call_streamed()
    streamed.loop_lag_ns = 93_500_000
    never = fx.call_success()
    never.t_acked, never.never_read = 0, True
    multiplexed = fx.call_success(fx.FakeMsg("Users:get_user"))
    no_msg = fx.call_success()
    no_msg.msg = None
    proxy_error = fx.call_success()
    proxy_error.error = "not sent: no endpoint available"
    proxy_error.outcome = "not_sent"
    abandoned = fx.call_retry()
    abandoned.attempts[1].t_acquired = abandoned.attempts[1].t_written = 0
    abandoned.attempts[1].t_first_reply = abandoned.attempts[1].t_reply = 0
    return [("success", fx.call_success(), "head"), ("declared", fx.call_declared(), "head"),
            ("retry", fx.call_retry(), "head"), ("timeout", fx.call_timeout(), "failed"),
            ("queued", fx.call_queued(), "head"), ("oneway", fx.call_oneway(), "head"),
            ("streamed", streamed, "head"), ("remote parent", sampled_parent, None),
            ("slow unsampled", slow_unsampled, None), ("failed unsampled", failed_unsampled, None),
            ("never read", never, "head"), ("multiplexed", multiplexed, "head"), ("no message", no_msg, "head"),
            ("proxy error", proxy_error, None), ("abandoned attempt", abandoned, "head")]


def test_every_span_shape_encodes_as_the_sdk_encodes_it():
    ref, fast = pair()
    encoder = fast.otlp
    for label, call, reason in shapes(ref):
        built = ref.build_spans(call, "UserService", "users", reason)
        expected = encode_spans(built)
        data = encoder.request([fast.encode_call(call, "UserService", "users", reason)])
        got = ExportTraceServiceRequest.FromString(data)
        assert got == expected, label
        assert len(got.resource_spans[0].scope_spans[0].spans) == len(built), label
        assert all(s.context.trace_flags.sampled for s in built), label  # what the SDK's processors need


def test_a_batch_of_calls_is_one_resource_and_one_scope():
    ref, fast = pair(seed=9)
    calls = [(call, reason) for _, call, reason in shapes(ref)]
    built = [s for call, reason in calls for s in ref.build_spans(call, "UserService", "users", reason)]
    data = fast.otlp.request([fast.encode_call(c, "UserService", "users", r) for c, r in calls])
    got = ExportTraceServiceRequest.FromString(data)
    assert got == encode_spans(built)
    (rs,) = got.resource_spans
    (ss,) = rs.scope_spans
    assert ss.scope.name == spans.INSTRUMENTATION_SCOPE and ss.schema_url == spans.SCHEMA_URL
    assert {kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.name"] == "sidecar-otlp"
    assert len(ss.spans) == len(built) > 100


def test_remote_parent_and_trace_state_on_the_wire():
    t = Telemetry(tracing(0.0), clock_offset_ns=OFFSET, rng=random.Random(3), exporter=None)
    call = with_parent("00", slow_call=0.005)
    t.begin(call)
    got = ExportTraceServiceRequest.FromString(t.otlp.request([t.encode_call(call, "UserService")]))
    out = got.resource_spans[0].scope_spans[0].spans
    server = out[0]
    assert server.kind == server.SPAN_KIND_SERVER
    assert server.parent_span_id == bytes.fromhex("00f067aa0ba902b7")
    assert server.flags == 0x300  # has-is-remote | is-remote
    assert server.trace_state == "vendor=abc,other=x"  # as the SDK writes it: parsed and re-joined
    assert all(s.flags == 0x100 for s in out[1:])
    assert {kv.key: kv.value.string_value for kv in server.attributes}[spans.SAMPLED_BY] == "slow"


VALUES = st.one_of(
    st.text(max_size=300), st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1),
    st.floats(allow_nan=False), st.binary(max_size=40), st.none(),
    st.lists(st.one_of(st.text(max_size=10), st.integers(-(2 ** 63), 2 ** 63 - 1)), max_size=4))


@settings(max_examples=200, deadline=None)
@given(attrs=st.dictionaries(st.text(min_size=1, max_size=150), VALUES, max_size=6),
       name=st.text(max_size=200), error=st.one_of(st.none(), st.text(max_size=200)),
       remote=st.booleans(), parent=st.integers(0, 2 ** 64 - 1), kind=st.sampled_from([1, 2, 3]))
def test_any_attribute_value_encodes_as_the_sdk_encodes_it(attrs, name, error, remote, parent, kind):
    """A span from Encoder.span parses into the Span the SDK encodes from the same ReadableSpan."""
    trace_id, span_id = 0x0123456789ABCDEF0123456789ABCDEF, 0x1122334455667788
    ctx = SpanContext(trace_id, span_id, False, TraceFlags(1))
    parent_ctx = SpanContext(trace_id, parent, remote, TraceFlags(1)) if parent else None
    status = Status(StatusCode.UNSET) if error is None else Status(StatusCode.ERROR, error)
    kinds = {1: SpanKind.INTERNAL, 2: SpanKind.SERVER, 3: SpanKind.CLIENT}
    resource = Resource({"service.name": "x", "n": 3})
    scope = InstrumentationScope("s", "1.0", "https://schema")
    span = ReadableSpan(name, ctx, parent_ctx, resource, dict(attrs), (), (), kinds[kind], None, status,
                        1_700_000_000_000_000_001, 1_700_000_000_000_000_999, scope)
    encoder = otlp.Encoder(resource.attributes, resource.schema_url, "s", "1.0", "https://schema")
    chunk = encoder.span(otlp.trace_prefix(trace_id), span_id, parent, remote and bool(parent), name, kind,
                         span.start_time, span.end_time, dict(attrs), error)
    got = ExportTraceServiceRequest.FromString(encoder.request([chunk]))
    assert got == encode_spans([span])


# -- transport ------------------------------------------------------------------------------


class GrpcReceiver:
    """A TraceService/Export server taking raw bytes; `fail` codes are answered first, in order."""

    def __init__(self, fail=(), response: bytes = b"", delay: float = 0.0):
        self.delay = delay  # seconds before each answer (`metadata` counts requests as they come)
        self.requests: list[bytes] = []
        self.metadata: list[dict] = []
        self.fail = list(fail)
        self.response = response
        self.server = grpc.server(ThreadPoolExecutor(2))
        service, method = GRPC_METHOD.strip("/").split("/")
        handler = grpc.unary_unary_rpc_method_handler(self._export)  # no (de)serializers: bytes
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _export(self, request: bytes, context):
        self.metadata.append(dict(context.invocation_metadata()))
        time.sleep(self.delay)
        if self.fail:
            code = self.fail.pop(0)
            if isinstance(code, tuple):  # (code, seconds): with a google.rpc.RetryInfo
                from google.rpc.error_details_pb2 import RetryInfo

                code, seconds = code
                info = RetryInfo()
                info.retry_delay.FromNanoseconds(int(seconds * 1e9))
                context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
            context.abort(code, "try later")
        self.requests.append(request)
        return self.response  # an ExportTraceServiceResponse (empty: all accepted)

    def stop(self):
        self.server.stop(0)


class HttpReceiver:
    """POST /v1/traces on 127.0.0.1; `statuses` are answered first, in order."""

    def __init__(self, statuses=(), response: bytes = b"", retry_after: str = "0"):
        receiver = self
        self.requests: list[tuple[str, dict, bytes]] = []
        self.statuses = list(statuses)
        self.posts = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts += 1
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                if status == 200:
                    receiver.requests.append((self.path, dict(self.headers), body))
                self.send_response(status)
                if status in (429, 503):
                    self.send_header("Retry-After", retry_after)
                out = response if status == 200 else b""
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def settings_for(protocol, port, **kw):
    target = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}/v1/traces"
    return Settings(protocol, target, True, **kw)


def received_spans(data: bytes):
    req = ExportTraceServiceRequest.FromString(data)
    return [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_telemetry_exports_to_a_real_receiver(protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        exporter = OtlpExporter(settings=settings_for(protocol, receiver.port,
                                                      headers=(("x-tenant", "blue"),)))
        t = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(5), exporter=exporter, interval=0.01)
        ref = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(5), exporter=None)
        calls = [fx.call_success(), fx.call_retry(), fx.call_timeout()]
        reasons = [t.finished(c, "UserService", "users") for c in calls]
        assert reasons == ["head"] * 3
        assert t.flush(10.0)
        assert t.queue.exported == 3 and t.queue.failed == 0
        assert t.shutdown(5.0)
        bodies = receiver.requests if protocol == "grpc" else [body for _, _, body in receiver.requests]
        got = [s for body in bodies for s in received_spans(body)]
        expected = [s for c in calls for s in received_spans(encode_spans(ref.build_spans(c, "UserService", "users", "head"))
                                                             .SerializeToString())]
        assert got == expected and len(got) == 8 + 13 + 7
        assert {s.name for s in got} >= set(spans.HOPS) - {spans.QUEUED}
        if protocol == "grpc":
            md = receiver.metadata[0]
            assert md["x-tenant"] == "blue" and md["user-agent"].startswith("thrift-sidecar/")
        else:
            path, headers, _ = receiver.requests[0]
            assert path == "/v1/traces" and headers["Content-Type"] == "application/x-protobuf"
            assert headers["x-tenant"] == "blue"
    finally:
        receiver.stop()


def test_a_batch_larger_than_a_receivers_4_mib_goes_as_several_requests():
    """A gRPC receiver takes messages of up to 4 MiB unless told otherwise (the Collector's and
    Jaeger's default, and grpc's). A batch whose spans come to more goes as several requests,
    each under MAX_REQUEST, and every call's spans arrive. Before: one request, refused
    (RESOURCE_EXHAUSTED), the whole batch lost."""
    from proxy.exporter import MAX_REQUEST

    receiver = GrpcReceiver()
    try:
        exporter = OtlpExporter(settings=settings_for("grpc", receiver.port))
        t = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(5), exporter=exporter,
                      interval=30.0, batch_size=100_000, capacity=100_000)
        call = fx.call_retry()
        one = len(t.encode_call(call, "UserService", "users", "head"))
        n = (6 << 20) // one + 1  # (> 6 MiB of spans in one batch)
        for _ in range(n):
            assert t.finished(fx.call_retry(), "UserService", "users") == "head"
        assert t.flush(60.0)
        assert t.queue.exported == n and t.queue.failed == 0
        sizes = [len(body) for body in receiver.requests]
        assert len(sizes) >= 2 and max(sizes) <= MAX_REQUEST + 4096, sizes
        assert sum(len(received_spans(body)) for body in receiver.requests) == 13 * n
        t.shutdown(5.0)
    finally:
        receiver.stop()


def _split_batch(receiver, timeout: float):
    """A Telemetry exporting to `receiver`, and > 7 MiB of spans queued: a batch of three parts."""
    exporter = OtlpExporter(settings=settings_for("grpc", receiver.port, timeout=timeout), backoff_base=0.01)
    t = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(5), exporter=exporter,
                  interval=30.0, batch_size=100_000, capacity=100_000)
    one = len(t.encode_call(fx.call_retry(), "UserService", "users", "head"))
    n = (7 << 20) // one + 1
    for _ in range(n):
        assert t.finished(fx.call_retry(), "UserService", "users") == "head"
    return t, n


def test_a_slow_collector_gets_every_part_of_a_split_batch():
    """Each part has the exporter's whole timeout: a collector answering each request in 0.6 s,
    with a 1 s timeout, takes all three parts and every call counts exported."""
    receiver = GrpcReceiver(delay=0.6)
    try:
        t, n = _split_batch(receiver, 1.0)
        try:
            assert t.flush(30.0)
            assert len(receiver.requests) == 3 and (t.queue.exported, t.queue.failed) == (n, 0)
        finally:
            t.shutdown(5.0)
    finally:
        receiver.stop()


def test_a_collector_that_does_not_answer_holds_the_export_one_timeout_not_one_per_part(caplog):
    """A collector that answers after 1.5 s, a 0.5 s timeout, a batch of three parts: the first
    part runs out of time, and the other two are not sent (counted failed, said in a line).
    Before: each part waited its own timeout, the worker held three times as long."""
    receiver = GrpcReceiver(delay=1.5)
    try:
        t, n = _split_batch(receiver, 0.5)
        try:
            with caplog.at_level(logging.WARNING, logger="proxy"):
                t.flush(30.0)
            assert len(receiver.metadata) == 1  # (requests as they came, before any answer)
            assert (t.queue.exported, t.queue.failed) == (0, n)
            took = re.search(r"not sent \(an earlier part of their batch failed after (\S+) s\)", caplog.text)
            assert took and float(took.group(1)) >= 0.25, caplog.text
        finally:
            t.shutdown(5.0)
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_gzip_and_the_sdk_interface(protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        exporter = OtlpExporter(settings=settings_for(protocol, receiver.port, compression="gzip"))
        t = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(6), exporter=None)
        built = t.build_spans(fx.call_success(), "UserService", "users", "head")
        assert exporter.export(built) is SpanExportResult.SUCCESS  # ReadableSpans, as the demo's tee sends
        exporter.shutdown()
        if protocol == "grpc":
            (body,) = receiver.requests  # grpc decompresses (grpc-encoding is not in the metadata)
        else:
            (_, headers, raw), = receiver.requests
            assert headers["Content-Encoding"] == "gzip"
            body = gzip.decompress(raw)
        assert ExportTraceServiceRequest.FromString(body) == encode_spans(built)
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_retryable_errors_are_retried(protocol):
    if protocol == "grpc":
        receiver = GrpcReceiver(fail=[grpc.StatusCode.UNAVAILABLE, (grpc.StatusCode.RESOURCE_EXHAUSTED, 0.01)])
    else:
        receiver = HttpReceiver(statuses=[503, 429])
    try:
        exporter = OtlpExporter(settings=settings_for(protocol, receiver.port, timeout=10.0), backoff_base=0.01)
        assert exporter.export_request(b"") is SpanExportResult.SUCCESS
        assert len(receiver.requests) == 1
        exporter.shutdown()
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "grpc-exhausted", "http"])
def test_non_retryable_errors_fail_at_once(protocol):
    if protocol == "grpc":
        receiver = GrpcReceiver(fail=[grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE])
    elif protocol == "grpc-exhausted":  # without RetryInfo: e.g. a request over the server's size limit
        receiver = GrpcReceiver(fail=[grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
    else:
        receiver = HttpReceiver(statuses=[400, 503])
    try:
        exporter = OtlpExporter(settings=settings_for(protocol.removesuffix("-exhausted"), receiver.port),
                                backoff_base=0.01)
        assert exporter.export_request(b"") is SpanExportResult.FAILURE
        assert len(receiver.statuses if protocol == "http" else receiver.fail) == 1  # one try only
        exporter.shutdown()
    finally:
        receiver.stop()


def test_an_http_collector_answering_a_byte_at_a_time_fails_at_the_deadline(caplog):
    """The timeout is the whole export's: a collector that reads the POST and then answers one
    byte every 0.3 s kept an export (and the export thread) for as long as it trickled, since
    requests' timeout is per socket read (found by an exporter hunt)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" * 100:
                if stop.wait(0.3):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    exporter = OtlpExporter(settings=settings_for("http", listener.getsockname()[1], timeout=1.0), backoff_base=0.01)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="proxy.otlp_transport"):
            assert exporter.export_request(b"x") is SpanExportResult.FAILURE
        assert time.monotonic() - t0 < 2.5
        assert "no answer within 1 s" in caplog.text
    finally:
        stop.set()
        exporter.shutdown()
        listener.close()


@pytest.mark.parametrize("status", [302, 307])
def test_an_http_redirect_is_a_failed_export_not_a_success(status, caplog):
    """A collector behind a login redirect: requests followed it (a 302 turns the POST into a
    GET) and counted the 200 of the login page as exported; nothing was (found by an exporter
    hunt). Redirects are not followed, and only 2xx is success."""
    receiver = HttpReceiver(statuses=[status])
    try:
        exporter = OtlpExporter(settings=settings_for("http", receiver.port), backoff_base=0.01)
        with caplog.at_level(logging.WARNING, logger="proxy.otlp_transport"):
            assert exporter.export_request(b"x") is SpanExportResult.FAILURE
        assert receiver.requests == [] and receiver.statuses == []  # one try, not retried
        assert f"HTTP {status}" in caplog.text and "redirects are not followed" in caplog.text
        exporter.shutdown()
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_nothing_listening_fails_by_the_deadline_without_raising(protocol):
    s = __import__("socket").socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nobody listens on
    exporter = OtlpExporter(settings=settings_for(protocol, port, timeout=0.5), backoff_base=0.05)
    t0 = time.monotonic()
    assert exporter.export_request(b"x") is SpanExportResult.FAILURE
    assert time.monotonic() - t0 < 3.0
    exporter.shutdown()
    assert exporter.export_request(b"x") is SpanExportResult.FAILURE  # after shutdown: refused, no raise


def test_shutdown_cuts_a_backoff_short():
    receiver = GrpcReceiver(fail=[grpc.StatusCode.UNAVAILABLE] * 10)
    try:
        exporter = OtlpExporter(settings=settings_for("grpc", receiver.port, timeout=60.0), backoff_base=20.0)
        result = []
        worker = threading.Thread(target=lambda: result.append(exporter.export_request(b"")))
        worker.start()
        deadline = time.monotonic() + 5.0
        while not receiver.metadata and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        exporter.shutdown()
        worker.join(5.0)
        assert result == [SpanExportResult.FAILURE] and time.monotonic() - t0 < 2.0
    finally:
        receiver.stop()


def test_settings_follow_the_sdk_exporters():
    env = {}
    default = Settings.resolve("grpc", None, env)
    assert (default.protocol, default.target, default.insecure, default.timeout) == ("grpc", "localhost:4317", True, 10)
    assert Settings.resolve("http", None, env).target == "http://localhost:4318/v1/traces"
    assert Settings.resolve("http", "http://c:4318", env).target == "http://c:4318/v1/traces"
    assert Settings.resolve("http", "http://c:4318/custom", env).target == "http://c:4318/custom"
    assert Settings.resolve("grpc", "https://c:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "true"}).insecure is False
    assert Settings.resolve("grpc", "c:4317", env).insecure is False   # no scheme: TLS, as the SDK
    assert Settings.resolve("grpc", "c:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}).insecure is True
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://col:4318/", "OTEL_EXPORTER_OTLP_HEADERS": "A=1,b=x%20y",
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}
    http = Settings.resolve("http", None, env)
    assert (http.target, http.timeout, http.compression) == ("http://col:4318/v1/traces", 2.5, "gzip")
    assert dict(http.headers) == {"a": "1", "b": "x y"}
    grpc_settings = Settings.resolve("grpc", None, {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1234"})
    assert (grpc_settings.target, grpc_settings.insecure) == ("t:1234", True)
    assert Settings.resolve("http", None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}).target == "http://t/x"
    assert Settings.resolve("grpc", None, {"OTEL_EXPORTER_OTLP_COMPRESSION": "deflate"}).compression is None


def _cpu_per_call(fn, n: int) -> float:
    import timeit

    return min(timeit.repeat(fn, number=n, repeat=3, timer=time.thread_time)) / n


def test_encode_cost_printed():
    """Benchmark, never a pass/fail: the export thread's CPU per call, SDK path vs direct path."""
    ref, fast = pair(seed=4)
    encoder = fast.otlp
    for label, call in (("success", fx.call_success()), ("retry", fx.call_retry())):
        sdk = _cpu_per_call(lambda: encode_spans(ref.build_spans(call, "UserService", "users", "head"))
                            .SerializeToString(), 200)
        direct = _cpu_per_call(lambda: encoder.request([fast.encode_call(call, "UserService", "users", "head")]),
                               2000)
        print(f"\n{label}: build_spans + SDK encode_spans + serialize {sdk * 1e6:.1f} µs/call, "
              f"encode_call + request {direct * 1e6:.1f} µs/call ({sdk / direct:.1f}x)")


def test_a_grpc_endpoint_without_scheme_warns_that_it_means_tls(caplog):
    with caplog.at_level(logging.WARNING, logger="proxy.otlp_transport"):
        assert Settings.resolve("grpc", "127.0.0.1:4317", {}).insecure is False
    assert "write http://127.0.0.1:4317 for plaintext" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="proxy.otlp_transport"):
        Settings.resolve("grpc", "http://127.0.0.1:4317", {})
        Settings.resolve("grpc", "https://collector:4317", {})
    assert caplog.text == ""


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spans_the_collector_rejects_are_counted_and_logged(protocol, caplog):
    """An accepted export whose response has a partial_success (rejected_spans, error_message)
    is not all exported: the spans are counted (/metrics) and the reason logged."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    from proxy.metrics import Metrics

    answer = ExportTraceServiceResponse()
    answer.partial_success.rejected_spans = 5
    answer.partial_success.error_message = "spans older than 1h"
    raw = answer.SerializeToString()
    receiver = GrpcReceiver(response=raw) if protocol == "grpc" else HttpReceiver(response=raw)
    try:
        exporter = OtlpExporter(settings=settings_for(protocol, receiver.port))
        t = Telemetry(tracing(), clock_offset_ns=OFFSET, rng=random.Random(5), exporter=exporter, interval=0.01)
        metrics = Metrics()
        metrics.watch_exporter(t.queue)
        with caplog.at_level(logging.WARNING, logger="proxy.otlp_transport"):
            t.finished(fx.call_success(), "UserService", "users")
            assert t.flush(10.0)
        assert exporter.rejected_spans == 5
        assert "thrift_sidecar_spans_rejected_total 5.0" in metrics.exposition().decode()
        assert any("rejected 5 span(s)" in r.getMessage() and "spans older than 1h" in r.getMessage()
                   for r in caplog.records)
        assert t.shutdown(5.0)
    finally:
        receiver.stop()


def test_a_collectors_retry_after_holds_the_next_exports_back():
    """429 with Retry-After: 30 against a 1 s export timeout: that export fails, and so do the
    next ones, at once, without a request (before: one POST per batch, every 0.2 s)."""
    receiver = HttpReceiver(statuses=[429, 429, 429], retry_after="30")
    try:
        exporter = OtlpExporter(settings=settings_for("http", receiver.port, timeout=1.0), backoff_base=0.01)
        assert exporter.export_request(b"") is SpanExportResult.FAILURE
        t0 = time.monotonic()
        for _ in range(5):
            assert exporter.export_request(b"") is SpanExportResult.FAILURE
        assert time.monotonic() - t0 < 0.5  # failed at once
        assert receiver.posts == 1
        exporter._quiet_until = 0.0  # (as 30 s later)
        receiver.statuses.clear()
        assert exporter.export_request(b"") is SpanExportResult.SUCCESS
        assert receiver.posts == 2
        exporter.shutdown()
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_export_cut_by_shutdown_in_its_backoff_says_why_it_failed(protocol, caplog):
    """A collector that refuses connections, and a shutdown during the retry's backoff: the
    warning names the refusal, not only "shutting down" (which the demo printed for a wrong
    THRIFT_SIDECAR_DEMO_OTLP, hiding the cause)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = OtlpExporter(settings=settings_for(protocol, port, timeout=10.0), backoff_base=0.5)
    threading.Timer(0.3, exporter.shutdown).start()
    with caplog.at_level(logging.WARNING, logger="proxy.otlp_transport"):
        t0 = time.monotonic()
        assert exporter.export_request(b"") == SpanExportResult.FAILURE
    assert time.monotonic() - t0 < 5
    (said,) = [r.getMessage() for r in caplog.records]
    assert "(no more tries: shutting down)" in said and re.search(r"refused|Connection", said), said
