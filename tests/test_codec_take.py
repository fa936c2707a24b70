"""Decoder.take (the hot path's one-read-one-message shortcut) agrees with feed + next_message."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from proxy.codec import Decoder, Framing, MessageType, Protocol, ProtocolError

SLOTS = ("name", "type", "seqid", "framing", "protocol", "start", "header", "body")


def frame(mtype: int, name: bytes, seqid: int, body: bytes = b"\x00", version: int = 0x80010000) -> bytes:
    head = struct.pack("!Ii", version | mtype, len(name)) + name + struct.pack("!i", seqid)
    return struct.pack("!i", len(head) + len(body)) + head + body


def general(data: bytes, protocol, max_frame_size: int):
    dec = Decoder(Framing.FRAMED, protocol, max_frame_size)
    dec.feed(data)
    try:
        return dec.next_message(), dec.buffered
    except ProtocolError:
        return "error", None


def same(a, b) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in SLOTS) and bytes(a.data) == bytes(b.data) \
        and bytes(a.readable) == bytes(b.readable)


@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.BINARY_NONSTRICT])
def test_one_whole_frame_is_taken_as_next_message_would_give_it(protocol):
    data = frame(MessageType.CALL, "pïng".encode(), 77, b"\x0b\x00\x01\x00\x00\x00\x02hi\x00")
    dec = Decoder(Framing.FRAMED, protocol)
    msg = dec.take(data)
    assert msg is not None and msg.data is data  # the read's bytes object, not a copy
    ref, left = general(data, protocol, 16_384_000)
    assert same(msg, ref) and left == 0
    assert (msg.name, msg.seqid, msg.type) == ("pïng", 77, MessageType.CALL)
    assert dec.buffered == 0 and dec.next_message() is None


@pytest.mark.parametrize("data", [
    frame(1, b"ping", 1)[:-1],                         # truncated: needs more bytes
    frame(1, b"ping", 1) + frame(1, b"ping", 2),       # two messages in one read
    frame(1, b"ping", 1, body=b""),                    # no body: the general path's error
    frame(5, b"ping", 1),                              # bad message type
    frame(1, b"ping", 1, version=0x80020000),          # bad version
    struct.pack("!i", 8) + b"\x00\x00\x00\x04ping",    # non-strict head
    frame(1, b"x" * 70_000, 1),                        # name longer than allowed
])
def test_anything_else_is_left_to_the_general_path_untouched(data):
    dec = Decoder(Framing.FRAMED, Protocol.BINARY)
    assert dec.take(data) is None
    assert dec.buffered == 0


def test_nothing_is_taken_while_bytes_are_buffered_or_for_other_framings():
    whole = frame(1, b"ping", 1)
    dec = Decoder(Framing.FRAMED, Protocol.BINARY)
    dec.feed(whole[:3])
    assert dec.take(whole) is None and dec.buffered == 3
    assert Decoder(Framing.BUFFERED, Protocol.BINARY).take(whole) is None
    assert Decoder(Framing.HEADER, Protocol.BINARY).take(whole) is None
    assert Decoder(Framing.FRAMED, Protocol.COMPACT).take(whole) is None
    assert Decoder(Framing.FRAMED, None).take(whole) is None  # detection happens on the general path
    assert Decoder(Framing.FRAMED, Protocol.BINARY, max_frame_size=10).take(whole) is None


@settings(max_examples=400, deadline=None)
@given(mtype=st.integers(0, 6), name=st.binary(max_size=12), seqid=st.integers(-2**31, 2**31 - 1),
       body=st.binary(max_size=20), version=st.sampled_from([0x80010000, 0x80020000, 0x00010000]),
       cut=st.integers(-3, 3), junk=st.binary(max_size=6),
       protocol=st.sampled_from([Protocol.BINARY, Protocol.BINARY_NONSTRICT]),
       max_frame_size=st.sampled_from([16_384_000, 20]))
def test_take_agrees_with_the_general_path(mtype, name, seqid, body, version, cut, junk, protocol,
                                           max_frame_size):
    data = frame(mtype, name, seqid, body, version)
    data = (data[:cut] if cut < 0 else data + junk[:cut]) or junk
    dec = Decoder(Framing.FRAMED, protocol, max_frame_size)
    got = dec.take(data)
    ref, left = general(data, protocol, max_frame_size)
    if got is None:
        assert dec.buffered == 0  # untouched: feeding it now gives the general path's answer
        dec.feed(data)
        try:
            again = dec.next_message()
        except ProtocolError:
            again = "error"
        assert again == ref if isinstance(ref, str) or ref is None else same(again, ref)
    else:
        assert ref not in (None, "error") and left == 0 and same(got, ref)


@pytest.mark.parametrize("framing", [Framing.FRAMED, Framing.HEADER])
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 120_000), min_size=1, max_size=6))
def test_a_large_frame_gathered_from_its_reads_decodes_as_in_one_read(framing, cuts):
    """Frames >= 16 KiB left incomplete by a read are gathered as the reads' bytes (joined once):
    the same messages, heads and errors as feeding everything at once."""
    from codec_fixtures import TestService, Wire, _send, write  # written by the Apache library

    wire = Wire(framing, Protocol.BINARY)
    big = write(wire, _send(TestService, 9, "echo", b"x" * 100_000))
    small = write(wire, _send(TestService, 10, "ping"))
    stream = big + small
    ref = Decoder(framing, Protocol.BINARY)
    ref.feed(stream)
    want = [ref.next_message(), ref.next_message()]
    dec = Decoder(framing, Protocol.BINARY)
    got, pos, gathered = [], 0, False
    for cut in sorted(set(cuts)) + [len(stream)]:
        if cut <= pos:
            continue
        dec.feed(stream[pos:cut])
        pos = cut
        gathered |= dec._parts is not None
        if pos < len(big):
            assert dec.buffered == pos
            head = dec.pending_head()
            assert head is None or (head.seqid == 9 and head.name in ("echo", ""))  # "": THeader seqid only
        while (m := dec.next_message()) is not None:
            got.append(m)
    assert [(m.name, m.seqid, bytes(m.data)) for m in got] == [(m.name, m.seqid, bytes(m.data)) for m in want]
    assert dec.buffered == 0
    if min(cuts) >= 64 and min(cuts) < len(big):
        assert gathered  # the shortcut was taken


def test_a_large_frame_cut_short_by_eof_reports_its_head():
    body = b"\x0b\x00\x01" + struct.pack("!i", 50_000) + b"y" * 50_000 + b"\x00"
    data = frame(MessageType.CALL, b"echo", 31, body)
    dec = Decoder(Framing.FRAMED, Protocol.BINARY)
    dec.feed(data[:20_000])
    assert dec.next_message() is None and dec._parts is not None
    with pytest.raises(ProtocolError) as e:
        dec.eof()
    assert e.value.head.seqid == 31 and "20000 bytes" in e.value.message
