"""The compiled span encoder (`proxy._otlp.encode_spans`) against its Python twin (`Encoder.pure_spans`).

They must write the same bytes for every plan the compiled one takes, take every plan of the
types the proxy's spans use (str, bool, int, float attributes; ids and times in 64 bits), and
hand everything else back (None) so that the Python encoder writes, skips or raises as it does.
"""

from __future__ import annotations

import enum
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import otlp

_otlp = otlp._otlp
needs_compiled = pytest.mark.skipif(_otlp is None, reason="proxy._otlp not built (or pure Python forced)")

TRACE_ID = 0x0123456789ABCDEF0123456789ABCDEF


def encoder() -> otlp.Encoder:
    return otlp.Encoder({"service.name": "x"}, None, "s", "1.0", None)


def test_compiled_span_encoder_is_built():
    """`make test` runs the compiled encoder: a build that silently fell back to Python fails here."""
    if os.environ.get("THRIFT_SIDECAR_PURE_PYTHON", "") not in ("", "0"):
        assert otlp.SPANS_IMPL == "python" and otlp._encode_spans is None
        return
    assert _otlp is not None, (
        "proxy._otlp is not built: `pip install -e .` (make deps) compiles proxy/_otlp.c "
        "with the system's C compiler; look for the build_ext warning in its output")
    assert otlp.SPANS_IMPL == "c" and otlp._encode_spans is _otlp.encode_spans


# Values the compiled encoder writes itself: every varint length of int (negative ones are 10
# bytes), floats with their odd bit patterns, strings across the one/two-byte length edges.
U64 = st.one_of(st.integers(0, 2 ** 64 - 1), st.sampled_from([0, 1, 127, 128, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]))
INTS = st.one_of(st.integers(-(2 ** 63), 2 ** 64 - 1), st.integers(-(2 ** 200), 2 ** 200),
                 st.sampled_from([0, 127, 128, 16383, 16384, -1, -(2 ** 63), 2 ** 64, 2 ** 64 + 5]))
TEXT = st.one_of(st.text(max_size=40), st.integers(120, 135).map(lambda n: "y" * n),
                 st.integers(16375, 16395).map(lambda n: "é" * (n // 2) + "z" * (n % 2)))
SUPPORTED = st.one_of(TEXT, st.booleans(), INTS, st.floats(), st.sampled_from([math.nan, -0.0, math.inf]))
KEYS = st.one_of(st.text(max_size=20), st.text(min_size=100, max_size=130))


def spans_of(values):
    return st.lists(st.tuples(
        TEXT, U64, U64, st.booleans(), st.integers(0, 255), U64, U64,
        st.one_of(st.none(), st.dictionaries(KEYS, values, max_size=8)),
        st.one_of(st.none(), st.just(""), TEXT)), max_size=9).map(lambda plan: [tuple(s) for s in plan])


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(plan=spans_of(SUPPORTED), state=st.one_of(st.none(), st.text(max_size=200)))
def test_the_twins_write_the_same_bytes(plan, state):
    trace = otlp.trace_prefix(TRACE_ID, state)
    data = _otlp.encode_spans(trace, plan)
    assert data is not None  # every value here is one the compiled encoder takes
    assert data == encoder().pure_spans(trace, plan)


UNSUPPORTED = st.one_of(st.none(), st.binary(max_size=8), st.lists(st.integers(0, 3), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2))


@needs_compiled
@settings(max_examples=150, deadline=None)
@given(plan=spans_of(st.one_of(SUPPORTED, UNSUPPORTED)))
def test_values_it_does_not_write_go_to_the_python_encoder(plan):
    """A plan with a sequence, mapping, bytes or None attribute: the compiled one hands it back,
    and `Encoder.spans` still writes what the Python encoder writes (lists and None are valid
    OTLP values; a dict here too)."""
    trace = otlp.trace_prefix(TRACE_ID)
    data = _otlp.encode_spans(trace, plan)
    expected = encoder().pure_spans(trace, plan)
    if data is not None:
        assert data == expected
    assert encoder().spans(trace, plan) == expected


class Kind(enum.IntEnum):
    A = 1


class Text(str):
    pass


SPAN = ("ping", 1, 2, False, 1, 10, 20, {"k": "v"}, None)


@needs_compiled
@pytest.mark.parametrize("change", [
    {0: Text("ping")}, {0: b"ping"}, {1: -1}, {2: 2 ** 64}, {3: 1}, {4: 256}, {4: Kind.A}, {5: True}, {6: 1.0},
    {7: {"k": Text("v")}}, {7: {"k": Kind.A}}, {7: {"k": object()}}, {7: {1: "v"}}, {7: [("k", "v")]},
    {8: b"boom"}, {8: 3},
], ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))!r}")
def test_anything_else_is_handed_back(change):
    span = list(SPAN)
    for i, v in change.items():
        span[i] = v
    plan = [SPAN, tuple(span)]
    assert _otlp.encode_spans(otlp.trace_prefix(TRACE_ID), plan) is None
    assert _otlp.encode_spans(otlp.trace_prefix(TRACE_ID), [SPAN, SPAN[:8]]) is None
    assert _otlp.encode_spans(bytearray(b"x"), [SPAN]) is None and _otlp.encode_spans(b"x", (SPAN,)) is None


@needs_compiled
def test_a_string_utf8_cannot_write_raises_as_in_python():
    """A lone surrogate: handed back, so `Encoder.spans` raises what the Python encoder raises
    (the export thread counts the call as failed)."""
    trace = otlp.trace_prefix(TRACE_ID)
    bad = [("ping\ud800", 1, 0, False, 1, 10, 20, None, None)]
    assert _otlp.encode_spans(trace, bad) is None
    with pytest.raises(UnicodeEncodeError):
        encoder().spans(trace, bad)
    assert _otlp.encode_spans(trace, [SPAN[:7] + ({"k": "\udfff"}, None)]) is None


@needs_compiled
def test_an_unsupported_value_is_skipped_with_a_warning_as_before(caplog):
    plan = [SPAN[:7] + ({"k": "v", "odd": object(), "n": 3}, None)]
    trace = otlp.trace_prefix(TRACE_ID)
    with caplog.at_level("WARNING", logger="proxy.otlp"):
        data = encoder().spans(trace, plan)
    assert data == encoder().pure_spans(trace, [SPAN[:7] + ({"k": "v", "n": 3}, None)])
    assert "span attribute odd: unsupported value type object, skipped" in caplog.text
