"""A real Jaeger for end-to-end tests: one per test session, on free loopback ports.

    from jaeger import jaeger_server        # in a test module: the fixture is then available

    def test_something(jaeger_server):
        jaeger_server.otlp_grpc             # "127.0.0.1:PORT"  (OTLP/gRPC receiver)
        jaeger_server.otlp_http             # "127.0.0.1:PORT"  (OTLP/HTTP, POST /v1/traces)
        jaeger_server.query_url             # "http://127.0.0.1:PORT"  (GET /api/traces, /api/services)
        jaeger_server.wait_for_spans("svc", 40)   # Jaeger's traces of svc, once it holds 40 spans

Started by the project's own scripts (`tools/jaeger/run.sh --background PIDFILE`, which builds the
binary once into the cache via `tools/jaeger/build.sh`) and stopped with `tools/jaeger/stop.sh
PIDFILE`. Free ports are picked so that it never collides with a Jaeger a developer runs on the
default ports, nor with another test run. Modules that import the fixture share one Jaeger (the
session fixture is reference-counted across them; the last user stops it). Outside pytest:
`start_jaeger(dir)` and `Jaeger.stop()`.

A cold build of the binary takes minutes (the Makefile builds it before the tests); if it cannot
be built here (no Go), the tests that need it are skipped — or fail when `CI` is set.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools" / "jaeger"
BUILD_TIMEOUT = 1800  # seconds: a cold build is ~5.5 min on 2 cores

__all__ = ["Jaeger", "JaegerUnavailable", "start_jaeger", "jaeger_server"]


class JaegerUnavailable(Exception):
    """The binary could not be built or Jaeger did not start."""


@dataclass
class Jaeger:
    pid: int
    pidfile: Path
    log: Path
    otlp_grpc: str
    otlp_http: str
    query_http: str
    query_grpc: str

    @property
    def query_url(self) -> str:
        return f"http://{self.query_http}"

    def get(self, path: str, **params) -> dict:
        url = f"{self.query_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)

    def services(self) -> list[str]:
        return self.get("/api/services").get("data") or []

    def traces(self, service: str, limit: int = 1000, lookback_s: int = 3600) -> list[dict]:
        end = int(time.time() * 1e6)
        return self.get("/api/traces", service=service, limit=limit, start=end - lookback_s * 1_000_000,
                        end=end).get("data") or []

    def trace(self, trace_id: str) -> dict:
        data = self.get(f"/api/traces/{trace_id}").get("data") or []
        return data[0] if data else {}

    def wait_for_spans(self, service: str, count: int, timeout: float = 30.0) -> list[dict]:
        """The traces of `service` once they hold at least `count` spans (else AssertionError)."""
        deadline = time.monotonic() + timeout
        while True:
            traces = self.traces(service)
            n = sum(len(t.get("spans") or ()) for t in traces)
            if n >= count:
                return traces
            if time.monotonic() > deadline:
                raise AssertionError(f"Jaeger holds {n} spans of {service}, expected {count} "
                                     f"(log: {self.log})")
            time.sleep(0.2)

    def stop(self) -> None:
        subprocess.run([str(TOOLS / "stop.sh"), str(self.pidfile)], capture_output=True, timeout=30)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _binary() -> str:
    if os.environ.get("JAEGER_BIN"):
        return os.environ["JAEGER_BIN"]
    try:
        r = subprocess.run([str(TOOLS / "build.sh")], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise JaegerUnavailable(f"tools/jaeger/build.sh: {e}") from e
    if r.returncode != 0 or not r.stdout.strip():
        raise JaegerUnavailable(f"tools/jaeger/build.sh failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return r.stdout.strip().splitlines()[-1]


def start_jaeger(workdir: Path, tries: int = 3) -> Jaeger:
    """Build (once, cached) and start a Jaeger on free loopback ports; returns when it answers."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    binary = _binary()
    last = ""
    for n in range(tries):
        grpc, http, query, query_grpc = (f"127.0.0.1:{p}" for p in _free_ports(4))
        pidfile = workdir / f"jaeger-{n}.pid"
        log = workdir / f"jaeger-{n}.log"
        env = dict(os.environ, JAEGER_BIN=binary, JAEGER_OTLP_GRPC_ENDPOINT=grpc, JAEGER_OTLP_HTTP_ENDPOINT=http,
                   JAEGER_QUERY_HTTP_ENDPOINT=query, JAEGER_QUERY_GRPC_ENDPOINT=query_grpc,
                   JAEGER_LOG_FILE=str(log), JAEGER_LOG_LEVEL="warn")
        r = subprocess.run([str(TOOLS / "run.sh"), "--background", str(pidfile)], capture_output=True, text=True,
                           env=env, timeout=120)
        if r.returncode == 0:
            values = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
            return Jaeger(int(values["JAEGER_PID"]), pidfile, log, values["JAEGER_OTLP_GRPC_ENDPOINT"],
                          values["JAEGER_OTLP_HTTP_ENDPOINT"], values["JAEGER_QUERY_HTTP_ENDPOINT"],
                          values["JAEGER_QUERY_GRPC_ENDPOINT"])
        last = r.stderr.strip()[-1500:]  # most likely a port taken between picking and binding: retry
    raise JaegerUnavailable(f"tools/jaeger/run.sh failed {tries} times: {last}")


_shared: Jaeger | None = None
_users = 0


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None


atexit.register(_stop_shared)  # also when the session is interrupted before fixture teardown


@pytest.fixture(scope="session")
def jaeger_server(tmp_path_factory):
    """A running Jaeger (see the module docstring); shared by every module that imports this."""
    global _shared, _users
    if _shared is None:
        try:
            _shared = start_jaeger(tmp_path_factory.mktemp("jaeger"))
        except JaegerUnavailable as e:
            if os.environ.get("CI"):
                pytest.fail(f"real Jaeger unavailable: {e}")
            pytest.skip(f"real Jaeger unavailable: {e}")
    _users += 1
    try:
        yield _shared
    finally:
        _users -= 1
        if _users == 0:
            _stop_shared()
