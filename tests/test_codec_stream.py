"""UnframedStream: the end of an unframed message found chunk by chunk, nothing kept but a cut token.

Invariant (property tests): a Decoder that reads a message's first chunks, hands it over
(`detach_unframed`) and an UnframedStream that follows the rest give what the decoder alone
gives for the same bytes in one chunk: the same message bytes and the same bytes past its
end, or the same ProtocolError (message text included), or "not complete yet"; whatever
the reads, wherever the hand-over happens, under any max_frame_size, with either scanner.
"""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_fixtures as cf
from proxy.codec import Decoder, Framing, MessageType, Protocol, ProtocolError
from proxy.codec.scan import CompiledStructScanner, PureStructScanner
from test_codec_fuzz import chunkings, mangle

B, C = Protocol.BINARY, Protocol.COMPACT
SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCANNERS = [PureStructScanner] + ([CompiledStructScanner] if CompiledStructScanner is not None else [])
SCANNER_IDS = ["pure", "compiled"][:len(SCANNERS)]


def whole(data: bytes, protocol: Protocol, max_size: int, scanner) -> tuple:
    """The decoder alone, all bytes in one read: (message bytes, bytes past it) / error / incomplete."""
    d = Decoder(Framing.BUFFERED, protocol, max_size, scanner)
    d.feed(data)
    try:
        m = d.next_message()
    except ProtocolError as e:
        return ("error", e.message)
    if m is None:
        return ("incomplete",)
    return ("message", bytes(m.data), data[len(m.data):])


def streamed(chunks, protocol: Protocol, max_size: int, scanner, hand_over_after: int) -> tuple:
    """What a streaming upstream connection does: the decoder reads whole until the message
    has a head and is still incomplete `hand_over_after` reads on, then the stream takes over."""
    d = Decoder(Framing.BUFFERED, protocol, max_size, scanner)
    out = bytearray()
    tail = None
    reads = 0
    for i, c in enumerate(chunks):
        try:
            if tail is None:
                d.feed(c)
                m = d.next_message()
                if m is not None:
                    return ("message", bytes(m.data), b"".join([bytes(c[len(c) - d.buffered:])] + chunks[i + 1:])
                            if d.buffered else b"".join(chunks[i + 1:]), "whole")
                if d.unframed_head() is not None:
                    reads += 1
                    if reads > hand_over_after:
                        first, tail = d.detach_unframed()
                        assert d.buffered == 0
                        out += first
                        assert tail.size == len(out)
            else:
                n = tail.feed(c)
                assert 0 <= n <= len(c)
                out += c[:n]
                assert tail.size == len(out)
                assert tail.buffered <= 16, "more than a cut token kept between reads"
                if tail.done:
                    return ("message", bytes(out), b"".join([bytes(c[n:])] + chunks[i + 1:]), "streamed")
                assert n == len(c)
        except ProtocolError as e:
            assert e.message.startswith("bad request:"), e.message
            return ("error", e.message)
    return ("incomplete",)


def same(expected: tuple, got: tuple) -> bool:
    return got[:3] == expected


@st.composite
def message_and_more(draw, protocol):
    """A fixture message (maybe followed by another: bytes past the end) of `protocol`."""
    pool = [cf.fixtures(cf.Wire(Framing.BUFFERED, protocol))[k].data for k in cf.SMALL_KEYS]
    first = draw(st.sampled_from(pool))
    more = draw(st.sampled_from([b"", b"\x00", pool[0]]))
    return first + more


@pytest.mark.parametrize("scanner", SCANNERS, ids=SCANNER_IDS)
@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
@SETTINGS
@given(data=st.data(), rnd=st.randoms(use_true_random=False), hand_over_after=st.integers(0, 3),
       max_size=st.sampled_from([16_384_000, 64, 24]))
def test_streaming_finds_what_the_decoder_finds(scanner, protocol, data, rnd, hand_over_after, max_size):
    stream = data.draw(message_and_more(protocol))
    expected = whole(stream, protocol, 16_384_000, scanner)
    assert expected[0] == "message"
    for chunks in chunkings(stream, rnd):
        assert same(expected, streamed(chunks, protocol, 16_384_000, scanner, hand_over_after))
    # Broken bytes and small limits: the same outcome as the decoder's, whatever the reads.
    broken = rnd.randbytes(rnd.randint(0, 200)) if rnd.random() < 0.1 else mangle(stream, rnd)
    expected = whole(broken, protocol, max_size, scanner)
    for chunks in chunkings(broken, rnd):
        assert same(expected, streamed(chunks, protocol, max_size, scanner, hand_over_after))


@pytest.mark.parametrize("scanner", SCANNERS, ids=SCANNER_IDS)
@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
def test_large_replies_stream_through_random_reads(scanner, protocol):
    """get_users(5499) (945 KB binary) and a 3 MB echo reply, in reads of 1 byte to 300 KB."""
    wire = cf.Wire(Framing.BUFFERED, protocol)
    rnd = random.Random(5499)
    for data in (cf.users_reply(wire, 5499)[0], cf.echo_reply(wire, 3_000_000)[0]):
        for top in (64, 4096, 300_000):
            pieces = []
            i = 0
            while i < len(data):
                n = rnd.randint(1, top)
                pieces.append(data[i:i + n])
                i += n
            got = streamed(pieces + [b"\x00" * 10], protocol, 16_384_000, scanner, 0)
            assert got[:3] == ("message", data, b"\x00" * 10)
            if len(pieces) > 2:
                assert got[3] == "streamed"


@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
def test_a_limit_inside_a_cut_token_is_found_as_the_decoder_finds_it(protocol):
    """Every read boundary over the first few hundred bytes, a limit anywhere near it: the token
    cut by the boundary is finished on a small bridge buffer, which must respect the limit too."""
    data = cf.users_reply(cf.Wire(Framing.BUFFERED, protocol), 200)[0]
    scanner = SCANNERS[-1]
    for cut in range(60, 400):
        chunks = [data[:50], data[50:cut], data[cut:]]
        for limit in range(cut - 12, cut + 12):
            assert same(whole(data, protocol, limit, scanner), streamed(chunks, protocol, limit, scanner, 0))
        assert same(whole(data, protocol, 16_384_000, scanner),
                    streamed(chunks, protocol, 16_384_000, scanner, 0))


def _handed_over(data: bytes, cut: int, max_size: int = 16_384_000, protocol: Protocol = B):
    d = Decoder(Framing.BUFFERED, protocol, max_size)
    d.feed(data[:cut])
    assert d.next_message() is None
    assert d.unframed_head() is not None
    first, tail = d.detach_unframed()
    return d, first, tail


def test_feed_says_how_much_of_each_chunk_is_the_message():
    data = cf.echo_reply(cf.Wire(Framing.BUFFERED, B), 100_000)[0]
    d, first, tail = _handed_over(data, 1000)
    assert bytes(first) == data[:1000] and tail.size == 1000 and not tail.done
    assert tail.feed(data[1000:50_000]) == 49_000 and tail.size == 50_000
    rest = data[50_000:] + b"next message"
    assert tail.feed(rest) == len(data) - 50_000
    assert tail.done and tail.size == len(data)
    assert tail.feed(b"more") == 0  # nothing more belongs to it
    # The decoder was left empty: the next message reads as usual.
    following = cf.fixtures(cf.Wire(Framing.BUFFERED, B))["ping-reply"].data
    d.feed(following)
    assert d.next_message().data == following


def test_only_a_cut_token_is_kept_between_reads():
    data = cf.users_reply(cf.Wire(Framing.BUFFERED, C), 200)[0]
    d, first, tail = _handed_over(data, 100, protocol=C)
    kept = set()
    for i in range(100, len(data)):
        assert tail.feed(data[i:i + 1]) == 1
        kept.add(tail.buffered)
        assert tail.done == (i == len(data) - 1)
    assert max(kept) <= 11 and tail.size == len(data)
    assert tail.examined <= 12 * len(data)  # a cut token is re-read, never the message


def test_scan_examines_each_byte_about_once():
    data = cf.users_reply(cf.Wire(Framing.BUFFERED, B), 20_000)[0]
    d, first, tail = _handed_over(data, 65_536)
    for i in range(65_536, len(data), 65_536):
        tail.feed(data[i:i + 65_536])
    assert tail.done
    pieces = -(-(len(data) - 65_536) // 65_536)
    assert len(data) - 65_536 - 16 <= tail.examined <= len(data) - 65_536 + 10 * pieces


def test_over_max_size_is_refused_as_the_decoder_refuses_it():
    # A reply { 0: { 1: 20 bytes, 2: 100,000 bytes } }, handed over inside its first string.
    data = (struct.pack("!Ii", 0x80010002, 4) + b"echo" + struct.pack("!i", 7) + b"\x0c\x00\x00"
            + b"\x0b\x00\x01" + struct.pack("!i", 20) + b"x" * 20
            + b"\x0b\x00\x02" + struct.pack("!i", 100_000) + b"y" * 100_000 + b"\x00\x00")
    d, first, tail = _handed_over(data, 40, max_size=50_000)
    # The second string's length says the message ends past the limit: refused at once.
    with pytest.raises(ProtocolError, match="exceeds max_frame_size 50000"):
        tail.feed(data[40:2000])
    users = cf.users_reply(cf.Wire(Framing.BUFFERED, B), 2000)[0]
    d, first, tail = _handed_over(users, 1000, max_size=50_000)
    assert tail.feed(users[1000:49_999]) == 48_999
    with pytest.raises(ProtocolError, match="exceeds max_frame_size 50000"):
        tail.feed(users[49_999:50_000])


def test_garbage_mid_message_is_a_protocol_error():
    data = bytearray(cf.users_reply(cf.Wire(Framing.BUFFERED, B), 2000)[0])
    d, first, tail = _handed_over(bytes(data), 1000)
    # A struct field header with an invalid type where the scan will look next.
    with pytest.raises(ProtocolError, match="bad request: "):
        for i in range(1000, len(data), 100):
            tail.feed(b"\x63" * 100)


def test_unframed_head_waits_for_the_first_result_field():
    for protocol in (B, C):
        wire = cf.Wire(Framing.BUFFERED, protocol)
        ok = cf.echo_reply(wire, 100_000)[0]
        notfound = cf.fixtures(wire)["lookup-notfound-reply"].data
        for data, field in ((ok, 0), (notfound, 1)):
            d = Decoder(Framing.BUFFERED, protocol)
            seen = None
            for i in range(len(data) - 1):
                d.feed(data[i:i + 1])
                assert d.next_message() is None
                seen = d.unframed_head()
                if seen is not None:
                    break
            assert seen is not None, "never readable"
            name, mtype, _, first_field = seen
            assert (name, mtype, first_field) == ("echo" if field == 0 else "lookup", MessageType.REPLY, field)


def test_detach_only_while_a_message_is_scanned():
    d = Decoder(Framing.BUFFERED, B)
    with pytest.raises(RuntimeError):
        d.detach_unframed()


# -- FrameBody: a framed request's struct checked as it streams upstream -----------------------


def framed_whole(frame: bytes, protocol: Protocol, scanner) -> tuple:
    """The listener's decoder with the whole frame: ("ok",) or ("error", text)."""
    d = Decoder(Framing.FRAMED, protocol, 16_384_000, scanner, whole_body=True)
    d.feed(frame)
    try:
        m = d.next_message()
    except ProtocolError as e:
        return ("error", e.message)
    assert m is not None
    return ("ok",)


def framed_streamed(frame: bytes, protocol: Protocol, scanner, rnd, cut: int):
    """The listener's way with a frame that streams: the decoder reads `cut` bytes, hands the
    frame over (`detach_frame`, `frame_body`); the check sees the rest in random reads, some
    passed over unseen (as a splice moves the inside of a long string). None: no head yet."""
    d = Decoder(Framing.FRAMED, protocol, 16_384_000, scanner, whole_body=True)
    d.feed(frame[:cut])
    pending = d.pending_frame()
    if pending is None:
        return None
    msg, total = pending
    assert total == len(frame)
    held = d.detach_frame()
    assert b"".join(held) == frame[:cut]
    check = d.frame_body(msg, total)
    rest = frame[cut:]
    try:
        for part in held:
            check.feed(part)
        i = 0
        while i < len(rest):
            if check.opaque and rnd.random() < 0.5:
                assert check.opaque <= len(rest) - i, "opaque past the frame's end"
                n = rnd.randint(1, check.opaque)
                check.pass_over(n)
            else:
                n = rnd.randint(1, len(rest) - i)
                check.feed(rest[i:i + n])
            i += n
    except ProtocolError as e:
        return ("error", e.message)
    return ("ok",)


@st.composite
def framed_message(draw, protocol, rnd):
    """A fixture call, maybe with a second message or garbage after its struct, maybe mangled,
    in one frame of its own length."""
    pool = [cf.fixtures(cf.Wire(Framing.BUFFERED, protocol))[k].data for k in cf.SMALL_KEYS]
    body = draw(st.sampled_from(pool)) + draw(st.sampled_from([b"", b"", b"\x00", pool[0]]))
    if draw(st.booleans()):
        body = mangle(body, rnd)
    return struct.pack("!i", len(body)) + body


@pytest.mark.parametrize("scanner", SCANNERS, ids=SCANNER_IDS)
@pytest.mark.parametrize("protocol", [B, C], ids=["binary", "compact"])
@SETTINGS
@given(data=st.data(), rnd=st.randoms(use_true_random=False))
def test_a_streamed_frames_check_agrees_with_the_whole_frames(scanner, protocol, data, rnd):
    """Whatever the reads and what a splice passes over, a frame checked as it streams is
    refused exactly when, and with the text with which, the listener refuses it whole."""
    frame = data.draw(framed_message(protocol, rnd))
    if len(frame) < 6:
        return
    expected = framed_whole(frame, protocol, scanner)
    compared = 0
    for cut in sorted({rnd.randint(1, len(frame) - 1) for _ in range(6)}):
        got = framed_streamed(frame, protocol, scanner, rnd, cut)
        if got is not None:
            assert got == expected, (cut, frame.hex())
            compared += 1
    if expected == ("ok",):
        got = framed_streamed(frame, protocol, scanner, rnd, len(frame) - 1)
        assert got == expected


def test_a_second_message_in_a_streamed_frame_is_found_in_the_read_that_brings_it():
    """The check raises on the read holding the struct's STOP when the frame goes on, before
    that read goes on; a string claimed past the frame's end, on the read holding its length."""
    head = struct.pack("!Ii", 0x80010001, 4) + b"echo" + struct.pack("!i", 9)
    call = head + b"\x0b\x00\x01" + struct.pack("!i", 100_000) + b"x" * 100_000 + b"\x00"
    second = cf.fixtures(cf.Wire(Framing.BUFFERED, B))[cf.SMALL_KEYS[0]].data
    frame = struct.pack("!i", len(call) + len(second)) + call + second
    d = Decoder(Framing.FRAMED, B, 16_384_000, whole_body=True)
    d.feed(frame[:200])
    msg, total = d.pending_frame()
    check = d.frame_body(msg, total)
    for part in d.detach_frame():
        check.feed(part)
    check.feed(frame[200:3 + len(call)])  # all but the struct's STOP: fine so far
    with pytest.raises(ProtocolError, match=rf"{len(second)} byte\(s\) after the message inside its frame"):
        check.feed(frame[3 + len(call):4 + len(call)])  # its STOP, with the frame not at its end
    lying = head + b"\x0b\x00\x01" + struct.pack("!i", 10_000_000) + b"x" * 1000
    d = Decoder(Framing.FRAMED, B, 16_384_000, whole_body=True)
    d.feed(struct.pack("!i", len(lying) + 5000) + lying)
    msg, total = d.pending_frame()
    check = d.frame_body(msg, total)
    with pytest.raises(ProtocolError, match="struct goes on past the end of its frame"):
        for part in d.detach_frame():
            check.feed(part)
