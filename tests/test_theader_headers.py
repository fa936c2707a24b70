"""THeader info headers through the proxy, as a THeader upstream receives them: the client's own
headers kept byte for byte when the proxy re-encodes the block (its client_timeout, trace context),
ours replacing the client's trace headers whatever their case, a block too full for ours, and
what client_timeout values are taken as a cap."""

from __future__ import annotations

import socket

import pytest
from thrift.protocol import THeaderProtocol
from thrift.transport import TTransport

from harness import HEADER_TYPES, Handler, TestService, config_text, read_messages
from spans_util import Traced
from test_tracing_live import HeaderServer

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Recorder(Handler):
    """Records each request's THeader headers as raw bytes."""

    def __init__(self) -> None:
        super().__init__("hup")
        self.seen: list[dict[bytes, bytes]] = []

    def _hit(self, method: str = "") -> None:
        prot = getattr(self.local, "prot", None)
        if prot is not None and hasattr(prot, "get_headers"):
            with self.lock:
                self.seen.append(dict(prot.get_headers()))
        super()._hit(method)


def _request(headers: dict[bytes, bytes], seqid: int = 1) -> bytes:
    buf = TTransport.TMemoryBuffer()
    prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
    for k, v in headers.items():
        prot.set_header(k, v)
    c = TestService.Client(prot)
    c._seqid = seqid
    c.send_lookup("k")
    return buf.getvalue()


def _call(port: int, data: bytes):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        (m,) = read_messages(s, 1, "header", timeout=10)
    return m


@pytest.fixture
def upstream():
    up = HeaderServer("header", "binary", handler=Recorder())
    yield up
    up.stop()


def _config(up, route: str = "") -> str:
    text = config_text([up.address], transport="header", cluster_transport="header")
    return text.replace("      - cluster: up", "      - cluster: up" + route)


@pytest.mark.parametrize("route", ["\n        timeout: 2s", "\n        strip_service: true"],
                         ids=["client_timeout_added", "strip_service"])
def test_header_bytes_that_are_not_utf8_pass_unchanged_when_the_block_is_re_encoded(upstream, route):
    """Before: decoded with 'replace', so ff fe 00 80 reached the upstream as U+FFFD sequences."""
    from harness import Proxy

    sent = {b"x-bin": b"\xff\xfe\x00\x80", b"k\xe9y": b"latin1-key"}
    with Proxy(_config(upstream, route)) as p:
        assert _call(p.port(), _request(sent)).type == 2
    got = upstream.handler.seen[-1]
    assert got[b"x-bin"] == b"\xff\xfe\x00\x80" and got[b"k\xe9y"] == b"latin1-key", got
    if "timeout" in route:
        assert b"client_timeout" in got  # (the block was re-encoded)


def test_a_header_block_too_full_for_the_proxys_headers_goes_on_with_the_clients(upstream):
    """The client's headers take 65,534 of the block's 65,535 words: the proxy's client_timeout
    does not fit, so the request goes on with the client's headers only. Before: a ValueError
    on the loop, the client's connection dropped without a reply."""
    from harness import Proxy

    big = {b"x-big": b"v" * 262_120}
    with Proxy(_config(upstream, "\n        timeout: 3s")) as p:
        reply = _call(p.port(), _request(big, seqid=5))
    assert (reply.type, reply.seqid) == (2, 5)
    got = upstream.handler.seen[-1]
    assert got[b"x-big"] == big[b"x-big"] and b"client_timeout" not in got


def test_a_full_header_block_never_forwards_the_clients_trace_headers_as_they_came(upstream):
    """The client's block is nearly full and carries trace headers the proxy drops as invalid:
    they do not go on (ours replace them when they fit). Before: the client's block went on
    verbatim, its invalid traceparent and tracestate included."""
    client = {b"x-big": b"v" * 262_060, b"traceparent": b"x", b"tracestate": b"bad key=1"}
    with Traced(_config(upstream, "\n        timeout: 3s"), ratio=1.0) as t:
        reply = _call(t.port(), _request(client, seqid=6))
        (call,) = t.wait_calls(1)
    assert (reply.type, reply.seqid) == (2, 6)
    got = upstream.handler.seen[-1]
    assert got[b"x-big"] == client[b"x-big"] and b"client_timeout" not in got
    assert got.get(b"traceparent") != b"x" and b"tracestate" not in got, got.get(b"traceparent")
    if b"traceparent" in got:  # ours: the attempt's CLIENT span is the upstream's parent
        (attempt,) = call.clients
        assert got[b"traceparent"].decode().split("-")[2] == f"{attempt.context.span_id:016x}"


@pytest.mark.parametrize("client_headers", [
    {b"traceparent": b"garbage", b"tracestate": b"vendor=abc"},
    {b"tracestate": b"vendor=abc"},
    {b"traceparent": TP.encode(), b"tracestate": b"v=" + b"a" * 598},
    {b"Traceparent": TP.encode()},
    {b"traceparent": TP.encode(), b"TRACESTATE": b"k=v"},
], ids=["bad_parent_with_state", "state_alone", "state_over_512", "capital_parent", "capital_state"])
def test_the_upstream_gets_our_trace_headers_only(upstream, client_headers):
    """The proxy reads the client's trace headers (case-insensitively, dropping what is
    invalid) and sends its own: none of the client's goes on beside them. Before: both, so the
    upstream had two conflicting parents or a tracestate the proxy had dropped."""
    with Traced(_config(upstream), ratio=1.0) as t:
        assert _call(t.port(), _request(client_headers)).type == 2
    got = upstream.handler.seen[-1]
    trace_keys = [k for k in got if k.lower() in (b"traceparent", b"tracestate")]
    assert b"traceparent" in trace_keys and all(k == k.lower() for k in trace_keys), got
    assert len(got.get(b"tracestate", b"")) <= 512
    if client_headers.get(b"traceparent") == b"garbage" or b"traceparent" not in {k.lower() for k in client_headers}:
        assert b"tracestate" not in got  # (travels only with a valid traceparent)


@pytest.mark.parametrize("value,seconds", [
    ("150", 0.15), ("0", 0.0), ("-5", 0.0), ("1_000", 0.0), (" 200 ", 0.0), ("\u0661\u0662\u0663", 0.0),
    ("garbage", 0.0), ("99999999999999999999", (2**31 - 1) / 1000), ("9" * 5000, (2**31 - 1) / 1000),
])
def test_client_timeout_is_ascii_milliseconds_clamped(value, seconds):
    """Only ASCII decimal ms are a cap, clamped (before: int() took '1_000', ' 200 ' and
    Arabic-Indic digits, and forwarded values past int64)."""
    from proxy.pipeline import _client_timeout

    assert _client_timeout(value) == seconds


def test_a_call_cut_by_the_clients_own_client_timeout_says_so(upstream):
    """Route timeout 2 s, the client's THeader client_timeout 200 ms: the client hears that its
    own client_timeout ended the call (before: "route timeout 200ms", a timeout no config has)."""
    from harness import app_exception

    buf = TTransport.TMemoryBuffer()
    prot = THeaderProtocol.THeaderProtocol(buf, HEADER_TYPES)
    prot.set_header(b"client_timeout", b"200")
    c = TestService.Client(prot)
    c._seqid = 9
    c.send_sleep(1000)
    with Traced(_config(upstream, "\n        timeout: 2s")) as t:
        m = _call(t.port(), buf.getvalue())
    assert m.seqid == 9
    message = app_exception(m).message
    assert message.startswith("thrift-sidecar: may have run: the client's THeader client_timeout 200ms: "
                              "no reply from "), message


@pytest.mark.parametrize("route", ["\n        timeout: 2s\n        retry: {per_try_timeout: 300ms}",
                                   "\n        retry: {per_try_timeout: 300ms}"],
                         ids=["route_timeout_and_per_try", "per_try_only"])
def test_the_client_timeout_sent_upstream_is_the_attempts_per_try_timeout_when_shorter(upstream, route):
    """The upstream is told the time this attempt has: its per-try timeout, not the whole route
    deadline. Before: 2000 ms (or nothing), so the service worked on past the moment the proxy
    gave up on the attempt."""
    from harness import Proxy

    with Proxy(_config(upstream, route)) as p:
        assert _call(p.port(), _request({})).type == 2
    got = upstream.handler.seen[-1]
    assert 1 <= int(got[b"client_timeout"]) <= 300, got


@pytest.mark.parametrize("route_timeout, counted", [("2s", False), (None, True)], ids=["under_the_route_timeout", "no_route_timeout"])
def test_a_clients_own_client_timeout_counts_against_the_breaker_only_without_a_route_timeout(route_timeout, counted):
    """A client sending THeader client_timeout 50 ms on a 300 ms call, 6 times, on two healthy
    endpoints (breakers open at 2 consecutive failures; max_open_percent 100: no panic). Under a
    route timeout of 2 s, the client's shorter deadline is its own choice: no breaker counts it,
    and another client's call goes through. With no route timeout, the client's deadline is the
    only bound there is and counts as the route's would. Before: both breakers opened either way,
    and the patient client got "no endpoint available"."""
    from thrift.Thrift import TApplicationException

    from harness import Proxy, ThriftServer, client

    a, b = ThriftServer(framing="header", name="A"), ThriftServer(framing="header", name="B")
    text = config_text([a.address, b.address], transport="header", lb="round_robin",
                       extra_cluster="\n    circuit_breaker: {consecutive_failures: 2, max_open_percent: 100}")
    if route_timeout:
        text = text.replace("      - cluster: up", f"      - cluster: up\n        timeout: {route_timeout}")
    try:
        with Proxy(text) as p:
            for _ in range(6):
                with client(p.port(), framing="header", headers={"client_timeout": "50"}) as c:
                    with pytest.raises(TApplicationException) as info:
                        c.sleep(300)
                    message = info.value.message
                    assert "the client's THeader client_timeout 50ms" in message or (
                        counted and "no endpoint available" in message), message  # (once both opened)
            opened = p.call(lambda: [ep.breaker.opened_total for ep in p.server.clusters["up"].endpoints])
            if counted:
                assert all(opened), opened
            else:
                assert opened == [0, 0], opened
                with client(p.port(), framing="header") as c:
                    assert c.sleep(10) == 10
    finally:
        a.stop()
        b.stop()
