"""End-to-end check of a running Jaeger: send one span over OTLP/HTTP and one over
OTLP/gRPC, then read both back from the query API.

    tools/jaeger/run.sh --background /tmp/jaeger.pid
    .venv/bin/python tools/jaeger/smoke.py        # needs opentelemetry-sdk + both OTLP exporters
    tools/jaeger/stop.sh /tmp/jaeger.pid

Endpoints come from the same environment variables as run.sh (JAEGER_OTLP_HTTP_ENDPOINT,
JAEGER_OTLP_GRPC_ENDPOINT, JAEGER_QUERY_HTTP_ENDPOINT). Exits non-zero on failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request
import uuid

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

OTLP_HTTP = os.environ.get("JAEGER_OTLP_HTTP_ENDPOINT", "127.0.0.1:4318")
OTLP_GRPC = os.environ.get("JAEGER_OTLP_GRPC_ENDPOINT", "127.0.0.1:4317")
QUERY = os.environ.get("JAEGER_QUERY_HTTP_ENDPOINT", "127.0.0.1:16686")


def send(service: str, exporter) -> str:
    """Export one span named after SERVICE synchronously; return its trace id (hex)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("smoke").start_as_current_span(f"{service}-op") as span:
        span.set_attribute("smoke.check", True)
        trace_id = format(span.get_span_context().trace_id, "032x")
    provider.shutdown()
    return trace_id


def traces(service: str) -> list[dict]:
    """GET /api/traces?service=SERVICE from the query API."""
    url = f"http://{QUERY}/api/traces?" + urllib.parse.urlencode({"service": service, "limit": 20})
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)["data"] or []


def check(service: str, trace_id: str, deadline: float) -> bool:
    while True:
        found = traces(service)
        for t in found:
            ops = [s["operationName"] for s in t["spans"]]
            if t["traceID"] == trace_id and f"{service}-op" in ops:
                print(f"ok   {service}: trace {trace_id} spans {ops}")
                return True
        if time.monotonic() > deadline:
            print(f"FAIL {service}: trace {trace_id} not found (got {[t['traceID'] for t in found]})")
            return False
        time.sleep(0.2)


def main() -> int:
    run = uuid.uuid4().hex[:8]
    sent = {
        f"smoke-http-{run}": send(f"smoke-http-{run}", HttpExporter(endpoint=f"http://{OTLP_HTTP}/v1/traces")),
        f"smoke-grpc-{run}": send(f"smoke-grpc-{run}", GrpcExporter(endpoint=OTLP_GRPC, insecure=True)),
    }
    deadline = time.monotonic() + 10
    ok = all([check(service, trace_id, deadline) for service, trace_id in sent.items()])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
