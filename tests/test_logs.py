"""proxy.logs.Throttle: repeated warnings thinned, with a count of those held back."""

from __future__ import annotations

import logging
import re
import time

import pytest
from thrift.Thrift import TApplicationException

from proxy.clock import ManualClock
from proxy.logs import Throttle


def test_first_line_at_once_then_one_per_interval_with_the_count_held_back():
    clock = ManualClock()
    t = Throttle(5.0, clock)
    assert t.admit("connect") == 0
    for _ in range(3):
        clock.advance(1.0)
        assert t.admit("connect") is None
    clock.advance(1.9)  # 4.9 s after the line that went out
    assert t.admit("connect") is None
    clock.advance(0.1)
    assert t.admit("connect") == 4  # the four held back since
    clock.advance(60)
    assert t.admit("connect") == 0  # nothing held back in between


def test_the_count_held_back_can_be_taken_when_lines_stop_coming():
    clock = ManualClock()
    t = Throttle(5.0, clock)
    assert t.admit("full") == 0
    assert t.admit("full") is None and t.admit("full") is None
    assert t.held("full") == 2 and t.held("full") == 0  # taken once
    assert t.held("other") == 0


def test_kinds_are_thinned_apart():
    clock = ManualClock()
    t = Throttle(5.0, clock)
    assert t.admit("connect") == 0
    assert t.admit("refused") == 0
    assert t.admit("connect") is None
    assert t.admit("refused") is None


def test_warn_says_how_many_were_held_back(caplog):
    clock = ManualClock()
    t = Throttle(5.0, clock)
    log = logging.getLogger("test.throttle")
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for _ in range(3):
            t.warn(log, "connect", "connect to %s failed", "127.0.0.1:9")
            clock.advance(2.0)
        t.warn(log, "connect", "connect to %s failed", "127.0.0.1:9")
    assert [r.getMessage() for r in caplog.records] == [
        "connect to 127.0.0.1:9 failed",
        "connect to 127.0.0.1:9 failed (and 2 more like it since the last such line)",
    ]


def test_text_lines_escape_control_characters_and_are_bounded_tracebacks_kept():
    from proxy.logs import MAX_MESSAGE, JsonFormatter, TextFormatter

    rec = logging.LogRecord("proxy.pipeline", logging.WARNING, __file__, 1, "call %s: %s",
                            ("get\n2024-01-01 00:00:00,000 CRITICAL forged\x1b[31m", "e" * 10_000), None)
    line = TextFormatter().format(rec)
    assert "\n" not in line and "\x1b" not in line
    assert "get\\x0a2024-01-01 00:00:00,000 CRITICAL forged\\x1b[31m" in line
    assert line.endswith(" more characters)")
    assert len(line) < MAX_MESSAGE + 200
    assert len(JsonFormatter().format(rec)) < MAX_MESSAGE + 400
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        rec = logging.LogRecord("proxy", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    lines = TextFormatter().format(rec).splitlines()
    assert lines[0].endswith("ERROR proxy: failed") and lines[1] == "Traceback (most recent call last):"


def _ping_only_config(port: int, endpoint: str, logging_extra: str = "") -> str:
    """Text logs at info; a listener on `port` that routes only `ping` (to `endpoint`)."""
    return f"""
logging: {{format: text, level: info{logging_extra}}}
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:{port}
    routes:
      - match: {{method: ping}}
        cluster: up
clusters:
  - name: up
    endpoints: [{endpoint}]
"""


def test_a_clients_method_names_neither_forge_log_lines_nor_flood_the_log():
    """Oneways to no route, named with a newline and a forged line: the proxy logs one line (the
    rest of the burst thinned), the name escaped on it. Before: a WARNING line per call, and the
    name's newline started a line that looked like the proxy's own."""
    import socket
    import struct

    from harness import ProxyProcess, free_port

    port = free_port()
    text = _ping_only_config(port, "127.0.0.1:9")
    name = b"ev\n2024-01-01 00:00:00,000 CRITICAL proxy: FORGED"
    body = struct.pack("!Ii", 0x80010004, len(name)) + name + struct.pack("!i", 1) + b"\x00"
    with ProxyProcess(text, [port]) as p:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall((struct.pack("!i", len(body)) + body) * 20)
            s.sendall(b"\x00\x00\x00\x05")  # (a frame it waits for: the oneways are all read)
            time.sleep(0.5)
        out = p.output()
    assert not any(ln.startswith("2024-01-01") for ln in out.splitlines()), out
    assert out.count("oneway call ev\\x0a2024-01-01 00:00:00,000 CRITICAL proxy: FORGED on listener test") == 1, out


def test_clients_bad_requests_and_refusals_are_thinned_per_kind():
    """300 connections each sending 6 bytes of a request and closing (a client with the wrong
    framing that reconnects per call), then 50 more over max_connections: one line each kind in
    the burst, where there was a line per connection (10,300 lines, 1.6 MB in 7 s: the lifecycle
    hunt), and refusals had none at all. The counters still count each."""
    import socket

    from harness import ProxyProcess, free_port

    port = free_port()
    text = f"""
logging: {{format: text, level: info}}
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:{port}
    max_connections: 3
    routes:
      - cluster: up
clusters:
  - name: up
    endpoints: [127.0.0.1:9]
"""
    with ProxyProcess(text, [port]) as p:
        for _ in range(300):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"\x00\x00\x00\x20\x80\x01")
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.3)
        for _ in range(50):
            try:
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.recv(1)
            except OSError:
                pass
        for s in held:
            s.close()
        time.sleep(0.3)
        out = p.output()
    assert out.count("connection closed inside a message") == 1, out[-3000:]
    assert out.count("has max_connections 3 open: refusing new connections") == 1, out[-3000:]


def test_text_access_log_lines_carry_the_hop_timings():
    """`access_log: true` with the text format: each call's line has its hop timings, endpoint and
    error as key=value pairs after the message, as the JSON format has them as keys. Before: only
    `INFO proxy.access: TestService ping ok`, the timings lost (the text formatter ignored the
    record's fields). A call with no route has no endpoint: the pair is left out, not `None`."""
    from harness import ProxyProcess, ThriftServer, client, free_port, wait_for

    up = ThriftServer()
    port = free_port()
    text = _ping_only_config(port, up.address, ", access_log: true")
    try:
        with ProxyProcess(text, [port]) as p:
            with client(port) as c:
                c.ping()
                with pytest.raises(TApplicationException):
                    c.lookup("k")

            def access() -> list[str]:
                return [ln for ln in p.output().splitlines() if " INFO proxy.access: " in ln]

            wait_for(lambda: len(access()) >= 2, timeout=5, what="2 access-log lines")
            ping, lookup = access()
    finally:
        up.stop()
    assert " TestService ping success " in ping, ping
    for key in ("total_ms", "read_request_ms", "acquire_ms", "write_upstream_ms", "service_time_ms",
                "read_response_ms", "write_response_ms", "request_bytes", "reply_bytes"):
        assert re.search(rf" {key}=\d+(\.\d+)?( |$)", ping), (key, ping)
    assert f" endpoint={up.address} " in ping and " attempts=1 " in ping, ping
    assert " error=" not in ping, ping
    assert " TestService lookup no_route " in lookup and " endpoint=" not in lookup, lookup
    assert re.search(r' error="no route: method \'lookup\' on listener \'test\'"', lookup), lookup


def test_access_log_hop_timings_account_for_every_attempt_and_backoff(caplog):
    """A retried call (the first attempt's reply stalls after 10 bytes: per_try_timeout 150ms,
    then a 100 ms backoff, then an answer) and a call cut by its route timeout (200ms, no reply
    byte): their access-log hop fields add up to their totals, summed over attempts with
    `backoff_ms`, as the spans and /metrics take them. Before: only the last attempt's hops
    (~1 ms of a ~260 ms call), no backoff, and service_time_ms null for the timed-out attempt."""
    from harness import Proxy, ThriftServer, client, config_text
    from test_upstream_faults import FaultUpstream

    faulty, slow = FaultUpstream(), ThriftServer()
    faulty.plan.extend(["stall_mid_reply", "ok"])
    text = "logging: {access_log: true}\n" + config_text([faulty.address], extra_cluster="""
  - name: slow
    endpoints: [%s]""" % slow.address).replace("      - cluster: up\n", """      - match: {method: sleep}
        cluster: slow
        timeout: 200ms
      - cluster: up
        retry: {attempts: 2, idempotent: true, per_try_timeout: 150ms, backoff: {base: 100ms, max: 100ms}}
""")
    try:
        with caplog.at_level(logging.INFO, logger="proxy.access"), Proxy(text) as p:
            with client(p.port()) as c:
                c.ping()
                with pytest.raises(TApplicationException, match="timeout"):
                    c.sleep(1000)
            deadline = time.monotonic() + 5
            while len([r for r in caplog.records if r.name == "proxy.access"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        faulty.close()
        slow.stop()
    logged = {r.fields["method"]: r.fields for r in caplog.records if r.name == "proxy.access"}
    hops = ("read_request_ms", "acquire_ms", "write_upstream_ms", "service_time_ms", "read_response_ms",
            "backoff_ms", "queued_ms", "write_response_ms")
    ping, sleep = logged["ping"], logged["sleep"]
    assert ping["attempts"] == 2 and ping["backoff_ms"] is not None, ping
    # full jitter: the backoff is 0-100 ms; the stalled attempt's 150 ms are read_response
    assert ping["read_response_ms"] >= 140 and ping["total_ms"] >= 140, ping
    assert sleep["service_time_ms"] is not None and sleep["service_time_ms"] >= 180, sleep
    for f in (ping, sleep):
        covered = sum(f[k] or 0 for k in hops)
        assert 0.9 * f["total_ms"] <= covered <= f["total_ms"] + 0.5, (covered, f)
