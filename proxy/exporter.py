"""Span export off the event loop: our own bounded queue feeding an OpenTelemetry span exporter.

Owns: the export queue (bounded, drops counted, a worker thread that builds and exports batches,
`flush` and `shutdown` with real deadlines), choosing the SDK exporter from the `tracing` config,
and the JSON-lines span file. Leaves to others: deciding which calls to export and building
their spans (`proxy.telemetry`), exposing the counters (`proxy.metrics`).

Why not the SDK's BatchSpanProcessor: when full it drops the oldest spans silently, and its
`force_flush` ignores its timeout. Here the loop side pays one `deque.append` per exported call
(the spans themselves are built in the worker thread), a full queue drops the *new* call and
counts it, and `flush(timeout)` returns False at its deadline whatever the exporter is doing.
A batch goes out when `batch_size` calls wait, else at the next `interval` tick, on `flush`, or
at shutdown; encoded spans go as several requests when a batch's exceed `MAX_REQUEST` bytes,
each with the exporter's whole timeout, and none more once one failed after `give_up_after`.

    queue = ExportQueue(exporter, build)    # build(item) -> list[ReadableSpan], in the worker
    queue = ExportQueue(exporter, encode, export=send)   # or any list send() takes (encoded spans)
    queue.submit(item)                      # loop: append, or count a drop; never blocks
    queue.flush(2.0)                        # True when everything submitted so far was exported
    queue.shutdown(2.0)                     # flush, stop the worker, shut the exporter down

Exporters (`tracing.exporter`): `otlp` (`proxy.otlp_transport.OtlpExporter`: gRPC or HTTP per
`otlp_protocol`, to `endpoint`; no endpoint = the SDK exporters' defaults, which honour the
OTEL_EXPORTER_OTLP_* variables; an HTTP endpoint without a path gets `/v1/traces`; it takes
whole encoded requests, so `proxy.telemetry` skips ReadableSpans for it), `jsonl` (`path`: one OTLP/JSON `ExportTraceServiceRequest`
per line — `{"resourceSpans": [...]}`, camelCase keys, trace/span ids in lowercase hex, enums as
integers — as the OpenTelemetry file exporter writes it), `console` (one JSON object per span
per line on stderr), `none` (no exporter, no queue).
"""

from __future__ import annotations

import base64
import json
import logging
import stat
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.logs import Throttle

log = logging.getLogger(__name__)

__all__ = ["ExportQueue", "JsonLinesSpanExporter", "encode_json_line", "encode_json_line_reference",
           "make_exporter"]

CAPACITY = 8192        # calls waiting for export
MAX_BYTES = 64 << 20   # payload bytes the waiting calls may keep alive (a queued Call holds its
                       # request and reply until its spans are built)
BATCH_SIZE = 256       # calls per export; the worker also wakes when this many are waiting
MAX_REQUEST = 3 << 20  # encoded span bytes per export request, when the items are encoded: a
                       # batch past it goes as several (OTLP receivers refuse gRPC messages over
                       # 4 MiB unless told otherwise: the Collector's and Jaeger's default)
INTERVAL = 0.2         # seconds between exports when fewer are waiting
LOG_EVERY = 10.0       # seconds between warnings about failed exports


class ExportQueue:
    """A bounded queue of finished calls and the daemon thread that exports their spans.

    Bounded twice: `capacity` items, and `max_bytes` of the sizes given to `submit` (a queued
    call keeps its request and reply bytes alive until its spans are built; slow 15 MB replies
    are exactly the calls we keep). Counters (read by `proxy.metrics` on scrape): `dropped`
    (queue full or shut down), `failed` (build or export failed), `exported` (calls whose spans
    the exporter accepted), `size`, `capacity`. Each counter has one writing thread: the loop
    writes `dropped` and the `_in` counters, the worker the others; no lock on the loop side.
    """

    def __init__(self, exporter: SpanExporter, build: Callable[[object], Sequence],
                 capacity: int = CAPACITY, batch_size: int = BATCH_SIZE, interval: float = INTERVAL,
                 max_bytes: int = MAX_BYTES, name: str = "thrift-sidecar-spans",
                 export: Callable[[list], SpanExportResult] | None = None,
                 max_request: int | None = None, give_up_after: float | None = None) -> None:
        self.exporter = exporter
        self.build = build
        # what a batch of built items goes to: the exporter's `export` (ReadableSpans), or e.g.
        # one that wraps already encoded OTLP spans into a request and sends it
        self.export = export if export is not None else exporter.export
        # built items are bytes (encoded spans) and one export takes at most this many of them:
        # a batch that holds more goes out as several exports, each counted for its own calls
        self.max_request = max_request
        # a part of a batch that failed after this many seconds (the collector did not answer
        # within the exporter's timeout, or retried that long): the batch's later parts are not
        # sent, so a collector that does not answer holds the worker one timeout, not one per part
        self.give_up_after = give_up_after
        self._gave_up: float | None = None  # (this batch's: how long its failed part took)
        self.capacity = capacity
        self.batch_size = batch_size
        self.interval = interval
        self.max_bytes = max_bytes
        self.dropped = 0
        self.failed = 0
        self.exported = 0
        self._items: deque = deque()
        self._accepted = 0   # items appended (loop side)
        self._handled = 0    # items exported or failed (worker side)
        self._wanted = 0     # items a flush waits for (export them even as a partial batch)
        self._bytes_in = 0   # sizes submitted (loop side)
        self._bytes_out = 0  # sizes handled (worker side)
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._stopping = False
        self._last_warning = 0.0
        self._drop_log = Throttle(LOG_EVERY)  # the loop's drop lines (queue full)
        self._loss_log = Throttle(LOG_EVERY)  # the worker's lines about failed exports
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def size(self) -> int:
        return len(self._items)

    # -- loop side --------------------------------------------------------------

    @property
    def queued_bytes(self) -> int:
        return self._bytes_in - self._bytes_out

    def submit(self, item, size: int = 0) -> bool:
        """Queue one item (keeping `size` bytes alive); False, counted, when full or shut down."""
        items = self._items
        n = len(items)
        held = self._bytes_in - self._bytes_out
        if n >= self.capacity or self._stopping or (held and held + size > self.max_bytes):
            self.dropped += 1
            if not self._stopping:
                self._drop_log.warn(
                    log, "full", "span export queue full (%d calls, %.0f MiB waiting): a call's spans dropped, "
                    "%d in all; the exporter is slower than the calls traced, or stuck", n, held / 2**20, self.dropped)
            return False
        items.append((item, size))
        self._accepted += 1
        self._bytes_in += size
        if n + 1 == self.batch_size:
            self._wake.set()
        return True

    # -- lifecycle (any thread) ------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far is exported (or failed); False at the deadline."""
        deadline = time.monotonic() + timeout
        target = self._accepted
        with self._progress:
            self._wanted = max(self._wanted, target)
        self._wake.set()
        with self._progress:
            while self._handled < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._progress.wait(remaining)
        return True

    def shutdown(self, timeout: float) -> bool:
        """Flush within the deadline, then stop the worker (which shuts the exporter down)."""
        deadline = time.monotonic() + timeout
        flushed = self.flush(timeout)
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        held = self._drop_log.held("full")  # the drop lines' tail: said before the process goes
        if held:
            log.warning("span export queue: %d more calls' spans dropped since the last such line, %d in all",
                        held, self.dropped)
        return flushed and not self._thread.is_alive()

    # -- worker -----------------------------------------------------------------

    def _run(self) -> None:
        wake = self._wake
        while True:
            woken = wake.wait(self.interval)
            wake.clear()
            self._drain(due=not woken)
            if self._stopping and not self._items:
                break
        try:
            self.exporter.shutdown()
        except Exception:  # noqa: BLE001 - exporter shutdown must not raise out of a daemon thread
            log.warning("span exporter shutdown failed", exc_info=True)

    def _drain(self, due: bool) -> None:
        """Export whole batches; a partial one only when due (an interval passed), flushed or stopping.

        Why not everything that is waiting: under load, calls keep arriving while a batch is
        built and sent, and draining them at once converges on batches of ~30 calls, each paying
        a whole export request (~0.5 ms of CPU over gRPC): a third of the export thread's time.
        """
        items = self._items
        owed = len(items) if due else 0  # what was waiting at the tick; later arrivals wait their turn
        size = self.batch_size
        while items:
            n = len(items)
            if n < size and owed <= 0 and not self._stopping and self._handled >= self._wanted:
                break
            take = min(n, size)
            batch = [items.popleft() for _ in range(take)]
            owed -= take
            self._export(batch)

    def _export(self, batch: list) -> None:
        n = len(batch)
        spans: list = []
        built = 0
        size = 0
        cap = self.max_request
        held = 0  # (bytes in `spans`, when capped)
        self._gave_up = None
        for item, nbytes in batch:
            size += nbytes
            try:
                made = self.build(item)
            except Exception:  # noqa: BLE001 - one bad call must not stop the worker
                self.failed += 1
                self._warn("building spans failed", exc_info=True)
                continue
            if cap is not None:
                more = sum(map(len, made))
                if spans and held + more > cap:
                    self._send(spans, built)
                    spans, built, held = [], 0, 0
                held += more
            spans.extend(made)
            built += 1
        self._send(spans, built)
        self._bytes_out += size
        with self._progress:
            self._handled += n
            self._progress.notify_all()

    def _send(self, spans: list, built: int) -> None:
        """Export the spans of `built` calls; count them exported or failed."""
        ok = True
        if spans and self._gave_up is not None:
            ok = False
            self._loss_log.warn(log, "not_sent", "span export: %d calls' spans not sent (an earlier part of their "
                                "batch failed after %.2f s), %d lost in all", built, self._gave_up,
                                self.failed + built)
        elif spans:
            t0 = time.monotonic()
            try:
                ok = self.export(spans) is SpanExportResult.SUCCESS
            except Exception:  # noqa: BLE001
                ok = False
                self._warn("span export raised", exc_info=True)
            if not ok:
                self._loss_log.warn(log, "failed", "span exporter failed: %d calls' spans lost, %d in all",
                                    built, self.failed + built)
                took = time.monotonic() - t0
                if self.give_up_after is not None and took >= self.give_up_after:
                    self._gave_up = took
        if ok:
            self.exported += built
        else:
            self.failed += built

    def _warn(self, msg: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_warning >= LOG_EVERY:
            self._last_warning = now
            log.warning(msg, *args, exc_info=exc_info)


# --------------------------------------------------------------------------------------------
# The span file


def encode_json_line(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON ExportTraceServiceRequest on one line (no newline).

    Written directly from the spans: the reference path (the SDK's `encode_spans`, then
    protobuf's `MessageToDict`, then ids from base64 to hex) costs ~0.5 ms per 8-span call,
    this ~20x less. `tests/test_telemetry_export.py` checks both give the same JSON for every
    span shape we build; spans with events or links (we make none) take the reference path.
    """
    groups: dict[tuple[int, int], tuple] = {}
    for span in spans:
        if span.events or span.links:
            return encode_json_line_reference(spans)
        key = (id(span.resource), id(span.instrumentation_scope))
        group = groups.get(key)
        if group is None:
            group = groups[key] = (span.resource, span.instrumentation_scope, [])
        group[2].append(_json_span(span))
    by_resource: dict[int, dict] = {}
    for resource, scope, encoded in groups.values():
        rs = by_resource.get(id(resource))
        if rs is None:
            rs = by_resource[id(resource)] = {"resource": _json_attrs_holder(resource.attributes), "scopeSpans": []}
            if resource.schema_url:
                rs["schemaUrl"] = resource.schema_url
        ss: dict = {"scope": _json_scope(scope), "spans": encoded}
        if scope is not None and scope.schema_url:
            ss["schemaUrl"] = scope.schema_url
        rs["scopeSpans"].append(ss)
    return json.dumps({"resourceSpans": list(by_resource.values())}, separators=(",", ":"), ensure_ascii=False)


def _json_value(v) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}  # int64 is a string in protobuf's JSON mapping
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_json_value(x) for x in v]} if v else {}}
    return {"stringValue": str(v)}


def _json_attrs(attributes) -> list[dict]:
    return [{"key": k, "value": _json_value(v)} for k, v in attributes.items()]


def _json_attrs_holder(attributes) -> dict:
    return {"attributes": _json_attrs(attributes)} if attributes else {}


def _json_scope(scope) -> dict:
    if scope is None:
        return {}
    out = {}
    if scope.name:
        out["name"] = scope.name
    if scope.version:
        out["version"] = scope.version
    if scope.attributes:
        out["attributes"] = _json_attrs(scope.attributes)
    return out


_HAS_IS_REMOTE = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200      # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def _json_span(span: ReadableSpan) -> dict:
    ctx = span.context
    parent = span.parent
    out: dict = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"}
    if ctx.trace_state:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    out["flags"] = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    if span.name:
        out["name"] = span.name
    out["kind"] = span.kind.value + 1  # OTLP counts SPAN_KIND_UNSPECIFIED as 0
    if span.start_time:
        out["startTimeUnixNano"] = str(span.start_time)
    if span.end_time:
        out["endTimeUnixNano"] = str(span.end_time)
    attributes = span.attributes
    if attributes:
        out["attributes"] = _json_attrs(attributes)
    status = span.status
    st: dict = {}
    if status.description:
        st["message"] = status.description
    if status.status_code.value:
        st["code"] = status.status_code.value
    out["status"] = st
    return out


def _hex_ids(obj: dict, keys=("traceId", "spanId", "parentSpanId")) -> None:
    for k in keys:
        v = obj.get(k)
        if v:
            obj[k] = base64.b64decode(v).hex()


def encode_json_line_reference(spans: Sequence[ReadableSpan]) -> str:
    """The same line through the SDK's protobuf encoder and protobuf's JSON mapping (slow)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    request = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    # protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants ids in hex
    for rs in request.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return json.dumps(request, separators=(",", ":"), ensure_ascii=False)


class JsonLinesSpanExporter(SpanExporter):
    """Appends OTLP/JSON requests, one per line, to a file (what `hops --spans` reads).

    A batch is written as lines of at most LINE_SPANS spans: one `json.dumps` is a single C call
    that holds the GIL throughout, and over a whole 256-call batch (~900 KB) it held the event
    loop up ~17 ms. The lines of one export go out in one write; one that fails part way (a full
    disk) is cut back to where it began, so the file keeps only whole lines. It grows by ~1 KB per
    traced call, up to `max_size` bytes (0: no cap): an export that would pass it first renames
    the file to `<path>.1` (replacing the one before) and starts a new one, so the spans take at
    most twice `max_size` of disk. A pipe or FIFO is never rotated.
    """

    LINE_SPANS = 64

    def __init__(self, path: str | os.PathLike, max_size: int = 0) -> None:
        self.path = os.fspath(path)
        self.max_size = max_size
        self._fd: int | None = self._open()
        self._lock = threading.Lock()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        step = self.LINE_SPANS
        data = "".join([encode_json_line(spans[i:i + step]) + "\n"
                        for i in range(0, len(spans), step)]).encode("utf-8")
        with self._lock:
            fd = self._fd
            if fd is None:
                return SpanExportResult.FAILURE
            try:
                start: int | None = os.lseek(fd, 0, os.SEEK_END)
            except OSError:  # a pipe, FIFO or tty (/dev/stdout): nothing to cut back
                start = None
            if start and self.max_size and start + len(data) > self.max_size and self._rotate(fd):
                fd, start = self._fd, 0
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:
                if start is not None:
                    try:
                        os.ftruncate(fd, start)  # no half line for readers to stumble on
                    except OSError:
                        pass
                raise
        return SpanExportResult.SUCCESS

    def _rotate(self, fd: int) -> bool:
        """`path` → `path.1`, and a new file at `path` (True). Only a regular file that `path`
        itself names (not through a symlink: `/dev/stdout` is renamed by no one) is rotated; one
        that cannot be renamed (a folder without write permission) is appended to past the cap,
        said once (False)."""
        try:
            mine, there = os.fstat(fd), os.lstat(self.path)
        except FileNotFoundError:  # moved away already (e.g. by logrotate): begin a new one
            mine = there = None
        if mine is not None and (not stat.S_ISREG(mine.st_mode) or stat.S_ISLNK(there.st_mode)
                                 or (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino)):
            self.max_size = 0
            log.warning("span file %s is not a regular file of its own (a symlink, a device, or replaced): "
                        "it is not rotated", self.path)
            return False
        if mine is not None:
            try:
                os.replace(self.path, self.path + ".1")
            except FileNotFoundError:
                pass
            except OSError as e:
                self.max_size = 0
                log.warning("span file %s cannot be rotated (%s): it grows past max_file_size", self.path,
                            e.strerror or e)
                return False
        self._fd = self._open()
        os.close(fd)
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written (unbuffered) before it returns

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# --------------------------------------------------------------------------------------------
# Choosing the exporter


def make_exporter(tracing) -> SpanExporter | None:
    """The SDK span exporter the `tracing` config asks for (None for `none` or no config)."""
    kind = "none" if tracing is None else tracing.exporter
    if kind == "none":
        return None
    if kind == "jsonl":
        return JsonLinesSpanExporter(tracing.path, tracing.max_file_size)
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n")
    if kind == "otlp":
        from proxy.otlp_transport import OtlpExporter

        return OtlpExporter(tracing.otlp_protocol, tracing.endpoint)
    raise ValueError(f"unknown tracing exporter {kind!r}")
