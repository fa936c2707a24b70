"""Operating the sidecar as a process: reload under load, drain, admin endpoints, logs."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from thrift.Thrift import TApplicationException

from harness import ProxyProcess, ThriftServer, client, free_port


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
            for i in range(20):
                target = (a, "A") if i % 2 else (b, "B")
                text = text_a if target[1] == "A" else text_b
                if i == 10:
                    p.path.write_text(bad)
                    p.proc.send_signal(signal.SIGHUP)
                    time.sleep(0.2)
                p.path.write_text(text)
                p.proc.send_signal(signal.SIGHUP)
                time.sleep(0.25)
                n0 = target[0].handler.calls
                time.sleep(0.15)
                seen[target[1]].append(target[0].handler.calls - n0)
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
    assert all(n > 0 for n in seen["A"]) and all(n > 0 for n in seen["B"]), seen
    assert "reload rejected" in out and "sidecar.yaml:" in out and "clusters[0].endpoints" in out


def test_drain_finishes_started_calls_serves_new_ones_ready_503_exit_0():
    up = ThriftServer()
    up.handler.sleep_ms = 500
    port, admin = free_port(), free_port()
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
            time.sleep(0.15)  # the calls are in flight
            t0 = time.monotonic()
            p.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            assert _get(f"http://127.0.0.1:{admin}/ready")[0] == 503
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


def test_admin_endpoints_over_real_http():
    up = ThriftServer()
    dead = ThriftServer()
    dead.stop()
    port, admin, health = free_port(), free_port(), free_port()
    text = _config(port, f"{up.address}, {dead.address}", extra="")
    text = text.replace("    endpoints:", "    circuit_breaker: {consecutive_failures: 1, open_for: 30s}\n    endpoints:")
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
            status, body = _get(base + "/metrics")
            fams = {f.name: f for f in text_string_to_metric_families(body)}
            calls = fams["thrift_sidecar_calls"]
            total = sum(s.value for s in calls.samples if s.name == "thrift_sidecar_calls_total"
                        and s.labels.get("method") == "lookup")
            assert total == 10
            # the health listener serves only /ready and /live
            assert _get(f"http://127.0.0.1:{health}/ready")[0] == 200
            assert _get(f"http://127.0.0.1:{health}/live")[0] == 200
            assert _get(f"http://127.0.0.1:{health}/stats")[0] == 404
            # access log: one structured line per call with hop timings
            time.sleep(0.2)
            lines = [json.loads(line) for line in p.output().splitlines() if line.startswith("{")]
            access = [line for line in lines if line.get("logger") == "proxy.access"]
            assert len(access) == 10
            assert {"read_request_ms", "service_time_ms", "write_response_ms", "endpoint"} <= access[0].keys()
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
