"""The rest of a large streaming reply goes upstream socket → client socket by splice(2).

Every test checks that the splice did happen (the pool's `spliced_replies` or `spliced_requests` count), so that none of them
passes by streaming through the transports instead."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import threading
import time

import pytest

from harness import (Proxy, RawUpstream, ThriftServer, client, config_text, request_bytes, small_window_client,
                     wait_for)
from proxy import splice

pytestmark = pytest.mark.skipif(not splice.available, reason="no splice(2) here")


def _config(upstream: str, listener: str = "") -> str:
    return config_text([upstream]).replace(
        "    protocol: binary\n    routes", f"    protocol: binary\n    max_frame_size: 300MiB{listener}\n    routes").replace(
        "    load_balancer", "    max_reply_size: 300MiB\n    load_balancer")


def _stats(p) -> dict:
    """The pool's snapshot (counts and stats), taken on the proxy's loop; {} before it exists."""
    def snap():
        (ep,) = p.server.clusters["up"].endpoints
        return {k: v for pool in ep.pools.values() for k, v in pool.snapshot().items()}
    return p.call(snap)


PING_REPLY = 38  # bytes of ShaUpstream's framed ping reply


def _leftovers() -> tuple[list[str], int]:
    """Sockets open more than once in this process (a splice's dup'd fds not closed), and how
    many pipes are open (a splice keeps up to PIPES_KEPT empty ones for the next)."""
    seen: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        seen[t] = seen.get(t, 0) + 1
    dups = [t for t, n in seen.items() if t.startswith("socket:") and n > 1]
    return dups, sum(1 for t in seen if t.startswith("pipe:"))


def _no_leftovers(pipes_before: int) -> bool:
    dups, pipes = _leftovers()
    return not dups and pipes <= pipes_before + splice.PIPES_KEPT


class ShaUpstream(RawUpstream):
    """Answers echo with a reply of `size` random bytes (sent in 1 MiB writes) and remembers
    their sha256; ping with 10 bytes. `die_after`: reset the connection after that many."""

    def __init__(self, size: int, die_after: int | None = None) -> None:
        self.size = size
        self.die_after = die_after
        self.sha = None
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):  # (the proxy may drop a connection mid-reply)
            for name, seqid in self.requests(c):
                size = 10 if name == b"ping" else self.size
                payload = os.urandom(size)
                self.sha = hashlib.sha256(payload).hexdigest()
                head = struct.pack("!Ii", 0x80010002, len(name)) + name + struct.pack("!i", seqid)
                field = b"\x0b" + struct.pack("!h", 0) + struct.pack("!i", size)
                c.sendall(struct.pack("!i", len(head) + len(field) + size + 1) + head + field)
                for at in range(0, size, 1 << 20):
                    c.sendall(payload[at:at + (1 << 20)])
                    if self.die_after is not None and at + (1 << 20) >= self.die_after:
                        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return  # reset mid-reply
                c.sendall(b"\x00")


def _read_reply(s: socket.socket, pause: float = 0.0, chunk: int = 1 << 20) -> bytes:
    """One framed reply from a raw socket, read `chunk` bytes at a time with `pause` between."""
    parts, got, total = [], 0, None
    while total is None or got < total:
        data = s.recv(chunk)
        assert data, f"closed after {got} bytes"
        parts.append(data)
        got += len(data)
        if total is None and got >= 4:
            total = 4 + struct.unpack("!i", b"".join(parts)[:4])[0]
        if pause:
            time.sleep(pause)
    reply = b"".join(parts)
    assert len(reply) == total
    return reply


def _payload_sha(reply: bytes, size: int) -> str:
    return hashlib.sha256(reply[-1 - size:-1]).hexdigest()


def test_a_large_reply_is_spliced_byte_exact_and_its_connection_reused():
    up = ShaUpstream(10_000_000)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.settimeout(10)
                for seqid in (1, 2):
                    s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=seqid))
                    reply = _read_reply(s)
                    assert _payload_sha(reply, 10_000_000) == up.sha
                    assert struct.unpack_from("!i", reply, 4 + 4 + 4 + 4)[0] == seqid  # (head: "echo")
                s.sendall(request_bytes("framed", "binary", "ping", seqid=3))  # after it, on the same
                assert len(_read_reply(s)) == PING_REPLY  # upstream connection
            stats = _stats(p)
        assert stats["spliced_replies"] == 2, stats
        # (from the first read after which the client's transport held nothing: timing decides)
        assert 2 * (1 << 20) <= stats["spliced_bytes"] <= 2 * len(reply), stats
        assert stats["connects"] == 1 and up.connections == 1
    finally:
        up.close()


def test_a_client_that_half_closes_after_its_request_still_gets_a_spliced_reply():
    """shutdown(SHUT_WR) right after the request: the client still reads, so the reply still
    streams, spliced. Before: read whole into the proxy's memory (up to max_reply_size per client)."""
    up = ShaUpstream(20_000_000)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.settimeout(10)
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=5))
                s.shutdown(socket.SHUT_WR)
                reply = _read_reply(s, pause=0.002)
                assert _payload_sha(reply, 20_000_000) == up.sha
                assert s.recv(1) == b""  # then the proxy closes
            stats = _stats(p)
        assert stats["spliced_replies"] == 1, stats
    finally:
        up.close()


def test_a_generated_client_gets_spliced_replies():
    """Apache Thrift's own client and server, 1.5 and 6 MB echoes, and a small one between."""
    up = ThriftServer()
    try:
        with Proxy(_config(up.address)) as p:
            with client(p.port()) as c:
                for size in (1_500_000, 30_000, 6_000_000):
                    big = os.urandom(size)
                    assert c.echo(big) == big
            stats = _stats(p)
        assert stats["spliced_replies"] == 2, stats
    finally:
        up.stop()


def test_a_slow_reader_gets_every_byte_and_its_pauses_are_counted():
    """A client that reads 64 KiB every 5 ms through a small receive buffer: the splice waits on
    its socket (the client connection is paused, as its transport would be) and goes on."""
    up = ShaUpstream(6_000_000)
    try:
        with Proxy(_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            s = small_window_client(p.port())
            with s:
                s.settimeout(10)
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=4))
                reply = _read_reply(s, pause=0.005, chunk=64 * 1024)
                assert _payload_sha(reply, 6_000_000) == up.sha
                s.sendall(request_bytes("framed", "binary", "ping", seqid=5))  # the connection goes on
                assert len(_read_reply(s)) == PING_REPLY
            wait_for(lambda: len(done) == 2, 5, "both calls recorded")
            stats = _stats(p)
        assert stats["spliced_replies"] == 1, stats
        (call,) = [c for c in done if c.msg.name == "echo"]
        assert call.streamed and call.outcome == "success"
        assert call.client_paused_ns > 100_000_000, call.client_paused_ns  # ~450 ms of reading
    finally:
        up.close()


def test_upstream_reset_mid_splice_closes_only_that_client():
    up = ShaUpstream(8_000_000, die_after=3_000_000)
    _, pipes = _leftovers()
    try:
        with Proxy(_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=5))
                s.settimeout(10)
                got = 0
                while chunk := s.recv(1 << 20):
                    got += len(chunk)
                assert 0 < got < 8_000_000  # part of it came, then the connection closed
            wait_for(lambda: len(done) == 1, 5, "the broken call recorded")
            (call,) = done
            assert call.streamed and call.outcome == "may_have_run"
            assert "lost after the request was written" in call.error, call.error
            stats = _stats(p)
            assert stats["spliced_replies"] == 1, stats
            up.die_after = None
            with socket.create_connection(("127.0.0.1", p.port())) as s:  # others are served
                s.settimeout(10)
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=6))
                assert _payload_sha(_read_reply(s), 8_000_000) == up.sha
            wait_for(lambda: _no_leftovers(pipes), 5, "no fd left open by the broken splice")
    finally:
        up.close()


def test_client_gone_mid_splice_discards_the_upstream_connection():
    up = ShaUpstream(30_000_000)
    _, pipes = _leftovers()
    try:
        with Proxy(_config(up.address)) as p:
            for _ in range(3):
                s = small_window_client(p.port())
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=7))
                s.settimeout(10)
                assert s.recv(65536)
                wait_for(lambda: _stats(p).get("spliced_replies", 0) >= 1, 5, "the splice started")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # reset, mid-reply
                wait_for(lambda: _stats(p)["open"] == 0, 5, "the upstream connection discarded")
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.settimeout(10)
                s.sendall(request_bytes("framed", "binary", "ping", seqid=8))
                assert len(_read_reply(s)) == PING_REPLY
            stats = _stats(p)
            assert stats["spliced_replies"] == 3, stats
            assert stats["connects"] == 4, stats
            wait_for(lambda: _no_leftovers(pipes), 5, "no fd left open by the cut splices")
    finally:
        up.close()


def test_a_client_that_stops_reading_mid_splice_is_closed_as_a_write_stall():
    up = ShaUpstream(30_000_000)
    try:
        with Proxy(_config(up.address, "\n    request_read_timeout: 1s")) as p:
            state = p.server.listeners["test"]
            s = small_window_client(p.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=9))
                s.settimeout(10)
                assert s.recv(65536)  # then nothing more is read
                wait_for(lambda: state.stats["write_stalls"] == 1, 10, "the stalled client closed")
            stats = _stats(p)
            assert stats["spliced_replies"] == 1, stats
    finally:
        up.close()


# -- the other way: the rest of a large framed request, client socket → upstream socket ----------

from test_upload import RecordingUpstream, StalledUpstream, _echo_request, _exception, _reply_text  # noqa: E402

from harness import read_messages  # noqa: E402
from proxy.codec import AppErrorType, MessageType  # noqa: E402


def test_a_large_request_is_spliced_upstream_byte_exact_and_the_next_one_read_as_usual():
    """A 10 MB request whose second part comes with a ping right behind it (in the same write):
    the splice reads up to the request's last byte, the listener reads the ping."""
    up = RecordingUpstream()
    big = _echo_request(10_000_000, seqid=11)
    ping = request_bytes("framed", "binary", "ping", seqid=12)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:2_000_000])
                wait_for(lambda: _stats(p).get("spliced_requests") == 1, 5, "the request spliced")
                s.sendall(big[2_000_000:] + ping)
                echo, pong = read_messages(s, 2, "framed", "binary")
            stats = _stats(p)
    finally:
        up.close()
    assert echo.seqid == 11 and _reply_text(echo) == hashlib.sha256(big).hexdigest().encode()
    assert pong.seqid == 12 and pong.type == MessageType.REPLY
    assert sorted(up.requests, key=len) == [ping, big]  # (the ping on a second connection, the first busy)
    assert stats["spliced_requests"] == 1 and stats["spliced_bytes"] >= 7_000_000, stats


class StallingRecordingUpstream(RecordingUpstream):
    """A RecordingUpstream that stops reading once it has 2 MB, through a small receive buffer,
    until `release` is set (or 10 s): the proxy's writes to it back up, then drain."""

    def __init__(self) -> None:
        self.stalled = False
        self.release = threading.Event()
        super().__init__()
        # small from the handshake on (accepted sockets inherit it): set only on the accepted
        # socket, the window was already scaled for the default buffer, and a loaded run's
        # autotuned buffer could take the 3 MB sent during the stall, holding nobody back
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)

    def _read(self, c: socket.socket) -> bytes | None:
        try:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        except OSError:  # closed (the test is over): as the base class's read, None
            return None
        if self.received >= 2_000_000 and not self.stalled:
            self.stalled = True
            self.release.wait(10)
        return super()._read(c)


def test_a_spliced_request_to_a_stalling_upstream_arrives_byte_exact():
    """The upstream's socket fills (the client is held back), drains, and then the splice waits
    for the client's next bytes: the client's transport must still not read them (it would take
    them out of the splice's stream)."""
    up = StallingRecordingUpstream()
    big = _echo_request(8_000_000, seqid=16)
    ping = request_bytes("framed", "binary", "ping", seqid=17)
    done = []
    try:
        with Proxy(_config(up.address)) as p:
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_500_000])
                wait_for(lambda: _stats(p).get("spliced_requests") == 1, 5, "the request spliced")
                # meets the stall: more than the proxy's socket (4 MiB at most) and pipe can take
                sender = threading.Thread(target=s.sendall, args=(big[1_500_000:7_500_000],))
                sender.start()
                wait_for(lambda: p.call(lambda: any(c.upload is not None and c.upload.paused
                                                    for conn in p.server.listeners["test"].connections
                                                    for c in conn.queue)), 10, "the client held back")
                up.release.set()
                sender.join(20)
                wait_for(lambda: up.received >= 7_400_000, 10, "the stall over")
                time.sleep(0.1)  # the splice waits for the client now
                for at in range(7_500_000, len(big), 100_000):
                    s.sendall(big[at:at + 100_000])
                    time.sleep(0.02)
                s.sendall(ping)
                replies = read_messages(s, 2, "framed", "binary", timeout=30)
            wait_for(lambda: len(done) == 2, 5, "both calls recorded")
    finally:
        up.close()
    echo, pong = sorted(replies, key=lambda m: m.seqid)
    assert echo.seqid == 16 and _reply_text(echo) == hashlib.sha256(big).hexdigest().encode()
    assert pong.seqid == 17 and pong.type == MessageType.REPLY
    (call,) = [c for c in done if c.msg.name == "echo"]
    assert call.upload.held_ns > 0  # the upstream held the client back


def test_a_client_half_closing_inside_a_spliced_request_is_answered_with_its_seqid():
    up = RecordingUpstream()
    big = _echo_request(6_000_000, seqid=13)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:3_000_000])
                wait_for(lambda: _stats(p).get("spliced_requests") == 1, 5, "the request spliced")
                wait_for(lambda: up.received >= 3_000_000, 5, "what was sent upstream")
                s.shutdown(socket.SHUT_WR)
                (err,) = read_messages(s, 1, "framed", "binary")
                s.settimeout(5)
                assert s.recv(1) == b""  # then the proxy closes
            assert up.closed_by_peer.wait(5), "the upstream connection holding part of a request stayed open"
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 13 and kind == AppErrorType.PROTOCOL_ERROR
    assert f"connection closed inside a request (3000000 of {len(big)} bytes received)" in text, text


def test_an_upstream_not_taking_a_spliced_request_is_blamed_and_the_client_held_back():
    up = StalledUpstream()
    big = _echo_request(40_000_000, seqid=14)
    done = []
    try:
        with Proxy(_config(up.address, "\n    request_read_timeout: 1s")) as p:
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.settimeout(10)
                sent = 0
                try:
                    while sent < len(big):
                        sent += s.send(big[sent:sent + (1 << 20)])
                except OSError:
                    pass  # (the proxy stopped reading, then closed after its answer)
                (err,) = read_messages(s, 1, "framed", "binary")
            wait_for(lambda: done, 5, "the call recorded")
            stats = _stats(p)
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 14 and kind == AppErrorType.INTERNAL_ERROR
    assert "may have run: " in text and "did not take the whole request within request_read_timeout 1s" in text, text
    assert int(text.split("(")[1].split(" of ")[0]) < 20_000_000, text  # held back, not read on
    assert stats["spliced_requests"] == 1, stats
    (call,) = done
    assert call.upload.held_ns > 500_000_000  # most of the second was the upstream's doing


def test_a_client_reset_inside_a_spliced_request_closes_that_upstream_connection():
    up = RecordingUpstream()
    big = _echo_request(6_000_000, seqid=15)
    _, pipes = _leftovers()
    try:
        with Proxy(_config(up.address)) as p:
            s = socket.create_connection(("127.0.0.1", p.port()))
            s.sendall(big[:3_000_000])
            wait_for(lambda: _stats(p).get("spliced_requests") == 1, 5, "the request spliced")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            assert up.closed_by_peer.wait(5), "the upstream connection holding part of a request stayed open"
            with client(p.port()) as c:  # the proxy goes on
                c.ping()
            wait_for(lambda: _no_leftovers(pipes), 5, "no fd left open by the cut splice")
    finally:
        up.close()


def test_idle_timeout_counts_spliced_request_bytes_as_activity():
    """A client sending a spliced request for ~1.6 s (idle_timeout 1s), then its next request 0.2 s
    after the reply, is not idle: it sent bytes all along."""
    up = RecordingUpstream()
    big = _echo_request(6_000_000, seqid=21)
    try:
        with Proxy(_config(up.address, "\n    idle_timeout: 1s")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:2_000_000])
                wait_for(lambda: _stats(p).get("spliced_requests") == 1, 5, "the request spliced")
                for at in range(2_000_000, len(big), 500_000):  # ~1.6 s of sending
                    time.sleep(0.2)
                    s.sendall(big[at:at + 500_000])
                (echo,) = read_messages(s, 1, "framed", "binary")
                assert echo.seqid == 21
                time.sleep(0.2)
                s.sendall(request_bytes("framed", "binary", "ping", seqid=22))
                (pong,) = read_messages(s, 1, "framed", "binary")
                assert pong.seqid == 22
    finally:
        up.close()


@pytest.mark.parametrize("spliced", [False, True])
def test_a_client_reset_inside_a_request_cancels_its_call_spliced_or_not(spliced):
    """A client that resets mid-request went away: its call is cancelled (as through the
    transport), not answered and recorded as the client's bad request."""
    up = RecordingUpstream()
    big = _echo_request(6_000_000, seqid=61)
    done = []
    try:
        with Proxy(_config(up.address)) as p:
            pipeline = p.server.listeners["test"].pipeline
            pipeline.on_complete = done.append
            p.call(lambda: setattr(splice, "available", spliced))
            s = socket.create_connection(("127.0.0.1", p.port()))
            s.sendall(big[:3_000_000])
            wait_for(lambda: up.received >= 3_000_000, 5, "what was sent upstream")
            assert _stats(p)["spliced_requests"] == int(spliced)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            assert up.closed_by_peer.wait(5), "the upstream connection holding part of a request stayed open"
            time.sleep(0.2)
            errors = p.call(lambda: pipeline.stats["errors"])
    finally:
        splice.available = True
        up.close()
    assert [(c.outcome, c.error) for c in done if not c.cancelled] == []
    assert errors == 0


def _smuggling(size: int, seqid: int) -> bytes:
    """A framed `echo` (one string of `size` bytes) whose frame also holds, after its args
    struct, a whole second call: Apache Thrift's framed transport would read it as the next
    call on that connection and run it, and its reply would answer another client's call."""
    first = request_bytes("buffered", "binary", "echo", os.urandom(size), seqid=seqid)
    hidden = request_bytes("buffered", "binary", "echo", b"smuggled", seqid=seqid + 1)
    return struct.pack("!i", len(first) + len(hidden)) + first + hidden


@pytest.mark.parametrize("spliced", [False, True], ids=["read", "spliced"])
def test_a_streamed_frame_hiding_a_second_message_never_reaches_the_upstream_whole(spliced):
    """A framed request that streams upstream is checked read by read before each goes on, as a
    frame read whole is: a struct that ends before its frame does is refused with the client's
    seqid, and the upstream connection holding the first part is closed, so the upstream never
    has the frame whole and runs nothing. Spliced, only the inside of the long string goes by
    splice; the bytes after it are read and checked. Before, such a request went upstream as it
    came (only requests read whole were checked)."""
    up = RecordingUpstream()
    bad = _smuggling(6_000_000, seqid=71)
    try:
        with Proxy(_config(up.address)) as p:
            p.call(lambda: setattr(splice, "available", spliced))
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(bad[:3_000_000])
                wait_for(lambda: up.received >= 2_500_000, 5, "the first part upstream")
                s.sendall(bad[3_000_000:])
                (err,) = read_messages(s, 1, "framed", "binary")
                s.settimeout(5)
                assert s.recv(1) == b""  # then closed (what follows a broken request is unknown)
            assert up.closed_by_peer.wait(5), "the upstream connection holding part of the frame stayed open"
            stats = _stats(p)
            ok = request_bytes("framed", "binary", "echo", b"fine", seqid=73)
            with socket.create_connection(("127.0.0.1", p.port())) as s:  # the proxy serves on
                s.sendall(ok)
                (reply,) = read_messages(s, 1, "framed", "binary")
    finally:
        splice.available = True
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 71 and kind == AppErrorType.PROTOCOL_ERROR, (err, text)
    assert "byte(s) after the message inside its frame (a second message in one frame?)" in text, text
    assert up.received < len(bad) and up.requests == [ok], "the upstream had the frame whole"
    assert reply.seqid == 73 and _reply_text(reply) == hashlib.sha256(ok).hexdigest().encode()
    assert stats["spliced_requests"] == int(spliced), stats
    if spliced:
        assert stats["spliced_bytes"] >= 2_000_000, stats


def test_a_streamed_frame_whose_string_cannot_fit_it_is_refused_before_anything_goes_upstream():
    """A string whose length runs past its frame's end is refused on the read that brings the
    length: with its seqid, nothing of it upstream."""
    up = RecordingUpstream()
    head = struct.pack("!Ii", 0x80010001, 4) + b"echo" + struct.pack("!i", 72)
    body = head + b"\x0b\x00\x01" + struct.pack("!i", 10_000_000) + os.urandom(3_000_000)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(struct.pack("!i", len(body) + 1) + body[:2_000_000])
                (err,) = read_messages(s, 1, "framed", "binary")
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 72 and "the message's struct goes on past the end of its frame" in text, text
    assert up.received == 0 and up.connections == 0
