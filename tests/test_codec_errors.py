"""Bad bytes: each is a ProtocolError carrying what to answer (DESIGN "Errors the proxy generates").

PROTOCOL_ERROR (7) for a malformed or oversized message, INVALID_TRANSFORM (8)
for an unknown THeader transform; the message starts with "bad request:"; the
head (name, seqid) rides along whenever it could be read, so the reply reaches
the right call. Bad bytes are taken from Apache Thrift fixtures and broken in one place.
"""

from __future__ import annotations

import struct
import zlib

import pytest

import codec_fixtures as cf
from proxy.codec import AppErrorType, Decoder, Framing, Head, HeaderBlock, Protocol, ProtocolError, reframe
from proxy.codec.heads import write_varint
from proxy.codec.theader import encode_header_frame

B, C, NS = Protocol.BINARY, Protocol.COMPACT, Protocol.BINARY_NONSTRICT
FRAMED_WIRES = [w for w in cf.WIRES if w.framing is not Framing.BUFFERED]


def fails(data: bytes, framing, protocol, max_frame_size: int = 16_384_000, app_type=7,
          starts: str = "bad request:") -> ProtocolError:
    """Feed data in one piece: next_message must raise (not wait for more)."""
    d = Decoder(framing, protocol, max_frame_size)
    d.feed(data)
    with pytest.raises(ProtocolError) as e:
        d.next_message()
    err = e.value
    assert err.app_type == app_type
    assert isinstance(err.app_type, AppErrorType)
    assert err.message.startswith(starts), err.message
    assert str(err) == err.message
    return err


def assert_head(err: ProtocolError, name: str, seqid: int, framing=None, protocol=None):
    assert err.head is not None, err.message
    assert (err.head.name, err.head.seqid) == (name, seqid)
    if framing is not None:
        assert err.head.framing is framing
    if protocol is not None:
        assert err.head.protocol is protocol


def fx(framing, protocol, key="lookup-ok-call", zlib=False) -> cf.Fixture:
    return cf.fixtures(cf.Wire(framing, protocol, zlib))[key]


def with_length(data: bytes, n: int) -> bytes:
    return struct.pack("!i", n) + data[4:]


# -- frame size ------------------------------------------------------------------


@pytest.mark.parametrize("wire", FRAMED_WIRES, ids=lambda w: w.id)
@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_oversized_frame_refused_at_the_prefix(wire: cf.Wire, auto: bool):
    f = fx(wire.framing, wire.protocol, zlib=wire.zlib)
    n = len(f.data) - 4
    config = (None, None) if auto and wire.autodetectable else (wire.framing, wire.protocol)

    # A frame of exactly max_frame_size is accepted ...
    d = Decoder(*config, max_frame_size=n)
    d.feed(f.data)
    assert d.next_message().data == f.data

    # ... one byte less and it is refused before the frame is complete.
    head_only = f.data[:-1]
    err = fails(head_only, *config, max_frame_size=n - 1,
                starts=f"bad request: frame of {n} bytes exceeds max_frame_size {n - 1}")
    assert err.close is True
    assert_head(err, "lookup", 2, wire.framing, wire.protocol)


@pytest.mark.parametrize("wire", [w for w in FRAMED_WIRES if not w.zlib], ids=lambda w: w.id)
def test_two_gigabyte_frame_refused_immediately(wire: cf.Wire):
    f = fx(wire.framing, wire.protocol)
    d = Decoder(wire.framing, wire.protocol)
    d.feed(f.data)
    body = d.next_message().body  # where the head ends (the args struct begins) in f.data
    prefix = b"\x7f\xff\xff\xff"
    if wire.framing is Framing.FRAMED_HEADER:
        prefix += b"\x7f\xff\xff\xfb"
    prefix_and_head = prefix + f.data[len(prefix):body]
    # Just the prefix: refused (explicit framing) with no head to address.
    err = fails(b"\x7f\xff\xff\xff", wire.framing, wire.protocol,
                starts="bad request: frame of 2147483647 bytes exceeds max_frame_size 16384000")
    assert err.head is None
    # The prefix and the head: refused at once, addressed to the call.
    err = fails(prefix_and_head, wire.framing, wire.protocol)
    assert err.message == "bad request: frame of 2147483647 bytes exceeds max_frame_size 16384000"
    assert_head(err, "lookup", 2)
    if wire.autodetectable:
        err = fails(prefix_and_head, None, None)
        assert_head(err, "lookup", 2, wire.framing, wire.protocol)


@pytest.mark.parametrize("framing", [Framing.FRAMED, Framing.HEADER, Framing.FRAMED_HEADER, None])
@pytest.mark.parametrize("length", [-1, -0x7FFFFFFF - 1, 0])
def test_negative_or_zero_frame_length(framing, length):
    data = struct.pack("!i", length) + bytes.fromhex("80010001") + b"\x00" * 8
    if framing is None:
        if length:
            err = fails(data, None, None, starts="bad request: cannot detect framing")
        else:
            err = fails(data, None, None, starts="bad request: invalid frame length 0")
    else:
        err = fails(data, framing, B, starts=f"bad request: invalid frame length {length}")
    assert err.close is True


def test_frame_length_checked_on_a_read_of_exactly_one_frame():
    """A read that is exactly one frame skips buffering; it must not skip the size check."""
    f = fx(Framing.FRAMED, B)
    fails(f.data, Framing.FRAMED, B, max_frame_size=len(f.data) - 5,
          starts="bad request: frame of")
    fails(b"\x00\x00\x00\x00", Framing.FRAMED, B, starts="bad request: invalid frame length 0")
    h = fx(Framing.HEADER, C)
    fails(h.data, Framing.HEADER, C, max_frame_size=len(h.data) - 5, starts="bad request: frame of")


# -- truncation ------------------------------------------------------------------


@pytest.mark.parametrize("wire", cf.WIRES, ids=lambda w: w.id)
def test_truncated_message_is_an_error_at_eof(wire: cf.Wire):
    f = fx(wire.framing, wire.protocol, zlib=wire.zlib)
    for cut in (1, 3, len(f.data) // 2, len(f.data) - 1):
        d = Decoder(wire.framing, wire.protocol)
        d.feed(f.data[:cut])
        assert d.next_message() is None
        assert d.buffered == cut
        with pytest.raises(ProtocolError) as e:
            d.eof()
        assert e.value.app_type == 7
        assert e.value.message == f"bad request: connection closed inside a message ({cut} bytes unframed)"


@pytest.mark.parametrize("wire,auto", [(w, a) for w in cf.WIRES for a in (False, True) if w.autodetectable or not a],
                         ids=lambda v: v.id if isinstance(v, cf.Wire) else ("auto" if v else "explicit"))
def test_head_of_a_message_still_arriving(wire: cf.Wire, auto: bool):
    """pending_head(): what a read timeout or EOF answers to, with the client's seqid."""
    config = (None, None) if auto else (wire.framing, wire.protocol)
    f = fx(wire.framing, wire.protocol, zlib=wire.zlib)
    want = Head("lookup", 1, 2, wire.framing, wire.protocol)
    d = Decoder(*config)
    assert d.pending_head() is None
    d.feed(f.data[:-1])
    assert d.pending_head() == want  # before any next_message() ...
    assert d.next_message() is None
    assert d.pending_head() == want  # ... and after it started on the message
    with pytest.raises(ProtocolError) as e:
        d.eof()
    assert e.value.head == want
    d.feed(f.data[-1:])
    assert d.next_message().data == f.data
    assert d.pending_head() is None
    # Only the first bytes: no head yet (THeader: just its seqid once the fixed part is here).
    d = Decoder(*config)
    d.feed(f.data[:3])
    assert d.pending_head() is None


def test_eof_between_messages_is_clean():
    f = fx(Framing.BUFFERED, C)
    d = Decoder(Framing.BUFFERED, C)
    d.feed(f.data + f.data)
    assert d.next_message() is not None and d.next_message() is not None
    d.eof()


# -- heads -----------------------------------------------------------------------

FRAMINGS = [Framing.FRAMED, Framing.BUFFERED]


def patch(framing, protocol, key, offset_in_plain: int, new: bytes) -> bytes:
    """A fixture with bytes of its plain message replaced at offset (framing kept valid)."""
    f = fx(framing, protocol, key)
    plain = bytearray(f.plain)
    plain[offset_in_plain:offset_in_plain + len(new)] = new
    plain = bytes(plain)
    return (struct.pack("!i", len(plain)) + plain) if framing is Framing.FRAMED else plain


@pytest.mark.parametrize("framing", FRAMINGS)
def test_wrong_binary_version(framing):
    err = fails(patch(framing, B, "ping-call", 0, bytes.fromhex("80020001")), framing, B,
                starts="bad request: bad binary protocol version 0x80020001")
    assert err.head is None


@pytest.mark.parametrize("framing", FRAMINGS)
def test_wrong_compact_version(framing):
    fails(patch(framing, C, "ping-call", 1, bytes((0x22,))), framing, C,
          starts="bad request: bad compact protocol version 2")
    fails(patch(framing, C, "ping-call", 0, bytes((0x83,))), framing, C,
          starts="bad request: bad compact protocol id 0x83")


@pytest.mark.parametrize("framing", FRAMINGS)
def test_strict_binary_refuses_an_unversioned_head(framing):
    data = fx(framing, NS, "ping-call").data
    err = fails(data, framing, B, starts="bad request: bad binary protocol version 0x00000004 "
                                         "(an unversioned message needs protocol binary_nonstrict)")
    # its head, read as unversioned, addresses the answer: the client's own seqid, not 0
    d = Decoder(framing, NS)
    d.feed(data)
    seqid = d.next_message().seqid
    assert seqid != 0
    assert_head(err, "ping", seqid, framing)


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("mtype", [0, 5, 7])
def test_invalid_message_type(framing, mtype):
    fails(patch(framing, B, "ping-call", 0, bytes((0x80, 0x01, 0x00, mtype))), framing, B,
          starts=f"bad request: invalid message type {mtype}")
    fails(patch(framing, C, "ping-call", 1, bytes(((mtype << 5) | 1,))), framing, C,
          starts=f"bad request: invalid message type {mtype}")
    # non-strict: the type byte follows the name ("ping")
    fails(patch(framing, NS, "ping-call", 8, bytes((mtype,))), framing, NS,
          starts=f"bad request: invalid message type {mtype}")


@pytest.mark.parametrize("framing", FRAMINGS)
def test_negative_method_name_length(framing):
    fails(patch(framing, B, "ping-call", 4, struct.pack("!i", -4)), framing, B,
          starts="bad request: bad method name length -4")


@pytest.mark.parametrize("protocol,offset", [(B, 4), (NS, 0), (C, 3)])
def test_method_name_beyond_the_frame(protocol, offset):
    # "ping" with a name length of 100 inside a frame of ~20 bytes.
    new = bytes((100,)) if protocol is C else struct.pack("!i", 100)
    data = patch(Framing.FRAMED, protocol, "ping-call", offset, new)
    fails(data, Framing.FRAMED, protocol, starts="bad request: message truncated inside its head")


@pytest.mark.parametrize("framing", [Framing.HEADER, Framing.FRAMED_HEADER])
def test_method_name_beyond_a_theader_frame_still_addressed_by_seqid(framing):
    f = fx(framing, B, "lookup-notfound-call")  # no info headers
    i = f.data.index(b"\x00\x00\x00\x06lookup")
    data = f.data[:i] + struct.pack("!i", 200) + f.data[i + 4:]
    err = fails(data, framing, B, starts="bad request: message truncated inside its head")
    assert_head(err, "", 3, framing, B)


@pytest.mark.parametrize("protocol", [B, C, NS])
def test_huge_method_name_length_unframed_refused_without_waiting(protocol):
    # A bogus name length must not make us buffer megabytes of an unframed stream.
    new = bytes((0x80, 0x80, 0x80, 0x40)) if protocol is C else struct.pack("!i", 0x7FFFFFF0)
    data = patch(Framing.BUFFERED, protocol, "ping-call", 3 if protocol is C else (0 if protocol is NS else 4), new)
    fails(data, Framing.BUFFERED, protocol, starts="bad request: bad method name length")


# -- body: negative lengths, nesting --------------------------------------------


def test_negative_string_length_binary():
    f = fx(Framing.BUFFERED, B, "lookup-ok-call")
    i = f.plain.index(b"\x00\x00\x00\x02k1")
    data = f.plain[:i] + struct.pack("!i", -5) + f.plain[i + 4:]
    err = fails(data, Framing.BUFFERED, B, starts="bad request: negative string length -5")
    assert_head(err, "lookup", 2, Framing.BUFFERED, B)


def test_negative_list_and_map_size_binary():
    f = fx(Framing.BUFFERED, B, "get_users-reply")
    i = f.plain.index(bytes((15, 0, 0, 12, 0, 0, 0, 3)))  # success: list<User> of 3
    data = f.plain[:i + 4] + struct.pack("!i", -1) + f.plain[i + 8:]
    err = fails(data, Framing.BUFFERED, B, starts="bad request: negative container size -1")
    assert_head(err, "get_users", 300)

    j = f.plain.index(bytes((13, 0, 8, 11, 11, 0, 0, 0, 3)))  # the first user's attrs map
    data = f.plain[:j + 5] + struct.pack("!i", -2) + f.plain[j + 9:]
    err = fails(data, Framing.BUFFERED, B, starts="bad request: negative container size -2")
    assert_head(err, "get_users", 300)


def test_compact_lengths_out_of_range():
    # Compact writes sizes as varints; a "negative" i32 size is a 5-byte varint >= 2**31.
    f = fx(Framing.BUFFERED, C, "lookup-ok-call")
    i = f.plain.index(b"\x02k1")
    minus5 = bytes((0xFB, 0xFF, 0xFF, 0xFF, 0x0F))
    data = f.plain[:i] + minus5 + f.plain[i + 1:]
    err = fails(data, Framing.BUFFERED, C, starts=f"bad request: length {2**32 - 5} out of range")
    assert_head(err, "lookup", 2, Framing.BUFFERED, C)

    g = fx(Framing.BUFFERED, C, "get_users-reply")
    j = g.plain.index(bytes((0x09, 0x00, 0x3C)))  # success: list, long-form field 0, 3 structs
    data = g.plain[:j + 2] + bytes((0xFC,)) + minus5 + g.plain[j + 3:]
    err = fails(data, Framing.BUFFERED, C, starts=f"bad request: length {2**32 - 5} out of range")
    assert_head(err, "get_users", 300)


def nested(protocol: Protocol, depth: int, kind: str = "struct") -> bytes:
    """A roundtrip CALL whose args struct nests `depth` levels in all (args struct included)."""
    if protocol is C:
        head = bytes((0x82, 0x21, 1, 9)) + b"roundtrip"
        if kind == "struct":
            return head + bytes((0x1C,)) * (depth - 1) + b"\x00" * depth
        # args { 1: list<list<...list<i32>>> }: innermost list empty
        return head + bytes((0x19,)) + bytes((0x19,)) * (depth - 2) + bytes((0x05,)) + b"\x00"
    head = bytes.fromhex("80010001") + struct.pack("!i", 9) + b"roundtrip" + struct.pack("!i", 1)
    if kind == "struct":
        return head + bytes((12, 0, 1)) * (depth - 1) + b"\x00" * depth
    lists = (bytes((15,)) + struct.pack("!i", 1)) * (depth - 2) + bytes((8,)) + struct.pack("!i", 0)
    return head + bytes((15, 0, 1)) + lists + b"\x00"


@pytest.mark.parametrize("protocol", [B, C])
@pytest.mark.parametrize("kind", ["struct", "list"])
def test_nesting_deeper_than_64(protocol, kind):
    d = Decoder(Framing.BUFFERED, protocol)
    ok = nested(protocol, 64, kind)
    d.feed(ok)
    assert d.next_message().data == ok
    err = fails(nested(protocol, 65, kind), Framing.BUFFERED, protocol,
                starts="bad request: nesting deeper than 64")
    assert_head(err, "roundtrip", 1)


# -- unframed size ---------------------------------------------------------------


@pytest.mark.parametrize("protocol", [B, C, NS])
def test_unframed_message_longer_than_max_frame_size(protocol):
    f = fx(Framing.BUFFERED, protocol, "get_users-reply")
    n = len(f.data)
    d = Decoder(Framing.BUFFERED, protocol, max_frame_size=n)
    d.feed(f.data)
    assert d.next_message().data == f.data
    err = fails(f.data, Framing.BUFFERED, protocol, max_frame_size=n - 1,
                starts=f"bad request: message exceeds max_frame_size {n - 1}")
    assert_head(err, "get_users", 300, Framing.BUFFERED, protocol)


@pytest.mark.parametrize("protocol", [B, C])
def test_unframed_message_refused_before_it_all_arrives(protocol):
    data, _ = cf.echo_call(cf.Wire(Framing.BUFFERED, protocol), 15_000_000)
    d = Decoder(Framing.BUFFERED, protocol, max_frame_size=1_000_000)
    fed = 0
    with pytest.raises(ProtocolError) as e:
        while True:
            d.feed(data[fed:fed + 65536])
            fed += 65536
            assert d.next_message() is None
    assert e.value.message == "bad request: message exceeds max_frame_size 1000000"
    assert_head(e.value, "echo", 5)
    # The string's length alone says it will not fit: refused with the first read.
    assert fed == 65536


def test_unframed_message_refused_once_its_scan_passes_the_limit():
    """Many small values (no long string to skip): refused once the limit is passed, not at the end."""
    data, _ = cf.users_reply(cf.Wire(Framing.BUFFERED, B), 2000)
    d = Decoder(Framing.BUFFERED, B, max_frame_size=100_000)
    fed = 0
    with pytest.raises(ProtocolError) as e:
        while True:
            d.feed(data[fed:fed + 4096])
            fed += 4096
            assert d.next_message() is None
    assert e.value.message == "bad request: message exceeds max_frame_size 100000"
    assert 100_000 <= fed < 100_000 + 4096 < len(data)


# -- THeader ---------------------------------------------------------------------


@pytest.mark.parametrize("framing", [Framing.HEADER, Framing.FRAMED_HEADER, None])
@pytest.mark.parametrize("protocol", [B, C])
def test_unknown_theader_transform(framing, protocol):
    f = fx(Framing.HEADER, protocol, "ping-call")
    data = encode_header_frame(HeaderBlock(0, 1, protocol.header_id, (3,), {"k": "v"}), f.plain)
    if framing is Framing.FRAMED_HEADER:
        data = struct.pack("!i", len(data)) + data
    err = fails(data, framing, None if framing is None else protocol, app_type=AppErrorType.INVALID_TRANSFORM,
                starts="bad request: unknown THeader transform 3 (only zlib is supported)")
    assert err.app_type == 8
    assert_head(err, "", 1, framing or Framing.HEADER, protocol)
    assert err.close is False  # the frame was whole: the connection can go on ...


@pytest.mark.parametrize("framing", [Framing.HEADER, Framing.FRAMED_HEADER])
def test_after_an_unknown_transform_the_next_message_decodes(framing):
    f = fx(framing, C, "ping-call")
    bad = encode_header_frame(HeaderBlock(0, 1, 2, (3,), {}), f.plain)
    if framing is Framing.FRAMED_HEADER:
        bad = struct.pack("!i", len(bad)) + bad
    for chunks in ([bad, f.data], [bad + f.data]):
        d = Decoder(framing, C)
        for c in chunks:
            d.feed(c)
        with pytest.raises(ProtocolError) as e:
            d.next_message()
        assert e.value.app_type == AppErrorType.INVALID_TRANSFORM and e.value.close is False
        m = d.next_message()
        assert (m.name, m.seqid, m.data) == ("ping", 1, f.data)
        assert d.buffered == 0


def test_theader_block_errors():
    f = fx(Framing.HEADER, B, "ping-call")
    good = encode_header_frame(HeaderBlock(0, 9, 0, (), {}), f.plain)
    # magic
    err = fails(good[:4] + b"\x0f\xfe" + good[6:], Framing.HEADER, B, starts="bad request: bad THeader magic 0x0ffe")
    # header size beyond the frame
    err = fails(good[:12] + b"\xff\xff" + good[14:], Framing.HEADER, B,
                starts="bad request: THeader header size 262140 beyond the frame")
    # unsupported protocol id (1 = JSON)
    err = fails(good[:14] + b"\x01" + good[15:], Framing.HEADER, None,
                starts="bad request: unsupported THeader protocol id 1")
    assert_head(err, "", 9)
    # compact payload where binary is configured
    c = encode_header_frame(HeaderBlock(0, 9, 2, (), {}), fx(Framing.HEADER, C, "ping-call").plain)
    err = fails(c, Framing.HEADER, B, starts="bad request: THeader protocol compact but binary is configured")
    assert_head(err, "", 9, Framing.HEADER, C)
    # framed THeader whose inner length disagrees with the frame
    fh = struct.pack("!i", len(good)) + good[:3] + bytes((good[3] + 1,)) + good[4:]
    fails(fh, Framing.FRAMED_HEADER, B, starts="bad request: framed THeader: inner length does not match")


def test_theader_block_header_count_is_bounded():
    """At most MAX_HEADERS key/value headers are read from one block: each costs the event loop
    ~1 µs, and a 256 KiB block of empty pairs cost every other client ~170 ms. A count the
    block's bytes cannot hold is refused before any is read."""
    from proxy.codec.theader import MAX_HEADERS, MAX_TRANSFORMS

    f = fx(Framing.HEADER, B, "ping-call")
    ok = encode_header_frame(HeaderBlock(0, 9, 0, (), {f"k{i}": "" for i in range(MAX_HEADERS)}), f.plain)
    d = Decoder(Framing.HEADER, B)
    d.feed(ok)
    m = d.next_message()
    assert (m.name, len(m.headers)) == ("ping", MAX_HEADERS)
    many = encode_header_frame(HeaderBlock(0, 9, 0, (), {f"k{i}": "" for i in range(MAX_HEADERS + 1)}), f.plain)
    err = fails(many, Framing.HEADER, B, starts=f"bad request: THeader block has {MAX_HEADERS + 1} headers "
                                                 f"(at most {MAX_HEADERS})")
    assert_head(err, "", 9)
    transforms = encode_header_frame(HeaderBlock(0, 9, 0, (1,) * (MAX_TRANSFORMS + 1), {}), f.plain)
    fails(transforms, Framing.HEADER, B, starts=f"bad request: THeader block has {MAX_TRANSFORMS + 1} transforms")
    good = encode_header_frame(HeaderBlock(0, 9, 0, (), {}), f.plain)

    def sections(*groups: dict) -> bytes:
        """A frame like `good` whose block holds one KEYVALUE section (info id 1) per group."""
        block = bytearray(b"\x00\x00")
        for g in groups:
            block.append(1)
            write_varint(block, len(g))
            for t in (t for kv in g.items() for t in kv):
                write_varint(block, len(t))
                block += t.encode()
        block += bytes(-len(block) % 4)
        frame = good[4:12] + struct.pack("!H", len(block) // 4) + bytes(block) + f.plain
        return struct.pack("!i", len(frame)) + frame

    # several sections: the bound counts them together, each section's count against its own bytes
    d = Decoder(Framing.HEADER, B)
    d.feed(sections({"a": "1", "b": "2", "c": "3"}, {"d": "4"}))
    assert d.next_message().headers == {"a": "1", "b": "2", "c": "3", "d": "4"}
    half = MAX_HEADERS // 2 + 1
    err = fails(sections({f"a{i}": "" for i in range(half)}, {f"b{i}": "" for i in range(half)}), Framing.HEADER, B,
                starts=f"bad request: THeader block has {2 * half} headers (at most {MAX_HEADERS})")
    assert_head(err, "", 9)
    # empty sections count too (a 256 KiB block holds 131,070 of them: ~100 ms of the loop)
    d = Decoder(Framing.HEADER, B)
    d.feed(sections(*([{}] * (MAX_HEADERS - 1)), {"k": "v"}))
    assert d.next_message().headers == {"k": "v"}
    err = fails(sections(*([{}] * (MAX_HEADERS + 1))), Framing.HEADER, B,
                starts=f"bad request: THeader block has {MAX_HEADERS + 1} key/value sections (at most {MAX_HEADERS})")
    assert_head(err, "", 9)
    # counts the 256-byte block cannot hold (zeros after them): told before any header is read
    for count, says in [(b"\x80\x80\x80\x80\x80\x80\x80\x80\x10", f"has {2 ** 60} headers"),  # 2^60
                        (b"\xe8\x07", "truncated THeader header block")]:  # 1000, 2 bytes each at least
        block = b"\x00\x00" + b"\x01" + count
        block += bytes(256 - len(block))
        frame = good[4:12] + struct.pack("!H", 64) + block + f.plain
        err = fails(struct.pack("!i", len(frame)) + frame, Framing.HEADER, B, starts="bad request: ")
        assert says in err.message, err.message
        assert_head(err, "", 9)


@pytest.mark.parametrize("protocol", [B, C])
def test_zlib_garbage(protocol):
    data = encode_header_frame(HeaderBlock(0, 4, protocol.header_id, (1,), {}), b"not zlib at all")
    err = fails(data, Framing.HEADER, protocol, starts="bad request: zlib payload does not inflate")
    assert_head(err, "", 4, Framing.HEADER, protocol)


@pytest.mark.parametrize("protocol", [B, C])
def test_zlib_payload_cut_short(protocol):
    """The head of a deflated payload cut short still reads; the whole payload does not."""
    f = fx(Framing.HEADER, protocol, "ping-call")
    data = encode_header_frame(HeaderBlock(0, 1, protocol.header_id, (1,), {}), zlib.compress(f.plain)[:-3])
    d = Decoder(Framing.HEADER, protocol)
    d.feed(data)
    m = d.next_message()
    assert (m.name, m.seqid, m.data) == ("ping", 1, data)
    with pytest.raises(ProtocolError) as e:
        m.payload()
    assert e.value.message == "bad request: zlib payload is truncated"


@pytest.mark.parametrize("protocol", [B, C])
def test_zlib_payload_inflating_past_the_limit_is_refused_when_inflated(protocol):
    """20 MB of zeros deflate to ~20 KB: the frame is small, its payload is not."""
    f = fx(Framing.HEADER, protocol, "echo-call")
    bomb = f.plain[:-8] + bytes(20_000_000)  # an echo call's head, then far too much
    data = encode_header_frame(HeaderBlock(0, 128, protocol.header_id, (1,), {}), zlib.compress(bomb))
    assert len(data) < 100_000
    d = Decoder(Framing.HEADER, protocol)
    d.feed(data)
    m = d.next_message()  # the head is read from a bounded prefix only
    assert (m.name, m.seqid) == ("echo", 128)
    with pytest.raises(ProtocolError) as e:
        m.payload()
    assert e.value.message == "bad request: inflated payload exceeds 16384000 bytes"
    with pytest.raises(ProtocolError) as e:
        reframe(m, Framing.FRAMED)
    assert e.value.message == "bad request: inflated payload exceeds 16384000 bytes"
    assert len(m.payload(max_size=20_000_000 + len(f.plain))) == len(bomb)
    # THeader to THeader needs no inflating: the payload passes as it came.
    assert reframe(m, Framing.FRAMED_HEADER)[4:] == data


def test_a_theader_frame_on_a_framed_listener_is_named_as_such():
    """A THeader client (e.g. proxy.client's default) on a framed/binary listener: the error says
    what it looks like and what to set, not "needs binary_nonstrict" (a new user's trap)."""
    frame = encode_header_frame(HeaderBlock(0, 1, 0, (), {}), fx(Framing.BUFFERED, B, "ping-call").data)
    fails(frame, Framing.FRAMED, B, starts="bad request: bad binary protocol version 0x0fff0000 (this looks like "
                                     "a THeader frame: set the listener's transport to header or auto)")


# -- a request's struct must fill its frame (Decoder whole_body: the listener) ---------------


@pytest.mark.parametrize("framing", [Framing.FRAMED, Framing.HEADER, Framing.FRAMED_HEADER])
@pytest.mark.parametrize("protocol", [B, C])
@pytest.mark.parametrize("extra", ["second-message", "one-byte", "struct-past-end"])
def test_a_request_whose_struct_does_not_fill_its_frame_is_refused_with_its_head(framing, protocol, extra):
    """An upstream's transport reads what is left of a frame as the next call. The upstream side
    (whole_body False) still takes such a message as it is: it is the upstream's to answer."""
    lookup = fx(Framing.FRAMED, protocol, "lookup-ok-call").plain
    second = fx(Framing.FRAMED, protocol, "ping-call").plain
    payload = {"second-message": lookup + second, "one-byte": lookup + b"\x00",
               "struct-past-end": lookup[:-1]}[extra]
    if framing is Framing.FRAMED:
        data = struct.pack("!i", len(payload)) + payload
    else:
        data = encode_header_frame(HeaderBlock(0, 5, protocol.header_id, (), {}), payload)
        if framing is Framing.FRAMED_HEADER:
            data = struct.pack("!i", len(data)) + data
    d = Decoder(framing, protocol, whole_body=True)
    assert d.take(data) is None
    d.feed(data)
    with pytest.raises(ProtocolError) as e:
        d.next_message()
    err = e.value
    assert err.message == ("bad request: the message's struct goes on past the end of its frame"
                           if extra == "struct-past-end" else
                           f"bad request: {len(payload) - len(lookup)} byte(s) after the message inside its frame "
                           "(a second message in one frame?)")
    assert err.head is not None and err.head.name == "lookup"
    lenient = Decoder(framing, protocol)
    lenient.feed(data)
    assert lenient.next_message().name == "lookup"
    if framing is not Framing.FRAMED:  # the same payload deflated (THeader zlib): inflated whole, checked
        zdata = encode_header_frame(HeaderBlock(0, 5, protocol.header_id, (1,), {}), zlib.compress(payload))
        if framing is Framing.FRAMED_HEADER:
            zdata = struct.pack("!i", len(zdata)) + zdata
        z = Decoder(framing, protocol, whole_body=True)
        z.feed(zdata)
        with pytest.raises(ProtocolError) as ze:
            z.next_message()
        assert ze.value.message == err.message and ze.value.head.name == "lookup"
        zwhole = encode_header_frame(HeaderBlock(0, 5, protocol.header_id, (1,), {}), zlib.compress(lookup))
        if framing is Framing.FRAMED_HEADER:
            zwhole = struct.pack("!i", len(zwhole)) + zwhole
        z = Decoder(framing, protocol, whole_body=True)
        z.feed(zwhole)
        assert z.next_message().name == "lookup"
    if framing is Framing.FRAMED:  # the message alone in its frame is taken (take: strict binary only)
        whole = struct.pack("!i", len(lookup)) + lookup
        exact = Decoder(framing, protocol, whole_body=True)
        exact.feed(whole)
        assert exact.next_message().name == "lookup"
        if protocol is B:
            assert Decoder(framing, protocol, whole_body=True).take(whole).name == "lookup"


def test_a_zlib_request_deflated_twice_into_a_bomb_is_refused_before_it_inflates():
    """197 bytes deflated twice can inflate to 16 MB (a list of empty structs), which the
    listener inflated and scanned on the loop (~110 ms each, 7.7 s with the pure scanner). One
    deflate cannot pass ~1032x: a payload that inflates past that is refused, with its head,
    having inflated no more than that. Deflated once, a 4 MB payload is taken."""
    head = struct.pack("!Ii", 0x80010001, 6) + b"lookup" + struct.pack("!i", 7)
    n = 4_000_000
    plain = head + b"\x0f\x00\x01\x0c" + struct.pack("!i", n) + b"\x00" * n + b"\x00"
    twice = encode_header_frame(HeaderBlock(0, 7, 0, (1, 1), {}), zlib.compress(zlib.compress(plain, 9), 9))
    assert len(twice) < 200
    d = Decoder(Framing.HEADER, B, whole_body=True)
    d.feed(twice)
    with pytest.raises(ProtocolError) as e:
        d.next_message()
    assert "inflates past" in e.value.message and "compression bomb" in e.value.message
    assert (e.value.head.name, e.value.head.seqid) == ("lookup", 7)
    once = encode_header_frame(HeaderBlock(0, 7, 0, (1,), {}), zlib.compress(plain, 9))
    d = Decoder(Framing.HEADER, B, whole_body=True)
    d.feed(once)
    assert d.next_message().name == "lookup"


def test_a_truncated_zlib_request_is_scanned_as_far_as_it_inflates():
    """A zlib stream without its end marker: Apache Thrift's Python reader takes what inflates,
    so the scan does too (and refuses a second message in it), rather than refusing it."""
    lookup = fx(Framing.FRAMED, B, "lookup-ok-call").plain
    second = fx(Framing.FRAMED, B, "ping-call").plain
    for payload, ok in [(lookup, True), (lookup + second, False)]:
        z = zlib.compressobj()
        cut = z.compress(payload) + z.flush(zlib.Z_SYNC_FLUSH)  # (no final block)
        data = encode_header_frame(HeaderBlock(0, 5, B.header_id, (1,), {}), cut)
        d = Decoder(Framing.HEADER, B, whole_body=True)
        d.feed(data)
        if ok:
            assert d.next_message().name == "lookup"
        else:
            with pytest.raises(ProtocolError, match="a second message in one frame"):
                d.next_message()


@pytest.mark.parametrize("framing,listener", [
    (f, lis) for f in (Framing.FRAMED, Framing.BUFFERED) for lis in ((None, None), (None, B), (f, None))])
def test_an_unversioned_message_where_the_listener_detects_is_answered_with_what_to_set(framing, listener):
    """Auto framing or protocol cannot tell an unversioned (non-strict) binary message from a
    frame (both begin with an i32 length): refused, and the error says what would read it, with
    the message's head (its client hears it, with its seqid, in its own framing). Before: no head,
    so the client's connection closed with no answer. Auto framing with protocol
    binary_nonstrict reads the same bytes (the decoder; the config refuses that pair)."""
    lf, lp = listener
    name = b"ping"
    body = struct.pack("!i", len(name)) + name + struct.pack("!bi", 1, 7) + b"\x00"
    data = struct.pack("!i", len(body)) + body if framing is Framing.FRAMED else body
    err = fails(data, lf, lp)
    said = "a framed" if framing is Framing.FRAMED else "an unframed"
    assert err.message == (
        f"bad request: {said} unversioned (non-strict) binary message: set the listener's protocol to "
        f"binary_nonstrict and its transport to {'framed' if framing is Framing.FRAMED else 'buffered'} "
        "(auto detects strict binary, compact and THeader only: an unversioned message begins with a "
        "length, as a frame does)"), err.message
    assert_head(err, "ping", 7, framing, NS)
    if framing is Framing.FRAMED:
        d = Decoder(None, Protocol.BINARY_NONSTRICT)
        d.feed(data)
        msg = d.next_message()
        assert (msg.name, msg.seqid, d.framing) == ("ping", 7, Framing.FRAMED)


@pytest.mark.parametrize("data", [
    struct.pack("!i", 13) + struct.pack("!i", 4) + b"pi\x01g" + struct.pack("!bi", 1, 7),  # a control byte
    struct.pack("!i", 13) + struct.pack("!i", 4) + b"ping" + struct.pack("!bi", 2, 7),  # a reply
    struct.pack("!i", 2000) + b"x" * 2000 + struct.pack("!bi", 1, 7),  # a name past 1,024 bytes
])
def test_bytes_that_are_not_plainly_an_unversioned_call_get_no_guessed_head(data):
    """Only a plain unversioned call (printable name of 1-1024 bytes, CALL or ONEWAY) is taken for
    one: other bytes get the generic error and no head (nothing answered in a guessed framing)."""
    err = fails(data, None, None, starts="bad request: cannot detect framing and protocol")
    assert err.head is None
