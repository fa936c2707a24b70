"""`thrift-sidecar hops`: which hop of the proxied calls is slow, read from their spans.

Owns: reading spans (the JSON-lines span file, or Jaeger's query API), rebuilding each call from
its SERVER span and descendants, the per-group hop table, the worst calls and the verdict.
Leaves to others: span names and attribute keys (`proxy.spans`), the HTML waterfall
(`proxy.hops_html`), argument parsing (`proxy.cli`).

    thrift-sidecar hops --spans spans.jsonl
    thrift-sidecar hops --jaeger http://127.0.0.1:16686 --service thrift-sidecar --by endpoint
    thrift-sidecar hops --spans spans.jsonl --method get_users --worst 10 --html hops.html

The rules, in one place (the README repeats them):

* A call is one SERVER span (`{service}/{method}`) with its descendants. Its **total** is the
  SERVER span's duration. A hop's time in a call is the sum of that call's spans of that name
  (every attempt's `acquire`, `service_time`, ...; every `backoff`).
* **Streamed replies**: `read_response` and `write_response` run at the same time, so their
  overlap is counted once. It goes to `write_response` when the client held the stream back
  longer than the stream waited for the upstream (`client_paused_ms > upstream_wait_ms`: a slow
  reader), else to `read_response` (the upstream sent it slowly, or neither side stalled and the
  size is the cost). The other hop keeps only its non-overlapping part. The same is done for any
  call whose two spans overlap, streamed or not.
* **Streamed requests**: `read_request` runs while the attempt's `acquire` and `write_upstream`
  do. Their overlap is counted once: in `read_request` (the client sent it slowly) unless the
  proxy held the client back for at least half of it (`sidecar.upload_held_ms`: the upstream was
  not taking bytes, or there was no connection yet), then in `acquire`/`write_upstream`.
* **Table**: per group (`--by method`: the SERVER span's name; `--by endpoint`: the endpoint of
  the call's longest CLIENT attempt, i.e. where it spent its upstream time, so a retried call
  counts under the upstream that was slow; `--by client`: the SERVER span's
  `network.peer.address:port`). p50/p99 are nearest-rank percentiles over the calls that have
  the hop, of the hop's time as the trace viewer shows it; **share** is the hop's accounted time
  (overlap counted once) summed over the group's calls / the group's summed totals. `(between
  hops)` is what no hop covers: the proxy's own work. `loop lag` is the largest event-loop lag
  seen during each call (`sidecar.loop_lag_ms`); it overlaps the hops it stretched, so it is not
  part of the 100%.
* **Worst calls**: the N largest totals over all groups, each with its dominant hop (largest
  accounted time).
* **Verdict** (the last line): if the worst N calls' loop lag (each call's capped at its total)
  is at least half of their summed totals, the proxy's own event loop is named. Otherwise the
  (group, hop) pair with the largest absolute accounted time over all calls is named, with its
  share of that group: `verdict: write_response is 62% of TestService/get_users: the client is
  slow to read its reply`.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from proxy import spans
from proxy.logs import escape_controls

__all__ = ["Span", "Attempt", "Call", "Group", "HopRow", "Report", "HopsError", "MEANINGS",
           "LOOP_LAG", "BETWEEN", "load_jsonl", "load_jaeger", "parse_otlp_request", "parse_jaeger",
           "rebuild_calls", "analyse", "render_text", "percentile", "run"]

LOOP_LAG = "loop lag"
BETWEEN = "(between hops)"
LOOP_LAG_VERDICT_SHARE = 0.5   # loop lag ≥ half the worst calls' time: the loop is the story

MEANINGS = {
    spans.READ_REQUEST: "the client is slow to send its request",
    spans.ACQUIRE: "the pool is exhausted or connects are slow",
    spans.WRITE_UPSTREAM: "the upstream is slow to take the request bytes",
    spans.SERVICE_TIME: "the upstream itself is slow",
    spans.READ_RESPONSE: "the reply is large or the upstream sends it slowly",
    spans.BACKOFF: "retries are adding delay",
    spans.QUEUED: "pipelined calls wait behind a slow earlier call",
    spans.WRITE_RESPONSE: "the client is slow to read its reply",
    BETWEEN: "the proxy's own work between hops is slow (CPU or blocking code)",
    LOOP_LAG: "the proxy's own event loop is stalled",
}

_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_HOP_NAMES = frozenset(spans.HOPS)


class HopsError(Exception):
    """Input that cannot be read (missing file, bad JSON, Jaeger unreachable)."""


# --------------------------------------------------------------------------------------------
# The model


@dataclass(slots=True)
class Span:
    trace_id: str    # lowercase hex, 32 digits
    span_id: str     # lowercase hex, 16 digits
    parent_id: str   # "" for a root
    name: str
    kind: str        # server | client | internal | ...
    start: int       # epoch ns
    end: int
    attrs: dict
    scope: str = ""  # the instrumentation scope's name, when the source says it

    @property
    def duration(self) -> int:
        return max(0, self.end - self.start)


@dataclass(slots=True)
class Attempt:
    span: Span
    hops: list[Span]

    @property
    def endpoint(self) -> str:
        a = self.span.attrs
        ep = a.get(spans.ENDPOINT)
        if ep:
            return str(ep)
        host, port = a.get(spans.SERVER_ADDRESS), a.get(spans.SERVER_PORT)
        if host is None:
            return "(unknown endpoint)"
        return _hostport(host, port)

    @property
    def number(self) -> int:
        return int(self.span.attrs.get(spans.ATTEMPT, 0) or 0)


@dataclass(slots=True)
class Call:
    server: Span
    hops: list[Span]                 # the SERVER span's own hop children
    attempts: list[Attempt]
    raw: dict = field(default_factory=dict)       # hop → ns, as the spans say
    accounted: dict = field(default_factory=dict)  # hop → ns, overlap counted once
    overlap: int = 0                 # ns of read_response/write_response overlap
    overlap_to: str | None = None    # the hop the overlap was counted in

    @property
    def total(self) -> int:
        return self.server.duration

    @property
    def trace_id(self) -> str:
        return self.server.trace_id

    @property
    def name(self) -> str:
        return self.server.name

    @property
    def loop_lag(self) -> int:
        return _ms_to_ns(self.server.attrs.get(spans.LOOP_LAG_MS))

    @property
    def streamed(self) -> bool:
        return bool(self.server.attrs.get(spans.STREAMED))

    @property
    def between(self) -> int:
        return max(0, self.total - sum(self.accounted.values()))

    @property
    def endpoint(self) -> str:
        """Where the call spent its upstream time: the endpoint of its longest attempt."""
        if not self.attempts:
            return "(no attempt)"
        longest = max(self.attempts, key=lambda a: (a.span.duration, a.number))
        return longest.endpoint

    @property
    def client(self) -> str:
        a = self.server.attrs
        host = a.get(spans.PEER_ADDRESS)
        if host is None:
            return "(unknown client)"
        return _hostport(host, a.get(spans.PEER_PORT))

    def all_spans(self) -> list[Span]:
        out = [self.server, *self.hops]
        for att in self.attempts:
            out.append(att.span)
            out.extend(att.hops)
        return out

    def dominant(self) -> tuple[str, int]:
        """The hop with the largest accounted time (or `(between hops)`), and that time."""
        best, best_ns = BETWEEN, self.between
        for hop in spans.HOPS:
            ns = self.accounted.get(hop, 0)
            if ns > best_ns:
                best, best_ns = hop, ns
        return best, best_ns


def _hostport(host, port) -> str:
    host = str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host if port in (None, "") else f"{host}:{port}"


def _ms_to_ns(v) -> int:
    try:
        return max(0, int(round(float(v) * 1e6)))
    except (TypeError, ValueError):
        return 0


# --------------------------------------------------------------------------------------------
# Reading spans: the OTLP/JSON span file


def _hex_id(v, digits: int) -> str:
    """OTLP/JSON ids are hex; protobuf's generic JSON mapping writes base64: accept both."""
    if not v:
        return ""
    s = str(v)
    if len(s) == digits:
        try:
            int(s, 16)
            return s.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(s, validate=True)
        if len(raw) * 2 == digits:
            return raw.hex()
    except (binascii.Error, ValueError):
        pass
    return s.lower().zfill(digits)


def _otlp_value(v: dict):
    if not isinstance(v, dict):
        return v
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return [_otlp_value(x) for x in (v["arrayValue"] or {}).get("values", ())]
    if "kvlistValue" in v:
        return {kv["key"]: _otlp_value(kv.get("value")) for kv in (v["kvlistValue"] or {}).get("values", ())}
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _otlp_kind(k) -> str:
    if isinstance(k, str):
        if k.isdigit():
            k = int(k)
        else:
            return k.removeprefix("SPAN_KIND_").lower()
    return _KINDS.get(k, "unspecified")


def parse_otlp_request(obj: dict) -> list[Span]:
    """The spans of one OTLP/JSON ExportTraceServiceRequest."""
    out = []
    for rs in obj.get("resourceSpans") or ():
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ():
            scope = (ss.get("scope") or ss.get("instrumentationLibrary") or {}).get("name") or ""
            for s in ss.get("spans") or ():
                # (protojson leaves an empty key out)
                attrs = {kv.get("key", ""): _otlp_value(kv.get("value")) for kv in s.get("attributes") or ()}
                out.append(Span(
                    trace_id=_hex_id(s.get("traceId"), 32),
                    span_id=_hex_id(s.get("spanId"), 16),
                    parent_id=_hex_id(s.get("parentSpanId"), 16),
                    name=str(s.get("name") or ""),
                    kind=_otlp_kind(s.get("kind", 0)),
                    start=int(s.get("startTimeUnixNano") or 0),
                    end=int(s.get("endTimeUnixNano") or 0),
                    attrs=attrs,
                    scope=str(scope),
                ))
    return out


def load_jsonl(path: str, bad: list[str] | None = None) -> list[Span]:
    """Every span of a span file (one ExportTraceServiceRequest per line).

    A line that is not a request (one cut short by a crash, say) is skipped and said in `bad`
    (`FILE:LINE: why`); with `bad` None it is an error. A file with no good line is an error.
    """
    out: list[Span] = []
    skipped: list[str] = []
    good = 0
    try:
        f = open(path, encoding="utf-8-sig", errors="replace")  # noqa: SIM115 - closed below
    except OSError as e:
        raise HopsError(f"{path}: {e.strerror}") from e
    with f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                why = f"{path}:{n}: not JSON: {e.msg}"
            else:
                if isinstance(obj, dict) and "resourceSpans" not in obj:
                    why = f"{path}:{n}: not an ExportTraceServiceRequest: no resourceSpans"
                    if "context" in obj and "name" in obj:  # (`exporter: console`'s span objects)
                        why += (" (a span object, as exporter console prints them: hops reads the "
                                "file exporter jsonl writes)")
                elif isinstance(obj, dict):
                    try:
                        out.extend(parse_otlp_request(obj))
                        good += 1
                        continue
                    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a field of another shape
                        why = f"{path}:{n}: not an ExportTraceServiceRequest: {type(e).__name__}: {e}"
                else:
                    why = f"{path}:{n}: not an ExportTraceServiceRequest object"
            if bad is None:
                raise HopsError(why)
            skipped.append(why)
    if skipped and not good:
        raise HopsError(skipped[0])
    if bad is not None:
        bad.extend(skipped)
    return out


# --------------------------------------------------------------------------------------------
# Reading spans: Jaeger's query API


def parse_jaeger(payload: dict, service: str | None = None) -> list[Span]:
    """Spans of Jaeger's `/api/traces` answer (`data[].spans[]`), only those of `service`.

    Times are µs there; ids are hex (Jaeger may drop leading zeros of the trace id).
    """
    out = []
    seen = set()
    for trace in payload.get("data") or ():
        processes = trace.get("processes") or {}
        for s in trace.get("spans") or ():
            proc = processes.get(s.get("processID")) or s.get("process") or {}
            if service is not None and proc.get("serviceName") != service:
                continue
            trace_id = _hex_id(s.get("traceID"), 32)
            span_id = _hex_id(s.get("spanID"), 16)
            if (trace_id, span_id) in seen:
                continue
            seen.add((trace_id, span_id))
            parent = ""
            for ref in s.get("references") or ():
                if _hex_id(ref.get("traceID"), 32) == trace_id:
                    parent = _hex_id(ref.get("spanID"), 16)
                    if ref.get("refType", "CHILD_OF") == "CHILD_OF":
                        break
            if not parent and s.get("parentSpanID"):
                parent = _hex_id(s["parentSpanID"], 16)
            attrs = {t["key"]: t.get("value") for t in s.get("tags") or ()}
            kind = str(attrs.pop("span.kind", "internal") or "internal").lower()
            start = int(s.get("startTime") or 0) * 1000
            out.append(Span(trace_id, span_id, parent, s.get("operationName", ""), kind, start,
                            start + int(s.get("duration") or 0) * 1000, attrs))
    return out


def load_jaeger(url: str, service: str, limit: int = 1000, lookback: float = 3600.0,
                timeout: float = 15.0) -> list[Span]:
    """GET {url}/api/traces?service=NAME&limit=...&start=...&end=... (the last `lookback` s)."""
    end = int(time.time() * 1e6)
    start = end - int(lookback * 1e6)
    query = urllib.parse.urlencode({"service": service, "limit": limit, "start": start, "end": end,
                                    "lookback": f"{int(lookback)}s"})
    if not url.lower().startswith(("http://", "https://")):
        raise HopsError(f"--jaeger {url}: must be an http:// or https:// URL, e.g. http://127.0.0.1:16686")
    full = f"{url.rstrip('/')}/api/traces?{query}"
    payload = _get_json(full, timeout)
    try:
        return parse_jaeger(payload, service)
    except (AttributeError, TypeError, KeyError, ValueError) as e:  # any other JSON answer
        raise HopsError(f"{full}: not a Jaeger /api/traces answer ({type(e).__name__}: {e})") from e


def _get_json(full: str, timeout: float):
    """GET `full` and parse its JSON answer; HopsError says what went wrong, in one line."""
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        body = e.read(300).decode("utf-8", "replace")
        raise HopsError(f"{full}: HTTP {e.code}: {body}") from e
    except (urllib.error.URLError, OSError) as e:
        raise HopsError(f"{full}: {getattr(e, 'reason', e)}") from e
    except json.JSONDecodeError as e:
        raise HopsError(f"{full}: not JSON: {e.msg}") from e
    except ValueError as e:  # (a URL urllib cannot use, e.g. no host)
        raise HopsError(f"{full}: {e}") from e


def jaeger_services(url: str, timeout: float = 5.0) -> list[str] | None:
    """The services Jaeger has traces of (GET {url}/api/services), or None when it cannot say."""
    try:
        data = _get_json(f"{url.rstrip('/')}/api/services", timeout).get("data")
    except (HopsError, AttributeError):
        return None
    return [str(x) for x in data] if isinstance(data, list) else None


# --------------------------------------------------------------------------------------------
# Rebuilding calls


def _overlap(a: list[Span], b: list[Span]) -> int:
    ns = 0
    for x in a:
        for y in b:
            ns += max(0, min(x.end, y.end) - max(x.start, y.start))
    return ns


def _account(call: Call) -> None:
    raw: dict[str, int] = defaultdict(int)
    by_name: dict[str, list[Span]] = defaultdict(list)
    for s in call.hops:
        raw[s.name] += s.duration
        by_name[s.name].append(s)
    for att in call.attempts:
        for s in att.hops:
            raw[s.name] += s.duration
            by_name[s.name].append(s)
    acc = dict(raw)
    overlap = _overlap(by_name[spans.READ_RESPONSE], by_name[spans.WRITE_RESPONSE])
    if overlap:
        a = call.server.attrs
        paused, waited = _ms_to_ns(a.get(spans.CLIENT_PAUSED_MS)), _ms_to_ns(a.get(spans.UPSTREAM_WAIT_MS))
        to, other = ((spans.WRITE_RESPONSE, spans.READ_RESPONSE) if paused > waited
                     else (spans.READ_RESPONSE, spans.WRITE_RESPONSE))
        acc[other] = max(0, acc[other] - overlap)
        call.overlap, call.overlap_to = overlap, to
    request = by_name[spans.READ_REQUEST]
    if request and call.attempts:
        ov_acquire = _overlap(request, by_name[spans.ACQUIRE])
        ov_write = _overlap(request, by_name[spans.WRITE_UPSTREAM])
        if ov_acquire or ov_write:
            if 2 * _ms_to_ns(call.server.attrs.get(spans.UPLOAD_HELD_MS)) >= ov_acquire + ov_write:
                acc[spans.READ_REQUEST] = max(0, acc[spans.READ_REQUEST] - ov_acquire - ov_write)
            else:
                for hop, ov in ((spans.ACQUIRE, ov_acquire), (spans.WRITE_UPSTREAM, ov_write)):
                    if ov:
                        acc[hop] = max(0, acc[hop] - ov)
    call.raw, call.accounted = dict(raw), acc


def is_ours(s: Span) -> bool:
    """A span the sidecar wrote, as far as the source says (a file from a collector may hold an
    instrumented upstream's spans too, children of our CLIENT spans)."""
    return not s.scope or s.scope == spans.INSTRUMENTATION_SCOPE


def rebuild_calls(all_spans: list[Span]) -> list[Call]:
    """One Call per SERVER span of ours, with its hops and its CLIENT attempts' hops; by start
    time. Other services' SERVER spans are no call of the sidecar's (`is_ours`)."""
    children: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for s in all_spans:
        if s.parent_id:
            children[(s.trace_id, s.parent_id)].append(s)
    calls = []
    for s in all_spans:
        if s.kind != "server" or not is_ours(s):
            continue
        hops, attempts = [], []
        for c in sorted(children.get((s.trace_id, s.span_id), ()), key=lambda x: x.start):
            if c.kind == "client":
                ahops = [h for h in sorted(children.get((c.trace_id, c.span_id), ()), key=lambda x: x.start)
                         if h.name in _HOP_NAMES]
                attempts.append(Attempt(c, ahops))
            elif c.name in _HOP_NAMES:
                hops.append(c)
        call = Call(s, hops, attempts)
        _account(call)
        calls.append(call)
    calls.sort(key=lambda c: (c.server.start, c.trace_id))
    return calls


# --------------------------------------------------------------------------------------------
# Analysis


def percentile(values, p: float):
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    s = sorted(values)
    if not s:
        return None
    k = max(1, math.ceil(p / 100.0 * len(s)))
    return s[k - 1]


@dataclass(slots=True)
class HopRow:
    name: str
    calls: int          # calls that have this hop
    p50: int            # ns
    p99: int
    time: int           # accounted ns over the group's calls
    share: float        # time / the group's summed totals


@dataclass(slots=True)
class Group:
    key: str
    label: str          # how the verdict names it
    calls: list[Call]
    total_time: int
    rows: list[HopRow]  # total, the hops present, (between hops), loop lag (if any)

    def row(self, name: str) -> HopRow | None:
        for r in self.rows:
            if r.name == name:
                return r
        return None


@dataclass(slots=True)
class Report:
    by: str
    calls: list[Call]
    groups: list[Group]
    worst: list[Call]
    verdict: str
    verdict_hop: str | None
    verdict_group: str | None
    source: str = ""


def _group_key(call: Call, by: str) -> str:
    if by == "endpoint":
        return call.endpoint
    if by == "client":
        return call.client
    return call.name


def _group_label(key: str, by: str) -> str:
    if by == "endpoint":
        return f"calls to {key}"
    if by == "client":
        return f"calls from {key}"
    return key


def _row(name: str, per_call: list[int], accounted: int, total: int) -> HopRow:
    return HopRow(name, len(per_call), percentile(per_call, 50) or 0, percentile(per_call, 99) or 0,
                  accounted, accounted / total if total else 0.0)


def _make_group(key: str, by: str, calls: list[Call]) -> Group:
    total = sum(c.total for c in calls)
    rows = [_row("total", [c.total for c in calls], total, total)]
    for hop in spans.HOPS:
        have = [c for c in calls if hop in c.raw]
        if have:
            rows.append(_row(hop, [c.raw[hop] for c in have], sum(c.accounted[hop] for c in have), total))
    rows.append(_row(BETWEEN, [c.between for c in calls], sum(c.between for c in calls), total))
    lagged = [c for c in calls if c.loop_lag]
    if lagged:
        rows.append(_row(LOOP_LAG, [c.loop_lag for c in lagged], sum(min(c.loop_lag, c.total) for c in lagged),
                         total))
    return Group(key, _group_label(key, by), calls, total, rows)


def _pct(x: float) -> str:
    return f"{round(x * 100)}%"


def analyse(calls: list[Call], by: str = "method", worst: int = 5) -> Report:
    groups_calls: dict[str, list[Call]] = defaultdict(list)
    for c in calls:
        groups_calls[_group_key(c, by)].append(c)
    groups = [_make_group(k, by, cs) for k, cs in groups_calls.items()]
    groups.sort(key=lambda g: (-g.total_time, g.key))
    worst_calls = sorted(calls, key=lambda c: (-c.total, c.trace_id))[:max(0, worst)]
    verdict, hop, group = _verdict(groups, worst_calls, by)
    return Report(by, calls, groups, worst_calls, verdict, hop, group)


def _verdict(groups: list[Group], worst: list[Call], by: str) -> tuple[str, str | None, str | None]:
    if not groups:
        return "verdict: no calls to analyse", None, None
    # 1. the proxy's own loop, when it accounts for most of the worst calls' time
    worst_total = sum(c.total for c in worst)
    worst_lag = sum(min(c.loop_lag, c.total) for c in worst)
    if worst_total and worst_lag >= LOOP_LAG_VERDICT_SHARE * worst_total:
        lag_by_group: dict[str, int] = defaultdict(int)
        for c in worst:
            lag_by_group[_group_key(c, by)] += min(c.loop_lag, c.total)
        key = max(lag_by_group, key=lambda k: (lag_by_group[k], k))
        largest = max(c.loop_lag for c in worst) / 1e6
        return (f"verdict: {LOOP_LAG} is {_pct(worst_lag / worst_total)} of the worst {len(worst)} calls "
                f"({_group_label(key, by)}; largest stall {largest:.1f} ms): {MEANINGS[LOOP_LAG]}",
                LOOP_LAG, key)
    # 2. the (group, hop) with the largest absolute time over all calls
    best: tuple[int, str, Group] | None = None
    for g in groups:
        for r in g.rows:
            if r.name in ("total", LOOP_LAG):
                continue
            if best is None or r.time > best[0]:
                best = (r.time, r.name, g)
    assert best is not None
    ns, hop, g = best
    if ns <= 0:
        return f"verdict: no time recorded in {len(groups)} group(s)", None, None
    share = _pct(ns / g.total_time) if g.total_time > 0 else f"{_ms(ns)} ms"  # (SERVER spans' ends missing)
    return f"verdict: {hop} is {share} of {g.label}: {MEANINGS[hop]}", hop, g.key


# --------------------------------------------------------------------------------------------
# Text


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def render_text(report: Report) -> str:
    by = report.by
    lines = []
    n = len(report.calls)
    streamed = sum(1 for c in report.calls if c.streamed)
    src = f" from {report.source}" if report.source else ""
    lines.append(f"hops: {n} calls{src}, by {by}"
                 + (f" ({streamed} streamed)" if streamed else ""))
    any_lag = False
    for g in report.groups:
        gs = sum(1 for c in g.calls if c.streamed)
        lines.append("")
        lines.append(f"{g.label}: {len(g.calls)} calls" + (f", {gs} streamed" if gs else ""))
        lines.append(f"  {'hop':<17}{'calls':>7}{'p50 ms':>12}{'p99 ms':>12}{'share':>9}")
        for r in g.rows:
            name = r.name
            if name == LOOP_LAG:
                name, any_lag = "loop lag*", True
            lines.append(f"  {name:<17}{r.calls:>7}{_ms(r.p50):>12}{_ms(r.p99):>12}{r.share * 100:>8.1f}%")
    lines.append("")
    if any_lag:
        lines.append("* loop lag: the largest event-loop stall seen during each call; it stretches the hops"
                     " above, so it is not part of the 100%")
    if streamed:
        to_write = sum(1 for c in report.calls if c.overlap_to == spans.WRITE_RESPONSE)
        to_read = sum(1 for c in report.calls if c.overlap_to == spans.READ_RESPONSE)
        lines.append(f"streamed calls: the read_response/write_response overlap is counted once: in "
                     f"write_response for {to_write} (client paused > upstream wait), in read_response for "
                     f"{to_read}")
    if any_lag or streamed:
        lines.append("")
    lines.append(f"worst {len(report.worst)} calls:")
    lines.append(f"  {'total ms':>10}  {'dominant hop':<34}  {'trace id':<32}  call")
    for c in report.worst:
        hop, ns = c.dominant()
        share = ns / c.total if c.total else 0.0
        dom = f"{hop} {ns / 1e6:.1f} ms ({_pct(share)})"
        what = c.name
        if by == "endpoint":
            what += f" @ {c.endpoint}"
        elif by == "client":
            what += f" from {c.client}"
        notes = []
        if c.streamed:
            notes.append("streamed")
        if len(c.attempts) > 1:
            notes.append(f"{len(c.attempts)} attempts")
        if c.loop_lag:
            notes.append(f"loop lag {c.loop_lag / 1e6:.1f} ms")
        err = c.server.attrs.get(spans.ERROR_TYPE)
        if err:
            notes.append(f"error {err}")
        if any(s.attrs.get(spans.CLIENT_NEVER_READ) for s in c.hops):
            notes.append("client never read")
        if notes:
            what += "  [" + ", ".join(notes) + "]"
        lines.append(f"  {_ms(c.total):>10}  {dom:<34}  {c.trace_id:<32}  {what}")
    lines.append(report.verdict)
    return "\n".join(map(escape_controls, lines))  # (names and errors come from clients)


# --------------------------------------------------------------------------------------------
# The command


def _matches(call: Call, pattern: str) -> bool:
    method = str(call.server.attrs.get(spans.RPC_METHOD, ""))
    return fnmatch.fnmatchcase(method, pattern) or fnmatch.fnmatchcase(call.name, pattern)


def run(args) -> int:
    """`thrift-sidecar hops`: 0 with a verdict, 1 when there is no call to analyse, 2 on bad input."""
    try:
        if args.spans:
            given = [f"--{name}" for name in ("service", "limit", "lookback") if getattr(args, name, None) is not None]
            if given:  # (said, not ignored: a user who filtered expects the filter to hold)
                print(f"thrift-sidecar hops: {', '.join(given)} go with --jaeger; --spans reads the whole "
                      "file (filter by method with --method)", file=sys.stderr)
                return 2
            bad: list[str] = []
            all_spans = load_jsonl(args.spans, bad)
            for why in bad:
                print(f"thrift-sidecar hops: {why} (line skipped)", file=sys.stderr)
            source = args.spans
        else:
            if not args.service:
                print("thrift-sidecar hops: --jaeger needs --service NAME (the sidecar's tracing.service_name)",
                      file=sys.stderr)
                return 2
            from proxy.units import parse_duration
            try:
                lookback = parse_duration(getattr(args, "lookback", "1h") or "1h")
            except ValueError as e:
                print(f"thrift-sidecar hops: --lookback: {e}", file=sys.stderr)
                return 2
            all_spans = load_jaeger(args.jaeger, args.service, limit=getattr(args, "limit", 1000) or 1000,
                                    lookback=lookback)
            source = f"{args.jaeger} (service {args.service})"
            if not all_spans:
                known = jaeger_services(args.jaeger)
                if known is not None and args.service not in known:
                    print(f"thrift-sidecar hops: {args.jaeger} has no service {args.service!r}; it has: "
                          f"{', '.join(sorted(known)) or 'none'} (--service is the sidecar's "
                          "tracing.service_name)", file=sys.stderr)
    except HopsError as e:
        print(f"thrift-sidecar hops: {e}", file=sys.stderr)
        return 2
    calls = rebuild_calls(all_spans)
    foreign = sum(1 for s in all_spans if s.kind == "server" and not is_ours(s))
    if foreign:
        print(f"thrift-sidecar hops: {foreign} SERVER span(s) of other instrumentation skipped "
              "(an upstream's own spans, say)", file=sys.stderr)
    if args.method:
        calls = [c for c in calls if _matches(c, args.method)]
    if args.worst < 0:
        print("thrift-sidecar hops: --worst must be 0 or more", file=sys.stderr)
        return 2
    report = analyse(calls, by=args.by, worst=args.worst)
    report.source = source
    if args.html:
        from proxy.hops_html import render_html
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(render_html(report))
        except OSError as e:
            print(f"thrift-sidecar hops: {args.html}: {e.strerror}", file=sys.stderr)
            return 2
        print(f"waterfall of the worst {len(report.worst)} calls: {args.html}", file=sys.stderr)
    print(render_text(report))
    return 0 if calls else 1
