"""Byte-exact decoding of what Apache Thrift writes, across the whole framing x protocol matrix.

Every fixture comes from the Apache Thrift Python library (tests/codec_fixtures.py):
clients' send_* for CALL and ONEWAY, the generated Processor for REPLY and
EXCEPTION, multiplexed names included. Each test states the exact value it expects.
"""

from __future__ import annotations

import struct
import zlib

import pytest

import codec_fixtures as cf
from proxy.codec import Decoder, Framing, Message, MessageType, Protocol, ProtocolError, frame_payload

ALL_CASES = [pytest.param(w, k, id=f"{w.id}-{k}") for w in cf.WIRES for k in cf.fixtures(w)]


def decode_one(data: bytes, framing, protocol) -> Message:
    d = Decoder(framing, protocol)
    d.feed(data)
    msg = d.next_message()
    assert msg is not None
    assert d.next_message() is None
    assert d.buffered == 0
    d.eof()
    return msg


def summary(m: Message):
    """Everything a decoded message says, for comparing decoders."""
    return (m.name, m.type, m.seqid, m.framing, m.protocol, bytes(m.data), bytes(m.payload()), m.headers,
            m.method, m.service, m.result_field() if m.type == MessageType.REPLY else "n/a")


@pytest.mark.parametrize("wire,key", ALL_CASES)
def test_decodes_apache_message(wire: cf.Wire, key: str):
    f = cf.fixtures(wire)[key]
    m = decode_one(f.data, wire.framing, wire.protocol)
    assert (m.name, m.type, m.seqid) == (f.name, f.type, f.seqid)
    assert m.framing is wire.framing
    assert m.protocol is wire.protocol
    assert m.data == f.data
    assert m.size == len(f.data)
    assert bytes(m.payload()) == f.plain
    assert m.headers == f.headers
    assert m.method == f.method
    assert m.service == f.service
    assert m.oneway is (f.type == MessageType.ONEWAY)
    assert m.head.name == f.name and m.head.seqid == f.seqid and m.head.framing is wire.framing
    if f.type == MessageType.REPLY:
        assert m.result_field() == f.result
    if wire.framing.is_header:
        assert m.header is not None
        assert m.header.seqid == f.seqid
        assert m.header.protocol_id == wire.protocol.header_id
        assert m.header.transforms == ((1,) if wire.zlib else ())
    else:
        assert m.header is None


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if not w.zlib], ids=lambda w: w.id)
def test_apache_bytes_are_the_plain_message_in_its_framing(wire: cf.Wire):
    """The fixtures are framing + plain message, and frame_payload writes exactly that."""
    for f in cf.fixture_list(wire):
        if wire.framing is Framing.FRAMED:
            assert f.data == struct.pack("!i", len(f.plain)) + f.plain
        elif wire.framing is Framing.BUFFERED:
            assert f.data == f.plain
        assert frame_payload(f.plain, wire.framing, wire.protocol, f.seqid, f.headers) == f.data, f.key


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if w.zlib], ids=lambda w: w.id)
def test_zlib_payload_stays_deflated_in_data(wire: cf.Wire):
    for f in cf.fixture_list(wire):
        m = decode_one(f.data, wire.framing, wire.protocol)
        assert bytes(m.data[m.start:]) == zlib.compress(f.plain)
        assert len(f.data) - m.start == len(zlib.compress(f.plain))


def test_thrift_header_fields_byte_exact():
    """The THeader fixed part and block of one request, spelled out."""
    wire = cf.Wire(Framing.HEADER, Protocol.COMPACT)
    f = cf.fixtures(wire)["lookup-notfound-call"]  # no info headers
    assert f.data[4:14] == bytes.fromhex("0fff" "0000" "00000003" "0001")
    assert f.data[14:18] == bytes((2, 0, 0, 0))  # protocol id 2, no transforms, padding
    assert f.data[18:] == f.plain
    assert struct.unpack("!i", f.data[:4])[0] == len(f.data) - 4


def test_compact_success_uses_the_long_field_form():
    """Field 0 cannot be a delta in compact: the type byte's high nibble is 0, the id a zigzag varint."""
    for wire in (cf.Wire(Framing.FRAMED, Protocol.COMPACT), cf.Wire(Framing.BUFFERED, Protocol.COMPACT)):
        f = cf.fixtures(wire)["mux-add-reply"]
        m = decode_one(f.data, wire.framing, wire.protocol)
        body = bytes(m.readable[m.body:m.body + 3])
        assert body[0] == 0x05 and body[1] == 0x00  # i32 type, long form, zigzag(0)
        assert m.result_field() == 0
        assert m.name == "add"


def test_compact_seqid_is_signed_32_bit():
    # Java writes a negative seqid as the varint of its unsigned 32-bit value.
    data = bytes((0x82, 0x21, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F, 4)) + b"ping" + b"\x00"
    m = decode_one(data, Framing.BUFFERED, Protocol.COMPACT)
    assert (m.name, m.type, m.seqid) == ("ping", MessageType.CALL, -1)


@pytest.mark.parametrize("wire", cf.WIRES, ids=lambda w: w.id)
def test_pipelined_messages_come_out_in_order(wire: cf.Wire):
    fx = cf.fixture_list(wire)
    stream = b"".join(f.data for f in fx)
    for step in (len(stream), 7, 1):
        d = Decoder(wire.framing, wire.protocol)
        got = []
        for i in range(0, len(stream), step):
            d.feed(stream[i:i + step])
            while (m := d.next_message()) is not None:
                got.append(m)
        assert [(m.name, m.seqid, m.data) for m in got] == [(f.name, f.seqid, f.data) for f in fx]
        assert d.buffered == 0


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if w.framing in (Framing.FRAMED, Framing.HEADER)],
                         ids=lambda w: w.id)
def test_a_read_of_exactly_one_frame_is_kept_as_is(wire: cf.Wire):
    f = cf.fixtures(wire)["ping-call"]
    data = bytes(bytearray(f.data))  # a fresh object
    d = Decoder(wire.framing, wire.protocol)
    d.feed(data)
    m = d.next_message()
    assert m.data is data


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if w.framing is Framing.BUFFERED], ids=lambda w: w.id)
def test_an_unframed_message_that_is_one_whole_read_is_kept_as_is(wire: cf.Wire):
    """Scanned where it is: no copy into the buffer and out again. A read that begins a
    message and goes on past it, or ends before it, still gives the right messages."""
    f = cf.fixtures(wire)["ping-call"]
    data = bytes(bytearray(f.data))
    d = Decoder(wire.framing, wire.protocol)
    d.feed(data)
    m = d.next_message()
    assert m.data is data and d.buffered == 0
    two = f.data + f.data
    d.feed(two[:len(f.data) + 3])  # a whole message and the next one's first bytes
    assert d.next_message().data == f.data and d.next_message() is None and d.buffered == 3
    d.feed(two[len(f.data) + 3:])
    assert d.next_message().data == f.data and d.buffered == 0


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if w.autodetectable], ids=lambda w: w.id)
@pytest.mark.parametrize("mode", ["auto", "auto-framing", "auto-protocol"])
def test_auto_detection_matches_explicit_config(wire: cf.Wire, mode: str):
    framing = None if mode in ("auto", "auto-framing") else wire.framing
    protocol = None if mode in ("auto", "auto-protocol") else wire.protocol
    fx = cf.fixture_list(wire)
    stream = b"".join(f.data for f in fx)
    for step in (len(stream), 3):
        d = Decoder(framing, protocol)
        got = []
        for i in range(0, len(stream), step):
            d.feed(stream[i:i + step])
            while (m := d.next_message()) is not None:
                got.append(summary(m))
        want = [summary(decode_one(f.data, wire.framing, wire.protocol)) for f in fx]
        assert got == want
        assert (d.framing, d.protocol) == (wire.framing, wire.protocol)


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if not w.autodetectable], ids=lambda w: w.id)
@pytest.mark.parametrize("mode", ["auto", "auto-protocol"])
def test_nonstrict_binary_is_explicit_only(wire: cf.Wire, mode: str):
    """An unversioned head looks like a length: detection refuses it rather than guess, and says
    what to set (with the head, for the answer)."""
    framing = None if mode == "auto" else wire.framing
    d = Decoder(framing, None)
    f = cf.fixtures(wire)["ping-call"]
    d.feed(f.data)
    with pytest.raises(ProtocolError) as e:
        d.next_message()
    assert "unversioned (non-strict) binary message: set the listener's protocol to binary_nonstrict" in e.value.message
    assert e.value.app_type == 7
    assert (e.value.head.name, e.value.head.seqid, e.value.head.framing) == (f.name, f.seqid, wire.framing)


@pytest.mark.parametrize("framing", [Framing.FRAMED, Framing.BUFFERED])
def test_nonstrict_config_also_reads_strict_messages(framing):
    strict = cf.fixtures(cf.Wire(framing, Protocol.BINARY))
    for f in strict.values():
        m = decode_one(f.data, framing, Protocol.BINARY_NONSTRICT)
        assert (m.name, m.type, m.seqid, m.data) == (f.name, f.type, f.seqid, f.data)
        assert m.protocol is Protocol.BINARY_NONSTRICT


@pytest.mark.parametrize("wire", cf.WIRES, ids=lambda w: w.id)
def test_fifteen_megabyte_echo(wire: cf.Wire):
    data, plain = cf.echo_call(wire, 15_000_000)
    d = Decoder(wire.framing, wire.protocol)
    got = []
    for i in range(0, len(data), 65536):
        d.feed(data[i:i + 65536])
        while (m := d.next_message()) is not None:
            got.append(m)
    assert len(got) == 1
    m = got[0]
    assert (m.name, m.type, m.seqid) == ("echo", MessageType.CALL, 5)
    assert m.data == data
    assert bytes(m.payload()) == plain
    assert d.buffered == 0


BIG_REPLY_WIRES = [cf.Wire(Framing.FRAMED, Protocol.BINARY), cf.Wire(Framing.BUFFERED, Protocol.COMPACT),
                   cf.Wire(Framing.BUFFERED, Protocol.BINARY_NONSTRICT), cf.Wire(Framing.HEADER, Protocol.COMPACT),
                   cf.Wire(Framing.FRAMED_HEADER, Protocol.BINARY), cf.Wire(Framing.HEADER, Protocol.BINARY, True),
                   cf.Wire(Framing.FRAMED_HEADER, Protocol.COMPACT, True)]


@pytest.mark.parametrize("wire", BIG_REPLY_WIRES, ids=lambda w: w.id)
def test_fifteen_megabyte_echo_reply(wire: cf.Wire):
    data, plain = cf.echo_reply(wire, 15_000_000)
    d = Decoder(wire.framing, wire.protocol)
    d.feed(data)
    m = d.next_message()
    assert (m.name, m.type, m.seqid) == ("echo", MessageType.REPLY, 5)
    assert m.data == data
    assert m.result_field() == 0  # a zlib payload: read from its inflated prefix only
    assert bytes(m.payload()) == plain
    assert d.buffered == 0


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if w.framing is Framing.FRAMED_HEADER], ids=lambda w: w.id)
@pytest.mark.parametrize("protocol_given", [True, False], ids=["protocol", "auto-protocol"])
def test_header_config_accepts_theader_nested_in_framed(wire: cf.Wire, protocol_given: bool):
    """Config says just "header": a client that nests THeader in a framed frame is read (and answered) so."""
    fx = cf.fixture_list(wire)
    stream = b"".join(f.data for f in fx)
    want = [summary(decode_one(f.data, wire.framing, wire.protocol)) for f in fx]
    for step in (len(stream), 1, 9):
        d = Decoder(Framing.HEADER, wire.protocol if protocol_given else None)
        got = []
        for i in range(0, len(stream), step):
            d.feed(stream[i:i + step])
            while (m := d.next_message()) is not None:
                got.append(summary(m))
        assert got == want
        assert d.framing is Framing.FRAMED_HEADER


def test_header_config_keeps_plain_theader_plain():
    wire = cf.Wire(Framing.HEADER, Protocol.BINARY)
    f = cf.fixtures(wire)["ping-call"]
    d = Decoder(Framing.HEADER, Protocol.BINARY)
    d.feed(f.data[:5])
    assert d.next_message() is None and d.framing is Framing.HEADER
    d.feed(f.data[5:])
    assert d.next_message().framing is Framing.HEADER
    # Decided on the first message: a later nested frame is not THeader here.
    d.feed(cf.fixtures(cf.Wire(Framing.FRAMED_HEADER, Protocol.BINARY))["ping-call"].data)
    with pytest.raises(ProtocolError) as e:
        d.next_message()
    assert e.value.message.startswith("bad request: bad THeader magic")


@pytest.mark.parametrize("wire", [cf.Wire(Framing.FRAMED, Protocol.BINARY), cf.Wire(Framing.BUFFERED, Protocol.COMPACT),
                                  cf.Wire(Framing.HEADER, Protocol.BINARY)], ids=lambda w: w.id)
def test_feed_takes_any_bytes_like_and_keeps_no_reference_to_mutable_input(wire: cf.Wire):
    f = cf.fixtures(wire)["lookup-ok-call"]
    for make in (bytearray, memoryview, lambda b: memoryview(bytearray(b))):
        src = make(f.data)
        d = Decoder(wire.framing, wire.protocol)
        d.feed(src)
        m = d.next_message()
        if isinstance(src, memoryview):
            src = src.obj if isinstance(src.obj, bytearray) else None
        if src is not None:
            src[:] = bytes(len(src))  # the caller reuses its buffer
        assert isinstance(m.data, bytes)
        assert (m.name, m.seqid, m.data) == ("lookup", 2, f.data)


def test_a_large_frames_head_trickled_byte_by_byte_is_found_within_twice_its_bytes():
    """pending_frame reads a cut head again only as the bytes double (at most 4 KiB apart), not
    at every read (before: each read joined all the reads so far, quadratic in a trickled name)."""
    name = b"m" * 3000
    frame = struct.pack("!iIi", 100_000, 0x80010001, len(name)) + name + struct.pack("!i", 7)
    frame += b"\x00" * (100_004 - len(frame))
    head_end = 4 + 8 + len(name) + 4
    d = Decoder(Framing.FRAMED, Protocol.BINARY)
    d.feed(frame[:64])
    assert d.next_message() is None
    found = None
    for i in range(64, 20_000):
        d.feed(frame[i:i + 1])
        got = d.pending_frame()
        if got is not None:
            found = i + 1
            break
    assert found is not None and head_end <= found <= 2 * head_end, found
    msg, total = got
    assert (msg.name, msg.seqid, total) == ("m" * 3000, 7, 100_004)
