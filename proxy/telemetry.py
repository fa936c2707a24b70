"""Traces of calls: which calls become spans, and building those spans after the call.

Owns: the per-call tracing API the pipeline and listener call, the export decision (head
sampled, slow, failed), and turning a finished Call's timestamps into its spans, in the export
thread: one plan of plain tuples (`plan`), made into OpenTelemetry `ReadableSpan`s for SDK
exporters (`build_spans`) or written straight as OTLP protobuf for the OTLP exporter
(`encode_call`, ~8x cheaper: no ReadableSpan, no SDK encoder). Leaves to others: taking the
timestamps (listener, pipeline, pool), trace context on the wire (`proxy.tracecontext`), the
export queue and the exporters (`proxy.exporter`, `proxy.otlp_transport`), the protobuf wire
format (`proxy.otlp`), histograms (`proxy.metrics`), names (`proxy.spans`).

Why not the SDK tracer: a tracer span costs ~17 µs here; a call has 8+ of them. So nothing
traces *during* a call: the call keeps monotonic timestamps (`proxy.calls`), and only a call
that is head-sampled, slower than its route's `slow_call`, or failed is queued (one append on
the loop) and turned into spans in the export thread.

    telemetry = Telemetry(cfg.tracing)                      # composition root
    call.trace = telemetry.begin(call)                      # THeader request, or THeader upstream
    headers = telemetry.upstream_headers(attempt)           # per attempt to a THeader upstream
    telemetry.finished(call, service, listener)             # once the call is over (reply acked)
    telemetry.shutdown(timeout)                             # drain: flush with a deadline

Span tree (DESIGN.md "Spans"; a hop whose timestamps are 0 has no span):

    SERVER "{service}/{method}"  t_start → t_acked (else t_handed; oneway: t_done)
     ├─ read_request             t_start → t_framed
     ├─ CLIENT "{service}/{method}"   per attempt: t_acquire → t_reply
     │   ├─ acquire              t_acquire → t_acquired (no connection: → t_reply, else t_done)
     │   ├─ write_upstream       t_acquired → t_written
     │   ├─ service_time         t_written → t_first_reply (a failed attempt: → t_reply)
     │   └─ read_response        t_first_reply (+ held_ns) → t_reply
     ├─ backoff                  call.backoffs
     ├─ queued                   t_done → t_write, when the reply waited behind an earlier one;
     │                           per attempt held for its turn: t_first_reply → + held_ns;
     │                           a request held back at max_inflight: t_framed → t_admitted
     └─ write_response           t_write → t_acked (else t_handed); handed_ms, client_never_read
                                 (never read: t_acked is when the proxy stopped waiting, the cap)

Every exported span carries the sampled trace flag, also for slow/failed calls that were not
head-sampled: the SDK's processors and most backends drop unsampled spans. `sampled_by` says
why the call was kept: `head`, `failed` or `slow` (in that order of precedence). A call whose
client never read its reply (`never_read`) counts as failed: error.type `client_never_read`
unless it failed otherwise too.
"""

from __future__ import annotations

import random
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from proxy import __version__, otlp, spans
from proxy.calls import DECLARED_EXCEPTION, SUCCESS
from proxy.exporter import MAX_REQUEST, ExportQueue, make_exporter
from proxy.logs import MAX_ERROR, MAX_NAME, cut
from proxy.metrics import INVALID, call_end, call_outcome, failure_type, is_failure
from proxy.tracecontext import TraceContext, inject, new_id, start

__all__ = ["Telemetry", "HEAD", "SLOW", "FAILED", "QUEUED_MIN_NS", "DEFAULT_SLOW_CALL"]

HEAD = spans.SAMPLED_HEAD
SLOW = spans.SAMPLED_SLOW
FAILED = spans.SAMPLED_FAILED

DEFAULT_SLOW_CALL = 1.0   # seconds, when a call has no route (the config's default too)
QUEUED_MIN_NS = 10_000    # a reply written within 10 µs of being ready did not wait in line

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)
_OK_ATTEMPT = frozenset((SUCCESS, DECLARED_EXCEPTION))
_NEVER_READ_TEXT = "the client never read its reply"
INTERNAL, SERVER, CLIENT = otlp.KIND_INTERNAL, otlp.KIND_SERVER, otlp.KIND_CLIENT
_SPAN_KIND = {INTERNAL: SpanKind.INTERNAL, SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}


class _Resource(Resource):
    """A Resource whose hash is computed once: the SDK's OTLP encoder hashes the resource of every
    span it encodes, and `Resource.__hash__` serialises all attributes to JSON (~4.5 µs) each time."""

    def __init__(self, attributes, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or super().__eq__(other)


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


DEFAULT_SERVICE_NAME = "thrift-sidecar"


def service_resource(configured: str | None) -> Resource:
    """The resource spans carry: OTEL_RESOURCE_ATTRIBUTES and the SDK's own, with service.name
    the configured one, else the environment's (OTEL_SERVICE_NAME, then service.name in
    OTEL_RESOURCE_ATTRIBUTES, as every OpenTelemetry SDK reads them), else thrift-sidecar."""
    if configured:
        return Resource.create({"service.name": configured})
    detected = Resource.create({})
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        return Resource.create({"service.name": DEFAULT_SERVICE_NAME})
    return detected


class Telemetry:
    """Tracing for all listeners: one RNG, one resource, one export queue (or none)."""

    def __init__(self, tracing, clock_offset_ns: int | None = None, rng: random.Random | None = None,
                 exporter=None, **queue_options) -> None:
        self.tracing = tracing
        self.ratio = 0.0 if tracing is None else tracing.sample_ratio
        self.rng = rng if rng is not None else random.Random()
        # ids for hop spans are drawn in the export thread: its own generator, seeded from ours
        self._ids = random.Random(self.rng.getrandbits(64))
        # monotonic ns + offset = epoch ns; computed once so spans of one call stay consistent
        self.offset_ns = (time.time_ns() - time.monotonic_ns()) if clock_offset_ns is None else clock_offset_ns
        detected = service_resource(None if tracing is None else tracing.service_name)
        self.resource = _Resource(detected.attributes, detected.schema_url)
        self.scope = InstrumentationScope(spans.INSTRUMENTATION_SCOPE, __version__, spans.SCHEMA_URL)
        scope = self.scope
        self.otlp = otlp.Encoder(self.resource.attributes, self.resource.schema_url, scope.name, scope.version,
                                 scope.schema_url, scope.attributes)  # for encode_call (the export thread)
        if exporter is None:
            exporter = make_exporter(tracing)
        self.exporter = exporter
        self.queue = None
        if getattr(exporter, "export_request", None) is not None:
            # an exporter that sends whole encoded OTLP requests: the spans go straight from the
            # call's timestamps to protobuf bytes (`encode_call`), never through ReadableSpan
            # (a part of a split batch that failed after half the exporter's timeout or more:
            # the batch's later parts are not sent, their collector is not answering)
            timeout = getattr(getattr(exporter, "settings", None), "timeout", None)
            self.queue = ExportQueue(exporter, self._encode_item, export=self._export_encoded,
                                     **{"max_request": MAX_REQUEST,
                                        "give_up_after": timeout / 2 if timeout else None, **queue_options})
        elif exporter is not None:
            self.queue = ExportQueue(exporter, self._build_item, **queue_options)

    # -- per call, on the loop ---------------------------------------------------------------

    def begin(self, call, headers: dict | None = None) -> TraceContext:
        """Join the client's trace (THeader headers) or start one; sets and returns `call.trace`.

        Call it when the request is THeader (it may carry a traceparent) or when an attempt will
        go to a THeader upstream (we inject ours). Plain calls need nothing: their head decision
        is drawn in `finished` and their trace id in the export thread. `headers`: the request's,
        when `call.msg` does not carry them (a bad request: its payload unreadable).
        """
        msg = call.msg
        if headers is None and msg is not None:
            headers = msg.headers
        ctx = start(headers, self.rng, self.ratio)
        call.trace = ctx
        return ctx

    def upstream_headers(self, attempt) -> dict[str, str]:
        """`traceparent` (and `tracestate`) for one attempt's THeader request; sets its span id."""
        call = attempt.call
        ctx = call.trace
        if ctx is None:
            ctx = self.begin(call)
        if not attempt.span_id:
            attempt.span_id = new_id(self.rng)
        return inject(ctx, attempt.span_id)

    def should_export(self, call, end: int = 0) -> str | None:
        """Why this finished call becomes spans (`head`, `failed`, `slow`), or None. Cheap: it
        runs for every call. `end`: `call_end(call)`, if the caller has it already."""
        ctx = call.trace
        if ctx is not None:
            if ctx.sampled:
                return HEAD
        else:
            ratio = self.ratio
            if ratio > 0.0 and (ratio >= 1.0 or self.rng.random() < ratio):
                return HEAD
        return self._kept_unsampled(call, end)

    @staticmethod
    def _kept_unsampled(call, end: int = 0) -> str | None:
        """Failed (a client that never read its reply counts), or slower than its route's
        slow_call, for a call the head decision did not keep."""
        if is_failure(call):
            return FAILED
        route = call.route
        settings = route.settings if route is not None else None
        slow = settings.slow_call if settings is not None else DEFAULT_SLOW_CALL
        if (end or call_end(call)) - call.t_start > slow * 1e9:
            return SLOW
        return None

    def finished(self, call, service: str, listener: str | None = None, end: int = 0) -> str | None:
        """The call is over (nothing will change it again): queue it for export if it is kept.

        Returns the reason it was kept (or None). The loop pays the decision and one append; the
        spans are built in the export thread from the call's fields. `end`: as for should_export.
        """
        queue = self.queue
        if queue is None:
            return None
        reason = self.should_export(call, end)
        if reason is not None:
            # what the queued call keeps alive until the export thread is done with it
            msg, reply = call.msg, call.reply
            size = (len(msg.data) if msg is not None else 0) + (len(reply) if reply is not None else 0)
            queue.submit((call, service, listener, reason), size)
        return reason

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        return True if self.queue is None else self.queue.flush(timeout)

    def shutdown(self, timeout: float) -> bool:
        return True if self.queue is None else self.queue.shutdown(timeout)

    # -- building spans (export thread) -----------------------------------------------------

    def _reason(self, call) -> str:
        """Why a call is being built when the caller did not say (no RNG draw: any thread)."""
        ctx = call.trace
        if ctx is not None and ctx.sampled:
            return HEAD
        return self._kept_unsampled(call) or HEAD

    def _build_item(self, item) -> list[ReadableSpan]:
        call, service, listener, reason = item
        return self.build_spans(call, service, listener, reason)

    def _encode_item(self, item) -> list[bytes]:
        call, service, listener, reason = item
        return [self.encode_call(call, service, listener, reason)]

    def _export_encoded(self, chunks: list[bytes]):
        return self.exporter.export_request(self.otlp.request(chunks))

    def build_spans(self, call, service: str, listener: str | None = None,
                    reason: str | None = None) -> list[ReadableSpan]:
        """The finished spans of one finished call: SERVER first, then its descendants."""
        trace_id, tracestate, parent_sampled, plan = self.plan(call, service, listener, reason)
        state = TraceState.from_header([tracestate]) if tracestate else None
        resource, scope = self.resource, self.scope
        contexts: dict[int, SpanContext] = {}
        out = []
        for name, span_id, parent_id, remote, kind, t0, t1, attrs, error in plan:
            ctx = contexts[span_id] = SpanContext(trace_id, span_id, False, _SAMPLED, state)
            if not parent_id:
                parent = None
            elif remote:
                parent = SpanContext(trace_id, parent_id, True, _SAMPLED if parent_sampled else _UNSAMPLED, state)
            else:
                parent = contexts[parent_id]
            status = _UNSET if error is None else Status(StatusCode.ERROR, error)
            # positional: (name, context, parent, resource, attributes, events, links, kind,
            # instrumentation_info, status, start_time, end_time, instrumentation_scope)
            out.append(ReadableSpan(name, ctx, parent, resource, attrs, (), (), _SPAN_KIND[kind], None, status,
                                    t0, t1, scope))
        return out

    def encode_call(self, call, service: str, listener: str | None = None, reason: str | None = None) -> bytes:
        """The same spans as `build_spans`, as OTLP protobuf `ScopeSpans.spans` fields (`proxy.otlp`).

        The OTLP exporter's path: no ReadableSpan, no SDK encoder (~8x cheaper per call).
        """
        trace_id, tracestate, _, plan = self.plan(call, service, listener, reason)
        # the trace state as the SDK's encoder writes it: parsed (invalid entries dropped), re-joined
        state = ",".join(f"{k}={v}" for k, v in TraceState.from_header([tracestate]).items()) if tracestate else None
        return self.otlp.spans(otlp.trace_prefix(trace_id, state), plan)

    def plan(self, call, service: str, listener: str | None = None, reason: str | None = None):
        """What the spans of one finished call are, as plain tuples (the one place that decides).

        Returns `(trace_id, tracestate header or None, parent_sampled, spans)`; each span is
        `(name, span_id, parent_id, remote_parent, otlp kind, start, end, attributes, error)`
        with epoch-ns times, `parent_id` 0 for a root and `error` None for status UNSET, else
        the ERROR status message. SERVER first, then its descendants (parents before children).
        """
        rand = self._ids.getrandbits  # new_id(self._ids), inlined: ~9 ids per call
        off = self.offset_ns
        ctx = call.trace
        if ctx is None:
            trace_id, server_id, parent_id, tracestate, new_trace = rand(128) or 1, rand(64) or 1, 0, None, True
            parent_sampled = False
        else:
            trace_id, server_id, parent_id, new_trace = ctx.trace_id, ctx.span_id, ctx.parent_span_id, ctx.new_trace
            tracestate = ctx.tracestate or None
            parent_sampled = bool(ctx.parent_sampled)

        msg = call.msg
        if msg is not None:
            method = msg.method
            svc = msg.service or service
            if len(method) > MAX_NAME or len(svc) > MAX_NAME:
                method, svc = cut(method, MAX_NAME), cut(svc, MAX_NAME)
        else:
            method, svc = INVALID, service
        name = spans.call_span_name(svc, method)
        outcome = call_outcome(call)
        error_type = failure_type(call, outcome)

        t_start = call.t_start
        t_end = call_end(call)

        # SERVER attributes
        attempts = list(call.attempts)
        a = {spans.RPC_SYSTEM: spans.RPC_SYSTEM_VALUE, spans.RPC_SERVICE: svc, spans.RPC_METHOD: method,
             spans.OUTCOME: outcome, spans.ATTEMPTS: len(attempts),
             spans.SAMPLED_BY: reason or self._reason(call), spans.NEW_TRACE: new_trace}
        if listener:
            a[spans.LISTENER] = listener
        peer = getattr(call.conn, "peer", None)
        if isinstance(peer, tuple) and len(peer) >= 2:
            a[spans.PEER_ADDRESS] = str(peer[0])
            a[spans.PEER_PORT] = int(peer[1])
        if msg is not None:
            a[spans.SEQID] = msg.seqid
            if call.request_size:  # (0: a refused request, only its head read)
                a[spans.REQUEST_SIZE] = call.request_size
        reply = call.reply
        reply_size = call.reply_size or (len(reply) if reply is not None else 0)
        if reply_size:
            a[spans.REPLY_SIZE] = reply_size
        if call.oneway:
            a[spans.ONEWAY] = True
        if call.streamed:
            a[spans.STREAMED] = True
            # (less the turns its reply was held for: `queued`, not the stream's pauses)
            a[spans.CLIENT_PAUSED_MS] = _ms(call.client_paused_ns - call.held_ns)
            a[spans.UPSTREAM_WAIT_MS] = _ms(call.upstream_wait_ns)
        if call.upload is not None:
            a[spans.REQUEST_STREAMED] = True
            a[spans.UPLOAD_HELD_MS] = _ms(call.upload.held_ns)
        if call.loop_lag_ns:
            a[spans.LOOP_LAG_MS] = _ms(call.loop_lag_ns)
        error = None
        if error_type is not None:
            a[spans.ERROR_TYPE] = error_type
            text = cut(call.error, MAX_ERROR) if call.error is not None else None
            if text is not None:
                a[spans.ERROR_MESSAGE] = text
            error = text or (_NEVER_READ_TEXT if error_type == spans.ERROR_CLIENT_NEVER_READ else outcome)
        out = [(name, server_id, parent_id, parent_id != 0, SERVER, t_start + off, t_end + off, a, error)]

        # children of SERVER
        t_framed = call.t_framed
        if t_framed >= t_start and t_framed:
            out.append((spans.READ_REQUEST, (rand(64) or 1), server_id, False, INTERNAL, t_start + off, t_framed + off,
                        None, None))
            t_admitted = call.t_admitted
            if t_admitted > t_framed:  # held back at max_inflight: behind the client's earlier calls
                out.append((spans.QUEUED, (rand(64) or 1), server_id, False, INTERNAL, t_framed + off,
                            t_admitted + off, None, None))
        for i, att in enumerate(attempts):
            self._attempt_plan(out, att, i, attempts, call, svc, method, name, server_id, rand, off)
        for b0, b1 in list(call.backoffs):
            if b0 and b1 >= b0:
                out.append((spans.BACKOFF, (rand(64) or 1), server_id, False, INTERNAL, b0 + off, b1 + off, None, None))
        t_done, t_write = call.t_done, call.t_write
        if t_done and t_write > t_done and call.waited:
            out.append((spans.QUEUED, (rand(64) or 1), server_id, False, INTERNAL, t_done + off, t_write + off,
                        None, None))
        t_acked, t_handed = call.t_acked, call.t_handed
        w0 = t_write or t_done  # (as the histogram: proxy.metrics.pure_record_hops)
        w1 = t_acked or t_handed
        if w0 and w1 >= w0:
            wa = {}
            if t_handed:
                wa[spans.HANDED_MS] = _ms(t_handed - w0)
            if call.never_read:
                wa[spans.CLIENT_NEVER_READ] = True
            out.append((spans.WRITE_RESPONSE, (rand(64) or 1), server_id, False, INTERNAL, w0 + off, w1 + off, wa, None))
        return trace_id, tracestate, parent_sampled, out

    @staticmethod
    def _attempt_plan(out, att, i, attempts, call, svc, method, name, server_id, rand, off) -> None:
        t0 = att.t_acquire
        if not t0:
            return
        t_acquired, t_written, t_first, t_reply = att.t_acquired, att.t_written, att.t_first_reply, att.t_reply
        t1 = t_reply or t_written or t_acquired
        if not t1:
            t1 = call.t_done or t0  # abandoned while waiting for a connection
        # an attempt's outcome: its own, else what the next attempt says it retried after
        outcome = att.outcome
        if outcome is None:
            if i + 1 < len(attempts):
                outcome = attempts[i + 1].retry_reason
            else:
                outcome = call_outcome(call)
        a = {spans.RPC_SYSTEM: spans.RPC_SYSTEM_VALUE, spans.RPC_SERVICE: svc, spans.RPC_METHOD: method,
             spans.ATTEMPT: att.number}
        ep = att.endpoint
        if ep is not None:
            a[spans.SERVER_ADDRESS] = ep.host
            a[spans.SERVER_PORT] = ep.port
            a[spans.ENDPOINT] = ep.label
        if outcome is not None:
            a[spans.OUTCOME] = outcome
        if att.retry_reason is not None:
            a[spans.RETRY_REASON] = att.retry_reason
        if att.breaker_state is not None:
            a[spans.BREAKER_STATE] = att.breaker_state
        if t_written and call.msg is not None:
            a[spans.REQUEST_SIZE] = att.request_size or call.request_size  # (what went upstream)
        if att.reply_size:
            a[spans.REPLY_SIZE] = att.reply_size
        error = None
        if outcome is not None and outcome not in _OK_ATTEMPT:
            a[spans.ERROR_TYPE] = outcome
            text = cut(att.error, MAX_ERROR) if att.error is not None else None
            if text is not None:
                a[spans.ERROR_MESSAGE] = text
            error = text or outcome
        client_id = att.span_id or (rand(64) or 1)
        out.append((name, client_id, server_id, False, CLIENT, t0 + off, t1 + off, a, error))
        if not t_acquired:  # never got a connection: it waited (or connected) until the attempt ended
            a1 = t_reply or call.t_done
            if a1 >= t0:
                out.append((spans.ACQUIRE, (rand(64) or 1), client_id, False, INTERNAL, t0 + off, a1 + off,
                            None, None))
        elif t_acquired >= t0:
            out.append((spans.ACQUIRE, (rand(64) or 1), client_id, False, INTERNAL, t0 + off, t_acquired + off,
                        None, None))
            if t_written >= t_acquired:
                out.append((spans.WRITE_UPSTREAM, (rand(64) or 1), client_id, False, INTERNAL, t_acquired + off,
                            t_written + off, None, None))
                s1 = t_first or t_reply
                if s1 >= t_written:
                    out.append((spans.SERVICE_TIME, (rand(64) or 1), client_id, False, INTERNAL, t_written + off,
                                s1 + off, None, None))
                    if t_first and t_reply >= t_first:
                        held = att.queued_ns
                        if held:  # a large reply held unread for its turn: that wait is queued
                            out.append((spans.QUEUED, (rand(64) or 1), server_id, False, INTERNAL, t_first + off,
                                        t_first + held + off, None, None))
                            t_first += held
                        out.append((spans.READ_RESPONSE, (rand(64) or 1), client_id, False, INTERNAL, t_first + off,
                                    t_reply + off, None, None))
