"""Encoding, checked by the Apache Thrift library reading what the codec writes.

exception_reply must be what a Thrift server would send (the generated client's
recv_* raises it), and reframe must move a message between framings without
touching its payload bytes, adding THeader info headers where asked.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, strategies as st
from thrift.Thrift import TApplicationException, TMessageType

import codec_fixtures as cf
from proxy.codec import AppErrorType, Decoder, Framing, Head, Message, Protocol, exception_reply, reframe
from proxy.codec.heads import peek_exception_type
from sidecar_test import AdminService, TestService

REPLY_CASES = [
    # fixture key, client class, recv method, bare name
    ("ping-call", TestService, "recv_ping", "ping"),
    ("lookup-ok-call", TestService, "recv_lookup", "lookup"),
    ("mux-ping-call", TestService, "recv_ping", "ping"),
    ("mux-add-call", AdminService, "recv_add", "add"),
]


def decode(data: bytes, framing, protocol) -> Message:
    d = Decoder(framing, protocol)
    d.feed(data)
    m = d.next_message()
    assert m is not None and d.buffered == 0
    return m


def strict(wire):
    """Our replies to non-strict binary clients use the strict head."""
    if wire.protocol is Protocol.BINARY_NONSTRICT:
        return cf.Wire(wire.framing, Protocol.BINARY, wire.zlib)
    return wire


def unzlib(wire: cf.Wire) -> cf.Wire:
    return cf.Wire(wire.framing, wire.protocol)


@pytest.mark.parametrize("wire", cf.WIRES, ids=lambda w: w.id)
@pytest.mark.parametrize("key,cls,recv,bare", REPLY_CASES, ids=[c[0] for c in REPLY_CASES])
def test_exception_reply_is_raised_by_the_apache_client(wire, key, cls, recv, bare):
    f = cf.fixtures(wire)[key]
    head = decode(f.data, wire.framing, wire.protocol).head
    text = "thrift-sidecar: not sent: no endpoint for cluster «users»"
    reply = exception_reply(head, AppErrorType.INTERNAL_ERROR, text)

    client = cls.Client(cf.reader(wire, reply))
    with pytest.raises(TApplicationException) as e:
        getattr(client, recv)()
    assert e.value.type == TApplicationException.INTERNAL_ERROR == 6
    assert e.value.message == text

    # What the generated client does not check, the head: bare name, the client's seqid.
    iprot = cf.reader(wire, reply)
    assert iprot.readMessageBegin() == (bare, TMessageType.EXCEPTION, f.seqid)

    # Byte for byte what an Apache Thrift server writes (it never deflates a reply we send);
    # to a non-strict client we answer with a strict (versioned) head, which every binary reader takes.
    assert reply == cf.application_exception(strict(unzlib(wire)), bare, f.seqid, 6, text)

    # And the codec reads its own reply back.
    m = decode(reply, wire.framing, wire.protocol)
    assert (m.name, m.type, m.seqid) == (bare, TMessageType.EXCEPTION, f.seqid)


@pytest.mark.parametrize("app_type", [AppErrorType.UNKNOWN_METHOD, AppErrorType.PROTOCOL_ERROR,
                                      AppErrorType.INVALID_TRANSFORM, 0])
@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.COMPACT, Protocol.BINARY_NONSTRICT])
def test_exception_reply_types(app_type, protocol):
    wire = cf.Wire(Framing.FRAMED, protocol)
    head = Head("Svc:lookup", TMessageType.CALL, 2**31 - 1, Framing.FRAMED, protocol)
    reply = exception_reply(head, app_type, "")
    client = TestService.Client(cf.reader(wire, reply))
    with pytest.raises(TApplicationException) as e:
        client.recv_lookup()
    assert e.value.type == int(app_type)
    assert cf.reader(wire, reply).readMessageBegin() == ("lookup", TMessageType.EXCEPTION, 2**31 - 1)
    assert reply == cf.application_exception(strict(wire), "lookup", 2**31 - 1, int(app_type), "")


# -- reframe ---------------------------------------------------------------------

FRAMINGS = [Framing.FRAMED, Framing.BUFFERED, Framing.HEADER, Framing.FRAMED_HEADER]
REFRAME_SOURCES = [w for w in cf.WIRES if w.protocol is not Protocol.BINARY_NONSTRICT]


def read_with_apache(wire: cf.Wire, data: bytes, f: cf.Fixture):
    """Apache Thrift reads `data` as `wire`: the head, then the whole args/result struct."""
    iprot = cf.reader(wire, data)
    assert iprot.readMessageBegin() == (f.name, f.type, f.seqid)
    body = struct_for(f)
    body.read(iprot)
    iprot.readMessageEnd()
    want = struct_for(f, cf.base_protocol(f.wire.protocol, cf.TMemoryBuffer(f.plain)))
    if isinstance(body, TApplicationException):
        assert (body.type, body.message) == (want.type, want.message) == (1, "Unknown function no_such_method")
    else:
        assert body == want
    return iprot


def struct_for(f: cf.Fixture, iprot=None):
    """The generated args/result struct of a fixture (read from iprot's message when given)."""
    if f.type == TMessageType.EXCEPTION:
        body = TApplicationException()
    else:
        module = AdminService if f.method in ("add", "version") else TestService
        method = "ping" if f.method == "no_such_method" else f.method
        body = getattr(module, f"{method}_{'result' if f.type == TMessageType.REPLY else 'args'}")()
    if iprot is not None:
        iprot.readMessageBegin()
        body.read(iprot)
    return body


@pytest.mark.parametrize("src", REFRAME_SOURCES, ids=lambda w: w.id)
@pytest.mark.parametrize("target", FRAMINGS, ids=lambda f: f.value)
def test_reframe_preserves_the_payload(src: cf.Wire, target: Framing):
    for f in cf.fixture_list(src):
        m = decode(f.data, src.framing, src.protocol)
        out = reframe(m, target)
        if target is src.framing:
            assert out is m.data
        m2 = decode(out, target, src.protocol)
        assert (m2.name, m2.type, m2.seqid, m2.framing) == (f.name, f.type, f.seqid, target)
        assert bytes(m2.payload()) == f.plain
        if src.framing.is_header and target.is_header:
            # THeader to THeader: block re-encoded, payload (deflated or not) untouched.
            assert bytes(m2.data[m2.start:]) == bytes(m.data[m.start:])
            assert m2.headers == f.headers
        read_with_apache(cf.Wire(target, src.protocol, src.zlib and target.is_header), out, f)


@pytest.mark.parametrize("target", [Framing.FRAMED, Framing.BUFFERED])
@pytest.mark.parametrize("src", [Framing.FRAMED, Framing.BUFFERED])
def test_reframe_nonstrict(src, target):
    wire = cf.Wire(src, Protocol.BINARY_NONSTRICT)
    for f in cf.fixture_list(wire):
        m = decode(f.data, src, wire.protocol)
        out = reframe(m, target)
        assert out == cf.fixtures(cf.Wire(target, Protocol.BINARY_NONSTRICT))[f.key].data
        read_with_apache(cf.Wire(target, wire.protocol), out, f)


@pytest.mark.parametrize("src", REFRAME_SOURCES, ids=lambda w: w.id)
@pytest.mark.parametrize("target", [Framing.HEADER, Framing.FRAMED_HEADER], ids=lambda f: f.value)
def test_reframe_to_theader_with_added_headers(src: cf.Wire, target: Framing):
    for f in cf.fixture_list(src):
        m = decode(f.data, src.framing, src.protocol)
        added = {**m.headers, "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                 "x-deadline-ms": "125", "ünï": "cödé"}
        out = reframe(m, target, added)
        m2 = decode(out, target, src.protocol)
        assert m2.headers == added
        assert (m2.name, m2.type, m2.seqid) == (f.name, f.type, f.seqid)
        assert bytes(m2.payload()) == f.plain
        if src.framing.is_header:
            assert bytes(m2.data[m2.start:]) == bytes(m.data[m.start:])
            assert m2.header.transforms == m.header.transforms
        iprot = read_with_apache(cf.Wire(target, src.protocol, src.zlib and src.framing.is_header), out, f)
        assert iprot.trans.get_headers() == {k.encode(): v.encode() for k, v in added.items()}


def test_reframe_header_to_header_without_changes_keeps_the_block():
    """HEADER <-> FRAMED_HEADER with no new headers only adds or drops the outer prefix,
    even for a block the codec would encode differently (here: an extra padding word)."""
    for protocol in (Protocol.BINARY, Protocol.COMPACT):
        h = cf.fixtures(cf.Wire(Framing.HEADER, protocol))["ping-call"]
        fh = cf.fixtures(cf.Wire(Framing.FRAMED_HEADER, protocol))["ping-call"]
        assert reframe(decode(h.data, Framing.HEADER, protocol), Framing.FRAMED_HEADER) == fh.data
        assert reframe(decode(fh.data, Framing.FRAMED_HEADER, protocol), Framing.HEADER) == h.data

        words = int.from_bytes(h.data[12:14], "big")
        block_end = 14 + 4 * words
        padded = (bytearray(h.data[:block_end]) + bytes(4) + h.data[block_end:])
        padded[0:4] = (len(padded) - 4).to_bytes(4, "big")
        padded[12:14] = (words + 1).to_bytes(2, "big")
        padded = bytes(padded)
        read_with_apache(cf.Wire(Framing.HEADER, protocol), padded, h)
        out = reframe(decode(padded, Framing.HEADER, protocol), Framing.FRAMED_HEADER)
        assert out == len(padded).to_bytes(4, "big") + padded
        back = reframe(decode(out, Framing.FRAMED_HEADER, protocol), Framing.HEADER)
        assert back == padded


# -- the type of an upstream's TApplicationException (what the breaker reads) ------------

@pytest.mark.parametrize("wire", cf.WIRES, ids=str)
@pytest.mark.parametrize("message", ["", "Unknown function add", "é" * 300, None])
def test_exception_type_is_read_from_what_apache_thrift_writes(wire, message):
    for app_type in (0, 1, 6, 7, 10, 11, -1, 2**31 - 1, -2**31):
        data = cf.application_exception(wire, "lookup", 7, app_type, message)
        m = decode(data, wire.framing, wire.protocol)
        assert m.exception_type() == app_type, (app_type, message)


@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.COMPACT, Protocol.BINARY_NONSTRICT])
def test_exception_type_of_a_cut_or_odd_struct_is_unknown_never_an_error(protocol):
    wire = cf.Wire(Framing.FRAMED, protocol)
    m = decode(cf.application_exception(wire, "add", 1, 1, "Unknown function add"), Framing.FRAMED, protocol)
    plain, body = bytes(m.readable), m.body
    for end in range(body, len(plain)):  # every cut: the type, or None; never a wrong one, never a raise
        assert peek_exception_type(plain, body, end, protocol) in (None, 1)
    assert peek_exception_type(plain, body, len(plain), protocol) == 1
    # a struct field before the type: not skipped, so the type is unknown
    first = bytes([0x0C, 0, 3]) if protocol is not Protocol.COMPACT else bytes([0x3C])
    assert peek_exception_type(plain[:body] + first + plain[body:], body, len(plain) + len(first), protocol) is None


@given(st.binary(max_size=64), st.sampled_from([Protocol.BINARY, Protocol.COMPACT]))
@example(bytes([0x25] + [0xFF] * 6 + [0x7F]), Protocol.COMPACT)  # an i32 varint of 49 bits
def test_exception_type_never_raises_on_garbage(data, protocol):
    t = peek_exception_type(data, 0, len(data), protocol)
    assert t is None or -2**31 <= t < 2**31
