"""What the call paths record for telemetry, over real sockets: the hop timestamps and outcomes
the pipeline and the listener leave on a call in the unusual paths (no route on THeader, a
protocol mismatch, requests held back at max_inflight, a streamed reply cut short), read
through the spans they become (an in-memory exporter, tests/spans_util.Traced)."""

from __future__ import annotations

import socket
import struct
import threading
import time

from thrift.Thrift import TApplicationException
import pytest

from harness import (Handler, ThriftServer, client, make_users, read_messages, request_bytes, small_window_client,
                     wait_for)
from proxy import spans
from spans_util import Traced
from test_tracing_live import PARENT_ID, TRACE_ID


RST = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s: close() resets the connection


def _non_reader(port: int) -> socket.socket:
    """A client connection with a 4 KB receive buffer (it will not read: replies back up)."""
    return small_window_client(port, 4096)


def _cfg(upstream: str, listener: str = "", route: str = "", cluster: str = "") -> str:
    return f"""
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:0{listener}
    routes:
      - cluster: up{route}
clusters:
  - name: up
    endpoints: [{upstream}]{cluster}
"""


def test_a_theader_call_with_no_route_joins_the_clients_trace():
    """The client's traceparent is joined by every call, the proxy's own errors included.
    Before: a no-route call started a trace of its own (sidecar.new_trace true)."""
    up = ThriftServer("header", "binary")
    text = _cfg(up.address, "\n    transport: header").replace(
        "      - cluster: up", "      - match: {method: ping}\n        cluster: up")
    try:
        with Traced(text, ratio=0.0) as t:
            with client(t.port(), "header") as c:
                c.header_protocol.set_header(b"traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01".encode())
                with pytest.raises(TApplicationException, match="no route"):
                    c.lookup("x")
            (call,) = t.wait_calls(1)
    finally:
        up.stop()
    assert call.attrs[spans.OUTCOME] == "no_route"
    assert call.server.context.trace_id == int(TRACE_ID, 16)
    assert call.server.parent is not None and call.server.parent.span_id == int(PARENT_ID, 16)
    assert call.attrs[spans.NEW_TRACE] is False


def test_a_protocol_mismatch_is_not_sent_in_every_record():
    """A binary client on a cluster that speaks compact: outcome not_sent, and error.type says
    the same (before: "error"). (An `auto` listener: one that names its protocol is checked
    against the cluster's at load.)"""
    up = ThriftServer("framed", "compact")
    try:
        with Traced(_cfg(up.address, listener="\n    protocol: auto", cluster="\n    protocol: compact"),
                    ratio=0.0) as t:
            with client(t.port(), "framed", "binary") as c:
                with pytest.raises(TApplicationException, match="never transcoded"):
                    c.lookup("x")
            (call,) = t.wait_calls(1)
    finally:
        up.stop()
    assert call.attrs[spans.OUTCOME] == "not_sent"
    assert call.attrs[spans.ERROR_TYPE] == "not_sent"


def test_a_reply_the_client_never_reads_shows_the_wait(monkeypatch):
    """A 50 KB reply to a client (4 KB receive buffer) that never reads: once the proxy stops
    waiting (the ACK cap, 300 ms here instead of 60 s), the call is recorded as never read and
    its write_response lasts until then. Before: it ended when the kernel took the bytes it
    could (a few ms), so the stall did not show."""
    import proxy.listener

    monkeypatch.setattr(proxy.listener, "ACK_CAP_NS", 300_000_000)
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address), ratio=1.0) as t:
            s = _non_reader(t.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "echo", b"x" * 50_000, seqid=3))
                (call,) = t.wait_calls(1, timeout=10.0)
    finally:
        up.stop()
    write = call.hop("write_response")
    assert write.attributes[spans.CLIENT_NEVER_READ] is True
    assert (write.end_time - write.start_time) / 1e6 >= 250
    assert call.total_ms >= 250


def test_a_stream_cut_by_a_write_stall_keeps_the_clients_pause_and_says_why():
    """A ~10 MB streamed reply that its client never reads: the proxy closes it after
    request_read_timeout (1 s). The call's span keeps the time the client held the stream back
    (so `hops` blames write_response, not the upstream) and says the proxy closed it for a
    write stall. Before: client_paused_ms 0 and "the client closed its connection"."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, "\n    request_read_timeout: 1s"), ratio=1.0) as t:
            s = _non_reader(t.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "get_users", 58000, 0, seqid=3))
                (call,) = t.wait_calls(1, timeout=15.0)
    finally:
        up.stop()
    assert call.attrs[spans.STREAMED] is True
    assert call.attrs[spans.CLIENT_PAUSED_MS] >= 700, call.attrs[spans.CLIENT_PAUSED_MS]
    assert "write stall" in call.server.status.description, call.server.status.description
    # the call ran and its upstream answered: the reply is not delivered, not "may have run"
    assert call.attrs[spans.ERROR_TYPE] == "not_delivered" and call.attrs[spans.OUTCOME] == "success", call.attrs


def test_a_client_reset_while_its_reply_streams_is_not_delivered_not_may_have_run():
    """The client reads part of a ~10 MB streamed reply, then resets: the call ran (the upstream
    answered success), so it is a reply not delivered, as when a reply read whole is not taken.
    Before: outcome may_have_run, which says nothing true about this call."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address), ratio=1.0) as t:
            s = small_window_client(t.port(), 64 * 1024)
            s.sendall(request_bytes("framed", "binary", "get_users", 58000, 0, seqid=3))
            assert len(s.recv(65536)) > 0
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST mid-reply
            (call,) = t.wait_calls(1, timeout=10.0)
            stats = t.proxy.server.listeners["test"].pipeline.stats
    finally:
        up.stop()
    assert call.attrs[spans.STREAMED] is True
    assert call.attrs[spans.ERROR_TYPE] == "not_delivered" and call.attrs[spans.OUTCOME] == "success", call.attrs
    assert call.server.status.description.startswith("not delivered: the client"), call.server.status.description
    assert stats["client_gone"] == 0


def test_requests_held_back_at_max_inflight_count_their_wait():
    """One write: sleep(300) then 131 pings on one connection. The listener keeps 128 calls open
    per connection; the last pings wait, whole, in its buffer until replies go out. Every ping's
    client waited ~300 ms, and every ping's recorded total says so (slow_call 100 ms keeps them
    at ratio 0). Before: the held ones started when they were framed (~1 ms totals, not kept)."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, route="\n        slow_call: 100ms"), ratio=0.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 300, seqid=0) + b"".join(
                    request_bytes("framed", "binary", "ping", seqid=i) for i in range(1, 132)))
                read_messages(s, 132)
            calls = t.wait_calls(132, timeout=10.0)
    finally:
        up.stop()
    pings = {c.attrs[spans.SEQID]: c for c in calls if c.attrs[spans.RPC_METHOD] == "ping"}
    assert sorted(pings) == list(range(1, 132))  # all kept as slow
    for seqid in (1, 127, 128, 131):
        assert pings[seqid].total_ms >= 250, (seqid, pings[seqid].total_ms)


def test_a_request_whose_start_was_held_back_at_max_inflight_counts_its_wait_as_queued():
    """max_inflight 1; one write: sleep(300) and the first 5 bytes of a ping, the ping's rest
    500 ms later. The ping's span starts with its first bytes (~0 ms), the 300 ms it sat unread
    behind the sleep is `queued`, and its own reading the ~200 ms after that. Before: its span
    started at the resume (~300 ms) and those 300 ms were in no hop."""
    up = ThriftServer()
    ping = request_bytes("framed", "binary", "ping", seqid=1)
    try:
        with Traced(_cfg(up.address, "\n    max_inflight: 1"), ratio=1.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                t0 = time.monotonic()
                s.sendall(request_bytes("framed", "binary", "sleep", 300, seqid=0) + ping[:5])
                time.sleep(0.5)
                s.sendall(ping[5:])
                read_messages(s, 2)
                waited = time.monotonic() - t0
            calls = t.wait_calls(2)
    finally:
        up.stop()
    (call,) = [c for c in calls if c.attrs[spans.RPC_METHOD] == "ping"]
    assert call.total_ms >= 450 and waited >= 0.45, (call, waited)
    assert 250 <= call.hop_ms("queued") <= 400, call
    assert 100 <= call.hop_ms("read_request") <= 300, call
    assert call.coverage() >= 0.95, call


def test_calls_behind_a_broken_stream_are_not_delivered_not_client_gone():
    """A streamed reply breaks (its upstream resets mid-reply): the proxy closes that client's
    connection, and the two pings pipelined behind it never reach the client. They are recorded
    as not delivered, because of the proxy's close, not as the client's leaving. Before:
    client_gone ("the client closed its connection") and client_never_read."""
    from test_upstream_faults import FaultUpstream

    up = FaultUpstream()
    up.plan.extend(["stream_reset:8000000", "ok", "ok"])
    try:
        text = _cfg(up.address, "\n    max_frame_size: 64MiB", cluster="\n    max_reply_size: 64MiB")
        with Traced(text, ratio=1.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "lookup", "big", seqid=1))
                time.sleep(0.05)  # (the upstream takes its plan in arrival order: lookup first)
                s.sendall(request_bytes("framed", "binary", "ping", seqid=2)
                          + request_bytes("framed", "binary", "ping", seqid=3))
                s.settimeout(10)
                while s.recv(1 << 20):
                    pass
            calls = t.wait_calls(3)
            stats = t.proxy.server.listeners["test"].pipeline.stats
    finally:
        up.close()
    pings = [c for c in calls if c.attrs[spans.RPC_METHOD] == "ping"]
    assert len(pings) == 2
    for c in pings:
        assert c.attrs[spans.ERROR_TYPE] == "not_delivered", c.attrs
        assert "an earlier call's streamed reply broke" in c.server.status.description
    assert stats["client_gone"] == 0


class _Gated(Handler):
    """Its `sleep` and `get_users` answer only once the test opens the gate (not after a fixed
    time: a loaded machine once let a 300 ms sleep end before the client's reset was sent, and
    the reply was then rightly recorded as delivered)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def _hit(self, method: str = "") -> None:
        super()._hit(method)
        self.entered.set()
        self.gate.wait(10.0)

    def sleep(self, ms):
        self._hit()
        return ms

    def get_users(self, count, sleep_ms):
        self._hit()
        return make_users(count)


@pytest.mark.parametrize("loop", ["idle", "busy"])
@pytest.mark.parametrize("reply", ["small", "large"])
def test_a_reply_to_a_client_that_half_closed_then_vanished_is_not_delivered(reply, loop, monkeypatch):
    """A client sends a slow call, half-closes (FIN: it is still answered), then resets before
    the reply. Writing the reply fails: the call is recorded as not delivered (traced as failed),
    not as a success the client never got. Before: delivered, and no trace kept.

    `busy`: the loop stays busy 5 ms after the reply is written, as a loaded machine makes it, so
    the first ack look (a 1 ms timer) runs before connection_lost. Before: that look saw the
    reset socket's empty queue as "all taken" and recorded the call as delivered."""
    if loop == "busy":
        import proxy.listener

        call_done = proxy.listener.ClientConnection.call_done

        def busy_after(self, call):
            call_done(self, call)
            time.sleep(0.005)

        monkeypatch.setattr(proxy.listener.ClientConnection, "call_done", busy_after)
    handler = _Gated()
    up = ThriftServer(handler=handler)
    try:
        with Traced(_cfg(up.address), ratio=0.0) as t:
            s = socket.create_connection(("127.0.0.1", t.port()))
            if reply == "small":
                s.sendall(request_bytes("framed", "binary", "sleep", 300, seqid=7))
            else:  # (500 users: a ~90 KB reply, more than one write's worth)
                s.sendall(request_bytes("framed", "binary", "get_users", 500, 300, seqid=7))
            s.shutdown(socket.SHUT_WR)
            assert handler.entered.wait(10.0), "the call never reached the upstream"
            conns = t.proxy.server.listeners["test"].connections
            wait_for(lambda: [c.closing for c in list(conns)] == [True], what="the proxy to see the FIN")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
            s.close()  # RST: the reply, when it comes, has nowhere to go
            handler.gate.set()  # (the reset is on the proxy's socket once close() returns)
            (call,) = t.wait_calls(1, timeout=10.0)
            stats = t.proxy.server.listeners["test"].pipeline.stats
    finally:
        handler.gate.set()
        up.stop()
    assert call.attrs[spans.ERROR_TYPE] == "not_delivered", call.attrs
    assert "the client's connection broke before it took the reply" in call.server.status.description
    assert stats["client_gone"] == 0


def test_an_upstream_slow_to_take_a_large_request_shows_in_write_upstream():
    """A 900 KB request (read whole: under retry_buffer) to an upstream that reads nothing for
    0.5 s, then reads it and replies at once. The time the upstream took to take the request is
    write_upstream's, not the service's. Before: write_upstream ended when the transport was
    handed the bytes (~1 ms) and service_time took the 0.5 s."""
    from harness import RawUpstream, reply_bytes

    class SlowReader(RawUpstream):
        def _one(self, c: socket.socket) -> None:
            with c:
                time.sleep(0.5)
                (n,) = struct.unpack("!i", c.recv(4, socket.MSG_WAITALL))
                req = c.recv(n, socket.MSG_WAITALL)
                (nlen,) = struct.unpack_from("!i", req, 4)
                (seqid,) = struct.unpack_from("!i", req, 8 + nlen)
                c.sendall(reply_bytes(req[8:8 + nlen], seqid))
                c.recv(1)

    up = SlowReader()
    try:
        with Traced(_cfg(up.address), ratio=1.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"x" * 900_000, seqid=5))
                s.settimeout(10)
                assert s.recv(1 << 16)
            (call,) = t.wait_calls(1, timeout=10.0)
    finally:
        up.close()
    write = call.hop_ms("write_upstream")
    service = call.hop_ms("service_time")
    assert write >= 350, (write, service)
    assert service < 150, (write, service)


def test_a_half_closed_client_that_never_reads_is_still_recorded(monkeypatch):
    """A client half-closes (FIN) after its request and never reads a ~4 MB reply: the proxy
    closes after the reply (linger), the transport never drains, so connection_lost never comes.
    The ack look still reaches the cap and records the call as never read (a review found an
    early version of the not-delivered change stopped looking at a closing transport)."""
    import proxy.listener

    monkeypatch.setattr(proxy.listener, "ACK_CAP_NS", 3_000_000_000)
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, cluster="\n    stream_threshold: 0"), ratio=1.0) as t:
            s = _non_reader(t.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "get_users", 30000, 0, seqid=3))
                s.shutdown(socket.SHUT_WR)
                calls = t.wait_calls(1, timeout=10.0)
    finally:
        up.stop()
    assert len(calls) == 1, "the call was never recorded"
    assert calls[0].hop("write_response").attributes[spans.CLIENT_NEVER_READ] is True


@pytest.mark.parametrize("users", [5000, 20000] * 4)
def test_a_reply_read_whole_before_a_reset_is_delivered(users):
    """The client reads its whole reply, then resets, maybe before the proxy's next ack look:
    the reply was delivered (the not-delivered rule is for replies whose write failed)."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, cluster="\n    stream_threshold: 0"), ratio=1.0) as t:
            s = socket.create_connection(("127.0.0.1", t.port()))
            s.sendall(request_bytes("framed", "binary", "get_users", users, 0, seqid=3))
            read_messages(s, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
            s.close()
            (call,) = t.wait_calls(1, timeout=10.0)
    finally:
        up.stop()
    assert call.attrs.get(spans.ERROR_TYPE) is None, call.server.status.description


def test_peak_ewma_still_sees_a_hung_upstream_that_never_takes_a_large_request():
    """write_upstream waits for the upstream to take a large request, but the endpoint's
    latency estimate (peak_ewma) still counts from the handover: an upstream that never reads a
    900 KB request and times out is observed at the timeout, not at the last look (~10 ms)."""
    from harness import RawUpstream

    class Hung(RawUpstream):
        def _one(self, c: socket.socket) -> None:
            time.sleep(3)

    up = Hung()
    try:
        text = _cfg(up.address, route="\n        timeout: 500ms", cluster="\n    load_balancer: peak_ewma")
        with Traced(text, ratio=1.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"x" * 900_000, seqid=5))
                s.settimeout(10)
                assert s.recv(1 << 16)
            (call,) = t.wait_calls(1, timeout=10.0)
            ewma = t.proxy.server.clusters["up"].endpoints[0].ewma.value
    finally:
        up.close()
    assert call.hop_ms("write_upstream") >= 400  # (it never took the request)
    assert ewma >= 0.4, ewma


def test_a_request_refused_by_max_frame_size_is_named_by_its_head():
    """A 2 MB request to a listener with max_frame_size 1 MiB is refused from its head: the
    client hears its own method and seqid, and the span says the same (before: `_INVALID`, no
    seqid, and a request size of 0)."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, "\n    max_frame_size: 1MiB"), ratio=1.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"x" * 2_000_000, seqid=42)[:70_000])
                (reply,) = read_messages(s, 1)
            (call,) = t.wait_calls(1, timeout=10.0)
    finally:
        up.stop()
    assert (reply.name, reply.seqid, reply.type) == ("echo", 42, 3)
    assert call.attrs[spans.RPC_METHOD] == "echo"
    assert call.attrs[spans.SEQID] == 42
    assert call.attrs[spans.OUTCOME] == "bad_request"
    assert spans.REQUEST_SIZE not in call.attrs
    assert "exceeds max_frame_size" in call.server.status.description


def test_a_reply_stuck_unsent_when_the_client_resets_is_not_delivered():
    """A ~4 MB reply to a client that reads nothing (4 KB receive buffer), then resets: the
    reset empties the proxy's send queue, so "nothing unsent" would say delivered. What the
    client's kernel acknowledged (TCP_INFO) says it never got the reply. Before: a success."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, cluster="\n    stream_threshold: 0"), ratio=1.0) as t:
            s = _non_reader(t.port())
            s.sendall(request_bytes("framed", "binary", "get_users", 30000, 0, seqid=3))
            time.sleep(0.5)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
            s.close()
            (call,) = t.wait_calls(1, timeout=10.0)
            page = t.proxy.call(t.proxy.server.metrics.exposition).decode()
    finally:
        up.stop()
    assert call.attrs[spans.ERROR_TYPE] == "not_delivered", call.attrs
    assert "connection broke before it took the reply" in call.server.status.description
    # (and in /metrics: a success by its outcome, but counted as not delivered)
    assert ('thrift_sidecar_replies_not_delivered_total{method="get_users",reason="not_delivered",'
            'service="TestService"} 1.0') in page, page


def test_a_reply_ready_behind_an_earlier_call_when_the_client_resets_is_not_delivered():
    """The client pipelines sleep(600) and lookup, then resets at ~300 ms: lookup's reply came
    at once and waited its turn, never written. It is recorded not delivered (the connection
    was gone), as a reply the connection lost is; sleep, still unanswered, as client_gone.
    Before: lookup counted as `client_never_read`, which means a client that did not read a
    written reply within the cap."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address), ratio=1.0) as t:
            s = socket.create_connection(("127.0.0.1", t.port()))
            s.sendall(request_bytes("framed", "binary", "sleep", 600, seqid=1)
                      + request_bytes("framed", "binary", "lookup", "k", seqid=2))
            time.sleep(0.3)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
            s.close()
            calls = {c.attrs[spans.RPC_METHOD]: c for c in t.wait_calls(2, timeout=10.0)}
            page = t.proxy.call(t.proxy.server.metrics.exposition).decode()
    finally:
        up.stop()
    lookup, sleep = calls["lookup"], calls["sleep"]
    assert lookup.attrs[spans.ERROR_TYPE] == "not_delivered", lookup.attrs
    assert "before its reply was written" in lookup.server.status.description
    assert sleep.attrs[spans.ERROR_TYPE] == "client_gone", sleep.attrs
    assert ('thrift_sidecar_replies_not_delivered_total{method="lookup",reason="not_delivered",'
            'service="TestService"} 1.0') in page, page
    assert "client_never_read" not in page


def test_a_reply_cut_by_a_write_stall_is_not_delivered():
    """A client that never reads a ~4 MB reply is closed as a write stall (request_read_timeout
    1 s): its reply is recorded as not delivered, with the stall as the reason. Before: a
    success whose write_response lasted the stall."""
    up = ThriftServer()
    try:
        text = _cfg(up.address, "\n    request_read_timeout: 1s", cluster="\n    stream_threshold: 0")
        with Traced(text, ratio=1.0) as t:
            s = _non_reader(t.port())
            with s:
                s.sendall(request_bytes("framed", "binary", "get_users", 30000, 0, seqid=3))
                (call,) = t.wait_calls(1, timeout=15.0)
            stats = t.proxy.server.listeners["test"].stats
    finally:
        up.stop()
    assert stats["write_stalls"] == 1
    assert call.attrs[spans.ERROR_TYPE] == "not_delivered", call.attrs
    assert "write stall" in call.server.status.description


def test_a_bad_request_answered_behind_a_call_is_recorded_when_the_client_resets():
    """A slow call, then a frame that is no Thrift message (the listener's own answer, queued
    behind the first), then the client resets: both calls are recorded, the second as a bad
    request its client never read. Before: only the first; /stats counted two."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address), ratio=0.0) as t:
            s = socket.create_connection(("127.0.0.1", t.port()))
            s.sendall(request_bytes("framed", "binary", "sleep", 300, seqid=1)
                      + struct.pack("!i", 12) + b"\x12\x34\x56\x78" + b"\x00" * 8)
            time.sleep(0.1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
            s.close()
            calls = t.wait_calls(2)
    finally:
        up.stop()
    by_outcome = {c.attrs[spans.OUTCOME]: c for c in calls}
    assert set(by_outcome) == {"client_gone", "bad_request"}, [c.server.name for c in calls]
    assert by_outcome["bad_request"].server.name == "TestService/_INVALID"


def test_a_oneway_refused_by_max_frame_size_is_recorded_and_not_answered():
    """A oneway over max_frame_size gets no answer (oneways never do), but is recorded as a
    bad request, named by its head, as a call would be. Before: only protocol_errors counted it."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address, "\n    max_frame_size: 1KiB"), ratio=0.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(request_bytes("framed", "binary", "log_event", "e" * 5000, seqid=7)[:2000])
                s.settimeout(5)
                assert s.recv(100) == b""  # closed, nothing answered
            (call,) = t.wait_calls(1, timeout=10.0)
            stats = t.proxy.server.listeners["test"].pipeline.stats
    finally:
        up.stop()
    assert call.server.name == "TestService/log_event"
    assert call.attrs[spans.OUTCOME] == "bad_request"
    assert "exceeds max_frame_size" in call.server.status.description
    assert stats["calls"] == 1 and stats["oneway_failures"] == 1


@pytest.mark.parametrize("damage", ["bad-type", "two-in-one"])
def test_a_theader_bad_request_joins_the_clients_trace(damage):
    """A THeader request whose header block is fine but whose payload is refused (a message type
    that does not exist; a second message after the first): the proxy's answer joins the
    client's trace, as a no-route answer does. Before: a trace of its own (sidecar.new_trace)."""
    from test_theader_headers import _request

    up = ThriftServer("header", "binary")
    data = bytearray(_request({b"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01".encode()}, seqid=3))
    if damage == "bad-type":
        i = data.find(b"\x80\x01\x00\x01")
        data[i + 3] = 9
    else:
        data += b"\x00"  # (a byte past the struct, inside the payload: the frame's length grows)
        data[0:4] = struct.pack("!i", len(data) - 4)
    try:
        with Traced(_cfg(up.address, "\n    transport: header"), ratio=0.0) as t:
            with socket.create_connection(("127.0.0.1", t.port())) as s:
                s.sendall(bytes(data))
                (reply,) = read_messages(s, 1, "header")
            (call,) = t.wait_calls(1)
    finally:
        up.stop()
    assert reply.seqid == 3 and reply.type == 3
    assert call.attrs[spans.OUTCOME] == "bad_request"
    assert call.server.context.trace_id == int(TRACE_ID, 16)
    assert call.server.parent is not None and call.server.parent.span_id == int(PARENT_ID, 16)
    assert call.attrs[spans.NEW_TRACE] is False


def test_a_call_whose_client_resets_has_every_span_inside_its_server_span():
    """The client resets 50 ms into a 200 ms call: the attempt stopped then ends within the
    SERVER span. Before: its CLIENT span (and service_time) ended ~40 µs after its parent."""
    up = ThriftServer()
    try:
        with Traced(_cfg(up.address), ratio=1.0) as t:
            for _ in range(3):
                s = socket.create_connection(("127.0.0.1", t.port()))
                s.sendall(request_bytes("framed", "binary", "sleep", 200, seqid=1))
                time.sleep(0.05)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
                s.close()
            calls = t.wait_calls(3, timeout=5)
    finally:
        up.stop()
    for call in calls:
        assert call.attrs[spans.OUTCOME] == "client_gone"
        for span in call.clients + [h for hops in call.hops.values() for h in hops]:
            assert span.end_time <= call.server.end_time, (span.name, span.end_time - call.server.end_time)
