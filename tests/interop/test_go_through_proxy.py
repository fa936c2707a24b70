"""A real Go Apache Thrift client through the sidecar (framed and buffered × binary and compact)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from harness import Proxy, ThriftServer, config_text


def run_go(go_client, port, transport, protocol, scenario, *args):
    cmd = [go_client, "-addr", f"127.0.0.1:{port}", "-transport", transport, "-protocol", protocol,
           "-scenario", scenario, "-timeout", "10s", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.strip()]
    detail = f"{' '.join(cmd)}\nrc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, lines, detail


WIRE = [(t, p) for t in ("framed", "buffered") for p in ("binary", "compact")]


@pytest.mark.parametrize("transport,protocol", WIRE)
@pytest.mark.parametrize("multiplex", [False, True], ids=["plain", "multiplex"])
def test_go_basic_through_proxy(go_client, transport, protocol, multiplex):
    up = ThriftServer(transport, protocol, multiplexed=multiplex)
    try:
        with Proxy(config_text([up.address], transport=transport, protocol=protocol)) as p:
            rc, lines, detail = run_go(go_client, p.port(), transport, protocol, "basic",
                                       *(["-multiplex"] if multiplex else []))
    finally:
        up.stop()
    assert rc == 0, detail
    assert lines and all(line["ok"] for line in lines), detail
    calls = {line["call"] for line in lines}
    assert {"ping", "roundtrip", "lookup(missing)", "lookup(down)"} <= calls, detail


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_go_large_request_streams_through_proxy(go_client, protocol):
    """A 6 MB echo from the Go client: over retry_buffer, so its request streams upstream as it
    arrives (the Go framed transport's own write pattern), and comes back intact."""
    up = ThriftServer("framed", protocol)
    try:
        with Proxy(config_text([up.address], transport="framed", protocol=protocol)) as p:
            done = []
            p.server.listeners["test"].pipeline.on_complete = done.append
            rc, lines, detail = run_go(go_client, p.port(), "framed", protocol, "basic", "-echo-size", "6000000")
            deadline = time.monotonic() + 5
            while not any(c.msg.name == "echo" for c in done) and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        up.stop()
    assert rc == 0, detail
    assert lines and all(line["ok"] for line in lines), detail
    assert {line["call"]: line for line in lines}["echo"]["result"] == 6_000_000
    (echo,) = [c for c in done if c.msg.name == "echo"]
    assert echo.upload is not None and echo.request_size > 6_000_000, detail


@pytest.mark.parametrize("transport,protocol", WIRE)
def test_go_oneway_sent_as_call_then_call_on_same_connection(go_client, transport, protocol):
    up = ThriftServer(transport, protocol)
    text = config_text([up.address], transport=transport, protocol=protocol,
                       extra_listener="\n    oneway_methods: [log_event]")
    try:
        with Proxy(text) as p:
            rc, lines, detail = run_go(go_client, p.port(), transport, protocol, "oneway_then_call")
    finally:
        up.stop()
    assert rc == 0, detail
    by_call = {line["call"].split("(")[0]: line for line in lines}
    assert by_call["log_event"]["wire_message_type"] == 1, detail  # Go really sends CALL
    assert by_call["ping"]["ok"] and by_call["count"]["ok"], detail
    assert by_call["count"]["result"] == 1, detail
    assert len(up.handler.events) == 1


@pytest.mark.parametrize("transport,protocol", WIRE)
@pytest.mark.parametrize("multiplex", [False, True], ids=["plain", "multiplex"])
def test_go_client_gets_not_sent_then_recovers(go_client, transport, protocol, multiplex):
    up = ThriftServer(transport, protocol, multiplexed=multiplex)
    port = up.port
    up.stop(hold_port=True)  # (refused meanwhile; no other socket can take the port)
    try:
        with Proxy(config_text([f"127.0.0.1:{port}"], transport=transport, protocol=protocol)) as p:
            rc, lines, detail = run_go(go_client, p.port(), transport, protocol, "errors",
                                       *(["-multiplex"] if multiplex else []))
            assert rc == 0, detail
            (line,) = lines
            assert line["error_type"] == "TApplicationException", detail
            assert line["app_error_type"] == 6, detail
            assert line["message"].startswith("thrift-sidecar: not sent:"), detail
            # One connection across the outage: pings fail "not sent", then succeed once it is back.
            cmd = [go_client, "-addr", f"127.0.0.1:{p.port()}", "-transport", transport, "-protocol", protocol,
                   "-scenario", "ping_loop", "-count", "3000", "-timeout", "10s",
                   *(["-multiplex"] if multiplex else [])]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)
            up.port = port
            up.start()
            out, err = proc.communicate(timeout=120)
            lines = [json.loads(s) for s in out.splitlines() if s.strip()]
            detail = f"rc={proc.returncode}\n{out[-2000:]}\n{err}"
            assert proc.returncode == 0, detail
            pings = [line for line in lines if line["call"] == "ping"]
            assert len(pings) == 3000, detail
            assert not pings[0]["ok"] and pings[0]["message"].startswith("thrift-sidecar: not sent:"), detail
            assert pings[-1]["ok"], detail
            first_ok = next(i for i, line in enumerate(pings) if line["ok"])
            assert all(line["ok"] for line in pings[first_ok:]), detail
            assert not any(line["call"] == "reconnect" for line in lines), detail  # the same connection
    finally:
        up.stop()
