"""proxy.client: the app-side helper — accelerated path, phase spans, trace context in THeader.

Real generated clients and servers (tests/harness.py), spans in an InMemorySpanExporter. The
one timing comparison is a ratio inside one run (medians), not an absolute figure.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
import warnings

import pytest
import thrift.protocol
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags, TraceState
from thrift.protocol import TBinaryProtocol, THeaderProtocol
from thrift.Thrift import TMessageType
from thrift.transport import THeaderTransport, TSocket, TTransport
from thrift.transport.TTransport import TTransportException

import proxy.client as client_mod
from harness import FRAMINGS, PROTOCOLS, Proxy, RawUpstream, ThriftServer, config_text, make_users
from proxy import spans, tracecontext
from proxy.client import (DECODE, DECODE_BLOCKED_MS, ENCODE, SEND, WAIT, AcceleratorWarning,
                          check_accelerated, connect)
from proxy.sockets import nodelay_of
from sidecar_test import AdminService, TestService
from sidecar_test.TestService import get_users_result
from sidecar_test.ttypes import NotFound

TWO_WAY = [ENCODE, SEND, WAIT, DECODE]


@pytest.fixture
def memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


@pytest.fixture
def fresh_warning(monkeypatch):
    """The once-per-process flag, reset for this test (and restored after it)."""
    monkeypatch.setattr(client_mod, "_warned", False)


def children(exporter, parent):
    return sorted((s for s in exporter.get_finished_spans()
                   if s.parent is not None and s.parent.span_id == parent.context.span_id),
                  key=lambda s: s.start_time)


def client_spans(exporter, name=None):
    return [s for s in exporter.get_finished_spans()
            if s.kind is SpanKind.CLIENT and (name is None or s.name == name)]


# -- (a) the accelerated path engages ------------------------------------------------------------


def _reply_bytes(count: int) -> bytes:
    """The get_users REPLY message a binary server writes (pure-Python encoder: same bytes)."""
    buf = TTransport.TMemoryBuffer()
    prot = TBinaryProtocol.TBinaryProtocol(buf)
    prot.writeMessageBegin("get_users", TMessageType.REPLY, 0)
    get_users_result(success=make_users(count)).write(prot)
    prot.writeMessageEnd()
    return buf.getvalue()


def test_decode_through_the_helper_is_5x_faster_than_pure_python(memory):
    """Helper calls and pure-Python decodes of the same reply bytes alternate, so both see the
    same machine load; the helper's decode time is its `decode` span (reply already in memory)."""
    tracer, exporter = memory
    reply = _reply_bytes(5499)

    def pure_decode() -> float:
        pure_client = TestService.Client(TBinaryProtocol.TBinaryProtocol(TTransport.TMemoryBuffer(reply)))
        t0 = time.perf_counter()
        users = pure_client.recv_get_users()
        elapsed = time.perf_counter() - t0
        assert len(users) == 5499
        return elapsed

    pure = []
    server = ThriftServer("framed", "binary")
    try:
        with connect(TestService.Client, port=server.port, tracer=tracer) as c:
            assert c.accelerated
            for _ in range(7):
                assert len(c.get_users(5499, 0)) == 5499
                pure.append(pure_decode())
    finally:
        server.stop()
    calls = client_spans(exporter, "TestService/get_users")
    assert len(calls) == 7
    # the helper decoded exactly these bytes (plus the frame's length prefix)
    assert {s.attributes[spans.REPLY_SIZE] for s in calls} == {len(reply) + 4}
    fast = statistics.median(
        (d.end_time - d.start_time) / 1e9 for s in calls for d in children(exporter, s) if d.name == DECODE)
    slow = statistics.median(pure)
    print(f"decode 5,499 users: helper {fast * 1e3:.1f} ms, pure Python {slow * 1e3:.1f} ms, "
          f"{slow / fast:.1f}x")
    assert slow >= 5 * fast, f"helper {fast * 1e3:.1f} ms vs pure {slow * 1e3:.1f} ms: {slow / fast:.1f}x"


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts calls into Thrift's C encoder/decoder (wrapped before any protocol is built)."""
    from thrift.protocol import fastbinary

    used = {"encode": 0, "decode": 0}

    class spy:  # a callable object, not a function: TMultiplexedProtocol must not bind it
        def __init__(self, kind, real):
            self.kind, self.real = kind, real

        def __call__(self, *args):
            used[self.kind] += 1
            return self.real(*args)

    for proto in PROTOCOLS:
        for kind in used:
            name = f"{kind}_{proto}"
            monkeypatch.setattr(fastbinary, name, spy(kind, getattr(fastbinary, name)))
    return used


@pytest.mark.parametrize("service", [None, "TestService"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_fastbinary_encodes_and_decodes_every_call(framing, protocol, service, fast_calls, memory):
    """The C encoder/decoder is what runs, whatever the framing (spied on, not timed)."""
    server = ThriftServer(framing, protocol, multiplexed=service is not None)
    try:
        with connect(TestService.Client, port=server.port, framing=framing, protocol=protocol,
                     service=service, tracer=memory[0]) as c:
            assert c.accelerated
            assert len(c.get_users(50, 0)) == 50
            assert c.lookup("k") == "upstream:k"
    finally:
        server.stop()
    assert fast_calls["encode"] >= 2 and fast_calls["decode"] >= 2, fast_calls


# -- (b) the spans -------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_each_call_is_a_client_span_with_its_phases(framing, protocol, memory):
    tracer, exporter = memory
    server = ThriftServer(framing, protocol)
    try:
        with connect(TestService.Client, port=server.port, framing=framing, protocol=protocol,
                     tracer=tracer) as c:
            with tracer.start_as_current_span("app") as app:
                c.ping()
                assert [u.id for u in c.get_users(100, 0)] == list(range(100))
                with pytest.raises(NotFound) as raised:
                    c.lookup("missing")
                assert raised.value.code == 404
                c.log_event("seen")
                assert c.count("seen") == 1  # the oneway call arrived before this reply
    finally:
        server.stop()

    calls = client_spans(exporter)
    assert [s.name for s in calls] == ["TestService/ping", "TestService/get_users", "TestService/lookup",
                                       "TestService/log_event", "TestService/count"]
    for s in calls:
        assert s.parent.span_id == app.context.span_id
        assert s.context.trace_id == app.context.trace_id
        assert s.attributes[spans.RPC_SYSTEM] == "apache_thrift"
        assert s.attributes[spans.RPC_SERVICE] == "TestService"
        assert s.attributes[spans.RPC_METHOD] == s.name.split("/")[1]
        assert s.attributes[spans.SERVER_PORT] == server.port
        assert s.attributes["sidecar.accelerated"] is True
        assert s.attributes[spans.REQUEST_SIZE] > 0
        phases = children(exporter, s)
        oneway = s.name.endswith("log_event")
        assert [p.name for p in phases] == (TWO_WAY[:2] if oneway else TWO_WAY)
        # the phases tile the call: consecutive, inside it, from its start to its end
        assert phases[0].start_time == s.start_time and phases[-1].end_time == s.end_time
        for a, b in zip(phases, phases[1:]):
            assert a.end_time == b.start_time
        for p in phases:
            assert p.context.trace_id == s.context.trace_id
            assert p.status.status_code is StatusCode.UNSET
        if not oneway:
            assert s.attributes[spans.REPLY_SIZE] > 0
        if framing == "buffered" and not oneway:
            assert DECODE_BLOCKED_MS in phases[-1].attributes

    ok = [s for s in calls if not s.name.endswith("lookup")]
    assert all(s.status.status_code is StatusCode.UNSET for s in ok)
    (lookup,) = client_spans(exporter, "TestService/lookup")
    assert lookup.status.status_code is StatusCode.ERROR
    assert lookup.attributes[spans.ERROR_TYPE] == "NotFound"
    assert [e.name for e in lookup.events] == ["exception"]
    users = client_spans(exporter, "TestService/get_users")[0]
    assert users.attributes[spans.REPLY_SIZE] > 100 * 50


@pytest.mark.parametrize("framing", FRAMINGS)
def test_waiting_for_the_reply_is_not_counted_as_decoding(framing, memory):
    tracer, exporter = memory
    server = ThriftServer(framing, "binary")
    try:
        with connect(TestService.Client, port=server.port, framing=framing, tracer=tracer) as c:
            assert len(c.get_users(500, 500)) == 500  # the service sleeps 500 ms first
    finally:
        server.stop()
    (call,) = client_spans(exporter)
    phases = {p.name: (p.end_time - p.start_time) / 1e9 for p in children(exporter, call)}
    # one-sided, from the mechanism: had decode waited for the reply, it would hold the 500 ms
    assert phases[WAIT] >= 0.5, phases
    assert phases[DECODE] < 0.5, phases


def test_multiplexed_services(memory):
    tracer, exporter = memory
    server = ThriftServer("framed", "binary", multiplexed=True)
    try:
        with connect(AdminService.Client, port=server.port, service="AdminService", tracer=tracer) as admin, \
                connect(TestService.Client, port=server.port, service="TestService", tracer=tracer) as test:
            assert admin.add(2, 3) == 5
            assert test.lookup("k") == "upstream:k"
    finally:
        server.stop()
    assert [s.name for s in client_spans(exporter)] == ["AdminService/add", "TestService/lookup"]


def test_a_broken_exchange_closes_the_connection_and_the_next_call_redials(memory):
    tracer, exporter = memory
    server = ThriftServer("framed", "binary")
    try:
        # 0.5 s leaves a busy machine time to redial and answer the lookup; the sleep reply comes
        # at 1.5 s, so a lookup that read the old connection would still time out waiting for it
        with connect(TestService.Client, port=server.port, timeout=0.5, tracer=tracer) as c:
            assert nodelay_of(c._sock)
            with pytest.raises(TTransportException) as raised:
                c.sleep(1500)
            assert raised.value.type == TTransportException.TIMED_OUT
            # a new connection: the late sleep reply cannot be read as this call's reply
            assert c.lookup("k") == "upstream:k"
            assert server.connections == 2
    finally:
        server.stop()
    failed, ok = client_spans(exporter)
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes[spans.ERROR_TYPE] == "TTransportException"
    phases = children(exporter, failed)
    assert [p.name for p in phases] == [ENCODE, SEND, WAIT]
    assert phases[-1].status.status_code is StatusCode.ERROR
    assert ok.status.status_code is StatusCode.UNSET


# -- (c) trace context in THeader headers --------------------------------------------------------


class HeaderRecorder(RawUpstream):
    """A THeader TestService server that records each request's info headers."""

    def __init__(self) -> None:
        from harness import Handler

        self.seen: list[dict[str, str]] = []
        self.processor = TestService.Processor(Handler("recorder"))
        super().__init__()

    def _one(self, conn: socket.socket) -> None:
        sock = TSocket.TSocket()
        sock.setHandle(conn)
        prot = THeaderProtocol.THeaderProtocol(sock, [THeaderTransport.THeaderClientType.HEADERS])
        processor = TestService.Processor(self.processor._handler)
        # called right after the request's THeader frame is read: its headers are current
        processor.on_message_begin(lambda *_: self.seen.append(
            {k.decode(): v.decode() for k, v in prot.get_headers().items()}))
        try:
            while True:
                processor.process(prot, prot)
        except Exception:
            conn.close()


@pytest.fixture
def recorder():
    r = HeaderRecorder()
    yield r
    r.close()


def test_header_framing_sends_the_client_span_as_traceparent(recorder, memory):
    tracer, exporter = memory
    remote = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED),
                         trace_state=TraceState([("vendor", "abc")]))
    parent_ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with connect(TestService.Client, port=recorder.port, framing="header", tracer=tracer) as c:
        with tracer.start_as_current_span("app", context=parent_ctx):
            assert c.lookup("a") == "recorder:a"
            assert c.lookup("b") == "recorder:b"
    calls = client_spans(exporter)
    assert len(calls) == 2 and len(recorder.seen) == 2
    for span, headers in zip(calls, recorder.seen):
        parent = tracecontext.parse(headers)  # read as the sidecar reads it
        assert parent is not None
        assert parent.trace_id == span.context.trace_id == remote.trace_id
        assert parent.span_id == span.context.span_id  # the sidecar's SERVER span becomes its child
        assert parent.sampled is True
        assert parent.tracestate == "vendor=abc"
        assert headers["traceparent"] == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"


def test_unsampled_calls_still_send_their_context_and_decision(recorder):
    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    with connect(TestService.Client, port=recorder.port, framing="header", tracer=tracer) as c:
        c.ping()
    parent = tracecontext.parse(recorder.seen[0])
    assert parent is not None and parent.sampled is False  # the sidecar follows: not head-sampled


def test_no_sdk_no_header(recorder):
    with connect(TestService.Client, port=recorder.port, framing="header", tracer=trace.NoOpTracer()) as c:
        c.ping()
    assert "traceparent" not in recorder.seen[0]


def test_the_sidecar_joins_the_app_trace(recorder, memory, tmp_path):
    """app CLIENT → sidecar SERVER (child of the app's span) → upstream sees the same trace."""
    tracer, exporter = memory
    path = tmp_path / "spans.jsonl"
    top = f"tracing: {{exporter: jsonl, path: {json.dumps(str(path))}, sample_ratio: 0.0}}\n"
    text = config_text([f"127.0.0.1:{recorder.port}"], transport="header", cluster_transport="header",
                       extra_top=top)
    with Proxy(text) as p:
        with connect(TestService.Client, port=p.port(), framing="header", tracer=tracer) as c:
            assert c.lookup("k") == "recorder:k"
    (call,) = client_spans(exporter)
    upstream = tracecontext.parse(recorder.seen[0])
    assert upstream.trace_id == call.context.trace_id and upstream.sampled is True
    assert upstream.span_id != call.context.span_id  # the sidecar's own CLIENT attempt
    exported = [s for line in path.read_text().splitlines()
                for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    (server,) = [s for s in exported if s["kind"] == 2]
    assert server["traceId"] == f"{call.context.trace_id:032x}"
    assert server["parentSpanId"] == f"{call.context.span_id:016x}"
    attempt = [s for s in exported if s["kind"] == 3]
    assert attempt and attempt[0]["spanId"] == f"{upstream.span_id:016x}"


# -- (d) the once-only warning -------------------------------------------------------------------


def test_warns_once_when_fastbinary_is_missing(monkeypatch, fresh_warning, memory):
    monkeypatch.setitem(sys.modules, "thrift.protocol.fastbinary", None)
    monkeypatch.delattr(thrift.protocol, "fastbinary", raising=False)
    server = ThriftServer("framed", "binary")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # only our own flag may keep the second one back
            with connect(TestService.Client, port=server.port, tracer=memory[0]) as c:
                assert not c.accelerated
                assert len(c.get_users(20, 0)) == 20  # still correct, in pure Python
            with connect(TestService.Client, port=server.port, tracer=memory[0]) as c:
                assert c.lookup("k") == "upstream:k"
    finally:
        server.stop()
    ours = [w for w in caught if issubclass(w.category, AcceleratorWarning)]
    assert len(ours) == 1
    assert "fastbinary" in str(ours[0].message)
    assert client_spans(memory[1])[0].attributes["sidecar.accelerated"] is False


def test_check_accelerated_names_a_transport_that_is_not_c_readable(fresh_warning):
    class Plain(TTransport.TTransportBase):  # e.g. a hand-written logging or socket transport
        def __init__(self):
            self.buf = TTransport.TMemoryBuffer()

        def read(self, n):
            return self.buf.read(n)

    slow = TestService.Client(TBinaryProtocol.TBinaryProtocolAccelerated(Plain()))
    fine = TestService.Client(TBinaryProtocol.TBinaryProtocolAccelerated(
        TTransport.TBufferedTransport(TTransport.TMemoryBuffer())))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_accelerated(fine) is True
        assert check_accelerated(slow) is False
        assert check_accelerated(slow) is False
    assert len(caught) == 1 and issubclass(caught[0].category, AcceleratorWarning)
    assert "Plain is not a CReadableTransport" in str(caught[0].message)
    # it points at the line that called check_accelerated (before: that line's caller)
    assert (caught[0].filename, caught[0].lineno) == (__file__, _line_of("assert check_accelerated(slow) is False"))


def _line_of(text: str) -> int:
    """The first line of this file that holds `text`, stripped (1-based)."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == text)


class _Interrupt(BaseException):
    """As KeyboardInterrupt or gevent.Timeout: not an Exception."""


def test_a_call_interrupted_while_it_waits_leaves_no_reply_for_the_next_call():
    """Before: the socket stayed open with call 1's reply coming; call 2 read it (300, not 1)."""
    import signal

    def interrupt(*_):
        raise _Interrupt()

    server = ThriftServer("framed", "binary")
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Proxy(config_text([server.address])) as p:
            c = client_mod.connect(TestService.Client, port=p.port(), framing="framed")
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(_Interrupt):
                c.sleep(300)
            time.sleep(0.4)  # call 1's reply has come
            assert c.sleep(1) == 1
            assert c.sleep(2) == 2
            c.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        server.stop()


def test_a_connection_the_sidecar_closed_idle_is_dialled_again_not_failed_on():
    """The listener's idle_timeout closes the app's idle connection: the next call dials again.
    Before: it failed (connection closed before the whole reply arrived), sent into a socket the
    sidecar had closed."""
    server = ThriftServer("framed", "binary")
    try:
        with Proxy(config_text([server.address], extra_listener="\n    idle_timeout: 0.2s")) as p:
            c = client_mod.connect(TestService.Client, port=p.port(), framing="framed")
            assert c.sleep(1) == 1
            time.sleep(0.6)  # closed by the sidecar meanwhile
            assert c.sleep(2) == 2
            c.close()
    finally:
        server.stop()


class _BigEchoUpstream(RawUpstream):
    """Answers echo with a 20,000,000-byte binary: one value, in one frame, over 16,384,000
    (the Thrift library's default frame and string limits)."""

    def _one(self, c: socket.socket) -> None:
        import struct

        for name, seqid in self.requests(c):
            buf = TTransport.TMemoryBuffer()
            p = TBinaryProtocol.TBinaryProtocol(buf)
            p.writeMessageBegin(name.decode(), TMessageType.REPLY, seqid)
            TestService.echo_result(success=b"z" * 20_000_000).write(p)
            p.writeMessageEnd()
            body = buf.getvalue()
            c.sendall(struct.pack("!i", len(body)) + body)


@pytest.mark.parametrize("framing", ["framed", "header"])
def test_max_frame_size_bounds_the_librarys_own_limits_too(framing):
    """connect(max_frame_size=64 MiB) through a sidecar that allows 64 MiB: a reply holding one
    20 MB binary value arrives, in any framing. Before: THeaderTransport kept its own 16,384,000
    frame limit ("Frame was too large") and the accelerated protocols their 16,384,000 string
    limit (a bare OverflowError) whatever max_frame_size said."""
    up = _BigEchoUpstream()
    text = config_text([up.address], transport=framing, cluster_transport="framed").replace(
        "    routes", "    max_frame_size: 64MiB\n    routes").replace(
        "    load_balancer", "    max_reply_size: 64MiB\n    load_balancer")
    try:
        with Proxy(text) as p:
            c = connect(TestService.Client, "127.0.0.1", p.port(), framing=framing, timeout=30,
                        max_frame_size=64 << 20)
            try:
                assert len(c.echo(b"hi")) == 20_000_000
            finally:
                c.close()
    finally:
        up.close()


# -- methods named like the client's own attributes; malformed replies; timeout --------------------


class _Replies(RawUpstream):
    """Answers each framed request with `replies(name, seqid, i)`'s bytes (i: the call's number)."""

    def __init__(self, replies) -> None:
        self.replies = replies
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        for name, seqid in self.requests(c):
            c.sendall(self.replies(name, seqid, self.calls))


class _ClosingService(TestService.Client):
    """A generated client with a method named `close` (lookup's code, under that name)."""

    def close(self, key):
        self.send_close(key)
        return self.recv_close()

    def send_close(self, key):
        self._oprot.writeMessageBegin("close", TMessageType.CALL, self._seqid)
        TestService.lookup_args(key=key).write(self._oprot)
        self._oprot.writeMessageEnd()
        self._oprot.trans.flush()

    recv_close = TestService.Client.recv_lookup


def test_a_method_named_like_the_clients_own_attribute_is_called_by_name():
    """A service with a method named `close` (or `timeout`, `address` ...): connect() works, the
    attribute stays the client's own, and call("close", ...) makes the traced call over the
    socket. Before: connect() raised ValueError and pointed at .client, whose calls never
    reach the socket (it encodes to memory only)."""
    from harness import reply_bytes

    up = _Replies(lambda name, seqid, i: reply_bytes(name, seqid, name))
    try:
        c = connect(_ClosingService, port=up.port, timeout=5)
        try:
            assert c.call("close", "k") == "close"
            assert c.call("lookup", "k") == c.lookup("k") == "lookup"
            with pytest.raises(AttributeError, match="no method 'nope'"):
                c.call("nope")
            assert up.calls == 3
        finally:
            c.close()  # the client's own close: the socket
        assert c._sock is None
    finally:
        up.close()


def test_a_malformed_reply_is_a_protocol_exception_and_the_next_call_dials_again():
    """A reply frame that ends inside its value: TProtocolException INVALID_DATA saying the
    decode failed, the connection is closed, and the next call dials again. Before: a bare
    EOFError (fastbinary's), or ValueError for a negative string length."""
    import struct

    from harness import reply_bytes
    from thrift.protocol.TProtocol import TProtocolException

    def replies(name, seqid, i):
        good = reply_bytes(name, seqid, b"fine")
        if i == 1:  # cut two bytes short inside the string, with a frame length that says so
            return struct.pack("!i", len(good) - 6) + good[4:-2]
        return good

    up = _Replies(replies)
    try:
        with connect(TestService.Client, port=up.port, timeout=5) as c:
            with pytest.raises(TProtocolException) as raised:
                c.lookup("a")
            assert raised.value.type == TProtocolException.INVALID_DATA
            assert str(raised.value).startswith("decode: malformed reply: EOFError"), str(raised.value)
            assert c._sock is None
            assert c.lookup("b") == "fine"
        assert up.connections == 2
    finally:
        up.close()


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_a_timeout_that_is_not_above_zero_is_refused(timeout):
    """timeout=0 made the socket non-blocking: connect failed with 'Operation now in progress'."""
    with pytest.raises(ValueError, match="timeout must be a number of seconds above 0, or None"):
        connect(TestService.Client, port=1, timeout=timeout)


def test_check_accelerated_on_connects_own_client_says_what_connect_found(fresh_warning):
    """`connect`'s client encodes into its own buffer, which is not the generated client's
    protocol: check_accelerated(connect(...)) said False and warned "TracedClient does not encode
    with fastbinary" about an accelerated client. Now it says what connect's own check found."""
    server = ThriftServer()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with connect(TestService.Client, port=server.port) as c:
                assert check_accelerated(c) is True
                assert c.lookup("k") == "upstream:k"
    finally:
        server.stop()
    assert not [w for w in caught if issubclass(w.category, AcceleratorWarning)], [str(w.message) for w in caught]
