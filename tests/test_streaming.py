"""Large replies stream through the proxy: bounded memory, backpressure, order, failure mid-stream."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import struct
import time

import pytest

from harness import (Proxy, ProxyProcess, RawUpstream, ThriftServer, client, config_text, free_port, proc_status, reset_peak,
                     app_exception, read_messages, reply_bytes, request_bytes, small_window_client,
                     wait_for)
from proxy.codec import Decoder, Framing, MessageType, Protocol
from proxy.codec.heads import write_varint


def _big_config(upstream: str, port: int = 0, extra_cluster: str = "", **kwargs) -> str:
    """`kwargs`: config_text's (transport, cluster_transport, ...)."""
    return config_text([upstream], listen_port=port, **kwargs).replace(
        "    protocol: binary\n    routes", "    protocol: binary\n    max_frame_size: 300MiB\n    routes").replace(
        "    load_balancer", f"    max_reply_size: 300MiB{extra_cluster}\n    load_balancer")


def test_large_replies_stream_and_arrive_intact():
    up = ThriftServer()
    try:
        with Proxy(_big_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with client(p.port()) as c:
                small = os.urandom(50_000)  # under stream_threshold (64 KiB)
                assert c.echo(small) == small
                for size in (1_500_000, 10_000_000):
                    big = os.urandom(size)
                    assert c.echo(big) == big
            time.sleep(0.2)
    finally:
        up.stop()
    streamed = {call.reply_size: call.streamed for call in done if call.msg.name == "echo"}
    assert streamed[50_028] is False
    assert streamed[1_500_028] is True and streamed[10_000_028] is True


def test_slowly_read_stream_arrives_byte_exact():
    """An 8 MB random reply, read slowly through a small receive buffer. The proxy's transport to
    this client is given a high write-buffer limit, so it queues what it cannot write instead of
    pausing the stream: a read buffer reused while a queued write still refers to it (uvloop
    queues memoryviews without copying) would show up here as corrupted bytes."""
    up = ThriftServer()
    try:
        with Proxy(_big_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            big = os.urandom(8_000_000)
            s = small_window_client(p.port())
            with s:
                state = p.server.listeners["test"]
                deadline = time.monotonic() + 5
                while not state.connections and time.monotonic() < deadline:
                    time.sleep(0.01)
                (conn,) = state.connections
                p.loop.call_soon_threadsafe(conn.transport.set_write_buffer_limits, 32 << 20)
                s.sendall(request_bytes("framed", "binary", "echo", big, seqid=7))
                parts, got = [], 0
                total = None
                while total is None or got < total:
                    chunk = s.recv(128 * 1024)  # ~10 MB/s: the proxy's socket send buffer fills up,
                    assert chunk, f"closed after {got} bytes"  # and its transport queues slices
                    parts.append(chunk)
                    got += len(chunk)
                    if total is None and got >= 4:
                        total = 4 + struct.unpack("!i", b"".join(parts)[:4])[0]
                    time.sleep(0.01)
            reply = b"".join(parts)
            dec = Decoder(Framing.FRAMED, Protocol.BINARY, 300 << 20)
            dec.feed(reply)
            msg = dec.next_message()
            assert msg.type == MessageType.REPLY and msg.seqid == 7 and dec.buffered == 0
            assert reply.endswith(big + b"\x00"), "the streamed bytes differ from what the upstream sent"
            time.sleep(0.1)
    finally:
        up.stop()
    assert [c.streamed for c in done if c.msg.name == "echo"] == [True]


class StaleAfterStreamUpstream(RawUpstream):
    """The first call gets a 4 MB reply whose tail comes late, and in the same write as that tail
    a well-formed reply for seqid 2 that nobody asked for; every other call gets b"REAL"."""

    def __init__(self) -> None:
        self.first = True
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        with c:
            for name, seqid in self.requests(c):
                if self.first:
                    self.first = False
                    big = reply_bytes(name, seqid, b"\xab" * 4_000_000)
                    c.sendall(big[:1_000_000])
                    time.sleep(0.5)  # meanwhile the second client waits for the pool's only connection
                    c.sendall(big[1_000_000:] + reply_bytes(b"echo", 2, b"STALE"))
                else:
                    c.sendall(reply_bytes(name, seqid, b"REAL"))


def test_framed_bytes_past_a_streamed_reply_discard_that_connection():
    """Bytes past a streamed reply's end must never be read as the next exchange's reply, even
    when they arrive with its last bytes while another call waits for that connection."""
    up = StaleAfterStreamUpstream()
    text = _big_config(up.address, extra_cluster="\n    pool: {max_connections: 1}")
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as a, \
                    socket.create_connection(("127.0.0.1", p.port())) as b:
                a.sendall(request_bytes("framed", "binary", "echo", b"", seqid=1))
                a.settimeout(5)
                got = len(a.recv(65536))  # the 4 MB reply is streaming
                b.sendall(request_bytes("framed", "binary", "echo", b"", seqid=2))  # waits for the pool
                while got < 4 + 4_000_000 + 16:
                    chunk = a.recv(1 << 20)
                    assert chunk, f"closed after {got} bytes"
                    got += len(chunk)
                (rb,) = read_messages(b, 1, "framed", "binary")
                assert b"REAL" in rb.data and b"STALE" not in rb.data, rb.data
        assert up.connections == 2  # the connection that sent bytes past its reply was closed
    finally:
        up.close()


def test_a_pooled_connection_keeps_nothing_of_its_streamed_reply():
    """After a large streamed reply its connection idles in the pool without keeping the call
    (and so its 6 MB request) alive."""
    up = ThriftServer()
    try:
        with Proxy(_big_config(up.address)) as p:
            with client(p.port()) as c:
                big = os.urandom(6_000_000)
                assert c.echo(big) == big
            time.sleep(0.3)

            def alive() -> tuple[int, int]:
                from proxy.calls import Call
                gc.collect()
                calls = [o for o in gc.get_objects()
                         if type(o) is Call and o.msg is not None and o.msg.name == "echo"]
                (ep,) = p.server.clusters["up"].endpoints
                return sum(len(pool.idle) for pool in ep.pools.values()), len(calls)

            idle, calls = p.call(alive)
            assert idle == 1 and calls == 0, (idle, calls)
    finally:
        up.stop()


def test_reply_behind_a_pending_call_is_read_whole_in_order_within_the_budget():
    up = ThriftServer()
    try:
        with Proxy(_big_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 200, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"z" * 3_000_000, seqid=2))
                first, second = read_messages(s, 2)
            assert (first.seqid, second.seqid) == (1, 2)
            assert second.type == MessageType.REPLY and len(second.data) == 3_000_028
            assert second.data.endswith(b"z" * 1000 + b"\x00")
            time.sleep(0.2)
    finally:
        up.stop()
    (echo,) = [call for call in done if call.msg.name == "echo"]
    # 3 MB: within the connection's budget for replies read whole to wait (16 MiB), so its
    # upstream connection was free again at once
    assert not echo.streamed and echo.outcome == "success"


def test_replies_past_the_waiting_budget_wait_unread_then_stream():
    """Three 6 MB replies behind a slow call: the first two to come are read whole to wait (12 MB,
    within the 16 MiB budget); the third would pass it and waits unread, then streams in its turn.
    All four arrive in order, byte for byte."""
    up = SlowFirstBigUpstream(6_000_000, delay=0.5)
    try:
        with Proxy(_big_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 500, seqid=1)
                          + b"".join(request_bytes("framed", "binary", "echo", b"", seqid=i) for i in (2, 3, 4)))
                s.settimeout(10)
                replies = read_messages(s, 4)
            assert [(r.seqid, r.type) for r in replies] == [(i, MessageType.REPLY) for i in (1, 2, 3, 4)]
            assert all(len(r.data) == 6_000_028 and r.data[-11:] == b"\xab" * 10 + b"\x00" for r in replies[1:])
            time.sleep(0.2)

            def waiting():
                (conn,) = p.server.listeners["test"].connections or (None,)
                return conn and (dict(conn._waiting), conn._waiting_bytes)

            assert p.call(waiting) in (None, ({}, 0))  # nothing left reserved
    finally:
        up.close()
    echoes = [c for c in done if c.msg.name == "echo"]
    # which two fit depends on which replies came first (three upstream connections)
    assert sorted(c.streamed for c in echoes) == [False, False, True]
    assert all(c.outcome == "success" for c in echoes)


@pytest.mark.parametrize("why", ["reframed", "retried"])
def test_replies_read_whole_in_their_turn_also_wait_unread_past_the_budget(why):
    """A large reply that is read whole even in its turn (re-framed for the client, or an
    exception the route retries) keeps to the waiting budget as a streaming one does: of three
    12 MB replies behind a slow call, the first to come is read whole to wait (12 MB), the other
    two would pass the 16 MiB budget and wait unread, then are read whole in their turn. All
    four replies arrive in order, byte for byte."""
    size = 12_000_000
    up = SlowFirstBigUpstream(size, delay=0.5)
    framing = "framed"
    if why == "reframed":  # the client speaks buffered, the upstream framed
        framing = "buffered"
        text = _big_config(up.address, transport="buffered", cluster_transport="framed")
    else:
        up.field_id = 1
        up.pace = 0.01  # ~120 ms to send each reply: what a stream's upstream_wait_ms measures
        text = _big_config(up.address).replace("      - cluster: up", (
            "      - cluster: up\n        retry: {attempts: 2, idempotent: [echo], on_exceptions: [1], "
            "backoff: {base: 1ms, max: 2ms}}"))
    try:
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes(framing, "binary", "sleep", 500, seqid=1)
                          + b"".join(request_bytes(framing, "binary", "echo", b"", seqid=i) for i in (2, 3, 4)))
                replies = read_messages(s, 4, framing=framing, timeout=20)
            assert [(r.seqid, r.type) for r in replies] == [(i, MessageType.REPLY) for i in (1, 2, 3, 4)]
            length = size + 24 + (4 if framing == "framed" else 0)
            assert all(len(r.data) == length and r.data[-11:] == b"\xab" * 10 + b"\x00" for r in replies[1:])
            time.sleep(0.2)
    finally:
        up.close()
    echoes = [c for c in done if c.msg.name == "echo"]
    assert len(echoes) == 3
    if why == "reframed":
        assert not any(c.streamed for c in echoes)  # (re-framed: read whole)
        held = sorted(c.held_ns > 0 for c in echoes)
    else:
        assert all(len(c.attempts) == 2 and c.outcome == "declared_exception" for c in echoes)
        held = sorted(c.attempts[0].held_ns > 0 for c in echoes)
        # A call held for its turn was retried in its turn: its second reply streamed. The time
        # that stream waited for the upstream's bytes is not cut by the first attempt's hold.
        waits = [c.upstream_wait_ns / 1e6 for c in echoes if c.attempts[0].held_ns and c.streamed]
        assert waits and min(waits) > 20, f"upstream_wait_ms of the held calls' streams: {waits}"
    # Which one came first (and was read whole to wait) depends on the three upstream connections.
    assert held == [False, True, True], "a reply past the budget was read whole while it waited"




class RawBigUpstream(RawUpstream):
    """A raw upstream answering any framed binary call with a reply carrying `size` bytes."""

    def __init__(self, size: int, die_after: int | None = None) -> None:
        self.size = size
        self.field_id = 0  # the result's field: 0 success, > 0 a declared exception
        self.die_after = die_after
        self.stall_after: int | None = None
        self.pace = 0.0  # seconds to wait after each MiB sent
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        with c:
            for name, seqid in self.requests(c):
                if not self._big(c, name, seqid):
                    return

    def _size(self, name: bytes) -> int:
        return 10 if name == b"ping" else self.size

    def _big(self, c: socket.socket, name: bytes, seqid: int) -> bool:
        """Send the reply; False once the connection was reset on purpose (die_after)."""
        head = struct.pack("!Ii", 0x80010002, len(name)) + name + struct.pack("!i", seqid)
        size = self._size(name)
        field = bytes((11,)) + struct.pack("!h", self.field_id) + struct.pack("!i", size)
        body_len = len(head) + len(field) + size + 1
        c.sendall(struct.pack("!i", body_len) + head + field)
        chunk = b"\xab" * (1 << 20)
        left = size
        sent = 0
        while left:
            part = chunk[:min(left, len(chunk))]
            try:
                c.sendall(part)
            except OSError:  # the proxy closed this connection (it gave up on the reply)
                return False
            left -= len(part)
            sent += len(part)
            if self.die_after is not None and sent >= self.die_after:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False  # reset mid-reply
            if self.stall_after is not None and sent >= self.stall_after:
                time.sleep(30)  # stops sending (until the proxy gives up and closes)
                return False
            if self.pace:
                time.sleep(self.pace)
        c.sendall(b"\x00")
        return True


class SlowFirstBigUpstream(RawBigUpstream):
    """`sleep` answers after `delay` seconds with a small reply; anything else at once with a
    reply carrying `size` bytes (RawBigUpstream's)."""

    def __init__(self, size: int, delay: float) -> None:
        self.delay = delay
        super().__init__(size)

    def _one(self, c: socket.socket) -> None:
        with c:
            for name, seqid in self.requests(c):
                if name != b"sleep":
                    self._big(c, name, seqid)
                    continue
                time.sleep(self.delay)
                c.sendall(reply_bytes(name, seqid))


@pytest.mark.parametrize("read_late", [False, True])
def test_large_reply_behind_a_pending_call_waits_unread_with_bounded_memory(read_late):
    """A client pipelines a slow call and a call with a 96 MB reply. The large reply cannot go
    out before the slow one's; it must not be read whole into the proxy meanwhile (with the
    default max_inflight of 128 and a raised max_reply_size, that would be gigabytes for one
    client): its upstream connection stops reading until it is first in line, then it streams.
    `read_late`: the client also reads nothing for a while after the slow reply is due."""
    size = 96 * 1024 * 1024
    port = free_port()
    up = SlowFirstBigUpstream(size, delay=0.8)
    try:
        with ProxyProcess(_big_config(up.address, port), [port]) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:  # warm up: pools, imports
                s.sendall(request_bytes("framed", "binary", "ping", seqid=1))
                read_messages(s, 1)
            base = reset_peak(p.proc.pid)
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 800, seqid=2)
                          + request_bytes("framed", "binary", "echo", b"", seqid=3))
                if read_late:
                    time.sleep(1.5)
                s.settimeout(30)
                small = reply_bytes(b"sleep", 2)
                got, start = 0, b""
                total = len(small) + 4 + size + 24  # echo: head, string field header, payload, STOP
                while got < total:
                    chunk = s.recv(1 << 20)
                    assert chunk, f"closed after {got} bytes"
                    if len(start) < 256:
                        start += chunk[:256]
                    got += len(chunk)
                assert got == total
                assert start.startswith(small)  # the slow call's reply first, whole
                echo = start[len(small):]
                assert struct.unpack("!iIi", echo[:12]) == (size + 24, 0x80010002, 4)
                assert echo[12:16] == b"echo" and struct.unpack("!i", echo[16:20])[0] == 3
            peak = proc_status(p.proc.pid, "VmHWM")
    finally:
        up.close()
    growth_mib = (peak - base) / 1024
    print(f"96 MB reply behind a pending call: proxy RSS +{growth_mib:.1f} MiB at its peak")
    assert growth_mib <= 32, f"peak RSS grew by {growth_mib:.1f} MiB: the waiting reply was read whole"


def _routes_config(upstream: str, echo_route: str) -> str:
    """`sleep` on a route with no timeout; everything else on a route with `echo_route`'s settings."""
    return _big_config(upstream).replace(
        "    routes:\n      - cluster: up\n",
        f"    routes:\n      - match: {{method: sleep}}\n        cluster: up\n      - cluster: up\n{echo_route}")


class _TopJitter:
    """A pipeline's `rng` whose full-jitter backoff is always at its top."""

    @staticmethod
    def random() -> float:
        return 0.999


def test_a_reply_held_for_its_turn_then_retried_keeps_its_credit_against_the_route_timeout():
    """A retryable exception held unread ~900 ms behind the client's slow call is retried in its
    turn. The route timeout (1 s) bounds the upstream, so the hold is credited before the retry's
    ~100 ms backoff is weighed against the deadline. (Before, the deadline moved only when its
    timer fired: at ~0.95 s the backoff ran past the uncredited 1 s, the retry was refused and
    the client got the first attempt's exception.)"""
    up = SlowFirstBigUpstream(24_000_000, delay=0.9)  # past the 16 MiB budget: held unread
    up.field_id = 1
    text = _routes_config(up.address, "        timeout: 1000ms\n        retry: {attempts: 2, idempotent: [echo], "
                                      "on_exceptions: [1], backoff: {base: 100ms, max: 100ms}}\n")
    try:
        with Proxy(text) as p:
            pipeline = p.server.listeners["test"].pipeline
            pipeline.rng = _TopJitter()
            done = []
            pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 900, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                first, second = read_messages(s, 2, max_size=64 << 20, timeout=20)
            time.sleep(0.2)
    finally:
        up.close()
    assert (first.seqid, second.seqid) == (1, 2) and len(second.data) == 24_000_028
    (call,) = [c for c in done if c.msg.name == "echo"]
    assert call.attempts[0].held_ns > 500e6, call.attempts[0].held_ns
    assert len(call.attempts) == 2, "the retry in its turn was refused: the hold was not credited"
    assert call.outcome == "declared_exception" and call.attempts[1].outcome == "declared_exception"


def test_a_reply_read_whole_to_wait_then_retried_frees_its_share_of_the_budget():
    """A retryable 12 MB exception behind a slow call is read whole to wait (within the 16 MiB
    budget), then dropped for its retry: while the retry's backoff runs, that reply's 12 MB no
    longer counts against the budget (before, it did until the call's final reply went out,
    holding other replies unread for memory nobody held)."""
    up = SlowFirstBigUpstream(12_000_000, delay=0.8)
    up.field_id = 1
    text = _routes_config(up.address, "        retry: {attempts: 2, idempotent: [echo], on_exceptions: [1], "
                                      "backoff: {base: 300ms, max: 300ms}}\n")

    def in_backoff():
        """(echo's call is waiting for its retry, the client connection's waiting bytes) or None."""
        (conn,) = p.server.listeners["test"].connections or (None,)
        calls = [c for c in conn.queue if c.msg.name == "echo"] if conn is not None else []
        if calls and calls[0].retry_timer is not None:
            return conn._waiting_bytes
        return None

    try:
        with Proxy(text) as p:
            p.server.listeners["test"].pipeline.rng = _TopJitter()
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 800, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                deadline = time.monotonic() + 5
                waiting = None
                while waiting is None and time.monotonic() < deadline:
                    waiting = p.call(in_backoff)
                    time.sleep(0.005)
                replies = read_messages(s, 2, timeout=20)
    finally:
        up.close()
    assert [r.seqid for r in replies] == [1, 2]
    assert waiting == 0, f"{waiting} bytes of a dropped reply still count against the waiting budget"


@pytest.mark.parametrize("which", ["timeout", "per_try_timeout"])
def test_time_held_for_its_turn_does_not_count_against_the_timeouts(which):
    """The echo's reply comes at once but is held ~700 ms behind the client's slow call; its
    route timeout (or per-try timeout) of 300 ms bounds the upstream, not the client's order:
    it is credited, as when such a reply was read whole (the call was over then)."""
    setting = "        timeout: 300ms\n" if which == "timeout" else "        retry: {per_try_timeout: 300ms}\n"
    up = SlowFirstBigUpstream(24_000_000, delay=0.7)  # past the 16 MiB budget: held unread
    try:
        with Proxy(_routes_config(up.address, setting)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 700, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                s.settimeout(10)
                first, second = read_messages(s, 2, max_size=64 << 20)
            assert (first.seqid, first.type) == (1, MessageType.REPLY)
            assert (second.seqid, second.type) == (2, MessageType.REPLY), second
            assert len(second.data) == 24_000_028
            time.sleep(0.2)
            assert p.server.listeners["test"].pipeline.stats["timeouts"] == 0
    finally:
        up.close()
    (echo,) = [call for call in done if call.msg.name == "echo"]
    assert echo.streamed and echo.outcome == "success" and echo.client_paused_ns >= 500e6


def test_time_held_for_its_turn_is_queued_in_the_spans_not_read_response(caplog):
    """The echo's 24 MB reply is held ~600 ms behind the client's slow call, then streams. That
    wait is the `queued` hop (the client's earlier call), not `read_response` (the upstream had
    sent its first bytes at once) nor the stream's client_paused_ms; the access log says the
    same. Before: read_response took the 600 ms, and `thrift-sidecar hops` blamed the upstream."""
    from proxy import spans
    from spans_util import Traced

    up = SlowFirstBigUpstream(24_000_000, delay=0.6)  # past the 16 MiB budget: held unread
    text = "logging: {access_log: true}\n" + _routes_config(up.address, "")
    try:
        with caplog.at_level(logging.INFO, logger="proxy.access"), Traced(text, ratio=1.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 600, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                s.settimeout(10)
                first, second = read_messages(s, 2, max_size=64 << 20)
            assert (second.seqid, len(second.data)) == (2, 24_000_028)
            calls = t.wait_calls(2)
    finally:
        up.close()
    (echo,) = [c for c in calls if c.attrs[spans.RPC_METHOD] == "echo"]
    assert echo.attrs[spans.STREAMED] is True
    queued, read = echo.hop_ms("queued"), echo.hop_ms("read_response")
    assert queued >= 450, (queued, read)
    assert read < queued, (queued, read)
    # (the hold is not a pause of the stream; were it counted there, it would be >= queued)
    assert echo.attrs[spans.CLIENT_PAUSED_MS] < queued, echo.attrs
    (logged,) = [r.fields for r in caplog.records if r.name == "proxy.access" and r.fields["method"] == "echo"]
    assert logged["queued_ms"] >= 450 and logged["read_response_ms"] < logged["queued_ms"], logged
    hold = echo.hops["queued"][0]
    assert hold.parent.span_id == echo.server.context.span_id
    assert hold.end_time <= echo.hop("read_response").start_time  # the stream starts at its turn


class SizedUpstream(SlowFirstBigUpstream):
    """SlowFirstBigUpstream with a reply size per method (`sizes`; others: `size`)."""

    def __init__(self, sizes: dict[bytes, int], delay: float) -> None:
        self.sizes = sizes
        super().__init__(0, delay)

    def _size(self, name: bytes) -> int:
        return self.sizes.get(name, 10)


def test_a_held_stream_that_starts_while_the_client_is_paused_counts_only_its_own_pause():
    """A 12 MB reply (read whole: stream_threshold 16 MiB) fills a client that reads nothing for
    1 s; behind it a slow small call and a 24 MB reply held for its turn. That turn comes (the
    slow call's reply, at ~0.5 s) while the connection is still paused: the stream's pause counts
    from then, not from when the 12 MB reply paused the connection (that time is the hold's,
    already credited). Before: the hold was counted twice, and client_paused_ns came to more than
    the reply's whole life."""
    up = SizedUpstream({b"get_users": 12_000_000, b"echo": 24_000_000}, delay=0.5)
    try:
        with Proxy(_big_config(up.address, extra_cluster="\n    stream_threshold: 16MiB")) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            s = small_window_client(p.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "get_users", 1, 0, seqid=1)
                          + request_bytes("framed", "binary", "sleep", 500, seqid=2)
                          + request_bytes("framed", "binary", "echo", b"", seqid=3))
                time.sleep(1.0)
                got = read_messages(s, 3, max_size=64 << 20)
            assert [m.seqid for m in got] == [1, 2, 3]
            wait_for(lambda: len(done) == 3, what="the three calls recorded")
    finally:
        up.close()
    (echo,) = [c for c in done if c.msg.name == "echo"]
    a = echo.attempts[0]
    assert echo.streamed and a.held_ns >= 300e6, (echo.streamed, a.held_ns)
    life = (echo.t_acked or echo.t_handed) - a.t_first_reply
    assert echo.client_paused_ns <= life, (echo.client_paused_ns / 1e6, life / 1e6, a.held_ns / 1e6)


def test_held_reply_times_out_once_the_upstream_stalls_after_its_turn():
    """The credit is for the hold only: once its turn came, a reply whose upstream stops sending
    still meets its route timeout (the client connection is closed: bytes went out)."""
    up = SlowFirstBigUpstream(64_000_000, delay=0.4)
    up.stall_after = 2_000_000
    try:
        with Proxy(_routes_config(up.address, "        timeout: 600ms\n")) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 400, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                s.settimeout(10)
                t0 = time.monotonic()
                got = _recv_all(s)
                closed_after = time.monotonic() - t0
            assert got < 64_000_000
            # held ~0.4 s (credited), then 0.6 s of route timeout for the stalled stream
            assert 0.9 <= closed_after < 5, closed_after
            time.sleep(0.2)
    finally:
        up.close()
    (echo,) = [call for call in done if call.msg.name == "echo"]
    assert echo.streamed and echo.outcome == "timeout" and "route timeout" in echo.error
    assert echo.error.startswith("may have run: route timeout 600ms (while streaming the reply")


def _held_then_ping(port: int, sleep_ms: int, echoes: int = 1, wait: float = 0.4, on_pong=None):
    """Client A pipelines sleep(sleep_ms) and `echoes` echo calls (seqids 2, 3, ...); `wait`
    seconds later (their replies held, or waiting for connections) another client pings.
    Returns the ping's reply, how long it took, and A's replies in order (`on_pong()` runs as
    soon as the ping's reply is in)."""
    with socket.create_connection(("127.0.0.1", port)) as a:
        a.sendall(request_bytes("framed", "binary", "sleep", sleep_ms, seqid=1)
                  + b"".join(request_bytes("framed", "binary", "echo", b"", seqid=i) for i in range(2, 2 + echoes)))
        time.sleep(wait)
        with socket.create_connection(("127.0.0.1", port)) as b:
            t0 = time.monotonic()
            b.sendall(request_bytes("framed", "binary", "ping", seqid=9))
            (pong,) = read_messages(b, 1)
            took = time.monotonic() - t0
            if on_pong is not None:
                on_pong()
        replies = read_messages(a, 1 + echoes, max_size=64 << 20)
    return pong, took, replies


@pytest.mark.parametrize("connections, echoes", [(2, 1), (3, 3)])
def test_held_replies_give_way_when_their_pool_runs_out_of_connections(connections, echoes):
    """Holding a reply unread keeps its upstream connection. A reply is not held while calls
    wait for a connection of its pool, and a held one is read whole (memory, as before holding
    existed) as soon as a call has to wait: another client's call does not wait out
    acquire_timeout. (2, 1): the sleep and one held echo take both connections, then the other
    client's ping comes; (3, 3): the third echo waits for a connection, so the replies that
    come meanwhile are not held."""
    up = SlowFirstBigUpstream(20_000_000, delay=1.5)  # each reply past the 16 MiB budget
    seqids = list(range(2, 2 + echoes))
    try:
        # The ping comes 0.4 s in: a connection only the sleep's reply (1.5 s) would free comes
        # >= 1.1 s later; a held reply read whole frees one within ~0.3 s even on a loaded machine.
        pool = f"\n    pool: {{max_connections: {connections}, acquire_timeout: 2s}}"
        with Proxy(_big_config(up.address, extra_cluster=pool)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            pong, took, replies = _held_then_ping(p.port(), 1500, echoes)
            assert (pong.seqid, pong.type) == (9, MessageType.REPLY), pong
            assert took < 0.9, took
            assert [(r.seqid, r.type) for r in replies] == [(i, MessageType.REPLY) for i in [1] + seqids]
            assert all(len(r.data) == 20_000_028 for r in replies[1:])
            time.sleep(0.2)
            stats = p.call(lambda: dict(p.server.clusters["up"].endpoints[0].pools.popitem()[1].stats))
            assert stats["acquire_timeouts"] == 0, stats
            assert p.server.waiting.used == 0  # (every reply read whole to wait gave its share back)
    finally:
        up.close()
    assert sorted(c.outcome for c in done) == ["success"] * (2 + echoes)


def test_held_replies_are_not_read_whole_for_a_waiting_call_past_the_proxys_budget():
    """As above (2, 1), but the proxy's budget for replies waiting in memory (WaitingBudget) is
    10 MB: the 20 MB held reply stays held (streamed in its turn), and the other client's ping
    waits for the sleep's connection instead. Before, pool pressure read every held reply
    whole whatever its size: a client pipelining large calls grew the proxy by as many replies
    as the pool had connections (300 MB seen)."""
    up = SlowFirstBigUpstream(20_000_000, delay=1.5)
    try:
        pool = "\n    pool: {max_connections: 2, acquire_timeout: 5s}"
        with Proxy(_big_config(up.address, extra_cluster=pool)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            p.server.waiting.limit = 10_000_000
            pong, took, replies = _held_then_ping(p.port(), 1500, 1)
            assert (pong.seqid, pong.type) == (9, MessageType.REPLY), pong
            assert took >= 0.9, took  # (it came 0.4 s in; the sleep ends at 1.5 s)
            assert [(r.seqid, r.type) for r in replies] == [(1, MessageType.REPLY), (2, MessageType.REPLY)]
            assert len(replies[1].data) == 20_000_028
            time.sleep(0.2)
            assert p.server.waiting.used == 0
    finally:
        up.close()
    (echo,) = [c for c in done if c.msg.name == "echo"]
    assert echo.streamed and echo.outcome == "success" and echo.attempts[0].held_ns >= 900e6


def test_one_client_s_held_replies_leave_its_pool_half_for_the_others():
    """Client A pipelines a 1.5 s call and 6 large-reply calls on a pool of 4 connections, with
    the proxy's budget for replies waiting in memory too small for any of them: its replies are
    held unread, one per connection, and its later calls wait for those connections. Another
    client's ping, 0.4 s in, is not held behind A's calls: A holds more than half the pool, so
    one of its held replies is read whole (over the budget), and the connection goes to the ping,
    not to A's next call (A's waiters queued first: had it gone to them, each of their replies
    would be held and read whole in turn, the memory growing by one reply per call). Before: the ping waited for the sleep's
    connection (1.5 s), which went to A's next echo; it timed out (acquire_timeout 2 s) or took
    over a second."""
    up = SlowFirstBigUpstream(2_000_000, delay=1.5)
    try:
        pool = "\n    pool: {max_connections: 4, acquire_timeout: 2s}"
        with Proxy(_big_config(up.address, extra_cluster=pool)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            p.server.waiting.limit = 1_000_000
            used = []
            pong, took, replies = _held_then_ping(p.port(), 1500, 6,
                                                  on_pong=lambda: used.append(p.call(lambda: p.server.waiting.used)))
            assert (pong.seqid, pong.type) == (9, MessageType.REPLY), pong
            assert took < 0.9, took
            # one of A's replies was read whole past the budget for the ping, not one per call of
            # A's that took the connection freed before the ping did (4 of them, 8 MB)
            assert used[0] <= 2_000_100, used
            assert [r.seqid for r in replies] == list(range(1, 8))
            assert all(r.type == MessageType.REPLY for r in replies), [r for r in replies if r.type != MessageType.REPLY]
            assert all(len(r.data) == 2_000_028 for r in replies[1:])
            time.sleep(0.2)
            assert p.server.waiting.used == 0
    finally:
        up.close()
    assert sorted(c.outcome for c in done) == ["success"] * 8


def test_a_held_reply_read_whole_early_keeps_its_timeout_credit():
    """A held reply that a waiting call makes read whole early (Pool.acquire) is no longer held
    nor streamed; the time it was held still does not count against its route timeout (800 ms):
    held ~0.5 s, then ~0.5 s to read the rest from a slow upstream, done by ~1.1 s."""
    up = SlowFirstBigUpstream(20_000_000, delay=1.2)
    up.pace = 0.04  # ~25 MB/s
    try:
        pool = "\n    pool: {max_connections: 2, acquire_timeout: 2s}"
        text = _routes_config(up.address, "        timeout: 800ms\n").replace(
            "    max_reply_size: 300MiB", "    max_reply_size: 300MiB" + pool)
        # The ping waits for the held reply's ~0.75 s read: on the sleep's route, with no timeout
        # (the 800 ms route is the echo's; on it the ping had ~50 ms to spare, too few under load).
        sleep_route = "      - match: {method: sleep}\n        cluster: up\n"
        text = text.replace(sleep_route, sleep_route + sleep_route.replace("sleep", "ping"))
        assert "method: ping" in text
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            pong, _, (first, second) = _held_then_ping(p.port(), 1200, wait=0.5)  # (echo held by then)
            assert pong.type == MessageType.REPLY
            assert (first.seqid, first.type) == (1, MessageType.REPLY)
            assert (second.seqid, second.type) == (2, MessageType.REPLY), second
            assert len(second.data) == 20_000_028
            time.sleep(0.2)
    finally:
        up.close()
    (echo,) = [c for c in done if c.msg.name == "echo"]
    assert echo.outcome == "success" and not echo.streamed and echo.attempts[0].held_ns >= 400e6


def test_time_held_is_not_the_endpoints_latency_for_peak_ewma():
    """A held reply read whole once a call waits for its connection (as above): the endpoint's
    latency sample (peak_ewma) leaves out the time it was held for the client's order."""
    up = SlowFirstBigUpstream(20_000_000, delay=1.5)
    try:
        pool = "\n    pool: {max_connections: 2, acquire_timeout: 700ms}"
        text = _big_config(up.address, extra_cluster=pool).replace("load_balancer: round_robin",
                                                                    "load_balancer: peak_ewma")
        with Proxy(text) as p:
            samples = []

            class Recording:  # the endpoint's estimator, each latency sample noted
                def __init__(self, inner):
                    self.inner = inner

                def observe(self, rtt):
                    samples.append(rtt)
                    self.inner.observe(rtt)

                def __getattr__(self, name):
                    return getattr(self.inner, name)

            def record():
                (ep,) = p.server.clusters["up"].endpoints
                ep.ewma = Recording(ep.ewma)

            p.call(record)
            # (the echo held by then, both connections busy; held 0.9 s before the ping comes)
            pong, _, replies = _held_then_ping(p.port(), 1500, wait=0.9)
            assert pong.type == MessageType.REPLY
            assert [r.seqid for r in replies] == [1, 2]
            time.sleep(0.2)
    finally:
        up.close()
    # the sleep (~1.5 s), the ping and the echo (read whole 0.9 s after its reply began: a sample
    # of 0.9 s or more would count the hold; reading 20 MB whole took 0.22 s on a loaded machine)
    assert len(samples) == 3 and max(samples) > 1.4, samples
    assert sorted(samples)[1] < 0.6, samples

def test_client_gone_while_a_reply_is_held_frees_its_upstream_connection():
    """The client leaves while its large reply is held unread: the upstream connection holding
    the rest of it is closed (never handed to another call with a reply half read), and the
    endpoint keeps serving."""
    up = SlowFirstBigUpstream(32_000_000, delay=0.5)
    try:
        with Proxy(_big_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            s = socket.create_connection(("127.0.0.1", p.port()))
            s.sendall(request_bytes("framed", "binary", "sleep", 500, seqid=1)
                      + request_bytes("framed", "binary", "echo", b"", seqid=2))
            time.sleep(0.2)  # the echo's reply is held by now
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            time.sleep(0.8)

            def state():
                (ep,) = p.server.clusters["up"].endpoints
                return ep.outstanding, sum(len(pool.idle) for pool in ep.pools.values())

            outstanding, idle = p.call(state)
            assert outstanding == 0
            with socket.create_connection(("127.0.0.1", p.port())) as s2:
                s2.sendall(request_bytes("framed", "binary", "ping", seqid=9))
                (reply,) = read_messages(s2, 1)
            assert (reply.seqid, reply.type, reply.data[-11:-1]) == (9, MessageType.REPLY, b"\xab" * 10)
    finally:
        up.close()
    echo = [call for call in done if call.msg.name == "echo"]
    assert [c.outcome for c in echo] == ["client_gone"]

@pytest.mark.slow
@pytest.mark.parametrize("framing", ["framed", "buffered"])
def test_256_mib_reply_streams_with_bounded_memory(framing):
    size = 256 * 1024 * 1024
    port = free_port()
    if framing == "framed":
        up = RawBigUpstream(size)
        text = _big_config(f"127.0.0.1:{up.port}", port)
        total = size + 28  # length prefix, head "echo", string field header, payload, STOP
    else:
        up = RawBufferedUpstream(size)
        text = _buffered_config(f"127.0.0.1:{up.port}", port)
        total = sum(len(piece) for piece in up.reply_pieces(b"echo", 2, 0)) + size + 4 * (size >> 20)
    try:
        with ProxyProcess(text, [port]) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:  # warm up: pools, imports
                s.sendall(request_bytes(framing, "binary", "ping", seqid=1))
                read_messages(s, 1, framing, "binary")
            base = reset_peak(p.proc.pid)
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request_bytes(framing, "binary", "echo", b"", seqid=2))
                s.settimeout(60)
                got = 0
                while got < total:
                    chunk = s.recv(1 << 20)
                    assert chunk, f"closed after {got} bytes"
                    got += len(chunk)
                assert got == total
            peak = proc_status(p.proc.pid, "VmHWM")
    finally:
        up.close()
    growth_mib = (peak - base) / 1024
    print(f"256 MiB {framing} reply: proxy RSS {base / 1024:.1f} MiB before, peak {peak / 1024:.1f} MiB "
          f"(+{growth_mib:.1f} MiB)")
    assert growth_mib <= 32, f"peak RSS grew by {growth_mib:.1f} MiB"


def test_upstream_reset_mid_stream_closes_only_that_client():
    up = RawBigUpstream(8_000_000, die_after=3_000_000)
    try:
        with Proxy(_big_config(f"127.0.0.1:{up.port}")) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=5))
                s.settimeout(10)
                got = _recv_all(s)
                assert 0 < got < 8_000_000  # part of it came, then the connection closed
            stats = p.server.listeners["test"].pipeline.stats
            assert stats["errors"] >= 1
            time.sleep(0.1)
            # the broken call is recorded like any other (metrics, a failed call's spans)
            (call,) = [c for c in done if c.msg.name == "echo"]
            assert call.streamed and call.outcome == "may_have_run" and call.error.startswith("may have run")
            assert call.t_write <= call.t_handed and call.t_acked == 0
    finally:
        up.close()


def test_a_connection_paused_by_backpressure_is_resumed_before_reuse():
    """A stream's last chunk can be the write that pauses the client transport, which pauses the
    upstream connection's reading as the stream ends: the pool must not lend it out paused."""
    up = ThriftServer()
    try:
        text = _big_config(up.address, extra_cluster="\n    pool: {max_connections: 1}")
        with Proxy(text) as p:
            with client(p.port()) as c:
                assert c.lookup("first") == "upstream:first"
                (ep,) = p.server.clusters["up"].endpoints
                (pool,) = ep.pools.values()

                def pause_and_release():
                    conn = pool.try_acquire()
                    conn.pause_reading()  # what backpressure does mid-stream
                    pool.release(conn)    # what the end of the stream does

                p.call(pause_and_release)
                assert c.lookup("second") == "upstream:second"  # the same, only connection
                assert pool.stats["connects"] == 1
    finally:
        up.stop()


class BigExceptionUpstream(RawUpstream):
    """A raw upstream answering every call with a declared exception (result field 2) carrying
    `size` bytes, sent in two pieces 50 ms apart: the first over stream_threshold and incomplete,
    so the reply would stream if the proxy let it. `framing`: framed or buffered."""

    def __init__(self, size: int, framing: str = "framed") -> None:
        self.size = size
        self.framing = framing
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        with c:
            for name, seqid in self.requests(c, self.framing):
                head = struct.pack("!Ii", 0x80010002, len(name)) + name + struct.pack("!i", seqid)
                # field 2 (Unavailable) { 1: string reason } then the result struct's stop
                body = (b"\x0c" + struct.pack("!h", 2) + b"\x0b" + struct.pack("!h", 1)
                        + struct.pack("!i", self.size) + b"r" * self.size + b"\x00" + b"\x00")
                reply = head + body
                if self.framing == "framed":
                    reply = struct.pack("!i", len(reply)) + reply
                c.sendall(reply[:100_000])
                time.sleep(0.05)
                c.sendall(reply[100_000:])


@pytest.mark.parametrize("framing", ["framed", "buffered"])
def test_large_retryable_exception_is_read_whole_and_retried(framing):
    """Over stream_threshold, but an exception the route retries: not streamed, so retried."""
    bad = BigExceptionUpstream(300_000, framing)
    good = ThriftServer(framing=framing)
    text = config_text([f"127.0.0.1:{bad.port}", good.address], transport=framing).replace(
        "      - cluster: up", "      - cluster: up\n        retry: {attempts: 2, idempotent: [lookup], "
        "on_exceptions: [2], backoff: {base: 1ms, max: 2ms}}")
    assert "on_exceptions" in text
    try:
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with client(p.port(), framing=framing) as c:
                for i in range(6):
                    assert c.lookup(f"k{i}") == f"upstream:k{i}"
            time.sleep(0.2)
        # The same reply streams when the route would not retry it (so the above tested something).
        with Proxy(config_text([f"127.0.0.1:{bad.port}"], transport=framing)) as p:
            plain = []
            p.server.listeners["test"].pipeline.on_complete = plain.append
            with client(p.port(), framing=framing) as c:
                with pytest.raises(Exception) as raised:
                    c.lookup("down")
                assert type(raised.value).__name__ == "Unavailable"
            time.sleep(0.2)
    finally:
        bad.close()
        good.stop()
    lookups = [call for call in done if call.msg.name == "lookup"]
    assert len(lookups) == 6
    retried = [call for call in lookups if len(call.attempts) == 2]
    assert retried, "round robin sent first attempts to the exception-throwing upstream"
    assert len(retried) == bad.calls - 1  # every call the bad upstream answered was retried (+ the plain one)
    assert all(call.attempts[0].outcome == "declared_exception" for call in retried)
    assert not any(call.streamed for call in lookups)
    (call,) = [call for call in plain if call.msg.name == "lookup"]
    # (length prefix 4,) head 18 ("lookup"), field 2 header 3, field 1 header 3 + length 4, two STOPs
    prefix = 4 if framing == "framed" else 0
    assert call.streamed and call.reply_size == prefix + 18 + 3 + 3 + 4 + 300_000 + 2


def _timeout_config(upstream: str, timeout: str) -> str:
    return _big_config(upstream).replace("      - cluster: up", f"      - cluster: up\n        timeout: {timeout}")


def _per_try_config(upstream: str, timeout: str) -> str:
    return _big_config(upstream).replace(
        "      - cluster: up", f"      - cluster: up\n        retry: {{per_try_timeout: {timeout}}}")


@pytest.mark.parametrize("config", [_timeout_config, _per_try_config], ids=["timeout", "per_try_timeout"])
def test_slow_reader_of_a_streamed_reply_is_not_cut_by_the_route_timeout(config):
    """The route timeout and the per-try timeout bound the upstream side: time the client holds
    a stream back does not count (as when a reply is read whole), so a slow but steady reader
    gets all of it."""
    up = RawBigUpstream(16_000_000)  # far more than the kernel buffers hold: the stream pauses
    try:
        with Proxy(config(f"127.0.0.1:{up.port}", "200ms")) as p:
            s = small_window_client(p.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=3))
                t0 = time.monotonic()
                parts = []
                got = 0
                while got < 4 + 16_000_024:
                    time.sleep(0.01)
                    chunk = s.recv(256 * 1024)
                    assert chunk, f"closed after {got} bytes"
                    parts.append(chunk)
                    got += len(chunk)
                got = b"".join(parts)
                took = time.monotonic() - t0
            assert took > 0.5, f"the client read too fast ({took:.2f}s) to test anything"
            assert len(got) == 16_000_028 and got[-1:] == b"\x00"
            assert p.server.listeners["test"].pipeline.stats["timeouts"] == 0
    finally:
        up.close()


def test_idle_timeout_leaves_a_connection_alone_while_its_reply_is_still_going_out():
    """idle_timeout 500ms and a 16 MB reply that a slow client takes ~1.5 s to read: the
    connection is not idle while reply bytes are still in the proxy's send queue, and the next
    request on it is answered. Before: closed as idle mid-reply (activity counted only reads)."""
    up = RawBigUpstream(16_000_000)
    try:
        text = _big_config(f"127.0.0.1:{up.port}").replace(
            "    max_frame_size: 300MiB", "    max_frame_size: 300MiB\n    idle_timeout: 500ms")
        with Proxy(text) as p:
            s = small_window_client(p.port())
            with s:
                s.settimeout(10)
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=3))
                got = 0
                while got < 4 + 16_000_024:
                    time.sleep(0.02)
                    chunk = s.recv(256 * 1024)
                    assert chunk, f"closed after {got} bytes"
                    got += len(chunk)
                s.sendall(request_bytes("framed", "binary", "ping", seqid=4))
                (r,) = read_messages(s, 1)
            assert (r.seqid, r.type) == (4, MessageType.REPLY)
            assert p.server.listeners["test"].stats["idle_closed"] == 0
    finally:
        up.close()


def test_a_client_that_never_reads_a_stream_is_closed_after_one_timeout_not_two():
    """request_read_timeout 2 s, a ~10 MB buffered (never spliced) reply, a client that never
    reads: closed as a write stall about 2 s after its last byte taken (looks every 1/4 of the
    timeout). Before: the first look, a whole
    timeout after the pause, counted the kernel still filling the client's buffer as reading
    and waited a second timeout (~4.5 s)."""
    up = ThriftServer("buffered", "binary")
    try:
        text = config_text([up.address], transport="buffered").replace(
            "    protocol: binary\n    routes", "    protocol: binary\n    request_read_timeout: 2s\n    routes")
        with Proxy(text) as p:
            s = small_window_client(p.port(), 4096)
            with s:
                s.sendall(request_bytes("buffered", "binary", "get_users", 58000, 0, seqid=3))
                state = p.server.listeners["test"]
                deadline = time.monotonic() + 10
                conns = []
                while not conns and time.monotonic() < deadline:  # writing to it paused: the stall begins
                    conns = [c for c in list(state.connections) if c.paused_writing]
                    time.sleep(0.005)
                paused = time.monotonic()
                assert conns
                while state.stats["write_stalls"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                took = time.monotonic() - paused
        print(f"closed as a write stall {took:.2f}s after the pause")
        assert 1.9 <= took < 3.6, took  # (before: ~4 s, two whole timeouts)
    finally:
        up.stop()


def test_a_slow_reader_is_not_cut_for_a_request_the_proxy_stopped_reading():
    """The replies back up (a ~10 MB reply, a client reading ~2.5 MB/s), so the proxy stops
    reading; the client's next request is half read. That pause is the proxy's doing: the
    request is answered, not cut with "request not complete within request_read_timeout"
    (before: a PROTOCOL_ERROR 2 s in, and the connection closed)."""
    up = ThriftServer("framed", "binary")
    try:
        text = config_text([up.address]).replace(
            "    protocol: binary\n    routes", "    protocol: binary\n    request_read_timeout: 2s\n    routes")
        with Proxy(text) as p:
            s = small_window_client(p.port(), 32 * 1024)
            with s:
                nxt = request_bytes("framed", "binary", "lookup", "k", seqid=2)
                s.sendall(request_bytes("framed", "binary", "get_users", 58000, 0, seqid=1) + nxt[:22])
                state = p.server.listeners["test"]
                wait_for(lambda: any(c.paused_writing for c in list(state.connections)), what="writing paused")
                time.sleep(0.2)
                s.sendall(nxt[22:])  # the whole request, within 0.2 s
                s.settimeout(10)
                got = bytearray()
                t0 = time.monotonic()
                while True:  # slow but steady: 64 KiB every 25 ms, for ~4 s
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    got += chunk
                    if len(got) > 4 and len(got) >= 4 + struct.unpack_from("!i", got)[0] + 4:
                        (n1,) = struct.unpack_from("!i", got)
                        if len(got) >= 8 + n1 + struct.unpack_from("!i", got, 4 + n1)[0]:
                            break  # both replies whole
                    time.sleep(0.025)
                took = time.monotonic() - t0
            assert took > 2.5, f"the reply was read in {took:.1f}s: no longer than the timeout, no test"
            (n1,) = struct.unpack_from("!i", got)
            second = bytes(got[4 + n1:])
            dec = Decoder(Framing.FRAMED, Protocol.BINARY, 1 << 20)
            dec.feed(second)
            r = dec.next_message()
            assert (r.seqid, r.type) == (2, MessageType.REPLY), app_exception(r).message if r.type == 3 else r
            assert state.stats["read_timeouts"] == 0 and state.stats["protocol_errors"] == 0
    finally:
        up.stop()


class StallingUpstream(RawUpstream):
    """Sends the first 200 KB of a 1 MB reply, then the rest after `gap` seconds (None: never;
    the connection stays open)."""

    def __init__(self, gap: float | None = None) -> None:
        super().__init__()
        self.gap = gap

    def _one(self, c: socket.socket) -> None:
        for name, seqid in self.requests(c):
            head = struct.pack("!Ii", 0x80010002, len(name)) + name + struct.pack("!i", seqid)
            size = 1_000_000
            field = b"\x0b" + struct.pack("!h", 0) + struct.pack("!i", size)
            c.sendall(struct.pack("!i", len(head) + len(field) + size + 1) + head + field + b"s" * 200_000)
            if self.gap is not None:
                time.sleep(self.gap)
                c.sendall(b"s" * (size - 200_000) + b"\x00")


def _per_try_within_timeout_config(upstream: str, timeout: str) -> str:
    """The route `timeout`, and a per-try timeout of half of it (which must not cut a stream)."""
    half = f"{int(timeout.removesuffix('ms')) // 2}ms"
    return _big_config(upstream).replace("      - cluster: up", f"      - cluster: up\n        timeout: {timeout}\n"
                                         f"        retry: {{per_try_timeout: {half}}}")


@pytest.mark.parametrize("config", [_timeout_config, _per_try_within_timeout_config],
                         ids=["timeout", "timeout_and_per_try_timeout"])
def test_upstream_stalling_mid_stream_still_times_out(config):
    """A reply that stops mid-stream is cut by the route timeout, as a reply read whole would
    be timed out. A per-try timeout no longer counts once reply bytes went to the client (no
    retry could follow): with half the route timeout, the stream still ends at the route's."""
    up = StallingUpstream()
    try:
        with Proxy(config(f"127.0.0.1:{up.port}", "400ms")) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=4))
                s.settimeout(5)
                t0 = time.monotonic()
                got = 0
                while True:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    got += len(chunk)
                took = time.monotonic() - t0
            assert 200_000 <= got < 1_000_000
            assert 0.35 < took < 1.5, f"closed after {took:.2f}s"
            assert p.server.listeners["test"].pipeline.stats["timeouts"] == 1
            # a timeout, as for a reply read whole: the outcome, the attempt's, and peak_ewma's
            # sample of how long it took (the breaker counts it as the endpoint's failure)
            wait_for(lambda: done, what="the call recorded")
            (call,) = done
            assert call.outcome == call.error_type == call.attempts[0].outcome == "timeout", call.error
    finally:
        up.close()


def test_a_streaming_reply_slower_than_the_per_try_timeout_is_not_cut():
    """per_try_timeout 200ms (retries on, the method idempotent), route timeout 3s, and an
    upstream whose 1 MB reply streams over ~0.6 s: the first bytes went to the client at once,
    so no retry could follow, and only the route timeout bounds the rest (Envoy ignores a
    per-try timeout once it sent anything downstream). Before: cut at 200 ms, the client's
    connection closed mid-reply and its call counted as a timeout against the endpoint."""
    up = StallingUpstream(gap=0.6)
    try:
        text = _big_config(up.address).replace(
            "      - cluster: up", "      - cluster: up\n        timeout: 3s\n"
            "        retry: {attempts: 2, idempotent: true, per_try_timeout: 200ms}")
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                t0 = time.monotonic()
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=4))
                (r,) = read_messages(s, 1, timeout=10)
                took = time.monotonic() - t0
            assert (r.seqid, r.type, len(r.data)) == (4, MessageType.REPLY, 4 + 16 + 7 + 1_000_000 + 1)  # (frame length, head, field, string, STOP)
            assert took >= 0.5, f"the reply came in {took:.2f}s: the upstream's gap did not hold it"
            wait_for(lambda: done, what="the call recorded")
            (call,) = done
            assert call.streamed and call.outcome == "success" and len(call.attempts) == 1, call.error
            assert p.server.listeners["test"].pipeline.stats["timeouts"] == 0
            assert up.calls == 1
    finally:
        up.close()


# -- unframed (buffered) replies stream too ------------------------------------------------
# An unframed reply has no length: it may stream once stream_threshold bytes of it are here
# without its end (proxy/upstream.py), its end then found by scanning each read as it passes.


def _buffered_config(upstream: str, port: int = 0, protocol: str = "binary", extra_cluster: str = "") -> str:
    return _big_config(upstream, port, extra_cluster).replace(
        "    transport: framed\n", "    transport: buffered\n").replace(
        "    protocol: binary\n", f"    protocol: {protocol}\n")


def _uvarint(n: int) -> bytes:
    out = bytearray()
    write_varint(out, n)
    return bytes(out)


class RawBufferedUpstream(RawUpstream):
    """A raw unframed upstream: any call but ping gets a success reply carrying `size` bytes as a
    list<binary> of 1 MiB elements (so a size limit can be crossed mid-reply), written as it goes.

    die_after: reset the connection after that many payload bytes. garbage: an invalid field type
    where the result struct's STOP should be. trailing: bytes sent after the reply.
    """

    PIECE = 1 << 20

    def __init__(self, size: int, protocol: str = "binary", die_after: int | None = None,
                 garbage: bool = False, trailing: bytes = b"") -> None:
        self.size = size
        self.protocol = protocol
        self.die_after = die_after
        self.garbage = garbage
        self.trailing = trailing
        super().__init__()

    def reply_pieces(self, name: bytes, seqid: int, size: int):
        """The reply, in the pieces it is written in (join them for the expected bytes)."""
        compact = self.protocol == "compact"
        n = -(-size // self.PIECE)
        if compact:
            head = bytes((0x82, 0x42)) + _uvarint(seqid & 0xFFFFFFFF) + _uvarint(len(name)) + name
            lst = b"\x09\x00" + (bytes((n << 4 | 8,)) if n < 15 else b"\xf8" + _uvarint(n))
        else:
            head = struct.pack("!Ii", 0x80010002, len(name)) + name + struct.pack("!i", seqid)
            lst = b"\x0f\x00\x00\x0b" + struct.pack("!i", n)
        yield head + lst
        left = size
        chunk = b"\xab" * self.PIECE
        while left:
            k = min(left, self.PIECE)
            yield (_uvarint(k) if compact else struct.pack("!i", k)) + chunk[:k]
            left -= k
        yield (b"\x63\x00\x01" + b"\x00" * 8 if self.garbage else b"\x00") + self.trailing

    def expected(self, name: bytes, seqid: int) -> bytes:
        return b"".join(self.reply_pieces(name, seqid, self.size))

    def _one(self, c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):  # the proxy may reset it (the tests that make it)
            for name, seqid in self.requests(c, "buffered", self.protocol):
                sent = 0
                for piece in self.reply_pieces(name, seqid, 0 if name == b"ping" else self.size):
                    c.sendall(piece)
                    sent += len(piece)
                    if self.die_after is not None and sent >= self.die_after:
                        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return  # reset mid-reply


def _spy_streams(pipeline) -> list:
    """The calls whose reply began to stream (a call whose stream broke never reaches
    on_complete: its client connection is closed and the call cancelled)."""
    calls = []
    start = pipeline.stream_start

    def stream_start(attempt, head):
        ok = start(attempt, head)
        if ok:
            calls.append(attempt.call)
        return ok

    pipeline.stream_start = stream_start
    return calls


def _recv_all(s: socket.socket) -> int:
    got = 0
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            return got
        got += len(chunk)


def test_large_buffered_replies_stream_and_arrive_intact():
    up = ThriftServer(framing="buffered")
    try:
        with Proxy(_buffered_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with client(p.port(), framing="buffered") as c:
                small = os.urandom(50_000)  # under stream_threshold (64 KiB)
                assert c.echo(small) == small
                for size in (1_500_000, 10_000_000):
                    big = os.urandom(size)
                    assert c.echo(big) == big
                assert c.lookup("after") == "upstream:after"  # the upstream connection is reusable
            time.sleep(0.2)
            (ep,) = p.server.clusters["up"].endpoints
            (pool,) = ep.pools.values()
            assert pool.stats["connects"] == 1
    finally:
        up.stop()
    # Unframed: no length prefix; head 16 + field header and length 7 + STOP 1.
    streamed = {call.reply_size: call.streamed for call in done if call.msg.name == "echo"}
    assert streamed == {50_024: False, 1_500_024: True, 10_000_024: True}
    for call in done:
        if call.streamed:
            assert call.attempts[-1].reply_size == call.reply_size


def test_compact_buffered_reply_streams():
    up = ThriftServer(framing="buffered", protocol="compact")
    try:
        with Proxy(_buffered_config(up.address, protocol="compact")) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with client(p.port(), framing="buffered", protocol="compact") as c:
                big = os.urandom(3_000_000)
                assert c.echo(big) == big
                assert c.lookup("after") == "upstream:after"
            time.sleep(0.2)
    finally:
        up.stop()
    (echo,) = [call for call in done if call.msg.name == "echo"]
    # compact: head 2 + seqid varint 1 + name 1 + 4, field 0 long form 2 + length varint 4, STOP 1
    assert echo.streamed and echo.reply_size == 3_000_015


def test_buffered_reply_behind_a_pending_call_waits_its_turn_then_streams_in_order():
    up = ThriftServer(framing="buffered")
    try:
        with Proxy(_buffered_config(up.address)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("buffered", "binary", "sleep", 200, seqid=1)
                          + request_bytes("buffered", "binary", "echo", b"z" * 3_000_000, seqid=2))
                first, second = read_messages(s, 2, "buffered", "binary")
            assert (first.seqid, second.seqid) == (1, 2)
            assert second.type == MessageType.REPLY and len(second.data) == 3_000_024
            assert second.data.endswith(b"z" * 1000 + b"\x00")
            time.sleep(0.2)
    finally:
        up.stop()
    (echo,) = [call for call in done if call.msg.name == "echo"]
    assert echo.streamed and echo.outcome == "success" and echo.client_paused_ns >= 150e6


def test_buffered_replies_read_whole_under_pool_pressure_count_their_size_one_unsized_at_a_time():
    """Unframed replies have no length: one read whole to wait its turn because calls wait for
    its connection was let in counted as 0, and stayed 0 once read, so every such reply was let
    in (a hunt saw 618 MiB of RSS for 90 x 10 MB replies where the budget is 64 MiB). Now it
    counts its size once read, and only one unsized reply is read whole at a time: behind a
    4 s call on a pool of 2 and a 1 MB budget, the first large reply is read whole and counted,
    the next ones wait unread (then stream in their turn), and the budget is all free after."""
    up = ThriftServer(framing="buffered")
    try:
        pool = "\n    pool: {max_connections: 2, acquire_timeout: 5s}"
        with Proxy(_buffered_config(up.address, extra_cluster=pool)) as p:
            p.server.waiting.limit = 1_000_000
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("buffered", "binary", "sleep", 4000, seqid=1)
                          + b"".join(request_bytes("buffered", "binary", "get_users", 20_000, 0, seqid=i)
                                     for i in range(2, 6)))
                wait_for(lambda: p.call(lambda: p.server.waiting.used) > 0, timeout=3.5,
                         what="an unframed reply read whole and counted")
                during = p.call(lambda: (p.server.waiting.used, p.server.waiting.unsized))
                replies = read_messages(s, 5, "buffered", "binary")
            time.sleep(0.2)
            after = p.call(lambda: (p.server.waiting.used, p.server.waiting.unsized))
    finally:
        up.stop()
    assert [(r.seqid, r.type) for r in replies] == [(i, MessageType.REPLY) for i in range(1, 6)]
    size = len(replies[1].data)
    assert size > 1_000_000 and all(len(r.data) == size for r in replies[1:])
    assert during == (size, 0), (during, size)
    assert after == (0, 0), after


def test_buffered_upstream_reset_mid_stream_closes_only_that_client():
    up = RawBufferedUpstream(8_000_000, die_after=3_000_000)
    try:
        with Proxy(_buffered_config(f"127.0.0.1:{up.port}")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as other:
                with socket.create_connection(("127.0.0.1", p.port())) as s:
                    s.sendall(request_bytes("buffered", "binary", "echo", b"", seqid=5))
                    s.settimeout(10)
                    got = _recv_all(s)
                    assert 0 < got < 8_000_000  # part of it came, then the connection closed
                other.sendall(request_bytes("buffered", "binary", "ping", seqid=6))
                (reply,) = read_messages(other, 1, "buffered", "binary")
                assert (reply.name, reply.seqid) == ("ping", 6)
            assert p.server.listeners["test"].pipeline.stats["errors"] >= 1
    finally:
        up.close()


def test_buffered_garbage_mid_stream_closes_the_client():
    up = RawBufferedUpstream(3_000_000, garbage=True)
    try:
        with Proxy(_buffered_config(f"127.0.0.1:{up.port}")) as p:
            streams = _spy_streams(p.server.listeners["test"].pipeline)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("buffered", "binary", "echo", b"", seqid=5))
                s.settimeout(10)
                got = _recv_all(s)
            assert 1_000_000 < got <= 3_000_000 + 100
            time.sleep(0.2)
    finally:
        up.close()
    (echo,) = streams
    assert "invalid field type 99" in echo.error and echo.outcome == "may_have_run"
    assert 1_000_000 < echo.reply_size <= got  # what got through


def test_buffered_reply_over_max_reply_size_mid_stream_closes_the_client():
    """Found over the limit only while it streams (an unframed reply has no length): the client's
    connection closes, and the error says it is the proxy's limit, which no breaker counts (as a
    framed reply over it, refused from its length, is not the endpoint's fault). Before: "bad
    reply", counted by the breaker, which ejected a healthy endpoint after 5 such calls."""
    up = RawBufferedUpstream(8_000_000)
    text = _buffered_config(f"127.0.0.1:{up.port}").replace("max_reply_size: 300MiB", "max_reply_size: 5MiB")
    assert "5MiB" in text
    try:
        with Proxy(text) as p:
            streams = _spy_streams(p.server.listeners["test"].pipeline)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("buffered", "binary", "echo", b"", seqid=5))
                s.settimeout(10)
                got = _recv_all(s)
            assert 3_000_000 < got <= 5 * 1024 * 1024
            time.sleep(0.2)
            breaker = p.server.clusters["up"].endpoints[0].breaker.snapshot()
    finally:
        up.close()
    (echo,) = streams
    assert "too large: message exceeds max_reply_size 5242880 (the proxy's limit" in echo.error, echo.error
    assert breaker["consecutive_failures"] == 0, breaker
    assert 3_000_000 < echo.reply_size <= 5 * 1024 * 1024  # what got through


def test_buffered_bytes_past_the_streamed_reply_discard_that_connection():
    up = RawBufferedUpstream(2_000_000, trailing=b"junk after the reply")
    try:
        with Proxy(_buffered_config(f"127.0.0.1:{up.port}")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                for seqid in (1, 2):
                    s.sendall(request_bytes("buffered", "binary", "echo", b"", seqid=seqid))
                    (reply,) = read_messages(s, 1, "buffered", "binary")
                    assert reply.data == up.expected(b"echo", seqid)[:-len(up.trailing)]
            assert up.connections == 2  # each reply's connection was closed, not reused
    finally:
        up.close()


def test_slow_reader_of_a_buffered_stream_gets_everything():
    up = RawBufferedUpstream(16_000_000)  # far more than the kernel buffers hold: the stream pauses
    try:
        with Proxy(_buffered_config(f"127.0.0.1:{up.port}").replace(
                "      - cluster: up", "      - cluster: up\n        timeout: 200ms")) as p:
            s = small_window_client(p.port())
            expected = up.expected(b"echo", 3)
            with s:
                s.sendall(request_bytes("buffered", "binary", "echo", b"", seqid=3))
                t0 = time.monotonic()
                parts = []
                got = 0
                while got < len(expected):
                    time.sleep(0.01)
                    chunk = s.recv(256 * 1024)
                    assert chunk, f"closed after {got} bytes"
                    parts.append(chunk)
                    got += len(chunk)
                took = time.monotonic() - t0
            assert took > 0.5, f"the client read too fast ({took:.2f}s) to test anything"
            assert b"".join(parts) == expected
            assert p.server.listeners["test"].pipeline.stats["timeouts"] == 0
    finally:
        up.close()


class _LosesFirstSleep(RawBigUpstream):
    """The first `sleep` request is lost (the connection closes 0.2 s after it, no reply);
    later ones are answered at once; `echo` gets the large reply."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.lost = False

    def _one(self, c):
        with c:
            for name, seqid in self.requests(c):
                if name == b"sleep":
                    if not self.lost:
                        self.lost = True
                        time.sleep(0.2)
                        return
                    c.sendall(reply_bytes(name, seqid))
                    continue
                if not self._big(c, name, seqid):
                    return


def test_a_retry_behind_its_clients_own_held_reply_gets_that_connection_past_the_budget():
    """One pool connection. A client pipelines sleep and echo; the sleep's first attempt is lost
    and, meanwhile, the echo takes the connection and its 20 MB reply is held for its turn
    (behind the sleep). The sleep's retry waits for that connection, which would come free only
    after the retry: it is read whole past the proxy's budget (10 MB here), and both calls
    succeed. Before (the budget without this), the retry failed at acquire_timeout."""
    up = _LosesFirstSleep(20_000_000)
    text = _big_config(up.address, extra_cluster="\n    pool: {max_connections: 1, acquire_timeout: 3s}").replace(
        "      - cluster: up",
        "      - cluster: up\n        retry: {attempts: 2, idempotent: true, backoff: {base: 50ms, max: 50ms}}")
    try:
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            p.server.waiting.limit = 10_000_000
            with socket.create_connection(("127.0.0.1", p.port())) as a:
                t0 = time.monotonic()
                a.sendall(request_bytes("framed", "binary", "sleep", 10, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                a.settimeout(20)
                first, second = read_messages(a, 2, max_size=64 << 20)
                took = time.monotonic() - t0
            assert (first.seqid, first.type) == (1, MessageType.REPLY), first.data[:200]
            assert (second.seqid, second.type, len(second.data)) == (2, MessageType.REPLY, 20_000_028)
            assert took < 2.5, took  # (not the 3 s acquire_timeout)
            time.sleep(0.2)
            assert p.server.waiting.used == 0
    finally:
        up.close()
    assert sorted(c.outcome for c in done) == ["success", "success"]


class _SlowSleepBuffered(RawUpstream):
    """Unframed: `sleep` answered after 1.5 s, `echo` with a 300 KB reply, the rest at once."""

    def _one(self, c):
        with c:
            for name, seqid in self.requests(c, "buffered"):
                if name == b"sleep":
                    time.sleep(1.5)
                payload = b"x" * (300_000 if name == b"echo" else 3)
                c.sendall(reply_bytes(name, seqid, payload)[4:])


def test_an_unframed_held_reply_is_read_whole_for_another_clients_call():
    """A buffered upstream: the 300 KB echo reply behind a slow sleep is held (its size is not
    known up front); another client's ping that needs a connection gets the echo's at once,
    the reply read whole while the proxy's budget has room (before: it waited for the sleep)."""
    up = _SlowSleepBuffered()
    text = config_text([up.address], cluster_transport="buffered",
                       extra_cluster="\n    pool: {max_connections: 2, acquire_timeout: 5s}")
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as a:
                a.sendall(request_bytes("framed", "binary", "sleep", 1500, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"", seqid=2))
                time.sleep(0.4)
                with socket.create_connection(("127.0.0.1", p.port())) as b:
                    t0 = time.monotonic()
                    b.sendall(request_bytes("framed", "binary", "ping", seqid=9))
                    (pong,) = read_messages(b, 1)
                    took = time.monotonic() - t0
                replies = read_messages(a, 2, max_size=64 << 20)
            assert pong.type == MessageType.REPLY and took < 0.7, took  # (the sleep ends ~1.1 s later)
            assert [(r.seqid, r.type) for r in replies] == [(1, MessageType.REPLY), (2, MessageType.REPLY)]
            assert len(replies[1].data) == 300_028
            time.sleep(0.2)
            assert p.server.waiting.used == 0
    finally:
        up.close()


class StallingHeaderUpstream(RawUpstream):
    """A THeader upstream that sends the first 200 KB of a 1 MB reply, then nothing more (the
    connection stays open)."""

    def _one(self, c: socket.socket) -> None:
        from thrift.protocol import THeaderProtocol
        from thrift.Thrift import TMessageType, TType
        from thrift.transport import TTransport

        from harness import HEADER_TYPES

        for name, seqid in self.requests(c, framing="header"):
            buf = TTransport.TMemoryBuffer()
            prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
            prot.writeMessageBegin(name.decode(), TMessageType.REPLY, seqid)
            prot.writeStructBegin("echo_result")
            prot.writeFieldBegin("success", TType.STRING, 0)
            prot.writeBinary(b"s" * 1_000_000)
            prot.writeFieldEnd()
            prot.writeFieldStop()
            prot.writeStructEnd()
            prot.writeMessageEnd()
            prot.trans.flush()
            c.sendall(buf.getvalue()[:200_000])


@pytest.mark.parametrize("route_timeout, counted", [("5s", False), (None, True)],
                         ids=["under_the_route_timeout", "no_route_timeout"])
def test_a_stream_cut_by_the_clients_own_client_timeout_counts_against_the_breaker_only_without_a_route_timeout(
        route_timeout, counted):
    """A THeader client's client_timeout of 300 ms cuts a streaming reply whose upstream stalls
    after 200 KB: a timeout (the client's connection closes, as for any stream cut), recorded
    so. Under a route timeout of 5 s the deadline was the client's own choice, so the breaker
    (opening at one failure) does not count it, as for a reply read whole; with no route timeout
    it is the only bound there is and counts. Before: the breaker counted it either way."""
    from thrift.protocol import THeaderProtocol
    from thrift.transport import TTransport

    from harness import HEADER_TYPES, TestService

    up = StallingHeaderUpstream()
    text = _big_config(up.address, transport="header",
                       extra_cluster="\n    circuit_breaker: {consecutive_failures: 1, max_open_percent: 100}")
    if route_timeout:
        text = text.replace("      - cluster: up", f"      - cluster: up\n        timeout: {route_timeout}")
    buf = TTransport.TMemoryBuffer()
    prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
    prot.set_header(b"client_timeout", b"300")
    c = TestService.Client(prot)
    c._seqid = 4
    c.send_echo(b"")
    try:
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                t0 = time.monotonic()
                s.sendall(buf.getvalue())
                s.settimeout(5)
                got = 0
                while chunk := s.recv(1 << 16):
                    got += len(chunk)
                took = time.monotonic() - t0
            assert 100_000 <= got < 1_000_000, got  # it streamed, then was cut
            assert 0.25 < took < 2.5, f"closed after {took:.2f}s"
            wait_for(lambda: done, what="the call recorded")
            (call,) = done
            assert call.streamed and call.outcome == call.attempts[0].outcome == "timeout", call.error
            assert "the client's THeader client_timeout 300ms" in call.error, call.error
            (ep,) = p.call(lambda: p.server.clusters["up"].endpoints)
            assert p.call(lambda: ep.breaker.opened_total) == (1 if counted else 0)
    finally:
        up.close()


def _stop_recorded(p, path) -> tuple[list[dict], list[dict], str]:
    """SIGTERM `p` (a ProxyProcess on a `_STOPPING` config) and wait for its exit 0: the SERVER
    spans in its jsonl span file `path` (attributes flattened), its JSON access-log lines, its log."""
    import json

    p.proc.send_signal(signal.SIGTERM)
    rc = p.proc.wait(15)
    log = p.output()
    assert rc == 0, log[-2000:]
    servers = []
    for line in path.read_text().splitlines() if path.exists() else ():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    if s["kind"] == 2:
                        attrs = {a["key"]: (int(v["intValue"]) if "intValue" in v else next(iter(v.values())))
                                 for a in s["attributes"] for v in (a["value"],)}
                        servers.append({**attrs, "status": s["status"].get("message", "")})
    access = [json.loads(line) for line in log.splitlines()
              if line.startswith("{") and '"proxy.access"' in line]
    return servers, access, log


# A 1 s drain, a JSON access log, and every call traced to {path}.
_STOPPING = """drain_timeout: 1s
logging: {{format: json, level: info, access_log: true}}
tracing: {{exporter: jsonl, path: {path}, sample_ratio: 1.0}}"""


@pytest.mark.parametrize("framing", ["framed", "buffered"])
def test_a_stream_cut_by_a_stop_is_recorded_as_not_delivered(tmp_path, framing):
    """SIGTERM (drain_timeout 1s) while a 64 MB reply streams to a client that stopped reading:
    at the stop the stream is cut, and the call is still recorded, as not delivered, in the
    access log and a span. Before: the client's connection was closed gracefully, its close
    waited on a reader that never came, and the process exited with the call unrecorded
    (buffered), or recorded after the spans were flushed, so without its span (framed)."""
    size = 64_000_000
    up = RawBigUpstream(size) if framing == "framed" else RawBufferedUpstream(size)
    port = free_port()
    path = tmp_path / "spans.jsonl"
    make = _big_config if framing == "framed" else _buffered_config
    text = _STOPPING.format(path=path) + make(f"127.0.0.1:{up.port}", port)
    try:
        with ProxyProcess(text, [port]) as p:
            with small_window_client(port) as s:
                s.sendall(request_bytes(framing, "binary", "echo", b"", seqid=7))
                got = 0
                while got < 2_000_000:
                    chunk = s.recv(256 * 1024)
                    assert chunk, f"closed after {got} bytes"
                    got += len(chunk)
                servers, access, log = _stop_recorded(p, path)  # and the client reads no more
    finally:
        up.close()
    why = "not delivered: the proxy shut down (drain_timeout 1s passed) (while its reply streamed)"
    assert [(a["seqid"], a.get("error_type"), a.get("error")) for a in access] == [(7, "not_delivered", why)], log[-3000:]
    assert [(s["sidecar.seqid"], s["error.type"], s["sidecar.error"], s["sidecar.streamed"]) for s in servers] == [
        (7, "not_delivered", why, True)], servers


def test_replies_a_client_never_took_are_recorded_at_a_stop(tmp_path):
    """SIGTERM (drain_timeout 1s) with 60 pipelined calls answered (60 KB each, written whole)
    and a client that reads none of them: at the stop every call is recorded, in the access log
    and a span each, those its kernel had not taken as not delivered. Before: the graceful close
    waited for the client, the process exited first, and the calls still in the proxy's send
    buffer were never recorded."""
    up = ThriftServer()
    port = free_port()
    path = tmp_path / "spans.jsonl"
    text = config_text([up.address], listen_port=port, extra_top=_STOPPING.format(path=path))
    n = 60
    try:
        with ProxyProcess(text, [port]) as p:
            with small_window_client(port) as s:
                payload = b"x" * 60_000
                s.sendall(b"".join(request_bytes("framed", "binary", "echo", payload, seqid=i)
                                   for i in range(1, n + 1)))
                wait_for(lambda: up.handler.calls == n, what=f"{n} calls upstream")
                time.sleep(0.3)
                servers, access, log = _stop_recorded(p, path)
    finally:
        up.stop()
    assert sorted(a["seqid"] for a in access) == list(range(1, n + 1)), log[-3000:]
    assert sorted(s["sidecar.seqid"] for s in servers) == list(range(1, n + 1))
    undelivered = [a for a in access if a.get("error_type") == "not_delivered"]
    assert undelivered and all("the proxy shut down" in a["error"] for a in undelivered), access[-3:]
