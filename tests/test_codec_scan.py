"""The unframed scanner resumes where it stopped: bytes examined stay ~1x the message size.

A scanner that restarted from the message's first byte on every read would
examine a 15 MB message fed in 64 KiB reads ~115 times over (quadratic); the
bound here (2x) only holds if the scan resumes. `Decoder.examined` counts every
byte the scanner looks at, re-reads of a token cut by a read included.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

import codec_fixtures as cf
from proxy.codec import Decoder, Framing, Protocol
from proxy.codec.scan import PureStructScanner, StructScanner

B, C = Protocol.BINARY, Protocol.COMPACT
PIECE = 64 * 1024


def feed_in_pieces(data: bytes, protocol: Protocol, sizes) -> Decoder:
    d = Decoder(Framing.BUFFERED, protocol)
    got = []
    i = 0
    for n in sizes:
        if i >= len(data):
            break
        d.feed(data[i:i + n])
        i += n
        while (m := d.next_message()) is not None:
            got.append(m)
    assert i >= len(data)
    assert len(got) == 1 and got[0].data == data
    assert d.buffered == 0
    d.last = got[0]
    return d


CASES = {
    "echo-15MB": lambda p: cf.echo_call(cf.Wire(Framing.BUFFERED, p), 15_000_000)[0],
    "get_users-20k": lambda p: cf.users_reply(cf.Wire(Framing.BUFFERED, p), 20_000)[0],
}


@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
@pytest.mark.parametrize("case", list(CASES))
def test_scan_examines_each_byte_about_once(protocol, case):
    data = CASES[case](protocol)
    assert len(data) > 2_000_000
    d = feed_in_pieces(data, protocol, iter(lambda: PIECE, None))
    body = d.last.body
    # Every byte after the head was passed over ...
    assert d.examined >= len(data) - body
    # ... and hardly any twice: only a field or length cut by a read is looked at again.
    assert d.examined <= 2 * len(data)
    # A token is at most 10 bytes, so re-reads per piece are bounded by that.
    pieces = -(-len(data) // PIECE)
    assert d.examined <= len(data) - body + 10 * pieces


@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
def test_scan_resumes_through_small_random_reads(protocol):
    """The 945 KB get_users(5499) reply in reads of 1-64 bytes: structure-heavy, every token split somewhere."""
    data = cf.users_reply(cf.Wire(Framing.BUFFERED, protocol), 5499)[0]
    rng = random.Random(5499)
    d = feed_in_pieces(data, protocol, iter(lambda: rng.randint(1, 64), None))
    assert len(data) - d.last.body <= d.examined <= 2 * len(data)


@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
@pytest.mark.parametrize("key", ["roundtrip-call", "get_users-reply", "roundtrip-reply"])
def test_scanner_stops_and_resumes_at_every_split_point(protocol, key):
    f = cf.fixtures(cf.Wire(Framing.BUFFERED, protocol))[key]
    data = f.data
    d = Decoder(Framing.BUFFERED, protocol)
    d.feed(data)
    body = d.next_message().body
    whole = StructScanner(protocol is C, body)
    assert whole.advance(data, len(data)) is True
    assert whole.pos == len(data)
    for k in range(body, len(data)):
        s = StructScanner(protocol is C, body)
        assert s.advance(data, k) is False, k
        assert s.pos <= k
        assert s.advance(data, len(data)) is True, k
        assert s.pos == len(data)
    # And no end is found early: the struct minus its last STOP byte is incomplete.
    s = StructScanner(protocol is C, body)
    assert s.advance(data[:-1], len(data) - 1) is False


def test_pure_scanner_speed_on_the_945kb_get_users_reply(capsys):
    """Printed, not asserted (STYLE 13): time to find the end of get_users(5499)'s reply."""
    lines = []
    for protocol in (B, C):
        data = cf.users_reply(cf.Wire(Framing.BUFFERED, protocol), 5499)[0]
        d = Decoder(Framing.BUFFERED, protocol)
        d.feed(data)
        body = d.next_message().body
        times = []
        for _ in range(5):
            s = PureStructScanner(protocol is C, body)
            t = time.perf_counter()
            s.advance(data, len(data))
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1000
        lines.append(f"pure scanner, get_users(5499) {protocol.value} reply ({len(data):,} B): "
                     f"{ms:.1f} ms median of 5 ({len(data) / ms / 1000:.0f} MB/s)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
