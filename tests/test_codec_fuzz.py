"""Property tests for the decoder (the h11/wsproto fuzz invariant).

Invariant: whatever bytes arrive, the decoder yields messages or raises
ProtocolError (never any other exception; nor do a message's lazy parts,
`payload()`, `result_field()`, `reframe`, or `pending_head()`), and how the bytes are cut into
reads never changes what it yields: one chunk, byte by byte and random
chunks give the same sequence of outcomes (messages, then maybe one error).
For pipelined Apache Thrift messages that sequence is exactly those messages.

Default runs keep to ~300 examples per config. For a long fuzz:
    HYPOTHESIS_PROFILE=fuzz python -m pytest tests/test_codec_fuzz.py
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_fixtures as cf
from proxy.codec import Decoder, Framing, Message, ProtocolError, reframe

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
SETTINGS = settings(
    max_examples=25_000 if FUZZ else 300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None if not FUZZ else settings.default.database,
)

# A config: (id, framing, protocol, wires whose fixtures it reads). "auto" reads any detectable wire.
CONFIGS = [(w.id, w.framing, w.protocol, [w]) for w in cf.WIRES]
CONFIGS.append(("auto", None, None, [w for w in cf.WIRES if w.autodetectable]))
# Config "header" also reads THeader nested in a framed frame.
CONFIGS.append(("header-config-any", Framing.HEADER, None, [w for w in cf.WIRES if w.framing.is_header]))


def pool(wire: cf.Wire) -> list[cf.Fixture]:
    fx = cf.fixtures(wire)
    return [fx[k] for k in cf.SMALL_KEYS]


def describe(m: Message):
    """Everything observable about a message, errors of its lazy parts included."""
    def attempt(fn):
        try:
            return fn()
        except ProtocolError as e:
            return ("error", int(e.app_type), e.message)
    return (m.name, m.type, m.seqid, m.framing, m.protocol, bytes(m.data), dict(m.headers), m.method,
            m.service, attempt(lambda: bytes(m.payload())), attempt(m.result_field),
            attempt(lambda: bytes(reframe(m, Framing.FRAMED))))


def outcomes(chunks, framing, protocol, max_frame_size, peek: bool = False) -> list:
    d = Decoder(framing, protocol, max_frame_size)
    out = []
    try:
        for c in chunks:
            d.feed(c)
            while (m := d.next_message()) is not None:
                out.append(describe(m))
            if peek:
                d.pending_head()  # must not raise either (its answer may depend on the reads)
        d.eof()
        out.append("eof")
    except ProtocolError as e:
        assert e.message.startswith(("bad request:", "bad reply:")), e.message
        out.append(("error", int(e.app_type), e.message))
    return out


def chunkings(data: bytes, rnd):
    """The same bytes as one chunk, byte by byte, and cut at random points."""
    points = sorted({rnd.randrange(1, len(data)) for _ in range(rnd.randint(0, 12))}) if len(data) > 1 else []
    pieces = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
    return [[data], [data[i:i + 1] for i in range(len(data))], pieces]


@st.composite
def pipelined(draw, wires):
    wire = draw(st.sampled_from(wires))
    msgs = draw(st.lists(st.sampled_from(pool(wire)), min_size=1, max_size=3))
    return wire, msgs


INTERESTING = [0x00, 0x01, 0x0F, 0x7F, 0x80, 0x81, 0xFF]


def mangle(data: bytes, rnd) -> bytes:
    """Pipelined fixtures broken in a few places."""
    data = bytearray(data)
    for _ in range(rnd.randint(1, 3)):
        op = rnd.choice(["set", "set", "set", "insert", "delete", "truncate", "append"])
        i = rnd.randrange(len(data)) if data else 0
        if op == "set" and data:
            data[i] = rnd.choice(INTERESTING) if rnd.random() < 0.5 else rnd.randrange(256)
        elif op == "insert":
            data[i:i] = rnd.randbytes(rnd.randint(1, 8))
        elif op == "delete":
            del data[i:i + rnd.randint(1, 8)]
        elif op == "truncate":
            del data[i:]
        else:
            data += rnd.randbytes(rnd.randint(1, 16))
    return bytes(data)


@pytest.mark.parametrize("cid,framing,protocol,wires", CONFIGS, ids=[c[0] for c in CONFIGS])
@SETTINGS
@given(msgs=st.data(), rnd=st.randoms(use_true_random=False), max_frame_size=st.sampled_from([16_384_000, 64, 24]))
def test_decoding_does_not_depend_on_read_sizes(cid, framing, protocol, wires, msgs, rnd, max_frame_size):
    wire, fixtures = msgs.draw(pipelined(wires))
    stream = b"".join(f.data for f in fixtures)

    # Valid pipelined messages: exactly those messages, whatever the reads.
    results = [outcomes(c, framing, protocol, 16_384_000, peek=i == 2)
               for i, c in enumerate(chunkings(stream, rnd))]
    assert results[0] == results[1], "one chunk vs byte by byte"
    assert results[0] == results[2], "one chunk vs random chunks"
    assert results[0][-1] == "eof"
    assert [(g[0], g[1], g[2], g[5], g[9]) for g in results[0][:-1]] == \
        [(f.name, f.type, f.seqid, f.data, f.plain) for f in fixtures]

    # Broken or random bytes (and small size limits): messages then maybe one ProtocolError,
    # nothing else raised, and the same outcomes whatever the reads.
    stream = rnd.randbytes(rnd.randint(0, 200)) if rnd.random() < 0.2 else mangle(stream, rnd)
    results = [outcomes(c, framing, protocol, max_frame_size, peek=i == 2)
               for i, c in enumerate(chunkings(stream, rnd))]
    assert results[0] == results[1], "one chunk vs byte by byte"
    assert results[0] == results[2], "one chunk vs random chunks"
