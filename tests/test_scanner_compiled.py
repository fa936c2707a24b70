"""The compiled scanner (proxy/codec/_scan.c) agrees with the pure one, step for step.

`proxy.codec.scan` has two implementations of the resumable unframed-message
scanner: `PureStructScanner` (the reference) and `CompiledStructScanner` (C,
built by `pip install -e .`, the default when it was built). Here both are
driven with the same bytes and the same cuts into reads, and after every
`advance` they must agree on everything observable: the result (True, False
or a ProtocolError and its message), `pos`, `reach`, `examined` and the
resumable state (`_state()`: pending type, bytes to skip, the frame stack).

Inputs: every codec fixture (all messages in both protocols), random bytes,
random structs of every type (StructWriter: empty and odd containers, long
varints, invalid types, negative sizes), real and random messages broken in a
few places, 15 MB messages in 64 KiB reads, and the
corpus in tests/fuzz_corpus/ (inputs `make fuzz` found with outcomes not seen
before, replayed here). Also: `make test` fails if the compiled scanner was not
built, and the decoder tests pass with the pure fallback too.

Default runs keep to a few hundred examples per test. `make fuzz` runs
tests/fuzz_codec.py (a million inputs through the same checks, adding inputs
with new outcomes to the corpus), then these with HYPOTHESIS_PROFILE=fuzz and
FUZZ_EXAMPLES examples per test.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_fixtures as cf
from proxy.codec import Decoder, Framing, Message, Protocol, ProtocolError, reframe
from proxy.codec import scan
from proxy.codec.heads import read_head
from proxy.codec.scan import CompiledStructScanner, PureStructScanner

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
FORCED_PURE = any(os.environ.get(v, "") not in ("", "0")
                  for v in ("THRIFT_SIDECAR_PURE_SCANNER", "THRIFT_SIDECAR_PURE_PYTHON"))

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0")) or (25_000 if FUZZ else 200)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None if not FUZZ else settings.default.database,
)

needs_compiled = pytest.mark.skipif(CompiledStructScanner is None,
                                    reason="compiled scanner not built (see test_compiled_scanner_is_built)")

B, C, N = Protocol.BINARY, Protocol.COMPACT, Protocol.BINARY_NONSTRICT
PIECE = 64 * 1024


# -- the build ----------------------------------------------------------------------------------


def test_compiled_scanner_is_built():
    """`make test` runs the compiled scanner: a build that silently fell back to pure Python fails here."""
    if FORCED_PURE:
        assert scan.SCANNER_IMPL == "python" and scan.StructScanner is PureStructScanner
        return
    assert CompiledStructScanner is not None, (
        "proxy.codec._scan is not built: `pip install -e .` (make deps) compiles proxy/codec/_scan.c "
        "with the system's C compiler; look for the build_ext warning in its output")
    assert scan.SCANNER_IMPL == "c"
    assert scan.StructScanner is CompiledStructScanner
    assert Decoder()._scanner_factory is CompiledStructScanner


# -- stepping both ------------------------------------------------------------------------------


def attempt(scanner, buf, end):
    try:
        return scanner.advance(buf, end)
    except ProtocolError as e:  # anything else is a bug and propagates
        return ("error", e.message)


BUFFER_KINDS = [bytes, bytearray, memoryview]


def step_both(data: bytes, compact: bool, pos: int, ends, max_depth: int = 64) -> tuple[list, int]:
    """Feed both scanners the same reads (buf[:end] for each end); assert they agree after each.

    Returns the results, up to and including the first True or error, and the final pos.
    """
    pure = PureStructScanner(compact, pos, max_depth)
    comp = CompiledStructScanner(compact, pos, max_depth)
    views = [kind(data) for kind in BUFFER_KINDS]
    results = []
    for i, end in enumerate(ends):
        rp = attempt(pure, data, end)
        rc = attempt(comp, views[i % 3], end)
        assert rc == rp, (i, end)
        assert (comp.pos, comp.reach, comp.examined) == (pure.pos, pure.reach, pure.examined), (i, end)
        assert comp._state() == pure._state(), (i, end)
        results.append(rp)
        if rp is not False:
            break
    return results, pure.pos


def cut_ends(data: bytes, pos: int, rnd: random.Random, n: int | None = None) -> list[int]:
    """Random read ends in [pos, len], the last one len(data)."""
    n = rnd.randint(0, 12) if n is None else n
    return sorted(rnd.randint(pos, len(data)) for _ in range(n)) + [len(data)]


def check_scan(data: bytes, compact: bool, pos: int, rnd: random.Random, max_depth: int = 64,
               bytewise: bool = True) -> tuple:
    """One input under several chunkings (whole, random cuts, byte by byte): both scanners agree at
    every step, and the final outcome (result, pos) does not depend on the reads. Returns it."""
    chunkings = [[len(data)], cut_ends(data, pos, rnd)]
    if bytewise:
        chunkings.append(list(range(pos, len(data) + 1)))
    finals = []
    for ends in chunkings:
        results, end_pos = step_both(data, compact, pos, ends, max_depth)
        finals.append((results[-1], end_pos))
    assert all(f == finals[0] for f in finals), finals
    return finals[0]


# -- inputs -------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def real_messages() -> list[tuple[bool, bytes, int]]:
    """(compact, plain message, body offset) for every fixture message of every wire, deduplicated."""
    seen = set()
    out = []
    for wire in cf.WIRES:
        for f in cf.fixtures(wire).values():
            key = (wire.protocol, f.plain)
            if key in seen:
                continue
            seen.add(key)
            body = read_head(f.plain, 0, len(f.plain), wire.protocol)[3]
            out.append((wire.protocol is C, f.plain, body))
    return out


INTERESTING = [0x00, 0x01, 0x0F, 0x7F, 0x80, 0x81, 0xF0, 0xFF]


def mangle(data: bytes, rnd: random.Random, start: int = 0) -> bytes:
    """data broken in a few places at or after `start` (a message's body)."""
    data = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.choice(["set", "set", "set", "insert", "delete", "truncate", "append", "dup"])
        i = rnd.randrange(start, len(data)) if len(data) > start else len(data)
        if op == "set" and i < len(data):
            data[i] = rnd.choice(INTERESTING) if rnd.random() < 0.5 else rnd.randrange(256)
        elif op == "insert":
            data[i:i] = bytes(rnd.choice(INTERESTING) for _ in range(rnd.randint(1, 8)))
        elif op == "delete":
            del data[i:i + rnd.randint(1, 8)]
        elif op == "truncate":
            del data[i:]
        elif op == "dup":  # repeat a slice: deeper nesting, longer containers
            j = rnd.randint(i, min(len(data), i + 32))
            data[i:i] = data[i:j] * rnd.randint(1, 8)
        else:
            data += rnd.randbytes(rnd.randint(1, 16))
    return bytes(data)


# Bytes that are often a valid type, a small size, or a varint continuation.
ALPHABET = bytes([0, 1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 13, 14, 15, 16, 0x19, 0x1c, 0x7f, 0x80, 0xff])


def random_bytes(rnd: random.Random) -> bytes:
    n = rnd.randint(0, 300)
    if rnd.random() < 0.5:
        return rnd.randbytes(n)
    return bytes(rnd.choice(ALPHABET) for _ in range(n))


class StructWriter:
    """Writes a random struct body in either protocol: every value type, empty and odd containers,
    and now and then what a scanner must refuse (invalid types, negative sizes, long varints)."""

    BIN_TYPES = [2, 3, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16]
    CMP_TYPES = list(range(1, 14))

    def __init__(self, rnd: random.Random, compact: bool, odd: float):
        self.rnd, self.compact, self.odd = rnd, compact, odd
        self.out = bytearray()

    def chance(self) -> bool:
        return self.rnd.random() < self.odd

    def vtype(self, container: bool = False) -> int:
        if self.chance():
            return self.rnd.randrange(16 if self.compact else 256)
        types = self.CMP_TYPES if self.compact else self.BIN_TYPES
        if self.compact and not container:
            return self.rnd.choice(types[2:] + [1, 2])  # bool fields (1, 2) carry no value
        return self.rnd.choice(types)

    def size(self, depth: int = 0) -> int:
        """A string or container size: small, and 0 once deep or long enough."""
        r = self.rnd.random()
        if r < 0.25 or depth >= 6 or len(self.out) > 1500:
            return 0
        return self.rnd.randint(1, 3) if r < 0.9 else self.rnd.randint(4, 40)

    def varint(self, n: int, extra: int = 0) -> None:
        while n > 0x7F:
            self.out.append(0x80 | (n & 0x7F))
            n >>= 7
        if extra:  # overlong: redundant continuation bytes
            self.out += b"\x80" * extra
        self.out.append(n)

    def length(self, n: int) -> None:
        if self.compact:
            self.varint(n, self.rnd.randint(0, 5) if self.chance() else 0)
        else:
            self.out += (self.rnd.randint(-(2 ** 31), -1) if self.chance() else n).to_bytes(4, "big", signed=True)

    def struct(self, depth: int) -> None:
        for _ in range(self.rnd.randint(0, 4) if depth < 6 and len(self.out) < 1500 else 0):
            t = self.vtype()
            if self.compact:
                if self.rnd.random() < 0.8:
                    self.out.append((self.rnd.randint(1, 15) << 4) | (t & 0x0F))
                else:
                    self.out.append(t & 0x0F)
                    self.varint(self.rnd.randrange(1 << 16), self.rnd.randint(0, 10) if self.chance() else 0)
                if t in (1, 2):
                    continue
            else:
                self.out.append(t)
                self.out += self.rnd.randrange(1 << 16).to_bytes(2, "big")
            self.value(t, depth)
        self.out.append(0)

    def value(self, t: int, depth: int) -> None:
        rnd, out = self.rnd, self.out
        fixed = ({1: 1, 2: 1, 3: 1, 7: 8, 13: 16} if self.compact else
                 {2: 1, 3: 1, 4: 8, 6: 2, 8: 4, 10: 8, 16: 16})
        string, struct = (8, 12) if self.compact else (11, 12)
        lists = (9, 10) if self.compact else (14, 15)
        smap = 11 if self.compact else 13
        if t in fixed:
            out += rnd.randbytes(fixed[t])
        elif self.compact and t in (4, 5, 6):
            self.varint(rnd.randrange(1 << rnd.choice([7, 15, 31, 63])), rnd.randint(0, 4) if self.chance() else 0)
        elif t == string:
            n = self.size()
            self.length(n)
            out += rnd.randbytes(n)
        elif t == struct:
            self.struct(depth + 1)
        elif t in lists:
            et, n = self.vtype(container=True), self.size(depth)
            if self.compact:
                if n < 15 and rnd.random() < 0.8:
                    out.append((n << 4) | (et & 0x0F))
                else:
                    out.append(0xF0 | (et & 0x0F))
                    self.length(n)
            else:
                out.append(et)
                self.length(n)
            for _ in range(n):
                self.value(et, depth + 1)
        elif t == smap:
            kt, vt, n = self.vtype(container=True), self.vtype(container=True), self.size(depth)
            if self.compact:  # size, then the types if not empty
                self.length(n)
                if n:
                    out.append(((kt & 0x0F) << 4) | (vt & 0x0F))
            else:  # the types, then the size
                out += bytes([kt, vt])
                self.length(n)
            for _ in range(n):
                self.value(kt, depth + 1)
                self.value(vt, depth + 1)
        else:  # an invalid type: whatever follows
            out += rnd.randbytes(rnd.randint(0, 4))


def gen_struct(rnd: random.Random, compact: bool) -> bytes:
    w = StructWriter(rnd, compact, rnd.choice([0.0, 0.0, 0.02, 0.1]))
    w.struct(0)
    return bytes(w.out)


def gen_scan_input(rnd: random.Random, data: bytes | None = None) -> tuple[bool, bytes, int, int]:
    """(compact, data, pos, max_depth): random bytes, a real or generated message, maybe broken."""
    kind = rnd.choice(["random", "real", "broken", "broken", "generated", "generated", "generated"])
    max_depth = rnd.choice([64, 64, 64, 3, 1, 0])
    if kind == "random":
        data = random_bytes(rnd) if data is None else data
        return rnd.random() < 0.5, data, rnd.randint(0, min(len(data), 4)), max_depth
    if kind == "generated":
        compact = rnd.random() < 0.5
        data, pos = gen_struct(rnd, compact), 0
        if rnd.random() < 0.3:
            data = mangle(data, rnd)
        return compact, data, pos, max_depth
    compact, data, pos = rnd.choice(real_messages())
    if kind == "broken":
        data = mangle(data, rnd, pos)
        pos = min(pos, len(data))
    return compact, data, pos, max_depth


@st.composite
def scan_inputs(draw):
    rnd = draw(st.randoms(use_true_random=False))
    data = draw(st.binary(max_size=300) | st.lists(st.sampled_from(ALPHABET), max_size=300).map(bytes))
    return (*gen_scan_input(rnd, data), rnd)


# -- agreement ----------------------------------------------------------------------------------


@needs_compiled
@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
def test_agrees_on_every_fixture_at_every_split(protocol):
    """Every codec fixture: whole, byte by byte, and every two-read split (sampled for long ones)."""
    rnd = random.Random(10)
    for compact, data, body in real_messages():
        if compact != (protocol is C):
            continue
        assert check_scan(data, compact, body, rnd) == (True, len(data))
        splits = range(body, len(data) + 1)
        if len(splits) > 120:
            splits = sorted(rnd.sample(splits, 120))
        for k in splits:
            assert step_both(data, compact, body, [k, len(data)])[0][-1] is True
        # Not complete without its last STOP byte.
        assert step_both(data[:-1], compact, body, [len(data) - 1])[0] == [False]


@needs_compiled
def test_a_map_field_skipped_in_one_step_agrees_at_the_nesting_limit_and_when_cut():
    """The compiled struct loop passes a map of strings/fixed values in one step, no frame
    pushed: at max_depth 1 it must still fail as the pure scanner does (the map's frame would
    be one too deep), and a map cut anywhere must leave both in the same state."""
    import struct
    entry = struct.pack(">i", 1) + b"k" + struct.pack(">q", 7)
    body = (struct.pack(">bh", 13, 1) + bytes([11, 10]) + struct.pack(">i", 2) + entry + entry
            + struct.pack(">bh", 13, 2) + bytes([11, 12]) + struct.pack(">i", 0) + b"\x00")
    rnd = random.Random(3)
    assert check_scan(body, False, 0, rnd, max_depth=1) == (("error", "bad request: nesting deeper than 1"), 9)
    assert check_scan(body, False, 0, rnd, max_depth=2) == (True, len(body))


@needs_compiled
@SETTINGS
@given(inp=scan_inputs())
def test_agrees_on_fuzzed_input(inp):
    compact, data, pos, max_depth, rnd = inp
    check_scan(data, compact, pos, rnd, max_depth)


def one_scan(fn, data, pos, end, compact):
    try:
        return fn(data, pos, end, compact)
    except ProtocolError as e:
        return ("error", e.message)


@needs_compiled
@SETTINGS
@given(inp=scan_inputs())
def test_the_one_call_scan_agrees_on_fuzzed_input(inp):
    """`struct_end` (the listener's body check: one call, no scanner object) against the pure
    reference, at the read's end and cut short, over every buffer kind."""
    compact, data, pos, _, rnd = inp
    for end in (len(data), rnd.randint(pos, len(data))):
        want = one_scan(scan.pure_struct_end, data, pos, end, compact)
        for kind in BUFFER_KINDS:
            assert one_scan(scan._compiled.struct_end, kind(data), pos, end, compact) == want


@needs_compiled
@pytest.mark.parametrize("compact", [False, True], ids=["binary", "compact"])
def test_the_one_call_scan_agrees_on_fixtures_and_past_its_inline_stack(compact):
    """Every fixture whole and without its last byte; structs nested 15 to 70 deep (its stack
    grows off the inline frames past 16; past 64 it is an error, as for StructScanner)."""
    fast, pure = scan._compiled.struct_end, scan.pure_struct_end
    for c, data, body in real_messages():
        if c == compact:
            assert fast(data, body, len(data), c) == pure(data, body, len(data), c) == len(data)
            assert fast(data, body, len(data) - 1, c) is None
    for depth in (15, 16, 17, 40, 63, 64, 65, 70):
        field = bytes([0x1C]) if compact else bytes([12, 0, 1])  # a struct field, id 1
        data = field * depth + b"\x00" * (depth + 1)
        assert one_scan(fast, data, 0, len(data), compact) == one_scan(pure, data, 0, len(data), compact)
    with pytest.raises(ValueError):
        fast(b"\x00", 0, 2, compact)


@needs_compiled
@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
@pytest.mark.parametrize("case", ["echo-15MB", "get_users-20k"])
def test_agrees_on_15mb_messages_in_64k_reads(protocol, case):
    if case == "echo-15MB":
        data = cf.echo_call(cf.Wire(Framing.BUFFERED, protocol), 15_000_000)[0]
    else:
        data = cf.users_reply(cf.Wire(Framing.BUFFERED, protocol), 20_000)[0]
    body = read_head(data, 0, len(data), protocol)[3]
    ends = list(range(PIECE, len(data), PIECE)) + [len(data)]
    assert step_both(data, protocol is C, body, ends)[0][-1] is True

    # Through the decoder, as the proxy reads: resumed, so each byte is examined about once.
    d = Decoder(Framing.BUFFERED, protocol, scanner_factory=CompiledStructScanner)
    got = []
    for i in range(0, len(data), PIECE):
        d.feed(data[i:i + PIECE])
        while (m := d.next_message()) is not None:
            got.append(m)
    assert len(got) == 1 and got[0].data == data
    assert len(data) - body <= d.examined <= 2 * len(data)


@needs_compiled
def test_limits_and_odd_calls():
    """Depth limits, resumed varints and lengths, buffer kinds, and calls after the end."""
    # Nesting: a struct field that is a struct, 70 deep (binary), list of lists (compact).
    deep_b = b"\x0c\x00\x01" * 70 + b"\x00" * 71
    deep_c = b"\x19\x19" + b"\x19" * 68 + b"\x00" * 2
    rnd = random.Random(1)
    for compact, data in ((False, deep_b), (True, deep_c)):
        for depth in (0, 1, 2, 64, 100):
            check_scan(data, compact, 0, rnd, depth)
    assert step_both(deep_b, False, 0, [len(deep_b)], 64)[0] == [("error", "bad request: nesting deeper than 64")]
    assert step_both(deep_b, False, 0, [len(deep_b)], 100) == ([True], len(deep_b))

    # After True: True again, nothing changes.
    data = b"\x08\x00\x01\x00\x00\x00\x05\x00"
    for cls in (PureStructScanner, CompiledStructScanner):
        s = cls(False)
        assert s.advance(data, len(data)) is True and s.pos == len(data)
        assert s.advance(data, len(data)) is True and s.pos == len(data)

    # The buffer is read in place and released: a bytearray can grow between calls.
    s = CompiledStructScanner(False)
    buf = bytearray(data[:3])
    assert s.advance(buf, len(buf)) is False
    buf += data[3:]
    assert s.advance(memoryview(buf), len(buf)) is True and s.pos == len(data)

    # Bad arguments are ValueError / TypeError, never a read outside the buffer.
    s = CompiledStructScanner(False)
    with pytest.raises(ValueError):
        s.advance(data, len(data) + 1)
    with pytest.raises(ValueError):
        s.advance(data, -1)
    s.pos = -1
    with pytest.raises(ValueError):
        s.advance(data, 3)
    with pytest.raises(TypeError):
        s.advance("text", 1)
    s = CompiledStructScanner(compact=True, pos=2, max_depth=5)
    assert (s.pos, s.reach, s.examined) == (2, 2, 0)
    s.examined = 7
    assert s.examined == 7


def test_scanner_speed_on_the_945kb_get_users_reply(capsys):
    """Printed, not asserted (STYLE 13): both scanners finding the end of get_users(5499)'s reply."""
    import statistics
    import time
    lines = []
    for protocol in (B, C):
        data = cf.users_reply(cf.Wire(Framing.BUFFERED, protocol), 5499)[0]
        body = read_head(data, 0, len(data), protocol)[3]
        for cls, reps in ((PureStructScanner, 3), (CompiledStructScanner, 50)):
            if cls is None:
                continue
            times = []
            for _ in range(reps):
                s = cls(protocol is C, body)
                t = time.perf_counter()
                s.advance(data, len(data))
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1000
            impl = "C" if cls is CompiledStructScanner else "pure"
            lines.append(f"{impl:>4} scanner, get_users(5499) {protocol.value} reply ({len(data):,} B): "
                         f"{ms:.2f} ms median of {reps} ({len(data) / ms / 1000:,.0f} MB/s)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# -- the decoder with either scanner ------------------------------------------------------------


def describe(m: Message):
    def attempt_(fn):
        try:
            return fn()
        except ProtocolError as e:
            return ("error", int(e.app_type), e.message)
    return (m.name, m.type, m.seqid, m.framing, m.protocol, bytes(m.data), dict(m.headers),
            attempt_(lambda: bytes(m.payload())), attempt_(lambda: bytes(reframe(m, Framing.FRAMED))))


def decode(chunks, framing, protocol, max_frame_size, factory) -> list:
    d = Decoder(framing, protocol, max_frame_size, scanner_factory=factory)
    out = []
    try:
        for c in chunks:
            d.feed(c)
            while (m := d.next_message()) is not None:
                out.append(("msg", *describe(m)))
            d.pending_head()
        d.eof()
        out.append("eof")
    except ProtocolError as e:
        assert e.message.startswith(("bad request:", "bad reply:")), e.message
        head = None if e.head is None else (e.head.name, e.head.seqid)
        out.append(("error", int(e.app_type), e.message, head))
    return out


def stream_chunkings(data: bytes, rnd: random.Random) -> list[list[bytes]]:
    points = sorted({rnd.randrange(1, len(data)) for _ in range(rnd.randint(0, 12))}) if len(data) > 1 else []
    pieces = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
    return [[data], [data[i:i + 1] for i in range(len(data))], pieces]


# Every decoder config of tests/test_codec_fuzz.py, by id (the corpus names them).
CONFIGS = {w.id: (w.framing, w.protocol) for w in cf.WIRES}
CONFIGS["auto"] = (None, None)
CONFIGS["header-config-any"] = (Framing.HEADER, None)
UNFRAMED_CONFIGS = ["buffered-binary", "buffered-compact", "buffered-binary_nonstrict", "auto"]


def check_decode(cid: str, stream: bytes, max_frame_size: int, rnd: random.Random,
                 expected: list[bytes] | None = None) -> list:
    """The decoder gives the same outcomes with either scanner and whatever the reads
    (for valid pipelined messages: exactly those). Nothing but ProtocolError is raised."""
    framing, protocol = CONFIGS[cid]
    factories = [PureStructScanner]
    if CompiledStructScanner is not None and cid in UNFRAMED_CONFIGS:  # others never scan
        factories.append(CompiledStructScanner)
    results = []
    for chunks in stream_chunkings(stream, rnd):
        each = [decode(chunks, framing, protocol, max_frame_size, f) for f in factories]
        assert all(r == each[0] for r in each), (cid, "pure vs compiled")
        # The head of a refused message may depend on how much had arrived: not compared across reads.
        results.append([o[:3] if o[0] == "error" else o for o in each[0]])
    assert all(r == results[0] for r in results), (cid, "one chunk vs byte by byte vs random chunks")
    if expected is not None:
        assert results[0][-1] == "eof" and [o[6] for o in results[0][:-1]] == expected, cid
    return results[0]


def config_wires(cid: str) -> list[cf.Wire]:
    """The wires whose messages a config reads (as in tests/test_codec_fuzz.py)."""
    if cid == "auto":
        return [w for w in cf.WIRES if w.autodetectable]
    if cid == "header-config-any":
        return [w for w in cf.WIRES if w.framing.is_header]
    return [w for w in cf.WIRES if w.id == cid]


def gen_stream(rnd: random.Random, cid: str) -> tuple[bytes, int, list[bytes] | None]:
    """(stream, max_frame_size, expected messages or None): 1-3 pipelined fixtures of one wire
    the config reads; mostly broken in a few places (then with small size limits too), or random bytes."""
    wire = rnd.choice(config_wires(cid))
    if cid == "auto" and rnd.random() < 0.5:  # the unframed ones: where the scanner runs
        wire = rnd.choice([w for w in config_wires(cid) if w.framing is Framing.BUFFERED])
    pool = cf.fixture_list(wire)
    msgs = [rnd.choice(pool) for _ in range(rnd.randint(1, 3))]
    stream = b"".join(f.data for f in msgs)
    r = rnd.random()
    if r < 0.1:
        return stream, 16_384_000, [f.data for f in msgs]
    stream = random_bytes(rnd) if r < 0.2 else mangle(stream, rnd)
    return stream, rnd.choice([16_384_000, 16_384_000, 600, 64, 24]), None


@st.composite
def unframed_streams(draw):
    rnd = draw(st.randoms(use_true_random=False))
    cid = draw(st.sampled_from(UNFRAMED_CONFIGS))
    return (cid, *gen_stream(rnd, cid), rnd)


@SETTINGS
@given(inp=unframed_streams())
def test_decoder_agrees_with_either_scanner(inp):
    """Unframed streams (real, broken, pipelined; small max_frame_size too): same outcomes both ways."""
    cid, stream, max_frame_size, expected, rnd = inp
    check_decode(cid, stream, max_frame_size, rnd, expected)


@pytest.mark.skipif(FORCED_PURE or CompiledStructScanner is None,
                    reason="runs the codec tests with the pure scanner when the compiled one is the default")
def test_codec_and_metrics_tests_pass_with_no_compiled_part():
    """The decoder and metrics tests again, with THRIFT_SIDECAR_PURE_PYTHON=1 (no compiled part at
    all): the fallbacks stay a working codec and hop histograms."""
    env = dict(os.environ, THRIFT_SIDECAR_PURE_PYTHON="1")
    env.pop("HYPOTHESIS_PROFILE", None)
    env.pop("FUZZ_EXAMPLES", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           "tests/test_codec_decode.py", "tests/test_codec_scan.py", "tests/test_codec_errors.py",
           "tests/test_codec_fuzz.py", "-k", "not test_decoding_does_not_depend_on_read_sizes or buffered or auto",
           "tests/test_scanner_compiled.py::test_compiled_scanner_is_built",
           "tests/test_codec_take.py", "tests/test_codec_stream.py", "tests/test_metrics.py"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# -- the corpus ---------------------------------------------------------------------------------
#
# tests/fuzz_corpus/scan.txt    lines "binary|compact pos max_depth hex": scanner inputs
# tests/fuzz_corpus/decode.txt  lines "config-id max_frame_size hex": decoder streams
#
# `make fuzz` appends an input whenever its outcome's shape (scanner: protocol and result;
# decoder: unframed config or not, and how the stream ended; numbers and names blanked) is
# one the corpus has no input for yet, and every input that failed; replayed by `make test`.


def _signature(*parts) -> str:
    """The outcome's shape: numbers, hex dumps and quoted names in its texts blanked."""
    def norm(x):
        if isinstance(x, (tuple, list)):
            return tuple(norm(y) for y in x)
        if isinstance(x, str):
            x = re.sub(r"'[^']*'|\"[^\"]*\"", "S", x)
            return re.sub(r"-?\b(0x)?[0-9a-fA-F]*\d[0-9a-fA-F]*\b", "N", x)
        return x
    return repr(norm(parts))


def _read_corpus(name: str) -> list[list[str]]:
    path = CORPUS / name
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _scan_entry(entry):
    proto, pos, depth, hexdata = entry if len(entry) == 4 else (*entry, "")
    return proto == "compact", bytes.fromhex(hexdata), int(pos), int(depth)


def _scan_sig(compact, result):
    return _signature("compact" if compact else "binary", result)


def _decode_sig(cid, outcome):
    """Unframed (where the scanner runs) or not, and how the stream ended."""
    last = outcome[-1]
    return _signature(cid in UNFRAMED_CONFIGS, last[:3] if last[0] == "error" else last)


@needs_compiled
def test_corpus_scan_inputs():
    entries = _read_corpus("scan.txt")
    rnd = random.Random(7)
    for entry in entries:
        compact, data, pos, max_depth = _scan_entry(entry)
        check_scan(data, compact, pos, rnd, max_depth)


def test_corpus_decoder_streams():
    entries = _read_corpus("decode.txt")
    rnd = random.Random(7)
    for entry in entries:
        cid, max_frame_size, hexdata = entry if len(entry) == 3 else (*entry, "")
        check_decode(cid, bytes.fromhex(hexdata), int(max_frame_size), rnd)


def test_corpus_is_small_and_well_formed():
    for name, fields in (("scan.txt", 4), ("decode.txt", 3)):
        path = CORPUS / name
        assert path.exists(), f"{path} is missing (make fuzz writes it)"
        assert path.stat().st_size < 512 * 1024
        for entry in _read_corpus(name):
            assert fields - 1 <= len(entry) <= fields, entry
            if name == "decode.txt":
                assert entry[0] in CONFIGS, entry
            else:
                assert entry[0] in ("binary", "compact"), entry
