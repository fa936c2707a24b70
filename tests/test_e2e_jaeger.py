"""End to end with the real Jaeger: the running sidecar exports OTLP (gRPC and HTTP); the app's
client helper joins the same trace; `hops --jaeger` reads it back and names the slow hop."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from harness import ROOT, ProxyProcess, TestService, ThriftServer, client, config_text, free_port
from jaeger import jaeger_server  # noqa: F401  (fixture)
from proxy import spans
from proxy.client import connect

HOPS = {spans.READ_REQUEST, spans.ACQUIRE, spans.WRITE_UPSTREAM, spans.SERVICE_TIME, spans.READ_RESPONSE,
        spans.WRITE_RESPONSE}


def _tracing(service: str, protocol: str, endpoint: str) -> str:
    return (f"tracing: {{service_name: {service}, exporter: otlp, otlp_protocol: {protocol}, "
            f"endpoint: '{endpoint}', sample_ratio: 1.0}}\n")


def _by_id(trace: dict) -> dict:
    return {s["spanID"]: s for s in trace["spans"]}


def _parent(span: dict) -> str | None:
    refs = [r for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
    return refs[0]["spanID"] if refs else None


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sidecar_exports_hop_spans_to_jaeger(jaeger_server, protocol):  # noqa: F811
    service = f"sidecar-e2e-{protocol}"
    endpoint = (f"http://{jaeger_server.otlp_grpc}" if protocol == "grpc"
                else f"http://{jaeger_server.otlp_http}/v1/traces")
    up = ThriftServer()
    up.handler.sleep_ms = 60  # the service is the slow hop
    port = free_port()
    try:
        text = _tracing(service, protocol, endpoint) + config_text([up.address], listen_port=port)
        with ProxyProcess(text, [port]) as p:
            with client(port) as c:
                for i in range(6):
                    c.lookup(f"k{i}")
            assert p.stop() == 0  # drain flushes the spans
    finally:
        up.stop()
    traces = jaeger_server.wait_for_spans(service, 6 * 8)  # SERVER, CLIENT and 6 hops per call
    assert len(traces) == 6
    for t in traces:
        by_id = _by_id(t)
        names = [s["operationName"] for s in t["spans"]]
        server = [s for s in t["spans"] if s["operationName"] == "TestService/lookup" and _parent(s) is None]
        assert len(server) == 1, names
        sid = server[0]["spanID"]
        client_spans = [s for s in t["spans"] if s["operationName"] == "TestService/lookup" and _parent(s) == sid]
        assert len(client_spans) == 1
        cid = client_spans[0]["spanID"]
        for s in t["spans"]:
            if s["operationName"] in (spans.ACQUIRE, spans.WRITE_UPSTREAM, spans.SERVICE_TIME, spans.READ_RESPONSE):
                assert _parent(s) == cid
            elif s["operationName"] in (spans.READ_REQUEST, spans.WRITE_RESPONSE):
                assert _parent(s) == sid
        assert HOPS <= set(names)
        assert all(_parent(s) is None or _parent(s) in by_id for s in t["spans"])
    out = subprocess.run([sys.executable, "-m", "proxy", "hops", "--jaeger", jaeger_server.query_url,
                          "--service", service], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "TestService/lookup" in out.stdout
    assert lines[-1].startswith("verdict: service_time") and "the upstream itself is slow" in lines[-1]


def test_app_client_span_and_sidecar_hops_in_one_trace(jaeger_server):  # noqa: F811
    service = "sidecar-e2e-chain"
    up = ThriftServer("header", "binary")
    port = free_port()
    provider = TracerProvider(resource=Resource.create({"service.name": "e2e-app"}))
    provider.add_span_processor(SimpleSpanProcessor(HttpExporter(endpoint=f"http://{jaeger_server.otlp_http}/v1/traces")))
    tracer = provider.get_tracer("e2e-app")
    try:
        text = (_tracing(service, "http", f"http://{jaeger_server.otlp_http}/v1/traces")
                + config_text([up.address], listen_port=port, transport="header"))
        with ProxyProcess(text, [port]) as p:
            with tracer.start_as_current_span("handle_request") as root:
                with connect(TestService.Client, "127.0.0.1", port, framing="header", tracer=tracer) as c:
                    assert len(c.get_users(300, 0)) == 300
            trace_id = format(root.get_span_context().trace_id, "032x")
            assert p.stop() == 0
    finally:
        up.stop()
        provider.shutdown()
    jaeger_server.wait_for_spans(service, 9)
    trace = jaeger_server.trace(trace_id)
    spans_ = trace["data"][0]["spans"] if "data" in trace else trace["spans"]
    by_id = {s["spanID"]: s for s in spans_}
    names = [s["operationName"] for s in spans_]
    app_client = [s for s in spans_ if s["operationName"] == "TestService/get_users"
                  and by_id.get(_parent(s), {}).get("operationName") == "handle_request"]
    assert len(app_client) == 1, names
    acid = app_client[0]["spanID"]
    kids = {by_id[s]["operationName"] for s in by_id if _parent(by_id[s]) == acid}
    assert {"encode", "decode"} <= kids, kids
    sidecar_server = [s for s in spans_ if _parent(s) == acid and s["operationName"] == "TestService/get_users"]
    assert len(sidecar_server) == 1, names  # the sidecar's SERVER span is the app CLIENT span's child
    ssid = sidecar_server[0]["spanID"]
    sidecar_client = [s for s in spans_ if _parent(s) == ssid and s["operationName"] == "TestService/get_users"]
    assert len(sidecar_client) == 1
    hop_parents = {s["operationName"]: _parent(s) for s in spans_ if s["operationName"] in HOPS}
    assert set(hop_parents) == HOPS
    assert hop_parents[spans.READ_REQUEST] == ssid and hop_parents[spans.WRITE_RESPONSE] == ssid
    assert hop_parents[spans.SERVICE_TIME] == sidecar_client[0]["spanID"]
