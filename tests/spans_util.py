"""Helpers for live tracing tests: a proxy whose spans land in memory, spans grouped per call.

    with Traced(text) as t:                 # text: a full config (tracing section optional)
        ... real clients against t.port() ...
        calls = t.wait_calls(5)             # the SERVER spans of 5 finished calls, with their trees
        calls[0].hop_ms("service_time")

Spans are grouped per call by walking parent links up to their SERVER span (a call's trace id
may be shared with others when clients send one traceparent).
"""

from __future__ import annotations

import statistics
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from harness import Proxy
from proxy import config as cfgmod
from proxy import spans
from proxy.telemetry import Telemetry


def ms(span) -> float:
    return (span.end_time - span.start_time) / 1e6


class CallSpans:
    """One call: its SERVER span, its CLIENT spans (by attempt), hop spans by name."""

    def __init__(self, server, members: list) -> None:
        self.server = server
        self.spans = members
        self.by_id = {s.context.span_id: s for s in members}
        self.clients = sorted((s for s in members if s.kind is SpanKind.CLIENT),
                              key=lambda s: s.attributes.get(spans.ATTEMPT, 0))
        self.hops: dict[str, list] = {}
        for s in members:
            if s.kind is SpanKind.INTERNAL:
                self.hops.setdefault(s.name, []).append(s)

    @property
    def attrs(self):
        return self.server.attributes

    @property
    def total_ms(self) -> float:
        return ms(self.server)

    def hop_ms(self, name: str) -> float:
        """Total duration of a hop (summed over attempts); 0 when it has no span."""
        return sum(ms(s) for s in self.hops.get(name, ()))

    def hop(self, name: str):
        found = self.hops.get(name, [])
        assert len(found) == 1, f"{name}: {len(found)} spans"
        return found[0]

    def children(self, span) -> list:
        sid = span.context.span_id
        return [s for s in self.spans if s.parent is not None and s.parent.span_id == sid]

    def coverage(self) -> float:
        """Share of the SERVER span covered by the union of its children's intervals."""
        t0, t1 = self.server.start_time, self.server.end_time
        iv = sorted((max(s.start_time, t0), min(s.end_time, t1)) for s in self.children(self.server))
        covered = 0
        cur_a = cur_b = None
        for a, b in iv:
            if b <= a:
                continue
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    covered += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        if cur_b is not None:
            covered += cur_b - cur_a
        return covered / max(t1 - t0, 1)

    def dominant(self) -> str:
        """The hop with the largest total duration."""
        return max(self.hops, key=self.hop_ms)

    def __repr__(self) -> str:
        hops = ", ".join(f"{n}={self.hop_ms(n):.2f}" for n in spans.HOPS if n in self.hops)
        return f"<{self.server.name} seq={self.attrs.get(spans.SEQID)} total={self.total_ms:.2f}ms {hops}>"


def group(all_spans) -> list[CallSpans]:
    """SERVER spans with their descendants, in SERVER start order."""
    by_id = {s.context.span_id: s for s in all_spans}
    members: dict[int, list] = {}
    for s in all_spans:
        top = s
        seen = 0
        while top.kind is not SpanKind.SERVER and top.parent is not None and seen < 10:
            nxt = by_id.get(top.parent.span_id)
            if nxt is None:
                break
            top = nxt
            seen += 1
        if top.kind is SpanKind.SERVER:
            members.setdefault(top.context.span_id, []).append(s)
    out = [CallSpans(by_id[sid], m) for sid, m in members.items()]
    out.sort(key=lambda c: c.server.start_time)
    return out


def with_tracing(text: str, ratio: float) -> str:
    return f"tracing: {{exporter: none, service_name: sidecar-live, sample_ratio: {ratio}}}\n" + text


class Traced:
    """An in-process proxy whose Telemetry exports to memory (the config's tracing settings)."""

    def __init__(self, text: str, ratio: float = 1.0, **server_kwargs) -> None:
        if "tracing:" not in text:
            text = with_tracing(text, ratio)
        cfg = cfgmod.loads(text, "test.yaml")
        self.memory = InMemorySpanExporter()
        self.telemetry = Telemetry(cfg.tracing, exporter=self.memory, interval=0.01)
        try:
            self.proxy = Proxy(text, telemetry=self.telemetry, **server_kwargs)
        except BaseException:
            self.telemetry.shutdown(2.0)
            raise

    def port(self, listener: str = "test") -> int:
        return self.proxy.port(listener)

    @property
    def loop(self):
        return self.proxy.loop

    def spans(self) -> list:
        self.telemetry.flush(5.0)
        return list(self.memory.get_finished_spans())

    def calls(self) -> list[CallSpans]:
        return group(self.spans())

    def wait_calls(self, n: int, timeout: float = 10.0, method: str | None = None) -> list[CallSpans]:
        """Wait until at least `n` calls (of `method`, if given) were exported; return them."""
        deadline = time.monotonic() + timeout
        while True:
            calls = self.calls()
            if method is not None:
                calls = [c for c in calls if c.attrs.get(spans.RPC_METHOD) == method]
            if len(calls) >= n or time.monotonic() > deadline:
                return calls
            time.sleep(0.02)

    def clear(self) -> None:
        self.telemetry.flush(5.0)
        self.memory.clear()

    def close(self) -> None:
        try:
            self.proxy.stop()
        finally:
            self.telemetry.shutdown(5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def median(values) -> float:
    return statistics.median(list(values))
