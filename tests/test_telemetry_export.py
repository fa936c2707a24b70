"""The export queue and the span file.

Queue invariants: it never holds more than its capacity (the excess is dropped and counted,
never silently), `flush(timeout)` returns by its deadline even when the exporter hangs, and
every accepted call ends up either exported or counted as failed.

Span file invariant (DESIGN.md "Span file format"): each line is one OTLP/JSON
ExportTraceServiceRequest — `resourceSpans → scopeSpans → spans`, camelCase keys, ids in
lowercase hex, enums as integers — with the names and parent links the builder made.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import threading
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy import spans
from proxy.exporter import (ExportQueue, JsonLinesSpanExporter, encode_json_line, encode_json_line_reference,
                           make_exporter)
from proxy.metrics import Metrics
from proxy.otlp_transport import OtlpExporter
from proxy.telemetry import Telemetry

import test_telemetry_fixtures as fx


class GatedExporter(SpanExporter):
    """Blocks in export until released (or for at most `hold` seconds)."""

    def __init__(self, hold: float = 10.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = hold
        self.batches: list[int] = []
        self.shut = False

    def export(self, batch):
        self.entered.set()
        self.release.wait(self.hold)
        self.batches.append(len(batch))
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.shut = True


def one_span(item):
    return [item]


def test_queue_is_bounded_and_counts_drops(caplog):
    gate = GatedExporter()
    q = ExportQueue(gate, one_span, capacity=5, batch_size=100, interval=0.01)
    try:
        assert q.submit("first")
        assert gate.entered.wait(5.0)  # the worker is stuck exporting "first"
        with caplog.at_level(logging.WARNING, logger="proxy.exporter"):
            accepted = [q.submit(i) for i in range(12)]
        assert accepted == [True] * 5 + [False] * 7
        assert q.size == 5 and q.dropped == 7
        # said at once, while the worker is stuck; thinned: one line for the burst, not seven
        lines = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
        assert lines == ["span export queue full (5 calls, 0 MiB waiting): a call's spans dropped, 1 in all; "
                         "the exporter is slower than the calls traced, or stuck"]
        caplog.clear()
        gate.release.set()
        assert q.flush(5.0)
        assert q.size == 0 and q.exported == 6 and q.failed == 0
        assert sum(gate.batches) == 6
    finally:
        gate.release.set()
        with caplog.at_level(logging.WARNING, logger="proxy.exporter"):
            assert q.shutdown(5.0)
    assert gate.shut
    # the six held back are said at shutdown, not lost with the process
    assert [r.getMessage() for r in caplog.records] == [
        "span export queue: 6 more calls' spans dropped since the last such line, 7 in all"]
    assert not q.submit("late") and q.dropped == 8  # after shutdown: dropped, counted


def test_flush_deadline_is_honoured_with_a_hanging_exporter():
    gate = GatedExporter(hold=30.0)
    q = ExportQueue(gate, one_span, capacity=100, batch_size=10, interval=0.01)
    try:
        q.submit("x")
        assert gate.entered.wait(5.0)
        t0 = time.monotonic()
        assert q.flush(0.2) is False
        took = time.monotonic() - t0
        assert 0.19 <= took < 2.0, took
        t0 = time.monotonic()
        assert q.shutdown(0.2) is False
        assert time.monotonic() - t0 < 2.0
    finally:
        gate.release.set()


def test_batch_size_wakes_the_worker_before_the_interval():
    memory = InMemorySpanExporter()
    q = ExportQueue(memory, one_span, capacity=1000, batch_size=50, interval=30.0)
    try:
        time.sleep(0.05)  # let the worker start waiting on its 30 s interval
        for i in range(50):
            q.submit(i)
        deadline = time.monotonic() + 5.0
        while q.exported < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert q.exported == 50
    finally:
        q.shutdown(2.0)


def test_whole_batches_go_at_once_a_partial_one_at_the_tick_or_on_flush():
    """Under load the worker must not chase every new call with a small export (each costs a request)."""
    memory = InMemorySpanExporter()
    batches = []

    def export(items):
        batches.append(len(items))
        return memory.export(items)

    q = ExportQueue(memory, one_span, capacity=1000, batch_size=10, interval=30.0, export=export)
    try:
        time.sleep(0.05)  # the worker waits on its 30 s interval
        for i in range(25):
            q.submit(i)
        deadline = time.monotonic() + 5.0
        while q.exported < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert q.exported == 20 and q.size == 5 and batches == [10, 10]  # the 5 wait for a tick
        assert q.flush(5.0)
        assert q.exported == 25 and batches == [10, 10, 5]
    finally:
        q.shutdown(2.0)
    ticked = ExportQueue(InMemorySpanExporter(), one_span, batch_size=10, interval=0.05)
    try:
        for i in range(3):
            ticked.submit(i)
        deadline = time.monotonic() + 5.0
        while ticked.exported < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ticked.exported == 3  # no flush: the interval tick sends a partial batch
    finally:
        ticked.shutdown(2.0)


def test_build_and_export_failures_are_counted(caplog):
    class Failing(SpanExporter):
        def export(self, batch):
            return SpanExportResult.FAILURE

    def build(item):
        if item == "bad":
            raise ValueError("broken call")
        return [item]

    q = ExportQueue(Failing(), build, interval=0.01)
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.exporter"):
            for item in ("a", "bad", "b"):
                q.submit(item)
            assert q.flush(5.0)
        assert q.failed == 3 and q.exported == 0
        assert "span exporter failed: 2 calls' spans lost, 3 in all" in caplog.text
    finally:
        q.shutdown(2.0)


def test_a_capped_batch_goes_in_parts_each_counted_for_its_own_calls():
    """Encoded items of 40 bytes, at most 100 bytes per export: 5 calls go as 2 + 2 + 1; the
    second export fails, and only its two calls count as failed."""
    sent: list[list[bytes]] = []

    def export(chunks):
        sent.append(chunks)
        return SpanExportResult.FAILURE if len(sent) == 2 else SpanExportResult.SUCCESS

    q = ExportQueue(InMemorySpanExporter(), lambda item: [item], batch_size=100, interval=30.0,
                    export=export, max_request=100)
    try:
        for i in range(5):
            q.submit(bytes([i]) * 40)
        assert q.flush(5.0)
        assert [len(part) for part in sent] == [2, 2, 1]
        assert [part[0][0] for part in sent] == [0, 2, 4]  # (in order)
        assert (q.exported, q.failed) == (3, 2)
    finally:
        q.shutdown(2.0)


@pytest.mark.parametrize("slow", [True, False], ids=["slow failure", "quick failure"])
def test_a_batch_s_later_parts_are_not_sent_once_a_part_failed_slowly(slow, caplog):
    """give_up_after 0.05 s: a part that failed after that long (its collector did not answer)
    leaves the batch's later parts unsent, counted failed, said in a line; one that failed at
    once (a refused request) does not, and the next part goes out. The next batch is tried."""
    sent: list[list[bytes]] = []

    def export(chunks):
        sent.append(chunks)
        if len(sent) == 1:
            time.sleep(0.08 if slow else 0)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    q = ExportQueue(InMemorySpanExporter(), lambda item: [item], batch_size=100, interval=30.0,
                    export=export, max_request=100, give_up_after=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.exporter"):
            for i in range(5):
                q.submit(bytes([i]) * 40)
            assert q.flush(5.0)
        if slow:
            assert [len(part) for part in sent] == [2] and (q.exported, q.failed) == (0, 5)
            took = re.search(r"span export: 2 calls' spans not sent \(an earlier part of their batch failed "
                             r"after (\S+) s\)", caplog.text)
            assert took and float(took.group(1)) >= 0.08, caplog.text  # (how long it took, not the bound)
        else:
            assert [len(part) for part in sent] == [2, 2, 1] and (q.exported, q.failed) == (3, 2)
        q.submit(b"n" * 40)  # (a new batch: sent)
        assert q.flush(5.0)
        assert sent[-1] == [b"n" * 40] and q.exported == (1 if slow else 4)
    finally:
        q.shutdown(2.0)


def test_metrics_expose_the_queue():
    q = ExportQueue(InMemorySpanExporter(), one_span, capacity=7)
    try:
        q.dropped = 3
        m = Metrics()
        m.watch_exporter(q)
        text = m.exposition().decode()
        assert 'thrift_sidecar_spans_dropped_total{reason="queue_full"} 3.0' in text
        assert "thrift_sidecar_span_queue_capacity 7.0" in text
        assert "thrift_sidecar_span_queue_size 0.0" in text
    finally:
        q.shutdown(2.0)


@pytest.mark.parametrize("configured,env,want", [
    (None, {}, "thrift-sidecar"),
    (None, {"OTEL_SERVICE_NAME": "checkout-sidecar"}, "checkout-sidecar"),
    (None, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,k8s.pod.name=p1"}, "from-attrs"),
    ("configured", {"OTEL_SERVICE_NAME": "checkout-sidecar"}, "configured"),  # the config file wins
])
def test_service_name_from_config_else_the_otel_environment(tmp_path, monkeypatch, configured, env, want):
    """What an OpenTelemetry user sets (OTEL_SERVICE_NAME) names the spans' service unless the
    config does; the exported file's resource says so (before: always thrift-sidecar)."""
    for k in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = tmp_path / "spans.jsonl"
    t = Telemetry(SimpleNamespace(service_name=configured, exporter="jsonl", path=path, max_file_size=0,
                                  sample_ratio=1.0),
                  rng=random.Random(9), interval=0.01)
    t.finished(fx.call_success(), "UserService", "users")
    assert t.flush(5.0) and t.shutdown(5.0)
    (rs,) = json.loads(path.read_text().splitlines()[0])["resourceSpans"]
    attrs = {a["key"]: a["value"]["stringValue"] for a in rs["resource"]["attributes"] if "stringValue" in a["value"]}
    assert attrs["service.name"] == want
    if "k8s.pod.name" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert attrs["k8s.pod.name"] == "p1"


def test_names_and_errors_a_client_chooses_are_cut_in_spans():
    """A 60 KB method name (the codec takes up to 64 KiB) is cut to 128 characters in span names
    and rpc.method, and a long error text to 1024: one client's names made a batch a 15 MB
    request, which a collector refuses whole (every call's spans in it lost)."""
    t = Telemetry(SimpleNamespace(service_name="s", exporter="none", sample_ratio=1.0), rng=random.Random(3))
    long = "m" * 60_000
    c = fx.call_timeout()
    c.msg = fx.FakeMsg(name="S" * 300 + ":" + long)
    c.error = "may have run: " + long
    built = t.build_spans(c, "UserService", "users", "head")
    server = built[0]
    assert server.name == "S" * 127 + "…/" + "m" * 127 + "…"
    assert server.attributes[spans.RPC_METHOD] == "m" * 127 + "…"
    assert server.attributes[spans.RPC_SERVICE] == "S" * 127 + "…"
    assert len(server.attributes[spans.ERROR_MESSAGE]) == 1024
    assert max(len(s.name) for s in built) == len(server.name)
    assert all(len(v) <= 1024 for s in built for v in s.attributes.values() if isinstance(v, str))
    assert all(len(s.status.description or "") <= 1024 for s in built)
    short = fx.call_success()
    assert t.build_spans(short, "UserService", "users", "head")[0].name == "UserService/get_user"


HEX32 = re.compile(r"[0-9a-f]{32}")
HEX16 = re.compile(r"[0-9a-f]{16}")


def test_jsonl_span_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    cfg = SimpleNamespace(service_name="sidecar-file", exporter="jsonl", path=path, max_file_size=0, sample_ratio=1.0)
    t = Telemetry(cfg, rng=random.Random(9), interval=0.01)
    assert isinstance(t.exporter, JsonLinesSpanExporter)
    calls = [fx.call_success(), fx.call_retry(), fx.call_timeout()]
    for c in calls:
        t.finished(c, "UserService", "users")
        assert t.flush(5.0)  # one export (one line) per call here
    assert t.shutdown(5.0)

    lines = path.read_text().splitlines()
    assert len(lines) == 3
    expected_counts = [8, 13, 7]
    for line, count in zip(lines, expected_counts):
        req = json.loads(line)
        assert list(req) == ["resourceSpans"]
        (rs,) = req["resourceSpans"]
        attrs = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
        assert attrs["service.name"] == {"stringValue": "sidecar-file"}
        (ss,) = rs["scopeSpans"]
        assert ss["scope"]["name"] == spans.INSTRUMENTATION_SCOPE
        assert ss["schemaUrl"] == spans.SCHEMA_URL
        out = ss["spans"]
        assert len(out) == count
        ids = {s["spanId"] for s in out}
        server = [s for s in out if s["kind"] == 2]  # SPAN_KIND_SERVER as an integer
        assert len(server) == 1 and server[0]["name"] == "UserService/get_user"
        assert "parentSpanId" not in server[0]
        for s in out:
            assert HEX32.fullmatch(s["traceId"]) and s["traceId"] == server[0]["traceId"]
            assert HEX16.fullmatch(s["spanId"])
            assert int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]) > 1_600_000_000 * 10**9
            if s is not server[0]:
                assert s["parentSpanId"] in ids
                assert s["name"] in spans.HOPS or s["kind"] == 3  # CLIENT
        names = {s["name"] for s in out}
        assert {"read_request", "acquire", "write_upstream", "service_time"} <= names
    timeout = json.loads(lines[2])["resourceSpans"][0]["scopeSpans"][0]["spans"]
    server = [s for s in timeout if s["kind"] == 2][0]
    assert server["status"]["code"] == 2  # STATUS_CODE_ERROR
    attrs = {a["key"]: a["value"] for a in server["attributes"]}
    assert attrs[spans.ERROR_TYPE] == {"stringValue": "timeout"}
    assert attrs[spans.SAMPLED_BY] == {"stringValue": "head"}


def test_jsonl_writes_a_large_batch_as_short_lines_and_never_half_a_line(tmp_path, monkeypatch):
    """A batch becomes lines of at most LINE_SPANS spans (one json.dumps over a 256-call batch held
    the GIL, and so the event loop, ~17 ms); a write that fails part way (a full disk) is cut
    back, so the file keeps whole lines only (found by an exporter hunt: a cut line followed by
    the next export's made `hops` reject the whole file)."""
    path = tmp_path / "spans.jsonl"
    t = Telemetry(SimpleNamespace(service_name="s", exporter="none", sample_ratio=1.0), rng=random.Random(3))
    exporter = JsonLinesSpanExporter(path)
    built = [s for c in [fx.call_success() for _ in range(20)] for s in t.build_spans(c, "UserService")]
    assert len(built) == 160
    assert exporter.export(built) is SpanExportResult.SUCCESS
    lines = path.read_text().splitlines()
    assert [len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in lines] == [64, 64, 32]
    size = path.stat().st_size

    real_write = os.write

    def half_then_full(fd, data):
        monkeypatch.setattr(os, "write", full)
        return real_write(fd, bytes(data[: len(data) // 2]))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        exporter.export(built[:8])
    monkeypatch.setattr(os, "write", real_write)
    assert path.stat().st_size == size  # the half written is gone
    assert exporter.export(built[:8]) is SpanExportResult.SUCCESS
    assert all(json.loads(line) for line in path.read_text().splitlines())
    exporter.shutdown()
    assert exporter.export(built[:8]) is SpanExportResult.FAILURE


def test_jsonl_span_file_is_rotated_at_its_cap_and_keeps_one_older_file(tmp_path):
    """Before, the file grew ~1 KB per traced call with no bound (a full disk, in time)."""
    path = tmp_path / "spans.jsonl"
    t = Telemetry(SimpleNamespace(service_name="s", exporter="none", sample_ratio=1.0), rng=random.Random(5))
    batch = [s for c in [fx.call_success() for _ in range(8)] for s in t.build_spans(c, "UserService")]
    exporter = JsonLinesSpanExporter(path, max_size=64 * 1024)
    exports = 0
    while not (tmp_path / "spans.jsonl.1").exists():
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        exports += 1
        assert exports < 1000
    assert 0 < (tmp_path / "spans.jsonl.1").stat().st_size <= 64 * 1024 and path.stat().st_size <= 64 * 1024
    rotations = 0
    for _ in range(exports * 3):  # more than two files' worth: the oldest is gone
        before = path.stat().st_size
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        rotations += path.stat().st_size < before
        assert path.stat().st_size <= 64 * 1024 and (tmp_path / "spans.jsonl.1").stat().st_size <= 64 * 1024
    assert rotations >= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spans.jsonl", "spans.jsonl.1"]
    for name in ("spans.jsonl", "spans.jsonl.1"):  # whole lines, each a request `hops` reads
        assert all(json.loads(line)["resourceSpans"] for line in (tmp_path / name).read_text().splitlines())
    os.rename(path, tmp_path / "moved.jsonl")  # someone else rotated it: a new file is begun
    for _ in range(exports + 1):
        assert exporter.export(batch) is SpanExportResult.SUCCESS
    assert path.exists()
    exporter.shutdown()


def test_jsonl_span_file_reached_through_a_symlink_is_never_rotated(tmp_path, caplog):
    """`path: /dev/stdout` with stdout a file, or any symlink: rotating would rename the link
    and write the spans to a new file in its place (a review found /dev/stdout renamed)."""
    real = tmp_path / "real.jsonl"
    link = tmp_path / "spans.jsonl"
    link.symlink_to(real)
    t = Telemetry(SimpleNamespace(service_name="s", exporter="none", sample_ratio=1.0), rng=random.Random(6))
    batch = [s for c in [fx.call_success() for _ in range(8)] for s in t.build_spans(c, "UserService")]
    exporter = JsonLinesSpanExporter(link, max_size=16 * 1024)
    for _ in range(8):
        assert exporter.export(batch) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert link.is_symlink() and real.stat().st_size > 16 * 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real.jsonl", "spans.jsonl"]
    assert [r.getMessage() for r in caplog.records if "not rotated" in r.getMessage()] == [
        f"span file {link} is not a regular file of its own (a symlink, a device, or replaced): it is not rotated"]


def test_jsonl_span_file_may_be_a_pipe(tmp_path):
    """`tracing.path: /dev/stdout` in a container, or a FIFO into a reader: no seeking there
    (a review caught lseek's ESPIPE failing every export)."""
    read_fd, write_fd = os.pipe()
    try:
        t = Telemetry(SimpleNamespace(service_name="s", exporter="none", sample_ratio=1.0), rng=random.Random(4))
        exporter = JsonLinesSpanExporter(f"/proc/self/fd/{write_fd}")
        assert exporter.export(t.build_spans(fx.call_success(), "UserService")) is SpanExportResult.SUCCESS
        exporter.shutdown()
        os.close(write_fd)
        write_fd = -1
        with os.fdopen(read_fd, "rb") as r:
            read_fd = -1
            (line,) = r.read().decode().splitlines()
        assert len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) == 8
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)


def test_make_exporter_by_config(tmp_path):
    def cfg(**kw):
        base = dict(service_name="s", exporter="none", otlp_protocol="grpc", endpoint=None,
                    path=None, max_file_size=0, sample_ratio=0.01)
        return SimpleNamespace(**{**base, **kw})

    assert make_exporter(None) is None
    assert make_exporter(cfg()) is None
    console = make_exporter(cfg(exporter="console"))
    assert type(console).__name__ == "ConsoleSpanExporter"
    grpc = make_exporter(cfg(exporter="otlp", endpoint="http://127.0.0.1:4317"))
    assert isinstance(grpc, OtlpExporter)
    assert (grpc.settings.protocol, grpc.settings.target, grpc.settings.insecure) == ("grpc", "127.0.0.1:4317", True)
    grpc.shutdown()
    http = make_exporter(cfg(exporter="otlp", otlp_protocol="http", endpoint="http://127.0.0.1:4318"))
    assert isinstance(http, OtlpExporter)
    assert (http.settings.protocol, http.settings.target) == ("http", "http://127.0.0.1:4318/v1/traces")
    http.shutdown()
    jsonl = make_exporter(cfg(exporter="jsonl", path=tmp_path / "x.jsonl"))
    assert isinstance(jsonl, JsonLinesSpanExporter)
    jsonl.shutdown()


def test_queue_bounds_the_bytes_it_keeps_alive():
    gate = GatedExporter()
    q = ExportQueue(gate, one_span, capacity=100, batch_size=100, interval=0.01, max_bytes=1000)
    try:
        assert q.submit("first", 5000)  # alone in the queue: even a huge call is kept
        assert gate.entered.wait(5.0)
        assert q.queued_bytes == 5000
        assert not q.submit("big", 5000) and q.dropped == 1  # the first one still holds its bytes
        gate.release.set()
        assert q.flush(5.0) and q.queued_bytes == 0
        assert [q.submit(i, 300) for i in range(4)] == [True, True, True, False]
        assert q.dropped == 2
    finally:
        gate.release.set()
        q.shutdown(5.0)


def test_span_file_encoder_matches_the_protobuf_json_mapping():
    """The direct OTLP/JSON writer gives what encode_spans + MessageToDict (+ hex ids) gives."""
    t = Telemetry(SimpleNamespace(service_name="sidecar-file", exporter="none", sample_ratio=1.0),
                  rng=random.Random(11), exporter=None)
    parented = fx.call_success(fx.FakeMsg(headers={
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "vendor=abc,other=x"}))
    t.begin(parented)
    streamed = fx.call_streamed()
    streamed.loop_lag_ns = 93_500_000
    never = fx.call_success()
    never.t_acked, never.never_read = 0, True
    out = []
    for c in (fx.call_success(), fx.call_declared(), fx.call_retry(), fx.call_timeout(), fx.call_queued(),
              fx.call_oneway(), streamed, parented, never):
        out += t.build_spans(c, "UserService", "users", "head")
    fast, reference = encode_json_line(out), encode_json_line_reference(out)
    assert "\n" not in fast
    assert json.loads(fast) == json.loads(reference)
    assert json.loads(encode_json_line(out[:1])) == json.loads(encode_json_line_reference(out[:1]))
