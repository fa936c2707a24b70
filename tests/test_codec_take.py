"""Decoder.take (the hot path's one-read-one-message shortcut) agrees with feed + next_message,
and its compiled twin (proxy/codec/_message.c) agrees with the pure one on any input."""

from __future__ import annotations

import gc
import os
import struct
import sys

import pytest
from hypothesis import given, settings, strategies as st

from proxy.codec import Decoder, Framing, Message, MessageType, Protocol, ProtocolError
from proxy.codec import message as message_mod
from proxy.codec.message import CompiledTakeFramed, PureTakeFramed

FORCED_PURE = os.environ.get("THRIFT_SIDECAR_PURE_PYTHON", "") not in ("", "0")
needs_compiled = pytest.mark.skipif(CompiledTakeFramed is None, reason="proxy.codec._message not built")

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


# -- the compiled twin --------------------------------------------------------------------------


def test_compiled_take_is_built():
    """`make test` runs the compiled shortcut: a build that silently fell back to pure Python fails here."""
    if FORCED_PURE:
        assert message_mod.TAKE_IMPL == "python" and message_mod.take_framed is PureTakeFramed
        assert "MessageBase" not in [c.__name__ for c in Message.__mro__]
        return
    assert CompiledTakeFramed is not None, (
        "proxy.codec._message is not built: `pip install -e .` (make deps) compiles proxy/codec/_message.c "
        "with the system's C compiler; look for the build_ext warning in its output")
    assert message_mod.TAKE_IMPL == "c" and message_mod.take_framed is CompiledTakeFramed
    assert Message.__mro__[1].__name__ == "MessageBase"


def both(data, protocol, max_frame_size: int):
    pure = PureTakeFramed(data, protocol, max_frame_size)
    compiled = CompiledTakeFramed(data, protocol, max_frame_size)
    if pure is None:
        assert compiled is None
        return None
    assert type(compiled) is Message and compiled.data is data and compiled.readable is data
    for k in SLOTS:
        assert getattr(compiled, k) == getattr(pure, k), k
        assert type(getattr(compiled, k)) is type(getattr(pure, k)), k
    return compiled


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(mtype=st.integers(1, 4), name=st.binary(max_size=12) | st.text(max_size=6).map(str.encode),
       seqid=st.sampled_from([0, -1, 2**31 - 1, -2**31]) | st.integers(-2**31, 2**31 - 1),
       body=st.binary(min_size=1, max_size=20), protocol=st.sampled_from([Protocol.BINARY, Protocol.BINARY_NONSTRICT]),
       slack=st.sampled_from([0, 1, 2**40, 2**63, 2**64]))
def test_compiled_take_framed_builds_what_the_pure_one_builds(mtype, name, seqid, body, protocol, slack):
    data = frame(mtype, name, seqid, body)
    assert both(data, protocol, len(data) - 4 + slack) is not None  # every one of these is a message


@needs_compiled
@settings(max_examples=600, deadline=None)
@given(mtype=st.integers(-1, 260), name=st.binary(max_size=12) | st.text(max_size=6).map(str.encode),
       seqid=st.integers(-2**31, 2**31 - 1), body=st.binary(max_size=20),
       version=st.sampled_from([0x80010000, 0x80020000, 0x00010000, 0x80010100, 0xFFFF0000]),
       cut=st.integers(-3, 3), junk=st.binary(max_size=6), protocol=st.sampled_from(list(Protocol)),
       max_frame_size=st.sampled_from([16_384_000, 2**64, 20, 0, -1, -2**64]) | st.integers(0, 40),
       length_delta=st.sampled_from([0, -1, 1, 2**31]))
def test_compiled_take_framed_agrees_with_the_pure_one(mtype, name, seqid, body, version, cut, junk, protocol,
                                                       max_frame_size, length_delta):
    data = bytearray(frame(mtype & 0xFF, name, seqid, body, version))
    if length_delta:
        struct.pack_into("!I", data, 0, (len(data) - 4 + length_delta) & 0xFFFFFFFF)
    data = bytes(data)
    data = (data[:cut] if cut < 0 else data + junk[:cut]) or junk
    both(data, protocol, max_frame_size)


@needs_compiled
@pytest.mark.parametrize("data,max_frame_size", [
    (frame(1, b"", 9, b"\x00"), 100),                               # 17 bytes: the smallest message
    (frame(1, b"", 9, b""), 100),                                    # 16 bytes: no body
    (frame(1, b"ping", 9), len(frame(1, b"ping", 9)) - 4),           # length == max_frame_size
    (frame(1, b"ping", 9), len(frame(1, b"ping", 9)) - 5),           # one over
    (frame(1, b"ping", 9), len(frame(1, b"ping", 9)) - 3),           # one under
    (frame(1, b"x" * 65536, 9), 10**6),                              # name of MAX_NAME_LENGTH
    (frame(1, b"x" * 65537, 9), 10**6),                              # one over
    (struct.pack("!iIi", 13, 0x80010001, -1) + b"\x00" * 5, 100),    # a negative name length
    (struct.pack("!iIi", 13, 0x80010001, -2**31) + b"\x00" * 5, 100),
    (frame(4, b"ping", -2**31), 2**80),                              # a huge limit, the lowest seqid
    (frame(2, b"ping", 2**31 - 1), 2**80),
    (frame(3, b"ping", 1), 100.5),                                   # a float limit: the pure one decides
])
def test_compiled_take_framed_edges(data, max_frame_size):
    both(data, Protocol.BINARY, max_frame_size)
    both(data, Protocol.BINARY_NONSTRICT, max_frame_size)


@needs_compiled
def test_a_limit_that_is_not_an_int_gets_the_pure_ones_answer():
    data = frame(1, b"ping", 1)
    for limit in (None, "16"):
        with pytest.raises(TypeError):
            PureTakeFramed(data, Protocol.BINARY, limit)
        with pytest.raises(TypeError):
            CompiledTakeFramed(data, Protocol.BINARY, limit)
    assert CompiledTakeFramed(data[:3], Protocol.BINARY, None) is None  # too short: the limit is not read


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64), protocol=st.sampled_from(list(Protocol)))
def test_compiled_take_framed_agrees_on_random_bytes(data, protocol):
    both(data, protocol, 16_384_000)
    both(struct.pack("!i", len(data)) + data, protocol, 16_384_000)


@needs_compiled
def test_compiled_take_framed_refuses_what_is_not_a_bytes_object():
    data = frame(1, b"ping", 5)
    assert both(data, Protocol.BINARY, 100) is not None
    for other in (bytearray(data), memoryview(data)):
        assert CompiledTakeFramed(other, Protocol.BINARY, 100) is None
        assert PureTakeFramed(other, Protocol.BINARY, 100) is None
    name = "métho\udcff".encode("utf-8", "surrogatepass")  # not valid UTF-8: replaced, as the pure one does
    assert both(frame(1, name, 5), Protocol.BINARY, 100).name == name.decode("utf-8", "replace")


@needs_compiled
def test_a_compiled_message_is_a_whole_message_and_is_freed():
    data = frame(MessageType.REPLY, b"Svc:get", -7, b"\x0c\x00\x00\x00")
    refs = sys.getrefcount(data)
    msg = CompiledTakeFramed(data, Protocol.BINARY_NONSTRICT, 1000)
    assert (msg.service, msg.method, msg.head.seqid, msg.size, msg.oneway) == ("Svc", "get", -7, len(data), False)
    assert msg.result_field() == 0 and msg.payload() == memoryview(data)[4:]
    assert "Svc:get" in repr(msg) and msg.headers == {}
    msg.seqid = 3  # writable, as the pure Message's slots are
    assert msg.seqid == 3
    with pytest.raises(AttributeError):
        msg.other = 1  # no dict: slots only
    import copy
    import pickle
    for twin in (copy.copy(msg), copy.deepcopy(msg), pickle.loads(pickle.dumps(msg))):
        assert type(twin) is Message and all(getattr(twin, k) == getattr(msg, k) for k in SLOTS)
        assert bytes(twin.data) == data
    assert sys.getrefcount(data) == refs + 2  # data and readable
    del msg
    gc.collect()
    assert sys.getrefcount(data) == refs
