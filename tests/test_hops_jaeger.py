"""End to end against a real Jaeger: spans exported over OTLP (gRPC and HTTP) by the sidecar's own
telemetry come back from Jaeger's query API with every hop and parent link, and `hops --jaeger`
reads them into the same table and verdict as `hops --spans` on a span file of the same calls.

The calls are the synthetic scenarios of `test_hops`, handed to `Telemetry.finished` with the
`otlp` exporter config (so the export queue, span builder and SDK exporter are the real ones).
Times are placed in the last minutes, aligned to whole µs (Jaeger's precision), so the numbers
read back from Jaeger equal the file's exactly.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from proxy import spans
from proxy.config import Tracing
from proxy.hops import load_jsonl, parse_jaeger, rebuild_calls

import test_hops as th
from jaeger import jaeger_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(900)  # the first use may build Jaeger (minutes, cold)

CALL_HOPS = set(spans.CALL_HOPS)
ATTEMPT_HOPS = set(spans.ATTEMPT_HOPS)


def _recent_offset(calls) -> int:
    """Monotonic → epoch offset that puts the calls in the last few minutes, on a whole µs."""
    last = max(c.t_start for c in calls) - th.BASE
    offset = time.time_ns() - th.BASE - last - 120_000_000_000
    return offset - offset % 1000


def _mixed_calls():
    """Every hop name at least once: a slow service, a retry with backoff, a pipelined call, a
    streamed reply to a slow reader, a loop stall."""
    calls = th.slow_service(8)
    extra = [th.retries(1)[0], th.pipelined(1)[0], th.slow_reader_large(1)[0], th.loop_stall(1)[0]]
    for i, c in enumerate(extra):  # move them after the slow-service calls
        th.shift(c, th.ms((8 + i) * th.SPACING))
    return calls + extra


SCENARIOS = {
    # protocol: (calls, --by, expected verdict start, group named in the verdict)
    "grpc": (_mixed_calls, "method", "verdict: service_time is ", "of TestService/get_user: "),
    "http": (th.one_slow_endpoint, "endpoint", "verdict: service_time is ", "of calls to 127.0.0.2:9192: "),
}


def _file_spans(tmp_path, calls, offset, seed):
    path = tmp_path / "same.jsonl"
    th.export(calls, Tracing(exporter="jsonl", path=str(path), sample_ratio=1.0), clock_offset_ns=offset, seed=seed)
    return str(path), load_jsonl(path)


@pytest.mark.parametrize("protocol", SCENARIOS)
def test_otlp_export_to_jaeger_and_hops_from_it(jaeger_server, tmp_path, protocol):  # noqa: F811
    make, by, verdict_start, group = SCENARIOS[protocol]
    calls = make()
    service = f"hops-e2e-{protocol}-{uuid.uuid4().hex[:8]}"
    endpoint = jaeger_server.otlp_grpc if protocol == "grpc" else jaeger_server.otlp_http
    offset, seed = _recent_offset(calls), 11
    th.export(calls, Tracing(service_name=service, exporter="otlp", otlp_protocol=protocol,
                             endpoint=f"http://{endpoint}", sample_ratio=1.0), clock_offset_ns=offset, seed=seed)
    # the same calls, same ids (same seed), to a span file: what Jaeger gives back must match it
    path, expected = _file_spans(tmp_path, calls, offset, seed)
    traces = jaeger_server.wait_for_spans(service, len(expected))
    assert len(traces) == len(calls)

    # every span arrived once, with its name, kind, parent and times (µs)
    got = parse_jaeger({"data": traces}, service)
    key = lambda s: (s.trace_id, s.span_id)  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, expected))
    by_id = {key(s): s for s in got}
    for s in expected:
        j = by_id[key(s)]
        assert (j.name, j.kind, j.parent_id) == (s.name, s.kind, s.parent_id), s.name
        assert (j.start, j.end) == (s.start, s.end), s.name
    # the tree, read straight from Jaeger's JSON: hops under SERVER or under their CLIENT attempt
    for t in traces:
        proc = {pid: p["serviceName"] for pid, p in t["processes"].items()}
        ours = [s for s in t["spans"] if proc[s["processID"]] == service]
        kinds = {s["spanID"]: next((tag["value"] for tag in s["tags"] if tag["key"] == "span.kind"), "internal")
                 for s in ours}
        names = {s["spanID"]: s["operationName"] for s in ours}
        (server,) = [sid for sid, k in kinds.items() if k == "server"]
        assert names[server].startswith("TestService/")
        for s in ours:
            refs = s.get("references") or []
            if s["spanID"] == server:
                assert refs == []  # the client sent no trace context: a root
                continue
            (ref,) = refs
            assert ref["refType"] == "CHILD_OF" and ref["traceID"] == t["traceID"]
            parent = ref["spanID"]
            name = s["operationName"]
            if kinds[s["spanID"]] == "client":
                assert parent == server and name == names[server]
            elif name in CALL_HOPS:
                assert parent == server, name
            else:
                assert name in ATTEMPT_HOPS and kinds[parent] == "client", name
        tags = {tag["key"]: tag["value"] for s in ours if s["spanID"] == server for tag in s["tags"]}
        assert tags[spans.RPC_SYSTEM] == spans.RPC_SYSTEM_VALUE and spans.PEER_ADDRESS in tags
    counts = Counter(s.name for s in got if s.kind == "internal")
    if protocol == "grpc":
        assert set(counts) == set(spans.HOPS), counts  # every hop name made it through

    # hops --jaeger: the table and verdict equal those of hops --spans on the same calls
    r = th.hops("--jaeger", jaeger_server.query_url, "--service", service, "--by", by)
    f = th.hops("--spans", path, "--by", by)
    verdict = th.verdict_of(r.stdout)
    assert verdict.startswith(verdict_start) and group in verdict, r.stdout
    assert r.stdout.splitlines()[1:] == f.stdout.splitlines()[1:]
    assert f"hops: {len(calls)} calls from {jaeger_server.query_url} (service {service})" in r.stdout
    # the calls rebuilt from Jaeger carry the attributes hops reads
    rebuilt = rebuild_calls(got)
    assert all(c.attempts and c.server.attrs.get(spans.RPC_METHOD) for c in rebuilt)
    if protocol == "grpc":
        streamed = [c for c in rebuilt if c.streamed]
        assert len(streamed) == 1 and streamed[0].overlap_to == spans.WRITE_RESPONSE
        assert any(c.loop_lag for c in rebuilt)


def test_hops_jaeger_unknown_service_has_no_calls(jaeger_server):  # noqa: F811
    """No calls, exit 1, and stderr names the services Jaeger does have (a demo exports as
    thrift-sidecar-demo, not the README example's thrift-sidecar). Before: only "no calls"."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{jaeger_server.query_url}/api/services", timeout=10) as resp:
        known = json.load(resp)["data"] or []
    name = f"nobody-{uuid.uuid4().hex[:8]}"
    r = th.hops("--jaeger", jaeger_server.query_url, "--service", name, check=False)
    assert r.returncode == 1 and th.verdict_of(r.stdout) == "verdict: no calls to analyse"
    said = f"{jaeger_server.query_url} has no service '{name}'; it has: "
    assert said in r.stderr, r.stderr
    assert all(k in r.stderr for k in known), (known, r.stderr)


def test_hops_jaeger_unreachable_exits_2():
    r = th.hops("--jaeger", "http://127.0.0.1:9", "--service", "x", check=False)
    assert r.returncode == 2 and "127.0.0.1:9" in r.stderr


@pytest.mark.parametrize("url, body, said", [
    ("notaurl", None, "must be an http:// or https:// URL"),
    ("http://", None, "no host given"),
    ("{server}", b"[]", "not a Jaeger /api/traces answer (AttributeError"),
    ("{server}", b'{"data": 5}', "not a Jaeger /api/traces answer (TypeError"),
    ("{server}", b'{"data": [{"spans": 5}]}', "not a Jaeger /api/traces answer (TypeError"),
])
def test_hops_jaeger_bad_url_or_answer_is_one_line_exit_2(url, body, said):
    """Before: a traceback (exit 1) for a URL urllib cannot use or JSON of another shape."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = th.hops("--jaeger", url.format(server=f"http://127.0.0.1:{server.server_port}"), "--service", "x",
                    check=False)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 2, r.stderr
    assert said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
