"""What happens when a call is over: metrics, spans, access log — one place, called once per call.

`CallRecorder` is the pipeline's `on_complete`: it ends a never-read reply's
wait (`t_acked`, if the listener did not), looks up the loop lag seen during
the call, feeds the per-(method, hop) histograms (every call), hands the call
to telemetry (which keeps it only if head-sampled, slow or failed; a client
that never read its reply counts as failed), and writes the optional
access-log line. Also the pipeline's
`on_begin`/`on_send` hooks for trace context on THeader traffic.
"""

from __future__ import annotations

import logging
from time import monotonic_ns

from proxy import spans
from proxy.logs import MAX_ERROR, MAX_NAME, cut
from proxy.looplag import LoopLagMonitor
from proxy.metrics import ServiceMetrics, call_end, call_outcome, failure_type, hop_totals
from proxy.tracecontext import TRACE_HEADERS

access_log = logging.getLogger("proxy.access")
_HOP_FIELDS = [f"{hop}_ms" for hop in spans.HOPS]  # read_request_ms, ..., backoff_ms, queued_ms, ...


def _ms(a: int, b: int) -> float | None:
    return round((b - a) / 1e6, 3) if a and b else None


class CallRecorder:
    def __init__(self, service: str, listener: str, metrics: ServiceMetrics, telemetry, lag: LoopLagMonitor,
                 access: bool = False) -> None:
        self.service = service
        self.listener = listener
        self.metrics = metrics
        self.telemetry = telemetry
        self.lag = lag
        self.access = access

    def __call__(self, call) -> None:
        if call.never_read and call.t_write and not call.t_acked:
            # The listener gave up waiting for a client that never read its written reply (the
            # ack cap): the reply sat unsent until now, which is when write_response and the call
            # end (else they would end when the kernel took the bytes, and the call look fast).
            call.t_acked = monotonic_ns()
        ended = call_end(call)
        end = ended or monotonic_ns()
        call.loop_lag_ns = self.lag.lag_for(call.t_start, end)
        if call.reply_size == 0 and call.reply is not None:
            call.reply_size = len(call.reply)
        call.reply = None  # sizes are recorded; the bytes are not needed any more
        self.metrics.record(call, ended)
        if self.telemetry is not None:
            self.telemetry.finished(call, self.service, self.listener, ended)
        if self.access and access_log.isEnabledFor(logging.INFO):
            self._log(call, end)

    def _log(self, call, end: int) -> None:
        msg = call.msg
        a = call.attempts[-1] if call.attempts else None
        hops = hop_totals(call)  # summed over attempts, as /metrics takes them (spans: one each)
        outcome = call_outcome(call)
        fields = {
            "listener": self.listener, "service": self.service,
            "method": cut(msg.method, MAX_NAME) if msg is not None else None,
            "seqid": msg.seqid if msg is not None else None,
            "outcome": outcome, "error_type": failure_type(call, outcome), "attempts": len(call.attempts),
            "endpoint": a.endpoint.label if a is not None else None,
            "client": f"{call.conn.peer[0]}:{call.conn.peer[1]}" if call.conn.peer else None,
            "request_bytes": call.request_size, "reply_bytes": call.reply_size,
            "total_ms": _ms(call.t_start, end),
            **{key: None if d is None else round(d / 1e6, 3) for key, d in zip(_HOP_FIELDS, hops)},
            "loop_lag_ms": round(call.loop_lag_ns / 1e6, 3),
            "error": cut(call.error, MAX_ERROR) if call.error is not None else None,
        }
        access_log.info("%s %s %s", self.service, fields["method"], fields["outcome"], extra={"fields": fields})


class TraceHooks:
    """Trace context for THeader traffic: join the client's trace; inject ours upstream."""

    def __init__(self, telemetry) -> None:
        self.telemetry = telemetry

    def begin(self, call, headers: dict | None = None) -> None:
        self.telemetry.begin(call, headers)

    def send(self, attempt, headers: dict) -> None:
        """Ours replace the client's trace headers, whatever their case (a client's traceparent,
        tracestate and B3 were read, kept or dropped, by `telemetry.begin`; sending them on beside
        ours would give the upstream two conflicting parents)."""
        for key in [k for k in headers if k.lower() in TRACE_HEADERS]:
            del headers[key]
        headers.update(self.telemetry.upstream_headers(attempt))
