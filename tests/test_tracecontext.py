"""Trace context: W3C and B3 in THeader headers → the call's context → the upstream traceparent.

Invariants: a valid parent's trace id survives into what we inject upstream, with our CLIENT
span as the parent and our head decision as the flag; an invalid value is as if absent (a new
trace, `new_trace`), never an exception; header names are case-insensitive.
"""

from __future__ import annotations

import random
import time
import timeit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import logging

from opentelemetry.trace import TraceState

from proxy.tracecontext import clean_tracestate, inject, parse, start

TID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SID = 0x00F067AA0BA902B7
TP = f"00-{TID:032x}-{SID:016x}-01"


def rng():
    return random.Random(42)


def test_w3c_round_trip():
    ctx = start({"traceparent": TP, "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"}, rng(), 0.0)
    assert ctx.trace_id == TID and ctx.parent_span_id == SID
    assert ctx.sampled is True and ctx.parent_sampled is True  # the parent's flag beats ratio 0
    assert ctx.new_trace is False and ctx.span_id not in (0, SID)
    out = inject(ctx, 0x1122334455667788)
    assert out == {"traceparent": f"00-{TID:032x}-1122334455667788-01",
                   "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"}


def test_w3c_unsampled_parent_is_honoured_at_ratio_one():
    ctx = start({"traceparent": TP[:-2] + "00"}, rng(), 1.0)
    assert ctx.sampled is False
    assert inject(ctx, 5)["traceparent"].endswith("-0000000000000005-00")
    assert "tracestate" not in inject(ctx, 5)


def test_header_names_are_case_insensitive():
    ctx = start({"TraceParent": TP, "TRACESTATE": "a=b"}, rng(), 0.0)
    assert ctx.trace_id == TID and ctx.tracestate == "a=b"
    b3 = parse({"X-B3-TraceId": "463ac35c9f6413ad48485a3953bb6124", "X-B3-SpanId": "a2fb4a1d1a96d312",
                "X-B3-Sampled": "1"})
    assert b3.trace_id == 0x463AC35C9F6413AD48485A3953BB6124 and b3.sampled is True


def test_future_w3c_version_with_more_fields():
    p = parse({"traceparent": f"cc-{TID:032x}-{SID:016x}-01-what-the-future-holds"})
    assert p.trace_id == TID and p.span_id == SID and p.sampled


@pytest.mark.parametrize("value", [
    "",
    "garbage",
    f"00-{TID:032X}-{SID:016x}-01",                 # uppercase hex
    f"00-{0:032x}-{SID:016x}-01",                   # all-zero trace id
    f"00-{TID:032x}-{0:016x}-01",                   # all-zero parent id
    f"ff-{TID:032x}-{SID:016x}-01",                 # version ff is invalid
    f"00-{TID:032x}-{SID:016x}-01-extra",           # version 00 has exactly 4 fields
    f"00-{TID:032x}"[:-1] + f"-{SID:016x}-01",      # short trace id
    f"00-{TID:032x}-{SID:016x}-0g",                 # bad flags
    f"0x-{TID:032x}-{SID:016x}-01",                 # bad version
    f"00_{TID:032x}_{SID:016x}_01",                 # wrong separators
])
def test_invalid_traceparent_starts_a_new_trace(value):
    assert parse({"traceparent": value, "tracestate": "a=b"}) is None
    ctx = start({"traceparent": value, "tracestate": "a=b"}, rng(), 0.0)
    assert ctx.new_trace and ctx.parent_span_id == 0 and ctx.trace_id not in (0, TID)
    assert ctx.sampled is False and ctx.tracestate == ""  # ratio 0; tracestate needs its traceparent


def test_b3_single():
    p = parse({"b3": "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90"})
    assert (p.trace_id, p.span_id, p.sampled) == (0x80F198EE56343BA864FE8B2A57D3EFF7, 0xE457B5A2E4D86BD1, True)
    p = parse({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1"})  # 64-bit trace id, no decision
    assert p.trace_id == 0x64FE8B2A57D3EFF7 and p.sampled is None
    assert parse({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1-d"}).sampled is True  # debug
    assert parse({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1-0"}).sampled is False
    ctx = start({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1"}, rng(), 1.0)  # no decision: the ratio
    assert ctx.sampled is True and ctx.trace_id == 0x64FE8B2A57D3EFF7 and not ctx.new_trace
    assert inject(ctx, 1)["traceparent"] == "00-000000000000000064fe8b2a57d3eff7-0000000000000001-01"


def test_b3_decision_only():
    ctx = start({"b3": "0"}, rng(), 1.0)
    assert ctx.new_trace and ctx.sampled is False
    ctx = start({"x-b3-sampled": "1"}, rng(), 0.0)
    assert ctx.new_trace and ctx.sampled is True


@pytest.mark.parametrize("value", ["zz-e457b5a2e4d86bd1-1", "64fe8b2a57d3eff7-e457b5a2e4d86bd1-2",
                                   "64fe8b2a57d3eff7-0000000000000000-1", "a-b-c-d-e", "maybe"])
def test_invalid_b3_single(value):
    assert parse({"b3": value}) is None
    assert start({"b3": value}, rng(), 0.0).new_trace


def test_b3_multi():
    h = {"x-b3-traceid": "463ac35c9f6413ad", "x-b3-spanid": "a2fb4a1d1a96d312", "x-b3-flags": "1",
         "x-b3-sampled": "0"}
    p = parse(h)
    assert (p.trace_id, p.span_id, p.sampled) == (0x463AC35C9F6413AD, 0xA2FB4A1D1A96D312, True)  # debug wins
    p = parse({"x-b3-traceid": "463ac35c9f6413ad", "x-b3-spanid": "a2fb4a1d1a96d312"})
    assert p.sampled is None
    bad = {"x-b3-traceid": "not-hex", "x-b3-spanid": "a2fb4a1d1a96d312"}
    assert parse(bad) is None and start(bad, rng(), 0.0).new_trace


def _b3_out(headers: dict, ratio: float = 0.0, span_id: int = 0xABC):
    ctx = start(headers, rng(), ratio)
    return ctx, inject(ctx, span_id)


def test_no_b3_in_means_no_b3_out():
    for headers in ({}, {"traceparent": TP}, {"x": "y"}):
        _, out = _b3_out(headers)
        assert set(out) <= {"traceparent", "tracestate"}


def test_b3_single_goes_upstream_as_ours_in_its_form():
    ctx, out = _b3_out({"b3": "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90"})
    assert out["b3"] == f"80f198ee56343ba864fe8b2a57d3eff7-{0xABC:016x}-1-{ctx.span_id:016x}"
    assert not any(k.startswith("x-b3-") for k in out)
    assert parse({"b3": out["b3"]}).span_id == 0xABC  # the upstream's parent: our CLIENT span
    # a 64-bit trace id stays 64-bit; debug stays debug; an unsampled call says 0
    _, out = _b3_out({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1-d"})
    assert out["b3"].startswith("64fe8b2a57d3eff7-0000000000000abc-d-")
    _, out = _b3_out({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1-0"}, ratio=1.0)
    assert out["b3"].split("-")[2] == "0"  # the client's decision, whatever the ratio


def test_b3_decision_only_goes_upstream_with_the_new_traces_ids():
    ctx, out = _b3_out({"b3": "1"})
    trace, span, state, parent = out["b3"].split("-")
    assert (int(trace, 16), int(span, 16), state, int(parent, 16)) == (ctx.trace_id, 0xABC, "1", ctx.span_id)
    assert len(trace) == 32


def test_b3_multi_goes_upstream_as_ours_whatever_the_clients_case():
    ctx, out = _b3_out({"X-B3-TraceId": "463ac35c9f6413ad", "X-B3-SpanId": "a2fb4a1d1a96d312",
                        "X-B3-ParentSpanId": "05e3ac9a4f6e3b90", "X-B3-Sampled": "0"}, ratio=1.0)
    assert out["x-b3-traceid"] == "463ac35c9f6413ad"
    assert out["x-b3-spanid"] == f"{0xABC:016x}"
    assert out["x-b3-parentspanid"] == f"{ctx.span_id:016x}"
    assert out["x-b3-sampled"] == "0" and "x-b3-flags" not in out and "b3" not in out
    _, out = _b3_out({"x-b3-traceid": "463ac35c9f6413ad", "x-b3-spanid": "a2fb4a1d1a96d312", "x-b3-flags": "1"})
    assert out["x-b3-flags"] == "1" and "x-b3-sampled" not in out  # debug: B3 sends no sampled with it


def test_b3_beside_a_traceparent_carries_the_traceparents_trace():
    """The traceparent wins: the B3 headers sent on must name the same trace and decision, not
    the client's (an upstream reading B3 first would see another trace)."""
    ctx, out = _b3_out({"traceparent": TP, "b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1-0"})
    assert ctx.trace_id == TID and ctx.sampled
    assert out["b3"] == f"{TID:032x}-{0xABC:016x}-1-{ctx.span_id:016x}"  # (128-bit: not cut to 16)


def test_b3_that_deferred_the_decision_goes_upstream_deferring_it():
    """`b3: {trace}-{span}` (no sampling state) leaves the decision to the next hop; ours does too,
    whatever our head decision (a B3-first upstream keeps deciding for itself)."""
    ctx, out = _b3_out({"b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1"}, ratio=0.0)
    assert out["b3"] == f"64fe8b2a57d3eff7-{0xABC:016x}"
    _, out = _b3_out({"x-b3-traceid": "463ac35c9f6413ad", "x-b3-spanid": "a2fb4a1d1a96d312"}, ratio=1.0)
    assert "x-b3-sampled" not in out and "x-b3-flags" not in out and out["x-b3-spanid"] == f"{0xABC:016x}"


def test_b3_debug_does_not_outvote_the_traceparent_that_won():
    """A traceparent saying 00 beside a B3 debug flag: the call is not sampled, and the B3 sent on
    says so too (one decision upstream, not two)."""
    tp00 = TP[:-2] + "00"
    ctx, out = _b3_out({"traceparent": tp00, "b3": "64fe8b2a57d3eff7-e457b5a2e4d86bd1-d"})
    assert ctx.sampled is False and out["b3"].split("-")[2] == "0"
    _, out = _b3_out({"traceparent": tp00, "x-b3-traceid": "463ac35c9f6413ad", "x-b3-spanid": "a2fb4a1d1a96d312",
                      "x-b3-flags": "1"})
    assert out["x-b3-sampled"] == "0" and "x-b3-flags" not in out


def test_b3_width_comes_from_the_form_that_has_a_trace_id():
    _, out = _b3_out({"b3": "junk", "x-b3-traceid": "463ac35c9f6413ad", "x-b3-spanid": "a2fb4a1d1a96d312"})
    assert out["b3"].startswith("463ac35c9f6413ad-") and out["x-b3-traceid"] == "463ac35c9f6413ad"


def test_an_invalid_b3_is_replaced_by_ours():
    ctx, out = _b3_out({"b3": "garbage-value", "x-b3-spanid": "zz"})
    assert ctx.new_trace
    assert parse({"b3": out["b3"]}).trace_id == ctx.trace_id
    assert out["x-b3-traceid"] == f"{ctx.trace_id:032x}"


def test_traceparent_wins_over_b3_and_invalid_traceparent_falls_back():
    b3 = "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-0"
    assert parse({"traceparent": TP, "b3": b3}).trace_id == TID
    assert parse({"traceparent": "junk", "b3": b3}).trace_id == 0x80F198EE56343BA864FE8B2A57D3EFF7


def test_no_headers_means_new_trace_and_ratio():
    r = random.Random(1)
    kept = sum(start({}, r, 0.3).sampled for _ in range(5000))
    assert 1300 < kept < 1700
    assert not any(start(None, r, 0.0).sampled for _ in range(100))
    assert all(start({}, r, 1.0).sampled for _ in range(100))
    ctx = start({"unrelated": "x"}, r, 0.0)
    assert ctx.new_trace and 0 < ctx.trace_id < 2**128 and 0 < ctx.span_id < 2**64


@settings(deadline=None)  # a busy machine can take 200 ms over any example
@given(trace_id=st.integers(1, 2**128 - 1), span_id=st.integers(1, 2**64 - 1),
       parent=st.integers(1, 2**64 - 1), flags=st.integers(0, 255))
def test_inject_parse_round_trip(trace_id, span_id, parent, flags):
    ctx = start({"traceparent": f"00-{trace_id:032x}-{parent:016x}-{flags:02x}"}, random.Random(0), 0.5)
    assert ctx.trace_id == trace_id and ctx.parent_span_id == parent and ctx.sampled == bool(flags & 1)
    p = parse(inject(ctx, span_id))
    assert (p.trace_id, p.span_id, p.sampled) == (trace_id, span_id, bool(flags & 1))


@settings(deadline=None)  # a busy machine can take 200 ms over any example
@given(st.dictionaries(st.sampled_from(["traceparent", "tracestate", "b3", "x-b3-traceid", "x-b3-spanid",
                                        "x-b3-sampled", "x-b3-flags", "other"]), st.text(max_size=80)))
def test_any_header_values_parse_or_are_ignored(headers):
    ctx = start(headers, random.Random(0), 0.5)
    assert 0 < ctx.trace_id < 2**128 and 0 < ctx.span_id < 2**64
    assert inject(ctx, 1)["traceparent"].startswith("00-")


@pytest.mark.parametrize("value,kept", [
    ("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
    (" a=b , ,\tc=d ", "a=b,c=d"),          # whitespace and empty members go
    ("t1@sys=1,a=x y", "t1@sys=1,a=x y"),     # a tenant key; a space inside a value
    ("congo=x,BAD KEY=1", ""),                # one member that does not parse: the whole of it goes
    ("a=b,a=c", ""),                          # a key twice
    (",".join(f"k{i}=v" for i in range(33)), ""),  # more than 32 members
    ("a=" + "x" * 600, ""),                   # longer than 512
    ("a=", ""),
])
def test_a_tracestate_is_kept_whole_and_clean_or_not_at_all(value, kept, caplog):
    """What is kept is forwarded upstream and exported; an invalid one is as if absent (not
    forwarded as it came), and the SDK that encodes spans never sees it, so it logs nothing
    (before: one warning line per traced call)."""
    assert clean_tracestate(value) == kept
    ctx = start({"traceparent": TP, "tracestate": value}, rng(), 1.0)
    assert ctx.tracestate == kept
    assert inject(ctx, 5).get("tracestate") == (kept or None)
    with caplog.at_level(logging.WARNING):
        assert len(TraceState.from_header([kept])) == (kept.count(",") + 1 if kept else 0)
    assert not caplog.records


@settings(deadline=None)
@given(st.text(alphabet=st.sampled_from("ab=,@ \t*-/_0z\x7f!é"), max_size=60))
def test_what_clean_tracestate_keeps_the_sdk_takes_silently(value):
    kept = clean_tracestate(value)
    logger = logging.getLogger("opentelemetry.trace.span")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        state = TraceState.from_header([kept])
    finally:
        logger.removeHandler(handler)
    assert not seen, (value, kept)
    assert ",".join(f"{k}={v}" for k, v in state.items()) == kept


def test_cost_printed():
    """Benchmark, never a pass/fail."""
    r = random.Random(0)
    n = 20_000
    for label, headers in (("plain", {}), ("w3c", {"traceparent": TP}), ("other headers", {"x": "y"})):
        per = min(timeit.repeat(lambda: start(headers, r, 0.01), number=n, repeat=3, timer=time.thread_time)) / n
        print(f"\nstart({label}): {per * 1e6:.2f} µs", end="")
    ctx = start({"traceparent": TP}, r, 0.01)
    per = min(timeit.repeat(lambda: inject(ctx, 12345), number=n, repeat=3, timer=time.thread_time)) / n
    print(f"\ninject: {per * 1e6:.2f} µs")
