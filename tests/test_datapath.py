"""The data path through real sockets: generated Apache Thrift clients and servers, every framing × protocol."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from thrift.Thrift import TApplicationException

from harness import (
    ProxyProcess,
    RawUpstream,
    free_ports,
    proc_status,
    reset_peak,
    oneway_as_call_then_call,
    FRAMINGS,
    PROTOCOLS,
    NotFound,
    Proxy,
    ThriftServer,
    Unavailable,
    app_exception,
    client,
    config_text,
    everything,
    read_messages,
    request_bytes,
)
from proxy.codec import MessageType

BIG = 15_000_000


def _exercise(port: int, framing: str, protocol: str, service: str | None = None) -> list:
    """A fixed series of calls; returns their results (exceptions as (type, fields))."""
    out = []
    with client(port, framing, protocol, service=service) as c:
        c.ping()
        out.append(c.roundtrip(everything()))
        out.append(len(c.get_users(200, 0)))
        out.append(c.lookup("k"))
        for key in ("missing", "down"):
            try:
                c.lookup(key)
                out.append("no exception")
            except (NotFound, Unavailable) as e:
                out.append((type(e).__name__, vars(e)))
        c.log_event("ev-" + framing + protocol)
        out.append(c.count("ev-" + framing + protocol) >= 1)
        big = bytes(range(256)) * (BIG // 256)
        out.append(c.echo(big) == big)
    return out


MATRIX = [(f, p) for f in FRAMINGS for p in PROTOCOLS] + [("framed_header", p) for p in PROTOCOLS]


@pytest.mark.parametrize("framing,protocol", MATRIX)
def test_matrix_replies_equal_direct(framing, protocol):
    up = ThriftServer(framing, protocol)
    listener_transport = "header" if framing == "framed_header" else framing
    try:
        direct = _exercise(up.port, framing, protocol)
        with Proxy(config_text([up.address], transport=listener_transport, protocol=protocol)) as p:
            proxied = _exercise(p.port(), framing, protocol)
    finally:
        up.stop()
    assert proxied == direct
    assert direct[0] == everything() and direct[1] == 200 and direct[-1] is True


@pytest.mark.parametrize("framing,protocol", [("framed", "binary"), ("buffered", "compact"), ("header", "binary")])
def test_auto_listener_detects_framing_and_protocol(framing, protocol):
    up = ThriftServer(framing, protocol)
    try:
        with Proxy(config_text([up.address], transport="auto", protocol="auto")) as p:
            with client(p.port(), framing, protocol) as c:
                assert c.roundtrip(everything()) == everything()
                assert c.lookup("x") == "upstream:x"
    finally:
        up.stop()


@pytest.mark.parametrize("listener", ["framed", "auto"])
def test_a_theader_frame_on_a_framed_connection_gets_a_hint_that_fits_the_listener(listener):
    """A THeader request on a connection whose transport is framed: on a framed listener the
    answer says to set the listener's transport to header or auto; on an auto listener, which
    detected framed from the connection's first request, that advice would be wrong (it is
    auto), so it says the connection keeps its first request's transport. Before: both said
    to set it to header or auto."""
    from harness import app_exception, read_messages, request_bytes

    up = ThriftServer("framed", "binary")
    try:
        with Proxy(config_text([up.address], transport=listener, cluster_transport="framed")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "lookup", "x", seqid=1))
                (first,) = read_messages(s, 1, "framed", "binary")
                assert first.seqid == 1 and first.type == MessageType.REPLY
                s.sendall(request_bytes("header", "binary", "lookup", "y", seqid=2))  # (a length, then THeader's magic)
                (answer,) = read_messages(s, 1, "framed", "binary")
            assert answer.type == MessageType.EXCEPTION
            text = app_exception(answer).message
            assert "this looks like a THeader frame" in text, text
            if listener == "auto":
                assert "this connection's first request was framed" in text and "set the listener" not in text, text
            else:
                assert "set the listener's transport to header or auto" in text, text
    finally:
        up.stop()


@pytest.mark.parametrize("listener,sent,hint", [
    (("framed", "binary"), ("buffered", "binary"),
     "an unframed binary message where the transport is framed (set the listener's transport to buffered or auto)"),
    (("framed", "auto"), ("buffered", "compact"),
     "an unframed compact message where the transport is framed (set the listener's transport to buffered or auto)"),
    (("header", "binary"), ("buffered", "binary"),
     "an unframed binary message where the transport is header (set the listener's transport to buffered or auto)"),
    (("buffered", "auto"), ("framed", "binary"),
     "a framed binary message where the transport is buffered (set the listener's transport to framed or auto)"),
    (("buffered", "binary"), ("framed", "compact"),
     "a framed compact message where the transport is buffered (set the listener's transport to framed or auto)"),
    (("header", "binary"), ("framed", "binary"),
     "a framed binary message where the transport is header (set the listener's transport to framed or auto)"),
    (("framed", "compact"), ("framed", "binary"),
     "a binary message where the protocol is compact (set the listener's protocol to binary or auto)"),
    (("buffered", "binary"), ("buffered", "compact"),
     "a compact message where the protocol is binary (set the listener's protocol to compact or auto)"),
], ids=lambda v: "-".join(v) if isinstance(v, tuple) else "")
def test_a_client_of_another_transport_or_protocol_reads_an_answer_that_names_the_fix(listener, sent, hint):
    """A generated client whose framing or protocol is not the listener's gets, through its own
    transport and protocol, a TApplicationException that says what it sent and which setting
    would take it; the connection closes, and the listener goes on serving right clients. Before:
    the answer came in the listener's framing and protocol (unreadable to this client: its
    transport failed on the answer's first bytes) and said e.g. "invalid frame length -2147418111",
    and on a listener left to detect the protocol (framed+auto, buffered+auto) the connection
    closed without a word."""
    protocol = "compact" if listener[1] == "compact" else "binary"  # (the listener's, if it is set)
    up = ThriftServer("framed", protocol)
    try:
        text = config_text([up.address], transport=listener[0], protocol=listener[1], cluster_transport="framed",
                           extra_cluster=f"\n    protocol: {protocol}")
        with Proxy(text) as p:
            with client(p.port(), *sent, timeout=5) as c:
                with pytest.raises(TApplicationException) as answer:
                    c.lookup("x")
            assert answer.value.message == "thrift-sidecar: bad request: " + hint
            assert answer.value.type == TApplicationException.PROTOCOL_ERROR
            with socket.create_connection(("127.0.0.1", p.port())) as s:  # its own seqid, and then EOF
                s.sendall(request_bytes(*sent, "lookup", "y", seqid=77))
                (raw,) = read_messages(s, 1, *sent)
                assert (raw.seqid, raw.name, raw.type) == (77, "lookup", MessageType.EXCEPTION)
                assert s.recv(1) == b""
            with client(p.port(), listener[0], protocol) as c:
                assert c.lookup("z") == "upstream:z"
    finally:
        up.stop()


def test_on_an_auto_listener_a_connection_keeps_its_first_requests_protocol_and_says_so():
    """A listener that detects the protocol fixes it per connection from its first request: a
    later request in another protocol is answered in its own protocol, with its seqid, saying
    so (not "set the listener's protocol ... or auto": it is auto)."""
    up = ThriftServer("framed", "binary")
    try:
        with Proxy(config_text([up.address], transport="auto", protocol="auto", cluster_transport="framed",
                               extra_cluster="\n    protocol: binary")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "lookup", "x", seqid=1))
                (first,) = read_messages(s, 1, "framed", "binary")
                assert first.type == MessageType.REPLY
                s.sendall(request_bytes("framed", "compact", "lookup", "y", seqid=2))
                (answer,) = read_messages(s, 1, "framed", "compact")
            assert (answer.seqid, answer.name, answer.type) == (2, "lookup", MessageType.EXCEPTION)
            assert app_exception(answer).message == (
                "thrift-sidecar: bad request: a compact message where the protocol is binary (this connection's "
                "first request was binary, and a connection keeps the protocol of its first request)")
    finally:
        up.stop()


@pytest.mark.parametrize("client_framing,upstream_framing", [
    ("buffered", "framed"), ("framed", "buffered"), ("framed", "header"), ("header", "framed"),
    ("framed_header", "header"),
])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_framing_translation(client_framing, upstream_framing, protocol):
    up = ThriftServer(upstream_framing, protocol)
    listener = "header" if client_framing == "framed_header" else client_framing
    try:
        text = config_text([up.address], transport=listener, protocol=protocol,
                           cluster_transport=upstream_framing)
        with Proxy(text) as p:
            with client(p.port(), client_framing, protocol) as c:
                assert c.roundtrip(everything()) == everything()
                with pytest.raises(NotFound):
                    c.lookup("missing")
                assert len(c.get_users(5499, 0)) == 5499
    finally:
        up.stop()


def test_multiplexed_services_through_the_proxy():
    up = ThriftServer("framed", "binary", multiplexed=True)
    try:
        with Proxy(config_text([up.address])) as p:
            with client(p.port(), service="TestService") as c:
                assert c.roundtrip(everything()) == everything()
            with client(p.port(), service="AdminService") as a:
                assert a.add(2, 3) == 5
    finally:
        up.stop()


def test_request_split_across_many_small_reads():
    up = ThriftServer("buffered", "compact")
    try:
        with Proxy(config_text([up.address], transport="buffered", protocol="compact")) as p:
            req = request_bytes("buffered", "compact", "roundtrip", everything(), seqid=41)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for i in range(0, len(req), 7):
                    s.sendall(req[i:i + 7])
                    time.sleep(0.0005)
                (reply,) = read_messages(s, 1, "buffered", "compact")
            assert reply.seqid == 41 and reply.type == MessageType.REPLY and reply.name == "roundtrip"
            assert reply.result_field() == 0
    finally:
        up.stop()


def test_pipelined_requests_answered_in_request_order():
    up = ThriftServer("framed", "binary")
    try:
        with Proxy(config_text([up.address])) as p:
            # Later requests finish first: replies must still come back in request order.
            reqs = b"".join(request_bytes("framed", "binary", "sleep", ms, seqid=100 + i)
                            for i, ms in enumerate([120, 80, 40, 0]))
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(reqs)
                replies = read_messages(s, 4, "framed", "binary")
            assert [r.seqid for r in replies] == [100, 101, 102, 103]
            assert all(r.type == MessageType.REPLY for r in replies)
            assert up.connections >= 2  # they really ran concurrently upstream
    finally:
        up.stop()


def test_proxy_error_read_by_multiplexed_client():
    up = ThriftServer("framed", "binary", multiplexed=True)
    text = config_text([up.address]).replace(
        "    routes:\n      - cluster: up", "    routes:\n      - match: {service: TestService}\n        cluster: up")
    try:
        with Proxy(text) as p:
            with client(p.port(), service="AdminService") as a:
                with pytest.raises(TApplicationException) as ei:
                    a.add(1, 2)
                assert ei.value.type == TApplicationException.UNKNOWN_METHOD
                assert ei.value.message.startswith("thrift-sidecar: no route:")
                assert "AdminService:add" in ei.value.message and "listener 'test'" in ei.value.message
            # raw: bare method name and the client's seqid
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "add", 1, 2, seqid=9, service="AdminService"))
                (r,) = read_messages(s, 1)
            assert (r.name, r.seqid, r.type) == ("add", 9, MessageType.EXCEPTION)
    finally:
        up.stop()


@pytest.mark.parametrize("framing,protocol", [("framed", "binary"), ("buffered", "compact"), ("header", "binary")])
@pytest.mark.parametrize("service", [None, "TestService"])
def test_upstream_down_not_sent_then_recovers(framing, protocol, service):
    up = ThriftServer(framing, protocol, multiplexed=service is not None)
    port = up.port
    up.stop(hold_port=True)  # (refused meanwhile; no other socket can take the port)
    try:
        with Proxy(config_text([f"127.0.0.1:{port}"], transport=framing, protocol=protocol)) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes(framing, protocol, "ping", seqid=77, service=service))
                (r,) = read_messages(s, 1, framing, protocol)
                assert (r.name, r.seqid, r.type) == ("ping", 77, MessageType.EXCEPTION)
                x = app_exception(r)
                assert x.type == TApplicationException.INTERNAL_ERROR
                assert x.message.startswith("thrift-sidecar: not sent: connect to 127.0.0.1:")
                # the same connection works once the upstream is back
                up.port = port
                up.start()
                s.sendall(request_bytes(framing, protocol, "lookup", "a", seqid=78, service=service))
                (r2,) = read_messages(s, 1, framing, protocol)
                assert (r2.name, r2.seqid, r2.type) == ("lookup", 78, MessageType.REPLY)
            with client(p.port(), framing, protocol, service=service) as c:
                assert c.lookup("b") == "upstream:b"
    finally:
        up.stop()


def test_generated_client_reads_not_sent_error():
    up = ThriftServer()
    port = up.port
    up.stop()
    with Proxy(config_text([f"127.0.0.1:{port}"])) as p:
        with client(p.port()) as c:
            with pytest.raises(TApplicationException) as ei:
                c.ping()
            assert ei.value.type == TApplicationException.INTERNAL_ERROR
            assert ei.value.message.startswith("thrift-sidecar: not sent:")


def test_upstream_closing_idle_connections_is_noticed():
    """The upstream closes idle connections after 100 ms: no call fails, none runs twice."""
    up = ThriftServer(idle_close=0.1)

    def proxy_connections(p: Proxy) -> int:
        """Connections the proxy has open to the upstream (read on its loop)."""
        return p.call(lambda: sum(pool.open for ep in p.server.clusters["up"].endpoints
                                  for pool in ep.pools.values()))

    try:
        with Proxy(config_text([up.address])) as p:
            with client(p.port()) as c:
                for i in range(5):
                    assert c.incr("once") == i + 1
                    # the next call comes after the upstream closed the idle connection and the
                    # proxy noticed (polled: a busy machine may run either late; a call sent as
                    # the close crosses it may have run, which is not what this test is about)
                    deadline = time.monotonic() + 5
                    while proxy_connections(p) and time.monotonic() < deadline:
                        time.sleep(0.02)
                    assert proxy_connections(p) == 0, "the proxy did not notice the upstream's close"
            assert up.handler.counts["once"] == 5
            assert up.connections >= 5  # each call after idleness needed a new connection
    finally:
        up.stop()


def test_upstream_lost_after_write_is_may_have_run():
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address])) as p:
            with client(p.port()) as c:
                c.ping()
                t = threading.Timer(0.1, up.stop)
                t.start()
                with pytest.raises(TApplicationException) as ei:
                    c.sleep(2000)
                t.join()
                assert ei.value.type == TApplicationException.INTERNAL_ERROR
                assert ei.value.message.startswith("thrift-sidecar: may have run: connection to 127.0.0.1:")
    finally:
        up.stop()


def test_oneway_is_forwarded_and_never_answered():
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address])) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "log_event", "ow1", seqid=5)
                          + request_bytes("framed", "binary", "count", "ow1", seqid=6))
                (r,) = read_messages(s, 1)
                assert r.seqid == 6  # the only reply is the call's
                s.settimeout(0.3)
                with pytest.raises(socket.timeout):
                    s.recv(1)
    finally:
        up.stop()
    assert up.handler.events == ["ow1"]


def test_oneway_methods_sent_as_call_do_not_block():
    """A client that sends a oneway method as CALL (like Apache Thrift Go) is not left waiting."""
    up = ThriftServer()
    try:
        text = config_text([up.address], extra_listener="\n    oneway_methods: [log_event]")
        with Proxy(text) as p:
            r = oneway_as_call_then_call(p.port())
            assert r.seqid == 4 and r.type == MessageType.REPLY
    finally:
        up.stop()


def test_tcp_nodelay_set_by_our_code_on_both_legs(monkeypatch):
    import proxy.listener
    import proxy.sockets
    import proxy.upstream

    seen = []
    real = proxy.sockets.set_nodelay

    def counting(sock):
        seen.append(sock.getsockname())
        return real(sock)

    monkeypatch.setattr(proxy.listener, "set_nodelay", counting)
    monkeypatch.setattr(proxy.upstream, "set_nodelay", counting)
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address])) as p:
            with client(p.port()) as c:
                c.ping()
                (conn,) = p.server.listeners["test"].connections
                accepted = conn.transport.get_extra_info("socket")
                (ep,) = p.server.clusters["up"].endpoints
                (pool,) = ep.pools.values()
                # read on the loop: the connection goes back to the pool just after the reply
                dialed = p.call(lambda: pool.idle[0].transport.get_extra_info("socket"))
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                assert dialed.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                assert accepted.getsockname() in seen and dialed.getsockname() in seen
    finally:
        up.stop()


def test_set_nodelay_helper_sets_the_option():
    from proxy.sockets import nodelay_of, set_nodelay

    with socket.socket() as s:
        assert nodelay_of(s) is False
        assert set_nodelay(s) is True
        assert nodelay_of(s) is True


def test_max_connections_refuses_the_excess():
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address], extra_listener="\n    max_connections: 2")) as p:
            with client(p.port()) as a, client(p.port()) as b:
                a.ping()
                b.ping()
                with pytest.raises(Exception):
                    with client(p.port(), timeout=2) as c:
                        c.ping()
                a.ping()
    finally:
        up.stop()


def test_request_read_timeout_applies_only_to_started_requests():
    up = ThriftServer()
    try:
        text = config_text([up.address], extra_listener="\n    request_read_timeout: 300ms")
        with Proxy(text) as p:
            with client(p.port()) as idle:
                idle.ping()
                time.sleep(0.6)  # idle between calls: left alone
                idle.ping()
            req = request_bytes("framed", "binary", "ping", seqid=12)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req[:-1])  # the head is complete, the body is not
                t0 = time.monotonic()
                (r,) = read_messages(s, 1)
                waited = time.monotonic() - t0
                assert r.seqid == 12 and r.type == MessageType.EXCEPTION
                x = app_exception(r)
                assert x.type == TApplicationException.PROTOCOL_ERROR
                assert "request_read_timeout" in x.message
                assert 0.25 < waited < 2.0
                s.settimeout(5)
                assert s.recv(100) == b""  # then closed
    finally:
        up.stop()


def test_oversized_frame_refused_with_protocol_error():
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address], extra_listener="\n    max_frame_size: 1000")) as p:
            req = request_bytes("framed", "binary", "echo", b"x" * 5000, seqid=33)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(req)
                (r,) = read_messages(s, 1)
                assert (r.name, r.seqid) == ("echo", 33)
                x = app_exception(r)
                assert x.type == TApplicationException.PROTOCOL_ERROR
                assert x.message.startswith("thrift-sidecar: bad request: frame of")
            with client(p.port()) as c:  # other clients unaffected
                c.ping()
    finally:
        up.stop()


@pytest.mark.parametrize("framing,protocol", [("framed", "binary"), ("buffered", "compact"), ("header", "compact")])
def test_strip_service_forwards_bare_names_to_a_plain_server(framing, protocol):
    up = ThriftServer(framing, protocol)  # not multiplexed: it only knows bare names
    text = config_text([up.address], transport=framing, protocol=protocol).replace(
        "    routes:\n      - cluster: up",
        "    routes:\n      - match: {service: TestService}\n        cluster: up\n        strip_service: true")
    try:
        with Proxy(text) as p:
            with client(p.port(), framing, protocol, service="TestService") as c:
                assert c.roundtrip(everything()) == everything()
                assert c.lookup("z") == "upstream:z"
    finally:
        up.stop()


@pytest.mark.parametrize("strip", [True, False], ids=["strip_service", "multiplexed_upstream"])
def test_a_method_name_with_a_colon_after_the_service_is_answered_by_the_upstream(strip):
    """`TestService:a:b`: the upstream (a plain server after strip_service, or a multiplexed
    processor) answers UNKNOWN_METHOD named `a:b`, which answers the call: the client gets that
    answer, six times, and no breaker counts it (a client calling a method no server has cannot
    eject the endpoints). Before: the reply was refused as another method's ("may have run: bad
    reply ... 'a:b' does not match"), each call counted against the endpoint, and its breaker
    opened (the protocol-matrix hunt)."""
    up = ThriftServer(multiplexed=not strip)
    route = "\n        strip_service: true" if strip else ""
    text = config_text([up.address]).replace("      - cluster: up", "      - cluster: up" + route)
    try:
        with Proxy(text) as p:
            for i in range(6):
                with socket.create_connection(("127.0.0.1", p.port())) as s:
                    name = b"TestService:a:b"  # (a raw call: no generated client has such a method)
                    body = struct.pack("!Ii", 0x80010001, len(name)) + name + struct.pack("!i", 40 + i) + b"\x00"
                    s.sendall(struct.pack("!i", len(body)) + body)
                    (m,) = read_messages(s, 1, timeout=5)
                x = app_exception(m)
                assert (m.seqid, x.type) == (40 + i, TApplicationException.UNKNOWN_METHOD), x.message
                assert "a:b" in x.message and "thrift-sidecar" not in x.message, x.message
            states = p.call(lambda: [ep.breaker.seen_state().value for ep in p.server.clusters["up"].endpoints])
            assert states == ["closed"], states
    finally:
        up.stop()


class _ZlibReplies(RawUpstream):
    """A THeader upstream answering every `echo` with a zlib reply of `size` zero bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        from thrift.Thrift import TMessageType
        from thrift.protocol import THeaderProtocol
        from thrift.transport import THeaderTransport, TTransport

        from harness import HEADER_TYPES, TestService

        for name, seqid in self.requests(c, "header", "binary"):
            buf = TTransport.TMemoryBuffer()
            prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
            prot.add_transform(THeaderTransport.THeaderTransformID.ZLIB)
            prot.writeMessageBegin(name.decode(), TMessageType.REPLY, seqid)
            TestService.echo_result(success=b"\0" * self.size).write(prot)
            prot.writeMessageEnd()
            prot.trans.flush()
            c.sendall(buf.getvalue())


@pytest.mark.parametrize("max_reply, size, ok", [("32MiB", 20_000_000, True), ("4MiB", 8_000_000, False)])
def test_a_deflated_reply_reframed_for_the_client_inflates_up_to_max_reply_size(max_reply, size, ok):
    """A zlib THeader reply re-framed for a framed client is inflated up to the cluster's
    max_reply_size, as for a reply that came inflated (before: 16,384,000 bytes whatever it said,
    so a 20 MB reply under max_reply_size 32MiB failed as a bad reply)."""
    up = _ZlibReplies(size)
    try:
        with Proxy(config_text([up.address], cluster_transport="header",
                               extra_cluster=f"\n    max_reply_size: {max_reply}")) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "echo", b"x", seqid=9))
                (r,) = read_messages(s, 1, "framed", "binary", timeout=30, max_size=64 << 20)
            assert (r.seqid, r.name) == (9, "echo")
            if ok:
                assert r.type == MessageType.REPLY and len(r.data) > size
            else:
                x = app_exception(r)
                assert x.message.startswith("thrift-sidecar: may have run: bad reply"), x.message
                assert "exceeds 4194304 bytes" in x.message, x.message
    finally:
        up.close()


def test_a_reply_over_max_reply_size_is_not_the_endpoints_fault():
    """A client asks for a reply larger than the cluster's max_reply_size (200,000 bytes): each
    such call fails ("may have run", it ran) with a message naming the proxy's limit, is not
    retried on the route that retries (another endpoint's reply would be as large), and opens
    no breaker: a client asking too much cannot eject healthy endpoints (as one calling a method
    no server has cannot). Before: 10 such calls opened both breakers, and another client's
    call then failed with "no endpoint available"."""
    a, b = ThriftServer(name="A"), ThriftServer(name="B")
    routes = ("      - cluster: up\n        retry: {attempts: 3, idempotent: true, "
              "backoff: {base: 1ms, max: 2ms}}")
    try:
        text = config_text([a.address, b.address], lb="round_robin",
                           extra_cluster="\n    max_reply_size: 200000\n    circuit_breaker: {max_open_percent: 100}")
        with Proxy(text.replace("      - cluster: up", routes)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            for _ in range(10):
                with client(p.port()) as c:
                    with pytest.raises(TApplicationException) as info:
                        c.get_users(5000, 0)
                    assert info.value.message.startswith("thrift-sidecar: may have run: reply from "), info.value.message
                    assert "exceeds max_reply_size 200000 (the proxy's limit" in info.value.message
            with client(p.port()) as c:
                assert c.lookup("k").endswith(":k")
            states = p.call(lambda: [ep.breaker.seen_state().value for ep in p.server.clusters["up"].endpoints])
            assert states == ["closed", "closed"], states
            time.sleep(0.1)
        big = [call for call in done if call.msg.name == "get_users"]
        assert len(big) == 10 and all(len(call.attempts) == 1 for call in big), [len(c.attempts) for c in big]
        assert a.handler.calls + b.handler.calls == 11
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("limit", [None, 1_000_000], ids=["default_limit", "max_frame_size_1MB"])
def test_deflated_request_inflating_past_the_limit_is_refused(limit):
    """A small zlib THeader frame that would inflate past max_frame_size when re-framed: refused
    (the listener's max_frame_size bounds the inflating), and that client's connection closes,
    as for any malformed request (a bomb costs its inflating once per connection)."""
    from thrift.protocol import THeaderProtocol
    from thrift.transport import THeaderTransport, TTransport

    from harness import HEADER_TYPES, TestService

    up = ThriftServer("framed", "binary")
    extra = f"\n    max_frame_size: {limit}" if limit else ""
    try:
        with Proxy(config_text([up.address], transport="header", cluster_transport="framed",
                               extra_listener=extra)) as p:
            buf = TTransport.TMemoryBuffer()
            prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
            prot.add_transform(THeaderTransport.THeaderTransformID.ZLIB)
            c = TestService.Client(prot)
            c._seqid = 21
            c.send_echo(b"\0" * (2_000_000 if limit else 20_000_000))
            frame = buf.getvalue()
            assert len(frame) < 100_000
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(frame)
                (r,) = read_messages(s, 1, "header")
                s.settimeout(5)
                assert s.recv(1) == b""  # closed after the error
            x = app_exception(r)
            assert (r.seqid, r.name) == (21, "echo")
            assert x.type == TApplicationException.PROTOCOL_ERROR
            assert x.message.startswith("thrift-sidecar: bad request:") and "exceeds" in x.message
            assert f"exceeds {limit or 16_384_000} bytes" in x.message
            with client(p.port(), "header", "binary") as ok:  # the proxy keeps serving
                assert ok.lookup("a") == "upstream:a"
    finally:
        up.stop()


def test_a_deflated_oneway_inflating_past_the_limit_closes_the_connection():
    """As for a call (above), but a oneway gets no error reply: the connection closes all the
    same. (Before, it only stopped reading: nothing closed it, not even idle_timeout, and the
    client's next calls on it went unanswered.)"""
    from thrift.protocol import THeaderProtocol
    from thrift.transport import THeaderTransport, TTransport

    from harness import HEADER_TYPES, TestService

    up = ThriftServer("framed", "binary")
    try:
        with Proxy(config_text([up.address], transport="header", cluster_transport="framed",
                               extra_listener="\n    max_frame_size: 1000000")) as p:
            buf = TTransport.TMemoryBuffer()
            prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
            prot.add_transform(THeaderTransport.THeaderTransformID.ZLIB)
            TestService.Client(prot).send_log_event("x" * 2_000_000)
            frame = buf.getvalue()
            assert len(frame) < 100_000
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(frame)
                s.settimeout(5)
                assert s.recv(1) == b""  # closed, with nothing to say
            with client(p.port(), "header", "binary") as ok:  # the proxy keeps serving
                assert ok.lookup("a") == "upstream:a"
    finally:
        up.stop()


def test_finished_calls_are_freed_by_reference_counting():
    """A finished call, its attempts and its request are freed as soon as nothing holds them, not
    left for the cyclic GC (call <-> attempt is a cycle until the call is over): with the GC off,
    300 calls leave no Call or Attempt behind. Retried calls count too (each attempt lets go)."""
    import gc

    from proxy.calls import Attempt, Call

    up = ThriftServer("framed", "binary")
    down = ThriftServer("framed", "binary")
    down.stop()  # a refused endpoint: a call that lands there first is retried on `up`
    text = config_text([up.address, down.address], extra_top="tracing: {exporter: none}\n")
    text = text.replace("      - cluster: up", "      - cluster: up\n        retry: {attempts: 2, idempotent: true}")
    try:
        with Proxy(text) as p, client(p.port()) as c:
            c.ping()  # connections and labels made
            gc.collect()
            gc.disable()
            try:
                for _ in range(300):
                    c.ping()
                time.sleep(0.05)  # the last acknowledgement is recorded
                live = p.call(lambda: sum(1 for o in gc.get_objects() if type(o) in (Call, Attempt)))
            finally:
                gc.enable()
            retried = p.call(lambda: p.server.listeners["test"].pipeline.stats["retries"])
    finally:
        up.stop()
    assert live <= 4, f"{live} calls and attempts still alive after 300 finished calls"
    assert retried > 0  # the retried path was exercised


def _until_eof(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    while True:
        data = s.recv(1 << 16)
        if not data:
            return out
        out += data


def _messages(data: bytes, framing: str = "framed") -> list:
    from proxy.codec import Decoder, Framing

    dec = Decoder(Framing(framing), None)
    dec.feed(data)
    out = []
    while (m := dec.next_message()) is not None:
        out.append(m)
    return out


def test_error_for_a_malformed_frame_never_takes_the_next_requests_seqid():
    """ping (1), a whole 12-byte frame with a bad version word, a valid lookup (4), in one
    write: ping's reply, then the error addressed to the bad frame (seqid 0: its own cannot be
    read), then lookup's own answer (not sent: it is behind a malformed request), then the
    connection closes. Before: the error went out as lookup's reply (seqid 4, name 'lookup'),
    blaming a valid request that never ran."""
    up = ThriftServer("framed", "binary")
    try:
        with Proxy(config_text([up.address])) as p:
            bad = struct.pack("!i", 12) + b"\x12\x34\x56\x78" + b"\x00" * 8
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "ping", seqid=1) + bad
                          + request_bytes("framed", "binary", "lookup", "k4", seqid=4))
                replies = _messages(_until_eof(s))
            assert [(r.name, r.seqid, r.type) for r in replies] == [
                ("ping", 1, MessageType.REPLY), ("", 0, MessageType.EXCEPTION), ("lookup", 4, MessageType.EXCEPTION)]
            assert "bad binary protocol version" in app_exception(replies[1]).message
            assert app_exception(replies[2]).message.startswith(
                "thrift-sidecar: not sent: an earlier request on this connection was malformed")
            assert up.handler.calls == 1  # (the ping)
    finally:
        up.stop()


def test_theader_frame_with_a_bad_header_size_is_answered_with_its_own_seqid():
    from proxy.codec.theader import HeaderBlock, encode_header_frame

    up = ThriftServer("header", "binary")
    try:
        with Proxy(config_text([up.address], transport="header")) as p:
            frame = bytearray(encode_header_frame(HeaderBlock(0, 3, 0, (), {}),
                                                  request_bytes("buffered", "binary", "lookup", "k", seqid=3)))
            struct.pack_into("!H", frame, 12, 0x4000)  # header size (in words) past the frame's end
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(bytes(frame) + request_bytes("header", "binary", "lookup", "k4", seqid=4))
                replies = _messages(_until_eof(s), "header")
            assert [(r.seqid, r.type) for r in replies] == [(3, MessageType.EXCEPTION), (4, MessageType.EXCEPTION)]
            assert "header size 65536 beyond the frame" in app_exception(replies[0]).message
            assert "not sent: an earlier request on this connection was malformed" in app_exception(replies[1]).message
            assert up.handler.calls == 0
    finally:
        up.stop()


@pytest.mark.parametrize("cut", [False, True], ids=["oversized", "cut_short"])
def test_oneway_methods_sent_as_call_get_nothing_back_even_when_refused(cut):
    """log_event, listed in oneway_methods and sent as a CALL (as Apache Thrift Go does), over
    max_frame_size or cut short (request_read_timeout): refused and logged, never answered
    (README: nothing is ever written back for such a method). Before: a PROTOCOL_ERROR."""
    up = ThriftServer()
    try:
        text = config_text([up.address], extra_listener="\n    oneway_methods: [log_event]"
                                                        "\n    max_frame_size: 10000\n    request_read_timeout: 500ms")
        with Proxy(text) as p:
            req = bytearray(request_bytes("framed", "binary", "log_event", "e" if cut else "x" * 20000, seqid=6))
            req[7] = 1  # CALL
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(bytes(req[:-3] if cut else req))
                assert _until_eof(s) == b""
            assert p.server.listeners["test"].stats["protocol_errors"] + \
                p.server.listeners["test"].stats["read_timeouts"] >= 1
    finally:
        up.stop()


class _Deaf(RawUpstream):
    """Accepts connections and never reads from them."""

    def _one(self, c: socket.socket) -> None:
        time.sleep(60)


def test_oneways_to_an_upstream_that_stops_reading_do_not_pile_up_in_the_proxy():
    """A client pipelines 80 MB of oneway calls to an upstream that accepts but never reads. A
    oneway's connection goes back to the pool only once the upstream took its bytes, so at
    most the pool's 2 connections' buffers fill; the rest wait for a connection, are refused
    (logged, counted as oneway_failures: never silently) and nothing is written back. Before:
    the one connection was reused at once and its buffer took everything (a reviewer's flood
    took the proxy from 56 to 483 MiB)."""
    up = _Deaf()
    (port,) = free_ports(1)
    text = config_text([up.address], listen_port=port,
                       extra_cluster="\n    pool: {max_connections: 2, acquire_timeout: 50ms}")
    p = ProxyProcess(text, [port])
    try:
        base = reset_peak(p.proc.pid)
        one = request_bytes("framed", "binary", "log_event", "e" * 10_000, seqid=0)
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(80):
                s.sendall(one * 100)  # ~1 MB
            time.sleep(1.0)
            grown = (proc_status(p.proc.pid, "VmHWM") - base) / 1024
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):
                s.recv(1)  # nothing written back for a oneway, refused or not
        print(f"proxy peak RSS +{grown:.1f} MiB after 80 MB of oneways; upstream connections {up.connections}")
        assert grown < 32, grown
        assert up.connections <= 2
        assert "oneway call log_event" in p.output()  # the refused ones are logged
    finally:
        p.stop()
        up.close()


def test_a_request_that_came_as_the_idle_timer_fell_due_is_answered_not_reset():
    """idle_timeout 200ms, and the loop busy (an I/O callback blocked 500 ms) as the timer falls
    due; the next request arrives meanwhile. libuv runs due timers before it polls again: the
    idle check saw a quiet connection and closed it with the request unread, a reset for the
    client. Now unread bytes are read first, and the call is answered on the same connection."""
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address], extra_listener="\n    idle_timeout: 200ms")) as p:
            with client(p.port()) as c:
                assert c.lookup("a").endswith(":a")
                time.sleep(0.08)
                # the loop busy from ~80 to ~580 ms in an I/O callback, as with other connections'
                # calls (a callback of call_soon would be followed by a poll before the timers)
                busy, poke = socket.socketpair()

                def block():
                    p.loop.remove_reader(busy.fileno())
                    time.sleep(0.5)
                p.loop.call_soon_threadsafe(p.loop.add_reader, busy.fileno(), block)
                time.sleep(0.01)
                poke.send(b"x")
                time.sleep(0.25)  # past the idle deadline, the loop still busy
                assert c.lookup("b").endswith(":b")
                busy.close()
                poke.close()
            state = p.server.listeners["test"]
            assert (state.stats["accepted"], state.stats["idle_closed"]) == (1, 0)
    finally:
        up.stop()


def test_idle_timeout_counts_from_the_last_reply_not_the_last_request():
    """idle_timeout 500ms and a call that takes 700 ms: the connection is busy, not idle, while
    the call runs, and idle only from its reply on. A call sent 50 ms after that reply is
    answered on the same connection. Before: idle counted from the request's last byte, so the
    connection was closed ~10 ms after the slow reply and the next call was lost with it."""
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address], extra_listener="\n    idle_timeout: 500ms")) as p:
            with client(p.port()) as c:
                assert c.sleep(700) == 700
                time.sleep(0.05)
                assert c.lookup("k").endswith(":k")  # answered, not a closed connection
                time.sleep(0.2)
                assert c.sleep(1) == 1  # 250 ms after a reply: still not idle
            state = p.server.listeners["test"]
            assert state.stats["idle_closed"] == 0
            assert state.stats["accepted"] == 1
    finally:
        up.stop()
