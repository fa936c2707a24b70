"""Large replies stream through the proxy: bounded memory, backpressure, order, failure mid-stream."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from harness import (Proxy, ProxyProcess, ThriftServer, client, config_text, free_port, proc_status, read_messages,
                     request_bytes)
from proxy.codec import MessageType


def _big_config(upstream: str, port: int = 0, extra_cluster: str = "") -> str:
    return config_text([upstream], listen_port=port).replace(
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


def test_reply_behind_a_pending_call_is_buffered_in_order():
    up = ThriftServer()
    try:
        with Proxy(_big_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 200, seqid=1)
                          + request_bytes("framed", "binary", "echo", b"z" * 3_000_000, seqid=2))
                first, second = read_messages(s, 2)
            assert (first.seqid, second.seqid) == (1, 2)
            assert second.type == MessageType.REPLY and len(second.data) == 3_000_028
    finally:
        up.stop()


class RawBigUpstream:
    """A raw upstream answering any framed binary call with a reply carrying `size` bytes."""

    def __init__(self, size: int, die_after: int | None = None) -> None:
        self.size = size
        self.die_after = die_after
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c:
            while True:
                hdr = c.recv(4, socket.MSG_WAITALL)
                if len(hdr) < 4:
                    return
                n = struct.unpack("!i", hdr)[0]
                req = c.recv(n, socket.MSG_WAITALL)
                nlen = struct.unpack("!i", req[4:8])[0]
                name = req[8:8 + nlen]
                seqid = req[8 + nlen:12 + nlen]
                head = struct.pack("!I", 0x80010002) + struct.pack("!i", len(name)) + name + seqid
                size = 10 if name == b"ping" else self.size
                field = bytes((11,)) + struct.pack("!h", 0) + struct.pack("!i", size)
                body_len = len(head) + len(field) + size + 1
                c.sendall(struct.pack("!i", body_len) + head + field)
                chunk = b"\xab" * (1 << 20)
                left = size
                sent = 0
                while left:
                    part = chunk[:min(left, len(chunk))]
                    c.sendall(part)
                    left -= len(part)
                    sent += len(part)
                    if self.die_after is not None and sent >= self.die_after:
                        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return  # reset mid-reply
                c.sendall(b"\x00")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
def test_256_mib_reply_streams_with_bounded_memory():
    size = 256 * 1024 * 1024
    up = RawBigUpstream(size)
    port = free_port()
    try:
        with ProxyProcess(_big_config(f"127.0.0.1:{up.port}", port), [port]) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:  # warm up: pools, imports
                s.sendall(request_bytes("framed", "binary", "ping", seqid=1))
                read_messages(s, 1)
            base = proc_status(p.proc.pid, "VmRSS")
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=2))
                s.settimeout(60)
                got = 0
                total = None
                while total is None or got < total:
                    chunk = s.recv(1 << 20)
                    assert chunk, f"closed after {got} bytes"
                    got += len(chunk)
                    if total is None and got >= 4:
                        total = 4 + size + 0  # at least the payload
                assert got >= size
            peak = proc_status(p.proc.pid, "VmHWM")
    finally:
        up.close()
    growth_mib = (peak - base) / 1024
    print(f"256 MiB reply: proxy RSS {base / 1024:.1f} MiB before, peak {peak / 1024:.1f} MiB "
          f"(+{growth_mib:.1f} MiB)")
    assert growth_mib <= 32, f"peak RSS grew by {growth_mib:.1f} MiB"


def test_upstream_reset_mid_stream_closes_only_that_client():
    up = RawBigUpstream(8_000_000, die_after=3_000_000)
    try:
        with Proxy(_big_config(f"127.0.0.1:{up.port}")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"", seqid=5))
                s.settimeout(10)
                got = 0
                while True:
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        break
                    got += len(chunk)
                assert 0 < got < 8_000_000  # part of it came, then the connection closed
            stats = p.server.listeners["test"].pipeline.stats
            assert stats["errors"] >= 1
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


class BigExceptionUpstream:
    """A raw upstream answering every framed binary call with a declared exception (result
    field 2) carrying `size` bytes, sent in two pieces 50 ms apart (so it cannot arrive in one
    read and would stream if the proxy let it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c:
            while True:
                hdr = c.recv(4, socket.MSG_WAITALL)
                if len(hdr) < 4:
                    return
                req = c.recv(struct.unpack("!i", hdr)[0], socket.MSG_WAITALL)
                self.calls += 1
                nlen = struct.unpack("!i", req[4:8])[0]
                name, seqid = req[8:8 + nlen], req[8 + nlen:12 + nlen]
                head = struct.pack("!I", 0x80010002) + struct.pack("!i", len(name)) + name + seqid
                # field 2 (Unavailable) { 1: string reason } then the result struct's stop
                body = (b"\x0c" + struct.pack("!h", 2) + b"\x0b" + struct.pack("!h", 1)
                        + struct.pack("!i", self.size) + b"r" * self.size + b"\x00" + b"\x00")
                frame = struct.pack("!i", len(head) + len(body)) + head + body
                c.sendall(frame[:1000])
                time.sleep(0.05)
                c.sendall(frame[1000:])

    def close(self) -> None:
        self.sock.close()


def test_large_retryable_exception_is_read_whole_and_retried():
    """Over stream_threshold, but an exception the route retries: not streamed, so retried."""
    bad = BigExceptionUpstream(300_000)
    good = ThriftServer()
    text = config_text([f"127.0.0.1:{bad.port}", good.address]).replace(
        "      - cluster: up", "      - cluster: up\n        retry: {attempts: 2, idempotent: [lookup], "
        "on_exceptions: [2], backoff: {base: 1ms, max: 2ms}}")
    assert "on_exceptions" in text
    try:
        with Proxy(text) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            with client(p.port()) as c:
                for i in range(6):
                    assert c.lookup(f"k{i}") == f"upstream:k{i}"
            time.sleep(0.2)
    finally:
        bad.close()
        good.stop()
    assert bad.calls >= 2, "round robin sent first attempts to the exception-throwing upstream"
    lookups = [call for call in done if call.msg.name == "lookup"]
    assert len(lookups) == 6
    retried = [call for call in lookups if len(call.attempts) == 2]
    assert len(retried) == bad.calls
    assert all(call.attempts[0].outcome == "declared_exception" for call in retried)
    assert not any(call.streamed for call in lookups)


def _timeout_config(upstream: str, timeout: str) -> str:
    return _big_config(upstream).replace("      - cluster: up", f"      - cluster: up\n        timeout: {timeout}")


def test_slow_reader_of_a_streamed_reply_is_not_cut_by_the_route_timeout():
    """The route timeout bounds the upstream side: time the client holds a stream back does not
    count (as when a reply is read whole), so a slow but steady reader gets all of it."""
    up = RawBigUpstream(16_000_000)  # far more than the kernel buffers hold: the stream pauses
    try:
        with Proxy(_timeout_config(f"127.0.0.1:{up.port}", "200ms")) as p:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.connect(("127.0.0.1", p.port()))
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


class StallingUpstream:
    """Sends the first 200 KB of a 1 MB reply, then nothing more."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            req = c.recv(1 << 16)
            nlen = struct.unpack("!i", req[8:12])[0]
            name, seqid = req[12:12 + nlen], req[12 + nlen:16 + nlen]
            head = struct.pack("!I", 0x80010002) + struct.pack("!i", len(name)) + name + seqid
            size = 1_000_000
            field = b"\x0b" + struct.pack("!h", 0) + struct.pack("!i", size)
            c.sendall(struct.pack("!i", len(head) + len(field) + size + 1) + head + field + b"s" * 200_000)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_upstream_stalling_mid_stream_still_times_out():
    up = StallingUpstream()
    try:
        with Proxy(_timeout_config(f"127.0.0.1:{up.port}", "400ms")) as p:
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
    finally:
        up.close()
