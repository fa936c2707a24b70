"""Trace context on the wire: read the client's from THeader headers, write ours upstream.

Owns: parsing W3C `traceparent`/`tracestate` and B3 (the single `b3` header and the multi
`x-b3-*` headers) from a THeader info-header dict, the head sampling decision for a call, and
the trace headers put on an upstream THeader request. Leaves to others: building spans
(`proxy.telemetry`), re-encoding the THeader block (`proxy.codec`).

    ctx = start(msg.headers, rng, sample_ratio)   # per call: trace id, SERVER span id, head decision
    headers = inject(ctx, attempt.span_id)        # per attempt: {"traceparent": ..., "tracestate": ...}

Upstream, a `traceparent` always; B3 too, in the form(s) the client sent (single `b3`, multi
`x-b3-*`; its trace-id width; debug kept when sampled; no sampling state when the client deferred),
rewritten to our CLIENT span: an upstream that reads B3 first would otherwise parent its span on
the client's and skip the proxy's, and see two parents.

Precedence: `traceparent`, then `b3`, then `x-b3-*`. An invalid value is ignored as if absent
(the call starts a new trace, `new_trace` = True); a `tracestate` only travels with a valid
`traceparent` (W3C: a tracestate without its traceparent means nothing). Header names are
matched case-insensitively. A parent that did not say whether it sampled (B3 without a sampling
state) leaves the decision to the ratio. Ids come from `rng.getrandbits`: no locks, no
`os.urandom` per call.
"""

from __future__ import annotations

import re

__all__ = ["B3_HEADERS", "B3Form", "Parent", "TraceContext", "inject", "new_id", "parse", "start"]

_HEX = frozenset("0123456789abcdef")
MAX_TRACESTATE = 512  # W3C: propagate at least 512 characters; longer values are dropped whole
B3_HEADERS = ("b3", "x-b3-traceid", "x-b3-spanid", "x-b3-parentspanid", "x-b3-sampled", "x-b3-flags")
TRACE_HEADERS = ("traceparent", "tracestate") + B3_HEADERS  # (lower case) a client's, never sent on as they came


class Parent:
    """What the client sent: its trace id, its span (our SERVER span's parent), its decision."""

    __slots__ = ("trace_id", "span_id", "sampled", "tracestate")

    def __init__(self, trace_id: int, span_id: int, sampled: bool | None, tracestate: str = "") -> None:
        self.trace_id = trace_id      # 0 = none given (B3 `b3: 1` carries only a decision)
        self.span_id = span_id        # 0 = none given
        self.sampled = sampled        # None = the parent did not say
        self.tracestate = tracestate

    def __repr__(self) -> str:
        return (f"Parent({self.trace_id:032x}-{self.span_id:016x}, sampled={self.sampled}, "
                f"tracestate={self.tracestate!r})")


class B3Form:
    """How the client sent B3, so the upstream gets ours the same way: which headers (single,
    multi, or both), the trace id's width (16 hex: a 64-bit id, for tracers that know no other),
    and debug (`d` / `x-b3-flags: 1`, which also means sampled)."""

    __slots__ = ("single", "multi", "width", "debug")

    def __init__(self, single: bool, multi: bool, width: int, debug: bool) -> None:
        self.single = single
        self.multi = multi
        self.width = width
        self.debug = debug

    def __repr__(self) -> str:
        return f"B3Form(single={self.single}, multi={self.multi}, width={self.width}, debug={self.debug})"


class TraceContext:
    """One call's place in a trace: set once at the start of the call, never changed after."""

    __slots__ = ("trace_id", "span_id", "parent_span_id", "sampled", "tracestate", "new_trace",
                 "parent_sampled", "b3")

    def __init__(self, trace_id: int, span_id: int, parent_span_id: int, sampled: bool,
                 tracestate: str, new_trace: bool, parent_sampled: bool | None = None,
                 b3: B3Form | None = None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id                # the SERVER span
        self.parent_span_id = parent_span_id  # the client's span (0 = none)
        self.sampled = sampled                # the head decision
        self.tracestate = tracestate
        self.new_trace = new_trace            # the client sent no (valid) trace context
        self.parent_sampled = parent_sampled  # what the client said (None = nothing)
        self.b3 = b3                          # the client's B3 headers' form (None = it sent none)

    def __repr__(self) -> str:
        return (f"TraceContext({self.trace_id:032x}, span={self.span_id:016x}, "
                f"parent={self.parent_span_id:016x}, sampled={self.sampled}, new={self.new_trace})")


def new_id(rng, bits: int = 64) -> int:
    """A random non-zero id (an all-zero trace or span id is invalid)."""
    return rng.getrandbits(bits) or 1


def _hex_id(s: str, lengths: tuple[int, ...]) -> int:
    """A lowercase-hex id of one of `lengths`, non-zero; 0 when invalid."""
    if len(s) not in lengths or not _HEX.issuperset(s):
        return 0
    return int(s, 16)


# version "-" trace-id "-" parent-id "-" flags, then (versions after 00 only) "-" anything
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)


# A W3C tracestate list member (key OWS "=" OWS value is not allowed: no spaces around "=").
_TS_MEMBER = re.compile(r"([a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
                        r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])")
MAX_TRACESTATE_MEMBERS = 32


def clean_tracestate(value: str) -> str:
    """A client's tracestate as it is kept, forwarded and exported: its members (empty ones
    and the whitespace around them dropped), or "" when it is not valid W3C as a whole (a
    member that does not parse, a key twice, more than 32 members, over 512 characters), as
    the W3C test suite and the OpenTelemetry SDKs treat it. Checked here once per call: the
    SDK's own parser logs a warning for each such header, one line per traced call."""
    members = []
    keys = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        m = _TS_MEMBER.fullmatch(member)
        if m is None or m.group(1) in keys:
            return ""
        keys.add(m.group(1))
        members.append(member)
    out = ",".join(members)
    return out if len(members) <= MAX_TRACESTATE_MEMBERS and len(out) <= MAX_TRACESTATE else ""


def _traceparent(value: str, tracestate: str | None) -> Parent | None:
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace, span, flags, more = m.groups()
    if version == "ff" or (more is not None and version == "00"):
        return None
    trace_id = int(trace, 16)
    span_id = int(span, 16)
    if not trace_id or not span_id:
        return None
    state = clean_tracestate(tracestate) if tracestate else ""
    return Parent(trace_id, span_id, bool(int(flags, 16) & 1), state)


def _b3_sampled(value: str) -> bool | None:
    """B3 sampling state: 1/0, d (debug: sample), and the legacy true/false."""
    value = value.strip().lower()
    if value in ("1", "d", "true"):
        return True
    if value in ("0", "false"):
        return False
    return None


def _b3_single(value: str) -> Parent | None:
    # {TraceId}-{SpanId}[-{SamplingState}[-{ParentSpanId}]], or just {SamplingState}
    parts = value.strip().lower().split("-")
    if len(parts) == 1:
        sampled = _b3_sampled(parts[0])
        return None if sampled is None else Parent(0, 0, sampled)
    if len(parts) > 4:
        return None
    trace_id = _hex_id(parts[0], (16, 32))
    span_id = _hex_id(parts[1], (16,))
    if not trace_id or not span_id:
        return None
    sampled = None
    if len(parts) >= 3:
        sampled = _b3_sampled(parts[2])
        if sampled is None:
            return None
    if len(parts) == 4 and not _hex_id(parts[3], (16,)):
        return None
    return Parent(trace_id, span_id, sampled)


def _b3_multi(h: dict[str, str]) -> Parent | None:
    flags = h.get("x-b3-flags")
    sampled = True if flags is not None and flags.strip() == "1" else None
    if sampled is None and (s := h.get("x-b3-sampled")) is not None:
        sampled = _b3_sampled(s)
    tid, sid = h.get("x-b3-traceid"), h.get("x-b3-spanid")
    if tid is None or sid is None:
        return None if sampled is None else Parent(0, 0, sampled)
    trace_id = _hex_id(tid.strip().lower(), (16, 32))
    span_id = _hex_id(sid.strip().lower(), (16,))
    if not trace_id or not span_id:
        return None if sampled is None else Parent(0, 0, sampled)
    return Parent(trace_id, span_id, sampled)


def parse(headers: dict[str, str]) -> Parent | None:
    """The client's trace context from THeader info headers, or None when there is none (valid)."""
    if not headers:
        return None
    return _parse({k.lower(): v for k, v in headers.items()})


def _parse(h: dict[str, str]) -> Parent | None:
    v = h.get("traceparent")
    if v is not None:
        p = _traceparent(v, h.get("tracestate"))
        if p is not None:
            return p
    v = h.get("b3")
    if v is not None:
        p = _b3_single(v)
        if p is not None:
            return p
    if "x-b3-traceid" in h or "x-b3-sampled" in h or "x-b3-flags" in h:
        return _b3_multi(h)
    return None


def _b3_form(h: dict[str, str]) -> B3Form | None:
    """The form of whatever B3 headers the client sent, valid or not (ours replace them all)."""
    single = "b3" in h
    multi = any(k in h for k in B3_HEADERS[1:])
    if not single and not multi:
        return None
    width = debug = 0
    if single:
        parts = h["b3"].strip().lower().split("-")
        width = len(parts[0]) if len(parts) > 1 else 0  # (a decision alone has no trace id)
        debug = (parts[2] if len(parts) > 2 else parts[0]) == "d"
    if multi:
        width = width or len(h.get("x-b3-traceid", "").strip())
        debug = debug or h.get("x-b3-flags", "").strip() == "1"
    return B3Form(single, multi, 16 if width == 16 else 32, bool(debug))


def start(headers: dict[str, str] | None, rng, sample_ratio: float) -> TraceContext:
    """The call's trace context: the client's trace (or a new one), our SERVER span, the decision."""
    parent = b3 = None
    if headers:
        h = {k.lower(): v for k, v in headers.items()}
        parent = _parse(h)
        b3 = _b3_form(h)
    if parent is not None and parent.sampled is not None:
        sampled = parent.sampled
    else:
        sampled = sample_ratio >= 1.0 or (sample_ratio > 0.0 and rng.random() < sample_ratio)
    span_id = new_id(rng)
    if parent is None or not parent.trace_id:
        return TraceContext(new_id(rng, 128), span_id, 0, sampled, "", True,
                            None if parent is None else parent.sampled, b3)
    return TraceContext(parent.trace_id, span_id, parent.span_id, sampled, parent.tracestate, False,
                        parent.sampled, b3)


def inject(ctx: TraceContext, span_id: int) -> dict[str, str]:
    """Headers for the upstream THeader request: our CLIENT span (`span_id`) as parent, our head
    decision; B3 as well when the client sent B3 (its parent span id: our SERVER span)."""
    headers = {"traceparent": f"00-{ctx.trace_id:032x}-{span_id:016x}-{'01' if ctx.sampled else '00'}"}
    if ctx.tracestate:
        headers["tracestate"] = ctx.tracestate
    b3 = ctx.b3
    if b3 is not None:
        tid = ctx.trace_id
        trace = f"{tid:016x}" if b3.width == 16 and tid < 1 << 64 else f"{tid:032x}"
        span, parent = f"{span_id:016x}", f"{ctx.span_id:016x}"
        debug = b3.debug and ctx.sampled  # (a traceparent that won and said 00: not debug)
        defer = ctx.parent_sampled is None  # the client left the decision to the next hop: so do we
        if b3.single:
            if defer:
                headers["b3"] = f"{trace}-{span}"  # (B3: a parent span id only after a sampling state)
            else:
                headers["b3"] = f"{trace}-{span}-{'d' if debug else '1' if ctx.sampled else '0'}-{parent}"
        if b3.multi:
            headers["x-b3-traceid"] = trace
            headers["x-b3-spanid"] = span
            headers["x-b3-parentspanid"] = parent
            if debug:
                headers["x-b3-flags"] = "1"  # (debug implies sampled: B3 says send no x-b3-sampled)
            elif not defer:
                headers["x-b3-sampled"] = "1" if ctx.sampled else "0"
    return headers
