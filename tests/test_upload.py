"""Large requests stream upstream as they arrive (DESIGN.md: over `retry_buffer`, never retried).

Real sockets on 127.0.0.1: raw clients that control exactly when each byte is sent, hand-written
upstreams that say what reached them and when, and a generated Apache client and server.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time

import pytest

from harness import (Proxy, ProxyProcess, RawUpstream, ThriftServer, client, config_text, free_port, proc_status, reset_peak,
                     read_messages, reply_bytes, request_bytes, wait_for)
from proxy.codec import AppErrorType, Decoder, Framing, MessageType, Protocol
from proxy.codec.heads import read_head


def _config(upstream: str, port: int = 0, route: str = "", listener: str = "", cluster: str = "") -> str:
    text = config_text([upstream], listen_port=port, extra_listener=listener, extra_cluster=cluster)
    if route:
        text = text.replace("      - cluster: up\n", f"      - cluster: up\n{route}")
    return text


def _echo_request(size: int, seqid: int) -> bytes:
    """A framed strict-binary `echo` CALL whose string argument is `size` random bytes."""
    return request_bytes("framed", "binary", "echo", os.urandom(size), seqid=seqid)


def _exception(msg):
    """(type, message) of a TApplicationException reply."""
    from thrift.protocol import TBinaryProtocol
    from thrift.Thrift import TApplicationException
    from thrift.transport import TTransport

    assert msg.type == MessageType.EXCEPTION, msg
    prot = TBinaryProtocol.TBinaryProtocol(TTransport.TMemoryBuffer(bytes(msg.payload())))
    prot.readMessageBegin()
    e = TApplicationException()
    e.read(prot)
    return e.type, e.message


class RecordingUpstream(RawUpstream):
    """Reads framed requests, counting every byte as it arrives (`received`); answers each
    whole request with a REPLY carrying the sha256 of its bytes. `cut_after`: the first
    connection closes once it has read that many bytes. `early`: the first connection replies as
    soon as it has a request's head (`early_after` seconds later), before the rest arrives."""

    def __init__(self, cut_after: int = 0, early: bool = False, silent: tuple = (), early_after: float = 0.0) -> None:
        self.early_after = early_after
        self.received = 0
        self.requests: list[bytes] = []
        self.cut_after = cut_after
        self.early = early
        self.silent = {name.encode() for name in silent}  # methods never answered
        self.closed_by_peer = threading.Event()
        super().__init__()

    def _read(self, c: socket.socket) -> bytes | None:
        """The next bytes from `c`, counted in `received`; None once it closed (or failed)."""
        try:
            data = c.recv(1 << 20)
        except OSError:
            return None
        if not data:
            self.closed_by_peer.set()
            return None
        self.received += len(data)
        return data

    def _one(self, c: socket.socket) -> None:
        first = self.connections == 1
        buf = bytearray()
        answered = False
        while True:
            data = self._read(c)
            if data is None:
                return
            buf += data
            if first and self.cut_after and self.received >= self.cut_after:
                c.close()
                return
            while len(buf) >= 4:
                total = 4 + struct.unpack_from("!i", buf)[0]
                if first and self.early and not answered and len(buf) >= 64:
                    name, _, seqid, _ = read_head(buf, 4, len(buf), Protocol.BINARY)
                    time.sleep(self.early_after)
                    c.sendall(reply_bytes(name.encode(), seqid, b"early"))
                    answered = True
                if len(buf) < total:
                    break
                frame = bytes(buf[:total])
                del buf[:total]
                self.requests.append(frame)
                if answered:
                    answered = False
                    continue
                name, _, seqid, _ = read_head(frame, 4, len(frame), Protocol.BINARY)
                if name.encode() in self.silent:
                    continue
                c.sendall(reply_bytes(name.encode(), seqid, hashlib.sha256(frame).hexdigest().encode()))


def _reply_text(msg) -> bytes:
    """The string result of a reply built by `reply_bytes`."""
    data = bytes(msg.data)
    n = struct.unpack_from("!i", data, msg.body + 3)[0]  # past the field header (type, id)
    return data[msg.body + 7:msg.body + 7 + n]


def _calls(p: Proxy) -> list:
    done = []
    p.server.listeners["test"].pipeline.on_complete = done.append
    return done


def test_a_large_request_reaches_the_upstream_before_the_client_has_sent_it_all():
    """Half of a 6 MB request is written upstream while the other half is still with the client:
    read whole first, the upstream would see nothing until the end and this would time out."""
    up = RecordingUpstream()
    req = _echo_request(6_000_000, seqid=41)
    try:
        with Proxy(_config(up.address)) as p:
            done = _calls(p)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req[:3_000_000])
                wait_for(lambda: up.received >= 2_500_000, 5, "the first half upstream")
                assert not up.requests
                s.sendall(req[3_000_000:])
                (reply,) = read_messages(s, 1, "framed", "binary")
            wait_for(lambda: done, 5, "the call recorded")
    finally:
        up.close()
    assert reply.seqid == 41 and reply.type == MessageType.REPLY
    assert up.requests == [req]
    assert _reply_text(reply) == hashlib.sha256(req).hexdigest().encode()
    (call,) = done
    assert call.upload is not None and call.request_size == len(req)
    a = call.attempts[0]
    # read_request and write_upstream overlap: the upstream had bytes long before the last one came
    assert a.t_acquired < call.t_framed <= a.t_written < a.t_reply


def test_requests_within_retry_buffer_are_read_whole():
    up = RecordingUpstream()
    req = _echo_request(3_000_000, seqid=5)
    try:
        with Proxy(_config(up.address, route="        retry_buffer: 8MiB\n")) as p:
            done = _calls(p)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req[:2_000_000])
                time.sleep(0.3)
                assert up.received == 0  # held until it is whole: it could be retried
                s.sendall(req[2_000_000:])
                (reply,) = read_messages(s, 1, "framed", "binary")
            wait_for(lambda: done, 5, "the call recorded")
    finally:
        up.close()
    assert reply.seqid == 5 and _reply_text(reply) == hashlib.sha256(req).hexdigest().encode()
    assert done[0].upload is None


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_generated_clients_large_echo_streams_and_arrives_intact(protocol):
    up = ThriftServer(protocol=protocol)
    try:
        with Proxy(config_text([up.address], protocol=protocol)) as p:
            done = _calls(p)
            with client(p.port(), protocol=protocol) as c:
                for size in (3_000_000, 12_000_000):
                    big = os.urandom(size)
                    assert c.echo(big) == big
                assert c.ping() is None
            wait_for(lambda: len(done) == 3, 5, "three calls recorded")
    finally:
        up.stop()
    streamed = [call.request_size for call in done if call.upload is not None]
    assert len(streamed) == 2 and min(streamed) > 3_000_000


def test_pipelined_request_right_behind_a_streamed_one_is_answered_in_order():
    up = RecordingUpstream()
    big = _echo_request(4_000_000, seqid=1)
    small = request_bytes("framed", "binary", "ping", seqid=2)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_000_000])
                wait_for(lambda: up.received > 0, 5, "the upload started")
                s.sendall(big[1_000_000:] + small)  # the big one's tail and the next request in one write
                replies = read_messages(s, 2, "framed", "binary")
    finally:
        up.close()
    assert [m.seqid for m in replies] == [1, 2]
    assert [_reply_text(m) for m in replies] == [hashlib.sha256(r).hexdigest().encode() for r in (big, small)]


def test_upstream_lost_mid_request_answers_may_have_run_and_the_connection_goes_on():
    up = RecordingUpstream(cut_after=1_000_000)
    big = _echo_request(5_000_000, seqid=9)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big)  # the proxy drops what follows the cut
                s.sendall(request_bytes("framed", "binary", "ping", seqid=10))
                err, ok = read_messages(s, 2, "framed", "binary")
            stats = p.server.listeners["test"].pipeline.stats
    finally:
        up.close()
    assert err.seqid == 9
    kind, text = _exception(err)
    assert kind == AppErrorType.INTERNAL_ERROR
    assert text.startswith("thrift-sidecar: may have run: connection to ")
    # "while the request was being written", or "after": the proxy may have handed its last
    # piece to the transport (which the reset then cut) before the reset came
    assert " lost " in text and "the request was being written" in text or "after the request was written" in text
    assert ok.seqid == 10 and ok.type == MessageType.REPLY
    assert stats["retries"] == 0
    assert up.connections == 2


def test_upstream_replying_before_the_request_is_all_written_is_passed_on_and_not_reused():
    up = RecordingUpstream(early=True)
    big = _echo_request(4_000_000, seqid=3)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:500_000])
                (early,) = read_messages(s, 1, "framed", "binary")
                s.sendall(big[500_000:])  # dropped by the proxy
                s.sendall(request_bytes("framed", "binary", "ping", seqid=4))
                (ping,) = read_messages(s, 1, "framed", "binary")
    finally:
        up.close()
    assert early.seqid == 3 and _reply_text(early) == b"early"
    assert ping.seqid == 4 and ping.type == MessageType.REPLY
    assert up.connections == 2  # the connection holding half a request was never reused


def test_an_early_reply_to_a_streaming_request_keeps_the_attempts_hops():
    """The upstream answers a streaming request ~150 ms after its head, before the client has
    sent the rest: the attempt's time after `acquire` is in write_upstream (the request was still
    being written), then read_response; the CLIENT span's hops cover it, and /metrics has a sample
    of each. Before: only `acquire` (t_written was never set), ~150 ms in no hop."""
    from spans_util import Traced, ms

    up = RecordingUpstream(early=True, early_after=0.15)
    big = _echo_request(4_000_000, seqid=3)
    try:
        with Traced(_config(up.address)) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(big[:500_000])
                (early,) = read_messages(s, 1, "framed", "binary")
            (call,) = t.wait_calls(1)
            page = t.proxy.call(t.proxy.server.metrics.exposition).decode()
    finally:
        up.close()
    assert early.seqid == 3 and _reply_text(early) == b"early"
    (attempt,) = call.clients
    hops = {s.name: s for s in call.children(attempt)}
    assert set(hops) == {"acquire", "write_upstream", "service_time", "read_response"}, hops
    covered = sum(ms(s) for s in hops.values())
    assert covered >= 0.95 * ms(attempt), (covered, ms(attempt))
    assert ms(hops["write_upstream"]) >= 100, call
    for hop in ("write_upstream", "service_time", "read_response"):
        assert f'thrift_sidecar_hop_duration_seconds_count{{hop="{hop}",method="echo"' in page, (hop, page)


def test_large_request_with_no_route_is_answered_at_once_and_the_rest_dropped():
    up = RecordingUpstream()
    text = _config(up.address).replace("      - cluster: up\n", "      - match: {method: ping}\n        cluster: up\n")
    big = _echo_request(4_000_000, seqid=21)
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_000_000])
                (err,) = read_messages(s, 1, "framed", "binary")  # before the rest was sent
                s.sendall(big[1_000_000:] + request_bytes("framed", "binary", "ping", seqid=22))
                (ok,) = read_messages(s, 1, "framed", "binary")
    finally:
        up.close()
    assert err.seqid == 21
    kind, text = _exception(err)
    assert kind == AppErrorType.UNKNOWN_METHOD and "no route: method 'echo'" in text
    assert ok.seqid == 22 and ok.type == MessageType.REPLY
    assert up.received == len(request_bytes("framed", "binary", "ping", seqid=22))


def test_client_gone_mid_request_closes_that_upstream_connection():
    up = RecordingUpstream()
    big = _echo_request(4_000_000, seqid=1)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_000_000])
                wait_for(lambda: up.received > 0, 5, "the upload started")
            assert up.closed_by_peer.wait(5), "the upstream connection holding half a request stayed open"
            with client(p.port()) as c:  # the proxy goes on
                up_requests = len(up.requests)
                c.ping()
            assert len(up.requests) == up_requests + 1
    finally:
        up.close()


def test_route_timeout_counts_from_the_requests_last_byte():
    """A request that takes ~0.8 s to arrive, under a 300 ms route timeout, succeeds: the
    timeout bounds the upstream's part, as it does for a request read whole."""
    up = RecordingUpstream()
    big = _echo_request(3_000_000, seqid=6)
    try:
        with Proxy(_config(up.address, route="        timeout: 300ms\n")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                for i in range(0, len(big), 400_000):
                    s.sendall(big[i:i + 400_000])
                    time.sleep(0.1)
                (reply,) = read_messages(s, 1, "framed", "binary")
    finally:
        up.close()
    assert reply.seqid == 6 and reply.type == MessageType.REPLY
    assert _reply_text(reply) == hashlib.sha256(big).hexdigest().encode()


def test_request_stopping_short_is_answered_with_its_seqid():
    """request_read_timeout bounds a streaming request as it bounds any other; a half-close
    inside one is answered too. Either way the upstream connection holding part of it goes."""
    up = RecordingUpstream()
    big = _echo_request(3_000_000, seqid=77)
    try:
        with Proxy(_config(up.address, listener="\n    request_read_timeout: 300ms")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_000_000])
                (err,) = read_messages(s, 1, "framed", "binary")
                s.settimeout(5)
                assert s.recv(1) == b""  # then closed
            kind, text = _exception(err)
            assert err.seqid == 77 and kind == AppErrorType.PROTOCOL_ERROR
            assert "request not complete within request_read_timeout 0.3s (1000000 of" in text
            assert up.closed_by_peer.wait(5)
            up.closed_by_peer.clear()
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_000_000])
                wait_for(lambda: up.received >= 2_000_000 or up.closed_by_peer.is_set() or False, 5,
                         "the second upload started")
                s.shutdown(socket.SHUT_WR)
                (err,) = read_messages(s, 1, "framed", "binary")
            kind, text = _exception(err)
            assert err.seqid == 77 and "connection closed inside a request (1000000 of" in text
            assert up.closed_by_peer.wait(5)
    finally:
        up.close()


# -- regressions found in review ----------------------------------------------------------


def test_client_held_while_waiting_for_a_connection_is_let_go_when_the_call_fails():
    """The request arrives whole (more than the proxy holds without a connection) while the
    attempt waits for one; the wait fails. The client hears why and its connection goes on."""
    up = RecordingUpstream(silent=("sleep",))
    text = _config(up.address, cluster="\n    pool: {max_connections: 1, acquire_timeout: 300ms}")
    big = _echo_request((1 << 20) + 20, seqid=5)  # held past UPLOAD_HOLD only by its last read
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as busy:
                busy.sendall(request_bytes("framed", "binary", "sleep", 5000, seqid=1))
                wait_for(lambda: up.requests, 5, "the pool's one connection busy")
                with socket.create_connection(("127.0.0.1", p.port())) as s:
                    s.sendall(big[:100_000])
                    time.sleep(0.05)
                    s.sendall(big[100_000:])
                    (err,) = read_messages(s, 1, "framed", "binary")
                    s.sendall(request_bytes("framed", "binary", "ping", seqid=6))
                    (after,) = read_messages(s, 1, "framed", "binary")  # read again: not left paused
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 5 and "not sent: " in text and "acquire_timeout 300ms" in text
    assert after.seqid == 6


def test_read_timeout_while_the_proxy_holds_the_client_blames_the_wait_for_a_connection():
    up = RecordingUpstream(silent=("sleep",))
    text = _config(up.address, cluster="\n    pool: {max_connections: 1, acquire_timeout: 5s}",
                   listener="\n    request_read_timeout: 300ms")
    big = _echo_request(3_000_000, seqid=12)
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as busy:
                busy.sendall(request_bytes("framed", "binary", "sleep", 5000, seqid=1))
                wait_for(lambda: up.requests, 5, "the pool's one connection busy")
                with socket.create_connection(("127.0.0.1", p.port())) as s:
                    s.sendall(big[:1_500_000])  # held (no connection) past UPLOAD_HOLD: reading paused
                    (err,) = read_messages(s, 1, "framed", "binary")
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 12 and kind == AppErrorType.INTERNAL_ERROR
    assert text.startswith("thrift-sidecar: not sent: no connection to 127.0.0.1:"), text
    assert "within request_read_timeout 0.3s" in text


def test_upload_keeps_its_read_deadline_at_max_inflight():
    """The streaming request is the call that fills max_inflight: reading is not paused under it
    (its bytes are its own counted call's), and a client that stalls mid-request is answered."""
    import dataclasses

    up = RecordingUpstream(silent=("sleep",))
    text = _config(up.address, route="        timeout: 1s\n", listener="\n    request_read_timeout: 300ms")
    big = _echo_request(4_000_000, seqid=500)
    try:
        with Proxy(text) as p:
            state = p.server.listeners["test"]
            state.settings = dataclasses.replace(state.settings, max_inflight=2)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 1, seqid=1) + big[:200_000])
                t0 = time.monotonic()
                first, second = read_messages(s, 2, "framed", "binary", timeout=10)
                took = time.monotonic() - t0
    finally:
        up.close()
    assert (first.seqid, second.seqid) == (1, 500)
    assert "route timeout 1000ms" in _exception(first)[1]
    assert "request not complete within request_read_timeout 0.3s (200000 of" in _exception(second)[1]
    assert took < 5


@pytest.mark.parametrize("framing", ["framed", "buffered"])
def test_a_streamed_request_at_max_inflight_1_goes_on_after_backpressure(framing):
    """max_inflight 1: the streamed request's own call fills it. When the upstream's side held
    the client back (backpressure, or a splice of the request's long string) and let go, reading
    resumed only if the connection was not "full", which it always was: the rest of the request
    was never read, and the client was blamed ("request not complete within
    request_read_timeout", 1.2 MB of 12 MB) though the proxy had stopped reading (a hunt found
    it). Now resuming exempts the upload from the full check, as pausing does."""
    up = ThriftServer(framing)
    text = config_text([up.address], transport=framing,
                       extra_listener="\n    max_inflight: 1\n    request_read_timeout: 5s")
    try:
        with Proxy(text) as p:
            done = _calls(p)
            with client(p.port(), framing) as c:
                for _ in range(2):
                    big = os.urandom(12_000_000)
                    assert c.echo(big) == big
            wait_for(lambda: len(done) == 2, 5, "two calls recorded")
            timeouts = p.server.listeners["test"].stats["read_timeouts"]
    finally:
        up.stop()
    assert all(call.upload is not None for call in done) and timeouts == 0


def test_early_reply_leaves_peak_ewma_sane():
    """A reply before the request was all written has no write time: it is not a latency sample."""
    up = RecordingUpstream(early=True)
    big = _echo_request(4_000_000, seqid=3)
    try:
        with Proxy(config_text([up.address], lb="peak_ewma")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:500_000])
                (early,) = read_messages(s, 1, "framed", "binary")
            ep = p.server.clusters["up"].endpoints[0]
            estimate = p.call(ep.ewma.estimate)
    finally:
        up.close()
    assert early.seqid == 3
    assert estimate < 1.0, f"latency estimate {estimate:.1f} s after one early reply"


def test_request_whose_head_is_cut_by_its_first_read_still_streams():
    """A first read of 70 bytes, a method name of 100: the head spans two reads."""
    up = RecordingUpstream()
    req = request_bytes("framed", "binary", "echo", os.urandom(6_000_000), seqid=41, service="S" * 95)
    try:
        with Proxy(_config(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req[:70])
                time.sleep(0.1)
                s.sendall(req[70:3_000_000])
                wait_for(lambda: up.received >= 2_000_000, 5, "the first half upstream")
                s.sendall(req[3_000_000:])
                (reply,) = read_messages(s, 1, "framed", "binary")
    finally:
        up.close()
    assert reply.seqid == 41 and up.requests == [req]


def test_large_oneway_with_no_route_is_read_whole_and_recorded_once():
    """Only CALLs stream: a large oneway (nothing is ever written back) is read whole as before,
    so one cut short is recorded once, as a bad request (nothing answered, nothing sent
    upstream), and a whole one exactly once."""
    up = RecordingUpstream()
    text = _config(up.address).replace("      - cluster: up\n", "      - match: {method: ping}\n        cluster: up\n")
    big = request_bytes("framed", "binary", "log_event", "x" * 3_000_000, seqid=9)
    try:
        with Proxy(text) as p:
            done = _calls(p)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big[:1_000_000])
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                assert s.recv(100) == b""
            wait_for(lambda: done, 5, "the cut-short oneway recorded")
            time.sleep(0.2)
            (cut,) = done
            assert (cut.msg.name, cut.outcome, cut.attempts) == ("log_event", "bad_request", [])
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(big + request_bytes("framed", "binary", "ping", seqid=10))
                (ok,) = read_messages(s, 1, "framed", "binary")
            wait_for(lambda: len(done) == 3, 5, "two more calls recorded")
    finally:
        up.close()
    assert ok.seqid == 10
    (oneway,) = [c for c in done[1:] if c.msg.name == "log_event"]
    assert oneway.upload is None and oneway.outcome == "no_route"


# -- unframed (buffered) requests stream too ------------------------------------------------
# An unframed request has no length: it streams once more than its route's retry_buffer of it
# came without its end, which is then found by scanning each read as it passes.


class BufferedRecordingUpstream(RecordingUpstream):
    """`RecordingUpstream` for unframed binary requests (found with the proxy's own decoder)."""

    def _one(self, c: socket.socket) -> None:
        dec = Decoder(Framing.BUFFERED, Protocol.BINARY, 1 << 30)
        while True:
            msg = dec.next_message()
            if msg is None:
                data = self._read(c)
                if data is None:
                    return
                dec.feed(data)
                continue
            frame = bytes(msg.data)
            self.requests.append(frame)
            sha = hashlib.sha256(frame).hexdigest().encode()
            c.sendall(reply_bytes(msg.name.encode(), msg.seqid, sha)[4:])  # unframed


def _buffered(upstream: str, route: str = "") -> str:
    return _config(upstream, route=route).replace("    transport: framed\n", "    transport: buffered\n")


def test_large_buffered_request_streams_before_the_client_has_sent_it_all():
    up = BufferedRecordingUpstream()
    req = request_bytes("buffered", "binary", "echo", os.urandom(6_000_000), seqid=43)
    small = request_bytes("buffered", "binary", "ping", seqid=44)
    try:
        with Proxy(_buffered(up.address)) as p:
            done = _calls(p)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req[:3_000_000])
                wait_for(lambda: up.received >= 2_500_000, 5, "the first half upstream")
                assert not up.requests
                s.sendall(req[3_000_000:] + small)  # its end found mid-read: the next one follows
                replies = read_messages(s, 2, "buffered", "binary")
            wait_for(lambda: len(done) == 2, 5, "the calls recorded")
    finally:
        up.close()
    assert [m.seqid for m in replies] == [43, 44]
    assert sorted(up.requests, key=len) == [small, req]  # (on two upstream connections: either first)
    assert [_reply_text(m) for m in replies] == [hashlib.sha256(r).hexdigest().encode() for r in (req, small)]
    big = [c for c in done if c.msg.name == "echo"][0]
    assert big.upload is not None and big.request_size == len(req)


def test_buffered_request_within_retry_buffer_is_read_whole():
    up = BufferedRecordingUpstream()
    req = request_bytes("buffered", "binary", "echo", os.urandom(3_000_000), seqid=5)
    try:
        with Proxy(_buffered(up.address, route="        retry_buffer: 8MiB\n")) as p:
            done = _calls(p)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req[:2_000_000])
                time.sleep(0.3)
                assert up.received == 0
                s.sendall(req[2_000_000:])
                (reply,) = read_messages(s, 1, "buffered", "binary")
            wait_for(lambda: done, 5, "the call recorded")
    finally:
        up.close()
    assert reply.seqid == 5 and done[0].upload is None


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_generated_buffered_clients_large_echo_streams_and_arrives_intact(protocol):
    up = ThriftServer("buffered", protocol)
    try:
        with Proxy(config_text([up.address], transport="buffered", protocol=protocol)) as p:
            done = _calls(p)
            with client(p.port(), "buffered", protocol) as c:
                big = os.urandom(5_000_000)
                assert c.echo(big) == big
                assert c.ping() is None
            wait_for(lambda: len(done) == 2, 5, "two calls recorded")
    finally:
        up.stop()
    (echo,) = [call for call in done if call.msg.name == "echo"]
    assert echo.upload is not None and echo.request_size > 5_000_000


def test_buffered_request_malformed_mid_stream_is_answered_and_closed():
    """Where the next request would begin cannot be known: the call is answered (its seqid),
    the connection closed, and so is the upstream connection holding part of it."""
    up = BufferedRecordingUpstream()
    name = b"echo"
    head = struct.pack("!Ii", 0x80010001, len(name)) + name + struct.pack("!i", 31)
    payload = os.urandom(2_000_000)
    bad = head + b"\x0b\x00\x01" + struct.pack("!i", len(payload)) + payload + b"\x7f\x00\x02"  # type 0x7f
    try:
        with Proxy(_buffered(up.address)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(bad[:1_500_000])
                wait_for(lambda: up.received > 0, 5, "the upload started")
                s.sendall(bad[1_500_000:])
                (err,) = read_messages(s, 1, "buffered", "binary")
                s.settimeout(5)
                while s.recv(1 << 16):  # the lingering close drops the rest
                    pass
            assert up.closed_by_peer.wait(5)
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 31 and kind == AppErrorType.PROTOCOL_ERROR and text.endswith("invalid field type 127"), text


def test_finished_streamed_calls_are_freed_by_reference_counting():
    """As for any call (tests/test_datapath.py): with the GC off, ten streamed requests, framed and
    unframed, leave no Call or Upload behind (nor, through it, their client connection)."""
    import gc

    from proxy.calls import Call, Upload

    framed, buffered = RecordingUpstream(), BufferedRecordingUpstream()
    try:
        with Proxy(_config(framed.address)) as pf, Proxy(_buffered(buffered.address)) as pb:
            gc.collect()
            gc.disable()
            try:
                before = sum(1 for o in gc.get_objects() if type(o) in (Call, Upload))  # other tests'
                for p, framing in ((pf, "framed"), (pb, "buffered")):
                    with socket.create_connection(("127.0.0.1", p.port())) as s:
                        for i in range(5):
                            req = request_bytes(framing, "binary", "echo", os.urandom(1_500_000), seqid=10 + i)
                            s.sendall(req[:700_000])
                            time.sleep(0.02)
                            s.sendall(req[700_000:])
                            (r,) = read_messages(s, 1, framing, "binary")
                            assert r.seqid == 10 + i and r.type == MessageType.REPLY
                time.sleep(0.1)  # the last acknowledgements are recorded
                live = sum(1 for o in gc.get_objects() if type(o) in (Call, Upload))
            finally:
                gc.enable()
    finally:
        framed.close()
        buffered.close()
    assert live - before == 0, f"{live - before} calls and uploads still alive after 10 streamed calls"


class StalledUpstream(RawUpstream):
    """Accepts and never reads: its receive window fills and the proxy's writes back up."""

    def _one(self, c: socket.socket) -> None:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        time.sleep(60)


def test_upstream_not_reading_holds_the_client_back_and_bounds_memory():
    """Backpressure: the proxy stops reading the client instead of queueing the request, and
    request_read_timeout then says whose fault it was."""
    up = StalledUpstream()
    port = free_port()
    big = _echo_request(60_000_000, seqid=8)
    text = _config(up.address, port, listener="\n    max_frame_size: 100MiB\n    request_read_timeout: 1s")
    try:
        with ProxyProcess(text, [port]) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:  # warm up
                s.sendall(request_bytes("framed", "binary", "ping", seqid=1))
            base = reset_peak(p.proc.pid)
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.settimeout(10)
                sent = 0
                try:
                    while sent < len(big):
                        sent += s.send(big[sent:sent + (1 << 20)])
                except (socket.timeout, OSError):
                    pass
                (err,) = read_messages(s, 1, "framed", "binary")
            peak = proc_status(p.proc.pid, "VmHWM")
    finally:
        up.close()
    kind, text = _exception(err)
    assert err.seqid == 8 and kind == AppErrorType.INTERNAL_ERROR
    assert "may have run: " in text and "did not take the whole request within request_read_timeout 1s" in text
    # what the proxy had read when it gave up: socket buffers' worth, not the 60 MB the client
    # had to send (the rest it could only send to the lingering close, which drops it)
    received = int(text.split("(")[1].split(" of ")[0])
    assert received < 20_000_000, text
    assert (peak - base) / 1024 <= 32, f"peak RSS grew by {(peak - base) / 1024:.1f} MiB"


class LateReader(RecordingUpstream):
    """Reads nothing for `stall` seconds (a small receive window: the proxy's writes back up),
    then reads and answers as RecordingUpstream does."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        super().__init__()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # (accepted ones inherit it)

    def _one(self, c: socket.socket) -> None:
        time.sleep(self.stall)
        super()._one(c)


def test_time_the_upstream_held_the_client_back_is_not_the_clients_read_time():
    """request_read_timeout is the client's budget: the 1.3 s an upstream took no bytes, with
    the client held back, is not counted against it. The client then pauses 1.3 s mid-request
    (the timeout's whole 2.5 s passed by then) and finishes: its call is answered, not cut as
    "bad request" (before: cut at 2.5 s, the client blamed for the upstream's stall). (The
    upstream has 1.2 s after its stall to take the first 40 MB: were the client still held back
    when the timeout's time is up, the upstream would be blamed, rightly.)"""
    up = LateReader(stall=1.3)
    big = _echo_request(48 << 20, seqid=9)
    text = _config(up.address, listener="\n    request_read_timeout: 2500ms\n    max_frame_size: 64MiB",
                   route="        retry_buffer: 64KiB\n")
    try:
        with Proxy(text) as p, socket.create_connection(("127.0.0.1", p.port())) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
            t0 = time.monotonic()
            s.sendall(big[:40 << 20])  # held back until the upstream reads (1.3 s): more than buffers hold
            held = time.monotonic() - t0
            time.sleep(1.3)  # the client's own pause, across the 2.5 s mark
            s.sendall(big[40 << 20:])
            (reply,) = read_messages(s, 1, "framed", "binary", timeout=10)
    finally:
        up.close()
    assert held >= 1.0, f"the client was not held back ({held:.2f}s): the test shows nothing"
    assert reply.type == MessageType.REPLY, _exception(reply)
    assert _reply_text(reply) == hashlib.sha256(big).hexdigest().encode()


@pytest.mark.slow
def test_256_mib_request_streams_with_bounded_memory():
    size = 256 * 1024 * 1024
    up = RecordingUpstream()
    port = free_port()
    text = _config(up.address, port, listener="\n    max_frame_size: 300MiB")
    name = b"echo"
    body = (struct.pack("!Ii", 0x80010001, len(name)) + name + struct.pack("!i", 5)
            + b"\x0b\x00\x01" + struct.pack("!i", size))
    total = len(body) + size + 1  # (the args struct's STOP ends it: nothing else may be in its frame)
    chunk = os.urandom(1 << 20)
    sha = hashlib.sha256()
    try:
        with ProxyProcess(text, [port]) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:  # warm up: pools, imports
                s.sendall(request_bytes("framed", "binary", "ping", seqid=1))
                read_messages(s, 1, "framed", "binary")
            base = reset_peak(p.proc.pid)
            up.requests.clear()
            with socket.create_connection(("127.0.0.1", port)) as s:
                head = struct.pack("!i", total) + body
                s.sendall(head)
                sha.update(head)
                for _ in range(size >> 20):
                    s.sendall(chunk)
                    sha.update(chunk)
                s.sendall(b"\x00")
                sha.update(b"\x00")
                (reply,) = read_messages(s, 1, "framed", "binary", timeout=60)
            peak = proc_status(p.proc.pid, "VmHWM")
    finally:
        up.close()
    assert reply.seqid == 5 and _reply_text(reply) == sha.hexdigest().encode()
    growth_mib = (peak - base) / 1024
    print(f"256 MiB request: proxy RSS {base / 1024:.1f} MiB before, peak {peak / 1024:.1f} MiB (+{growth_mib:.1f} MiB)")
    assert growth_mib <= 32, f"peak RSS grew by {growth_mib:.1f} MiB"


# -- the codec's part: pending_frame / detach_frame -----------------------------------------


@pytest.mark.parametrize("first", [4, 20, 64, 70_000])
@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.COMPACT, None])
def test_pending_frame_reads_the_head_and_detach_hands_over_every_byte(first, protocol):
    wire = Protocol.COMPACT if protocol is Protocol.COMPACT else Protocol.BINARY
    req = request_bytes("framed", wire.value, "echo", os.urandom(200_000), seqid=12345)
    dec = Decoder(Framing.FRAMED, protocol)
    dec.feed(req[:first])
    assert dec.next_message() is None
    assert dec.pending_size() == len(req)  # from the length prefix alone
    pending = dec.pending_frame()
    if first < 20:
        assert pending is None  # its head is not here yet
        dec.feed(req[first:100])
        assert dec.next_message() is None
        pending = dec.pending_frame()
        first = 100
    head, total = pending
    assert (head.name, head.type, head.seqid, head.protocol) == ("echo", MessageType.CALL, 12345, wire)
    assert total == len(req)
    dec.feed(req[first:first + 1000])  # more of it, still incomplete
    assert dec.next_message() is None and dec.pending_frame()[1] == total
    parts = dec.detach_frame()
    assert b"".join(parts) == req[:first + 1000]
    assert dec.buffered == 0 and dec.pending_frame() is None and dec.protocol is wire
    nxt = request_bytes("framed", wire.value, "ping", seqid=7)
    dec.feed(nxt)
    assert dec.next_message().seqid == 7  # the decoder goes on with what follows


def test_pending_frame_reads_a_head_cut_over_many_reads_and_never_joins_past_it(monkeypatch):
    """Asked at every read of a large request, pending_frame joins at most the reads a head can
    need: a frame whose head never reads (garbage, compact bytes on a binary listener) cost a join
    of everything so far per read (16 MB in 64 KiB reads: 0.4 s of the loop; 64 MB: 5.6 s)."""
    from proxy.codec import decoder as decmod

    name = "m" * 60_000  # a long name, its head cut over 60 reads
    head = struct.pack("!Ii", 0x80010001, len(name)) + name.encode() + struct.pack("!i", 3)
    req = struct.pack("!i", 3_000_000) + head + bytes(3_000_000 - len(head))
    dec = Decoder(Framing.FRAMED, Protocol.BINARY, max_frame_size=4_000_000)
    seen = []
    real = decmod.read_head
    monkeypatch.setattr(decmod, "read_head", lambda buf, *a: seen.append(len(buf)) or real(buf, *a))
    pending = None
    for i in range(0, 70_000, 1000):
        dec.feed(req[i:i + 1000])
        assert dec.next_message() is None
        pending = dec.pending_frame()
        if pending is not None:
            break
    assert pending is not None and pending[0].name == name and pending[0].seqid == 3
    garbage = b"\x00\x00\x10\x00" + b"\xee" * (4096 + 12)
    dec = Decoder(Framing.FRAMED, Protocol.BINARY, max_frame_size=2 ** 30)
    dec.feed(struct.pack("!i", 64 * 2 ** 20) + garbage)
    assert dec.next_message() is None  # (a large frame arriving: its reads are gathered)
    seen.clear()
    for _ in range(200):  # 12.8 MB in 64 KiB reads
        dec.feed(b"\xee" * 65536)
        assert dec.next_message() is None and dec.pending_frame() is None
    assert max(seen) <= decmod._HEAD_MAX + 65536, max(seen)


def test_pending_frame_is_none_for_whole_or_refused_frames():
    dec = Decoder(Framing.FRAMED, Protocol.BINARY, max_frame_size=1000)
    dec.feed(_echo_request(5000, seqid=1)[:3000])  # over max_frame_size: next_message refuses it
    assert dec.pending_frame() is None
    dec = Decoder(Framing.BUFFERED, Protocol.BINARY)
    dec.feed(request_bytes("buffered", "binary", "echo", b"x" * 5000)[:3000])
    assert dec.next_message() is None and dec.pending_frame() is None  # unframed: read whole
