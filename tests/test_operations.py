"""Operating the sidecar as a process: reload under load, drain, admin endpoints, logs."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from thrift.Thrift import TApplicationException

from harness import ProxyProcess, ThriftServer, client, free_port, free_ports, wait_for


def _config(port: int, upstream: str, admin_port: int | None = None, extra: str = "") -> str:
    admin = f"admin: {{listen: 127.0.0.1:{admin_port}}}\n" if admin_port else ""
    return f"""{admin}logging: {{format: json, level: info, access_log: true}}
drain_timeout: 8s
{extra}listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:{port}
    routes:
      - cluster: up
        retry: {{attempts: 2, idempotent: true}}
clusters:
  - name: up
    endpoints: [{upstream}]
"""


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_reload_under_load_switches_upstreams_without_failing_a_call():
    a, b = ThriftServer(name="A"), ThriftServer(name="B")
    port = free_port()
    text_a, text_b = _config(port, a.address), _config(port, b.address)
    bad = text_a.replace("    endpoints:", "    endpoint:")  # an invalid file between the good ones
    stop = threading.Event()
    failures: list[Exception] = []
    calls = [0]

    def worker() -> None:
        with client(port) as c:
            while not stop.is_set():
                try:
                    c.lookup("k")
                    calls[0] += 1
                except Exception as e:  # noqa: BLE001 - any failure counts
                    failures.append(e)

    try:
        with ProxyProcess(text_a, [port]) as p:
            threads = [threading.Thread(target=worker) for _ in range(8)]
            for t in threads:
                t.start()
            seen = {"A": [], "B": []}

            def switched(new: ThriftServer, old: ThriftServer, name: str) -> bool:
                """Over 0.1 s, `new` took calls and `old` none: the reload is in force."""
                n_new, n_old = new.handler.calls, old.handler.calls
                time.sleep(0.1)
                if new.handler.calls > n_new and old.handler.calls == n_old:
                    seen[name].append(new.handler.calls - n_new)
                    return True
                return False

            for i in range(20):
                target, other = ((a, "A"), b) if i % 2 else ((b, "B"), a)
                text = text_a if target[1] == "A" else text_b
                if i == 10:
                    p.path.write_text(bad)
                    p.proc.send_signal(signal.SIGHUP)
                    # the proxy read the bad file (before the good one replaces it) and kept serving
                    wait_for(lambda: "reload rejected" in p.output(), what="the bad file to be rejected")
                p.path.write_text(text)
                p.proc.send_signal(signal.SIGHUP)
                wait_for(lambda: switched(target[0], other, target[1]),
                         what=f"reload {i}: calls to {target[1]} only; seen so far {seen}")
            stop.set()
            for t in threads:
                t.join(10)
            out = p.output()
    finally:
        stop.set()
        a.stop()
        b.stop()
    assert failures == [], failures[:3]
    assert calls[0] > 200
    assert len(seen["A"]) == len(seen["B"]) == 10 and all(n > 0 for n in seen["A"] + seen["B"]), seen
    assert "reload rejected" in out and "sidecar.yaml:" in out and "clusters[0].endpoints" in out


def test_drain_finishes_started_calls_serves_new_ones_ready_503_exit_0():
    up = ThriftServer()
    up.handler.sleep_ms = 1000
    port, admin = free_ports(2)
    results, errors = [], []
    try:
        with ProxyProcess(_config(port, up.address, admin), [port, admin]) as p:
            assert _get(f"http://127.0.0.1:{admin}/ready")[0] == 200

            def slow_call() -> None:
                try:
                    with client(port) as c:
                        results.append(c.lookup("slow"))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=slow_call) for _ in range(4)]
            for t in threads:
                t.start()
            wait_for(lambda: up.handler.calls == 4, what="the 4 slow calls to reach the upstream")
            t0 = time.monotonic()
            p.proc.send_signal(signal.SIGTERM)
            # /ready turns 503 once the signal is handled (polled: the process may be slow to run)
            wait_for(lambda: _get(f"http://127.0.0.1:{admin}/ready")[0] == 503, timeout=5, what="/ready 503")
            with client(port) as c:  # a new call during the grace period is served
                results.append(c.lookup("new"))
            for t in threads:
                t.join(10)
            rc = p.proc.wait(10)
            elapsed = time.monotonic() - t0
    finally:
        up.stop()
    assert errors == [] and len(results) == 5
    assert rc == 0
    assert elapsed < 8  # within drain_timeout


@pytest.mark.parametrize("signals", [1, 2])
def test_an_admin_client_that_never_reads_holds_up_no_stop(signals):
    """An admin client pipelines 2,000 GET /config with a 4 KB receive buffer and reads
    nothing. A stop still ends within drain_timeout (1 s) and the admin server's short shutdown
    bound; a second signal ends it at once. Before: aiohttp's default shutdown_timeout (60 s,
    twice) held the process 122 s, past drain_timeout and past the second signal (found by the
    lifecycle hunt)."""
    import socket

    up = ThriftServer()
    port, admin = free_ports(2)
    text = _config(port, up.address, admin).replace("drain_timeout: 8s", "drain_timeout: 1s")
    assert "drain_timeout: 1s" in text
    try:
        with ProxyProcess(text, [port, admin]) as p:
            with socket.create_connection(("127.0.0.1", admin)) as a:
                a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                a.sendall(b"GET /config HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)
                time.sleep(0.5)
                t0 = time.monotonic()
                p.proc.send_signal(signal.SIGTERM)
                if signals == 2:
                    time.sleep(0.5)
                    p.proc.send_signal(signal.SIGTERM)
                rc = p.proc.wait(30)
                elapsed = time.monotonic() - t0
    finally:
        up.stop()
    print(f"exit {rc} after {elapsed:.1f} s")
    assert rc == 0
    assert elapsed < (5.0 if signals == 1 else 2.5), elapsed


def test_sighups_during_a_stop_are_ignored_and_the_exit_is_clean():
    """SIGTERM with a call in flight, then a SIGHUP every 2 ms until the process is gone (a
    config reloader while the pod terminates): the call gets its reply, the exit code is 0, and
    the log says once that reloads are ignored. Before: a SIGHUP after the loop closed ended the
    process by the signal (returncode -1), and the drain logged one line per SIGHUP (found by the
    lifecycle hunt)."""
    import socket

    from harness import read_messages, request_bytes

    up = ThriftServer()
    port = free_port()
    text = _config(port, up.address).replace("drain_timeout: 8s", "drain_timeout: 3s")
    try:
        with ProxyProcess(text, [port]) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request_bytes("framed", "binary", "sleep", 800, seqid=42))
                time.sleep(0.2)
                p.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                rc = None
                while rc is None and time.monotonic() - t0 < 15:
                    try:
                        p.proc.send_signal(signal.SIGHUP)
                    except ProcessLookupError:
                        pass
                    time.sleep(0.002)
                    rc = p.proc.poll()
                (reply,) = read_messages(s, 1)
            log = p.output()
    finally:
        up.stop()
    assert (reply.seqid, reply.type) == (42, 2)
    assert rc == 0, (rc, log[-2000:])
    assert log.count("ignored: the proxy is draining to stop") == 1, log[-3000:]


def test_calls_cut_by_the_drain_deadline_are_answered_and_not_blamed_on_the_client(tmp_path):
    """SIGTERM with a 3 s call in flight and drain_timeout 1s: at the deadline the client hears
    "may have run: the proxy shut down before its reply (drain_timeout 1s passed)" with its
    seqid, not a bare close, and the call's span says so (outcome may_have_run), not
    `client_gone` ("the client closed its connection"), which blamed the client (found by a
    trace-truth hunt)."""
    up = ThriftServer()
    port = free_port()
    path = tmp_path / "spans.jsonl"
    text = f"""drain_timeout: 1s
tracing: {{exporter: jsonl, path: {path}, sample_ratio: 1.0}}
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:{port}
    routes:
      - cluster: up
clusters:
  - name: up
    endpoints: [{up.address}]
"""
    errors = []
    try:
        with ProxyProcess(text, [port]) as p:
            def slow_call() -> None:
                try:
                    with client(port) as c:
                        c.sleep(3000)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

            t = threading.Thread(target=slow_call)
            t.start()
            wait_for(lambda: up.handler.calls == 1, what="the slow call to reach the upstream")
            p.proc.send_signal(signal.SIGTERM)
            t.join(10)
            assert p.proc.wait(10) == 0, p.output()
    finally:
        up.stop()
    assert len(errors) == 1 and isinstance(errors[0], TApplicationException), errors
    assert errors[0].message == ("thrift-sidecar: may have run: the proxy shut down before its reply "
                                 "(drain_timeout 1s passed)")
    server = [s for line in path.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
              for ss in rs["scopeSpans"] for s in ss["spans"] if s["kind"] == 2]
    assert len(server) == 1
    attrs = {a["key"]: a["value"] for a in server[0]["attributes"]}
    assert attrs["sidecar.outcome"] == {"stringValue": "may_have_run"}
    assert "drain_timeout 1s passed" in server[0]["status"]["message"]


def test_requests_held_back_at_max_inflight_are_answered_at_the_drain_deadline_and_never_started():
    """max_inflight 2, five 3 s calls pipelined, SIGTERM's drain (drain_timeout 1s) ends with
    them open: the two started ones hear "may have run", the three held back "not sent", each
    with its seqid, and none of those three reaches the upstream. Before: answering the first
    two resumed reading, which started the held ones upstream as the proxy stopped, and the
    client got EOF for them."""
    import socket

    from harness import Proxy, app_exception, config_text, read_messages, request_bytes

    up = ThriftServer()
    try:
        with Proxy("drain_timeout: 1s\n" + config_text([up.address])) as p:
            object.__setattr__(p.server.listeners["test"].settings, "max_inflight", 2)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(b"".join(request_bytes("framed", "binary", "sleep", 3000, seqid=i) for i in range(1, 6)))
                wait_for(lambda: up.handler.calls == 2, what="two calls upstream")
                p.loop.call_soon_threadsafe(p.server.request_stop)  # what SIGTERM does
                msgs = read_messages(s, 5, "framed", "binary", timeout=10)
            p.thread.join(10)
    finally:
        up.stop()
    assert [m.seqid for m in msgs] == [1, 2, 3, 4, 5]
    texts = [app_exception(m).message for m in msgs]
    assert texts[:2] == ["thrift-sidecar: may have run: the proxy shut down before its reply "
                         "(drain_timeout 1s passed)"] * 2, texts
    assert texts[2:] == ["thrift-sidecar: not sent: the proxy shut down before it handled this request "
                         "(drain_timeout 1s passed)"] * 3, texts
    time.sleep(0.3)
    assert up.handler.calls == 2  # the held ones never started


def test_admin_endpoints_over_real_http():
    up = ThriftServer()
    dead = ThriftServer()
    dead.stop()
    port, admin, health = free_ports(3)
    text = _config(port, f"{up.address}, {dead.address}", extra="")
    # round_robin: the dead endpoint is certainly picked within 10 calls (least_request, the
    # default, breaks the tie between two idle endpoints at random)
    text = text.replace("    endpoints:", "    circuit_breaker: {consecutive_failures: 1, open_for: 30s}\n"
                                         "    load_balancer: round_robin\n    endpoints:")
    text = f"admin: {{listen: 127.0.0.1:{admin}, health_listen: 127.0.0.1:{health}}}\n" + text
    try:
        with ProxyProcess(text, [port, admin, health]) as p:
            with client(port) as c:
                for i in range(10):
                    c.lookup(f"x{i}")
            base = f"http://127.0.0.1:{admin}"
            assert _get(base + "/live") == (200, "live\n")
            assert _get(base + "/ready")[0] == 200
            status, body = _get(base + "/stats")
            stats = json.loads(body)
            eps = {e["address"]: e for e in stats["clusters"]["up"]["endpoints"]}
            assert eps[dead.address]["breaker"] == "open"  # a breaker state change
            assert eps[up.address]["breaker"] == "closed"
            assert stats["listeners"]["test"]["calls"] == 10
            assert "retry_budget" in stats["clusters"]["up"] and "pools" in eps[up.address]
            status, body = _get(base + "/config")
            cfg = json.loads(body)
            assert cfg["listeners"][0]["max_frame_size"] and cfg["clusters"][0]["pool"]["max_connections"] == 64

            def lookups_in_metrics() -> float:
                status, body = _get(base + "/metrics")
                fams = {f.name: f for f in text_string_to_metric_families(body)}
                calls = fams["thrift_sidecar_calls"]
                return sum(s.value for s in calls.samples if s.name == "thrift_sidecar_calls_total"
                           and s.labels.get("method") == "lookup")

            # a call is recorded once the client has its reply, which may be just after the client
            # returned: wait for the 10th, then check there are exactly 10
            wait_for(lambda: lookups_in_metrics() >= 10, timeout=5, what="10 lookups in /metrics")
            assert lookups_in_metrics() == 10
            # the health listener serves only /ready and /live
            assert _get(f"http://127.0.0.1:{health}/ready")[0] == 200
            assert _get(f"http://127.0.0.1:{health}/live")[0] == 200
            assert _get(f"http://127.0.0.1:{health}/stats")[0] == 404
            # access log: one structured line per call with hop timings

            def access_lines() -> list[dict]:
                lines = [json.loads(line) for line in p.output().splitlines() if line.startswith("{")]
                return [line for line in lines if line.get("logger") == "proxy.access"]

            wait_for(lambda: len(access_lines()) >= 10, timeout=5, what="10 access-log lines")
            access = access_lines()
            assert len(access) == 10
            assert {"read_request_ms", "service_time_ms", "write_response_ms", "endpoint"} <= access[0].keys()
    finally:
        up.stop()


def test_a_malformed_admin_request_is_answered_400_and_logged_in_one_thinned_line():
    """A port scanner's garbage is the client's fault: no ERROR with a traceback per request."""
    import socket

    up = ThriftServer()
    port, admin = free_ports(2)
    try:
        with ProxyProcess(_config(port, up.address, admin_port=admin), [port, admin]) as p:
            bad = b"GET /stats HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", admin), timeout=5) as s:
                    s.sendall(bad)
                    assert s.recv(64).startswith(b"HTTP/1.0 400 ")
            assert _get(f"http://127.0.0.1:{admin}/live") == (200, "live\n")  # still serving
            wait_for(lambda: "bad HTTP request" in p.output(), timeout=5, what="the warning")
            lines = [json.loads(line) for line in p.output().splitlines() if line.startswith("{")]
            bad_lines = [line for line in lines if "bad HTTP request" in line["msg"]]
            assert len(bad_lines) == 1, bad_lines  # 5 requests, one line within 10 s
            assert bad_lines[0]["level"] == "warning" and "Content-Length" in bad_lines[0]["msg"]
            assert not [line for line in lines if line["level"] == "error" or "exc" in line]
    finally:
        up.stop()


def test_hot_path_debug_logging_is_guarded(monkeypatch):
    """With debug off, nothing on the call path formats its arguments; with it on, it does."""
    from harness import Proxy, config_text
    from proxy.calls import Attempt, Call

    formatted = [0]
    real_call_repr, real_attempt_repr = Call.__repr__, Attempt.__repr__

    def counting(real):
        def rep(self):
            formatted[0] += 1
            return real(self)
        return rep

    monkeypatch.setattr(Call, "__repr__", counting(real_call_repr))
    monkeypatch.setattr(Attempt, "__repr__", counting(real_attempt_repr))
    proxy_log = logging.getLogger("proxy")
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address])) as p:
            proxy_log.setLevel(logging.INFO)
            with client(p.port()) as c:
                for _ in range(50):
                    c.ping()
            assert formatted[0] == 0
            proxy_log.setLevel(logging.DEBUG)
            handler = logging.NullHandler()
            proxy_log.addHandler(handler)
            try:
                with client(p.port()) as c:
                    for _ in range(5):
                        c.ping()
            finally:
                proxy_log.removeHandler(handler)
                proxy_log.setLevel(logging.NOTSET)
            assert formatted[0] >= 5  # the same lines do format once debug is on
    finally:
        up.stop()
