"""The HTML waterfall of `thrift-sidecar hops --html FILE`: how a user *looks* at hops without a UI.

Owns: drawing a `proxy.hops.Report`'s worst calls as one self-contained page — inline CSS and
SVG, no script, no fonts or images fetched — one row per span (SERVER, its hops, each CLIENT
attempt and its hops), bars placed by start and duration on the call's own time axis, labels in
ms, one colour per hop and a legend. Leaves to others: reading spans and the numbers
(`proxy.hops`).

The page is also well-formed XML (every element closed, only numeric character references), so
tests can parse it with the standard library; `tools/screenshot.sh` renders it in headless
Chromium.
"""

from __future__ import annotations

from xml.sax import saxutils

from proxy import spans
from proxy.hops import BETWEEN, LOOP_LAG, MEANINGS, Call, Report, Span, render_text

# The control characters XML 1.0 forbids (a client's method name may hold them), shown escaped
# as the text table shows them (`\x01`); tab and newline are allowed, and kept.
_XML_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f) if c not in (0x09, 0x0a, 0x0d)}


def escape(text: str) -> str:
    """`text` for XML: forbidden control characters shown escaped, then &, < and > escaped."""
    return saxutils.escape(text.translate(_XML_CONTROLS))


def quoteattr(text: str) -> str:
    return saxutils.quoteattr(text.translate(_XML_CONTROLS))


__all__ = ["render_html", "COLORS"]

COLORS = {
    "server": "#8f8f8f",
    "client": "#b9b2ab",
    spans.READ_REQUEST: "#4e79a7",
    spans.ACQUIRE: "#f28e2b",
    spans.WRITE_UPSTREAM: "#d4b12a",
    spans.SERVICE_TIME: "#59a14f",
    spans.READ_RESPONSE: "#2fa7a0",
    spans.BACKOFF: "#b07aa1",
    spans.QUEUED: "#ff8fa0",
    spans.WRITE_RESPONSE: "#e15759",
}

WIDTH = 1340      # svg width (px)
LABEL_W = 300     # left column: span names
TRACK_X = LABEL_W + 10
TRACK_W = WIDTH - TRACK_X - 90   # room for a ms label after a bar that ends at the right edge
ROW_H = 20
AXIS_H = 18

_CSS = """
body { font: 13px/1.35 -apple-system, "Segoe UI", "DejaVu Sans", Arial, sans-serif; margin: 14px 20px;
       color: #222; background: #fff; }
h1 { font-size: 17px; margin: 0 0 4px 0; }
.verdict { font-size: 15px; font-weight: bold; margin: 4px 0 8px 0; padding: 6px 10px;
           background: #fff4e5; border-left: 4px solid #f28e2b; }
.legend { margin: 0 0 8px 0; }
.legend span.item { display: inline-block; margin: 0 14px 3px 0; white-space: nowrap; }
.legend span.sw { display: inline-block; width: 12px; height: 12px; vertical-align: -1px;
                  margin-right: 4px; border-radius: 2px; }
.call { margin: 6px 0 10px 0; }
.call h2 { font-size: 13px; margin: 0; font-weight: normal; }
.call h2 b { font-weight: bold; }
.call .note { color: #666; }
svg text { font: 11.5px "DejaVu Sans Mono", Menlo, Consolas, monospace; fill: #222; }
svg text.axis { fill: #888; font-size: 10px; }
svg line.tick { stroke: #e4e4e4; stroke-width: 1; }
svg rect.bar { stroke: rgba(0,0,0,0.25); stroke-width: 0.5; }
svg rect.bar.error { stroke: #c00000; stroke-width: 1.5; }
svg g.span:hover rect.bar { stroke: #000; stroke-width: 1.2; }
svg line.handed { stroke: #111; stroke-width: 2; }
pre.table { font: 12px "DejaVu Sans Mono", Menlo, Consolas, monospace; background: #f7f7f7; padding: 8px;
            border: 1px solid #e5e5e5; overflow-x: auto; }
"""


def _fmt_ms(ns: int) -> str:
    ms = ns / 1e6
    if ms == 0:
        return "0 ms"
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 10:
        return f"{ms:.1f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def _rows(call: Call) -> list[tuple[Span, int]]:
    """(span, depth) in waterfall order: SERVER, then its children by start, attempts with their hops."""
    kids: list[tuple[int, int, object]] = []
    for h in call.hops:
        kids.append((h.start, 0, h))
    for att in call.attempts:
        kids.append((att.span.start, 1, att))
    kids.sort(key=lambda k: (k[0], k[1]))
    out = [(call.server, 0)]
    for _, _, k in kids:
        if isinstance(k, Span):
            out.append((k, 1))
        else:
            out.append((k.span, 1))
            out.extend((h, 2) for h in k.hops)
    return out


def _color(s: Span) -> str:
    if s.kind == "server":
        return COLORS["server"]
    if s.kind == "client":
        return COLORS["client"]
    return COLORS.get(s.name, "#999999")


def _label(s: Span) -> str:
    if s.kind == "server":
        return f"{s.name} (SERVER)"
    if s.kind == "client":
        a = s.attrs
        ep = a.get(spans.ENDPOINT) or a.get(spans.SERVER_ADDRESS, "?")
        return f"attempt {a.get(spans.ATTEMPT, '?')} \u2192 {ep}"
    return s.name


def _tooltip(s: Span, call: Call) -> str:
    lines = [f"{s.name} [{s.kind}] {_fmt_ms(s.duration)}",
             f"starts at +{_fmt_ms(s.start - call.server.start)}", f"span {s.span_id}"]
    for k, v in sorted(s.attrs.items()):
        lines.append(f"{k} = {v}")
    return "\n".join(lines)


_OVERLAPPING = (spans.READ_RESPONSE, spans.WRITE_RESPONSE)


def _overlaps(s: Span, call: Call) -> list[tuple[int, int]]:
    """Intervals where `s` (read_response or write_response) overlaps a span of the other name."""
    other = spans.WRITE_RESPONSE if s.name == spans.READ_RESPONSE else spans.READ_RESPONSE
    out = []
    for o in call.all_spans():
        if o.kind == "internal" and o.name == other:
            a, b = max(s.start, o.start), min(s.end, o.end)
            if b > a:
                out.append((a, b))
    return out


def _call_svg(call: Call) -> str:
    rows = _rows(call)
    t0 = call.server.start
    total = max(1, call.total)
    scale = TRACK_W / total
    height = AXIS_H + len(rows) * ROW_H + 4
    out = [f'<svg class="waterfall" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
           f'role="img" aria-label={quoteattr("waterfall of trace " + call.trace_id)}>']
    # time axis: 0, 25, 50, 75, 100 % of the call's total
    for i in range(5):
        x = TRACK_X + TRACK_W * i / 4
        ns = total * i // 4
        anchor = "start" if i == 0 else ("end" if i == 4 else "middle")
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{AXIS_H - 4}" x2="{x:.1f}" y2="{height}"/>')
        out.append(f'<text class="axis" x="{x:.1f}" y="{AXIS_H - 7}" text-anchor="{anchor}">'
                   f'{escape(_fmt_ms(ns))}</text>')
    for i, (s, depth) in enumerate(rows):
        y = AXIS_H + i * ROW_H
        x = TRACK_X + max(0, s.start - t0) * scale
        w = max(1.0, s.duration * scale)
        if x + w > TRACK_X + TRACK_W + 1:  # a span that outlives the SERVER span (clock skew): clip
            w = max(1.0, TRACK_X + TRACK_W - x)
        cls = "span " + ("server" if s.kind == "server" else "client" if s.kind == "client" else "hop-" + s.name)
        out.append(f'<g class="{cls}" data-span-id="{escape(s.span_id)}" data-name={quoteattr(s.name)} '
                   f'data-kind="{escape(s.kind)}">')
        out.append(f"<title>{escape(_tooltip(s, call))}</title>")
        indent = 6 + depth * 16
        weight = ' font-weight="bold"' if s.kind == "server" else ""
        label = _label(s)
        if len(label) > 38 - depth * 2:
            label = label[:36 - depth * 2] + "\u2026"
        out.append(f'<text x="{indent}" y="{y + 14}"{weight}>{escape(label)}</text>')
        err = s.attrs.get(spans.ERROR_TYPE)
        bar = "bar error" if err else "bar"
        out.append(f'<rect class="{bar}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 6}" rx="2" '
                   f'fill="{_color(s)}"/>')
        if call.overlap and s.kind == "internal" and s.name in _OVERLAPPING and s.name != call.overlap_to:
            # the part of this hop that overlaps the other one is counted there: drawn faded
            for o in _overlaps(s, call):
                ox = TRACK_X + (o[0] - t0) * scale
                ow = max(1.0, (o[1] - o[0]) * scale)
                out.append(f'<rect class="overlap" x="{ox:.1f}" y="{y + 3}" width="{ow:.1f}" height="{ROW_H - 6}" '
                           f'fill="#ffffff" fill-opacity="0.6"/>')
        if s.name == spans.WRITE_RESPONSE and s.attrs.get(spans.HANDED_MS) is not None and w >= 8:
            hx = x + min(s.duration, float(s.attrs[spans.HANDED_MS]) * 1e6) * scale
            out.append(f'<line class="handed" x1="{hx:.1f}" y1="{y + 2}" x2="{hx:.1f}" y2="{y + ROW_H - 2}"/>')
        text = _fmt_ms(s.duration)
        if err:
            text += f" \u2717 {err}"
        if x + w + 6 + 8 * len(text) <= WIDTH:
            out.append(f'<text x="{x + w + 5:.1f}" y="{y + 14}">{escape(text)}</text>')
        else:
            out.append(f'<text x="{x - 5:.1f}" y="{y + 14}" text-anchor="end">{escape(text)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _call_header(n: int, call: Call) -> str:
    hop, ns = call.dominant()
    share = ns / call.total if call.total else 0.0
    notes = []
    if call.streamed:
        a = call.server.attrs
        notes.append(f"streamed: read_response overlaps write_response by {_fmt_ms(call.overlap)}, counted in "
                     f"{call.overlap_to or spans.READ_RESPONSE} (client paused {a.get(spans.CLIENT_PAUSED_MS, 0)} ms,"
                     f" upstream wait {a.get(spans.UPSTREAM_WAIT_MS, 0)} ms)")
    if call.loop_lag:
        notes.append(f"loop lag up to {_fmt_ms(call.loop_lag)} during the call")
    err = call.server.attrs.get(spans.ERROR_TYPE)
    if err:
        notes.append(f"error: {err}")
    note = f' <span class="note">\u2014 {escape("; ".join(notes))}</span>' if notes else ""
    return (f"<h2>#{n} <b>{escape(call.name)}</b> {escape(_fmt_ms(call.total))} \u2014 dominant "
            f"<b>{escape(hop)}</b> {escape(_fmt_ms(ns))} ({round(share * 100)}%) \u2014 trace "
            f"<code>{escape(call.trace_id)}</code>{note}</h2>")


def _legend() -> str:
    items = []
    for key, label in (("server", "SERVER span (the whole call)"), ("client", "CLIENT span (one attempt)")):
        items.append(f'<span class="item"><span class="sw" style="background:{COLORS[key]}"></span>'
                     f"{escape(label)}</span>")
    for hop in spans.HOPS:
        items.append(f'<span class="item" title={quoteattr(MEANINGS[hop])}><span class="sw" '
                     f'style="background:{COLORS[hop]}"></span>{escape(hop)}</span>')
    items.append('<span class="item"><span class="sw" style="background:#111;width:3px"></span>'
                 "kernel took the last reply byte (handed_ms)</span>")
    items.append('<span class="item"><span class="sw" style="background:#2fa7a0;opacity:0.4"></span>'
                 "faded: a streamed reply's overlap, counted in the other hop</span>")
    return '<div class="legend">' + "".join(items) + "</div>"


def render_html(report: Report) -> str:
    title = f"thrift-sidecar hops \u2014 worst {len(report.worst)} of {len(report.calls)} calls"
    parts = ['<!DOCTYPE html>', '<html lang="en">', "<head>", '<meta charset="utf-8"/>',
             f"<title>{escape(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{escape(title)}</h1>",
             f'<div class="verdict">{escape(report.verdict)}</div>', _legend()]
    if not report.worst:
        parts.append("<p>No calls to draw.</p>")
    for n, call in enumerate(report.worst, 1):
        parts.append(f'<div class="call" data-trace-id="{escape(call.trace_id)}">')
        parts.append(_call_header(n, call))
        parts.append(_call_svg(call))
        parts.append("</div>")
    parts.append(f"<p>Hop times per group ({escape(BETWEEN)}: time no hop covers; {escape(LOOP_LAG)}: "
                 "the largest event-loop stall per call, overlapping the hops):</p>")
    parts.append(f'<pre class="table">{escape(render_text(report))}</pre>')
    parts.append("</body>")
    parts.append("</html>")
    return "\n".join(parts) + "\n"
