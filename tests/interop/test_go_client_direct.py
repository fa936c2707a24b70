"""The Go interop client (tests/interop/go) against a plain Python Thrift server.

No proxy here: this checks the Go client itself (and that Go and Python agree
on every type of the test IDL, over framed/buffered/header x binary/compact,
plain and multiplexed), so that the proxy tests that use the client can trust
it. The Go binary comes from $SIDECAR_GO_CLIENT (`make go-client`), else it is
built with tests/interop/go/build.sh into a temporary cache.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IDL = ROOT / "tests" / "idl" / "sidecar_test.thrift"
BUILD_SH = ROOT / "tests" / "interop" / "go" / "build.sh"


def _gen_dir() -> Path:
    """tests/gen (the Makefile's `gen`), else code generated into a temp dir."""
    gen = ROOT / "tests" / "gen"
    if (gen / "sidecar_test" / "ttypes.py").exists():
        return gen
    if shutil.which("thrift") is None:
        pytest.skip("no tests/gen and no thrift compiler", allow_module_level=True)
    tmp = Path(tempfile.mkdtemp(prefix="sidecar-gen-py-"))
    subprocess.run(["thrift", "--gen", "py", "-out", str(tmp), str(IDL)], check=True)
    return tmp


_GEN = str(_gen_dir())
if _GEN not in sys.path:
    sys.path.insert(0, _GEN)

from sidecar_test import AdminService, TestService  # noqa: E402
from sidecar_test.ttypes import NotFound, Unavailable, User  # noqa: E402
from thrift.protocol import TBinaryProtocol, TCompactProtocol  # noqa: E402
from thrift.protocol.THeaderProtocol import THeaderProtocolFactory  # noqa: E402
from thrift.TMultiplexedProcessor import TMultiplexedProcessor  # noqa: E402
from thrift.transport import TSocket, TTransport  # noqa: E402

log = logging.getLogger(__name__)

TRANSPORTS = ["framed", "buffered", "header"]
PROTOCOLS = ["binary", "compact"]

# Keys every output line of the Go client has.
LINE_KEYS = {"call", "ok", "result", "error_type", "app_error_type", "message"}


# --- a minimal Python server ---------------------------------------------------


class Handler:
    """TestService + AdminService. ping_mode makes ping fail on purpose:
    "app_error" -> an undeclared exception (TApplicationException
    INTERNAL_ERROR on the wire), "drop_second" -> the server closes the
    connection instead of answering the second ping of the first connection."""

    def __init__(self, ping_mode: str | None = None):
        self.ping_mode = ping_mode
        self.lock = threading.Lock()
        self.incrs: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()
        self.pings = 0

    # TestService
    def ping(self):
        with self.lock:
            self.pings += 1
            n = self.pings
        if self.ping_mode == "app_error":
            raise RuntimeError("ping fails on purpose")
        if self.ping_mode == "drop_second" and n == 2:
            raise TTransport.TTransportException(TTransport.TTransportException.UNKNOWN, "drop")

    def roundtrip(self, e):
        return e

    def echo(self, payload):
        return payload

    def get_users(self, count, sleep_ms):
        if sleep_ms:
            time.sleep(sleep_ms / 1000)
        return [
            User(
                id=i + 1,
                username=f"user{i + 1:06d}",
                email=f"user{i + 1:06d}@example.com",
                first_name="Ada",
                last_name="Lovelace",
                is_staff=i % 17 == 0,
                date_joined=1500000000 + i,
                attrs={"team": f"team-{i % 40:02d}"},
            )
            for i in range(count)
        ]

    def lookup(self, key):
        if key == "missing":
            raise NotFound(what=key, code=404)
        if key == "down":
            raise Unavailable(reason="backend down")
        return f"value-of-{key}"

    def sleep(self, ms):
        time.sleep(ms / 1000)
        return ms

    def log_event(self, event):
        with self.lock:
            self.events[event] += 1

    def incr(self, key):
        with self.lock:
            self.incrs[key] += 1
            return self.incrs[key]

    def count(self, key):
        with self.lock:
            return self.incrs[key] + self.events[key]

    # AdminService
    def version(self):
        return "python-test-server"

    def add(self, a, b):
        return a + b


class Server:
    """A thread per connection on 127.0.0.1:<ephemeral>."""

    def __init__(self, transport: str, protocol: str, multiplex: bool, handler: Handler):
        self.transport, self.protocol, self.handler = transport, protocol, handler
        if multiplex:
            self.processor = TMultiplexedProcessor()
            self.processor.registerProcessor("TestService", TestService.Processor(handler))
            self.processor.registerProcessor("AdminService", AdminService.Processor(handler))
        else:
            self.processor = TestService.Processor(handler)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._accept_loop, daemon=True)
        self.thread.start()

    def _accept_loop(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _protocol(self, conn):
        sock = TSocket.TSocket()
        sock.setHandle(conn)
        if self.transport == "header":
            return THeaderProtocolFactory().getProtocol(sock)
        trans = (
            TTransport.TFramedTransport(sock)
            if self.transport == "framed"
            else TTransport.TBufferedTransport(sock)
        )
        if self.protocol == "compact":
            return TCompactProtocol.TCompactProtocolAccelerated(trans)
        return TBinaryProtocol.TBinaryProtocolAccelerated(trans)

    def _serve(self, conn):
        prot = self._protocol(conn)
        try:
            while True:
                self.processor.process(prot, prot)
        except TTransport.TTransportException:
            pass  # client went away (or the handler dropped the connection)
        except Exception as e:  # noqa: BLE001 - kept for the test to report
            log.exception("test server connection failed")
            self.errors.append(e)
        finally:
            conn.close()

    def close(self):
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close()


# --- fixtures ------------------------------------------------------------------


@pytest.fixture
def make_server():
    servers: list[Server] = []

    def make(transport="framed", protocol="binary", multiplex=False, handler=None):
        s = Server(transport, protocol, multiplex, handler or Handler())
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()
    for s in servers:
        assert not s.errors, f"test server errors: {s.errors!r}"


def run_client(go_client, server, transport, protocol, scenario, *args, expect_rc=0):
    cmd = [
        go_client,
        "-addr", server.addr,
        "-transport", transport,
        "-protocol", protocol,
        "-scenario", scenario,
        "-timeout", "10s",
        *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.strip()]
    detail = f"{' '.join(cmd)}\nrc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == expect_rc, detail
    for line in lines:
        assert LINE_KEYS <= line.keys(), detail
    return lines, detail


# --- tests ---------------------------------------------------------------------


@pytest.mark.parametrize("multiplex", [False, True], ids=["plain", "multiplex"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_basic(go_client, make_server, transport, protocol, multiplex):
    server = make_server(transport, protocol, multiplex)
    args = ["-multiplex"] if multiplex else []
    lines, detail = run_client(go_client, server, transport, protocol, "basic", *args)
    assert all(line["ok"] for line in lines), detail
    calls = [line["call"] for line in lines]
    want = ["ping", "add", "roundtrip", "echo", "get_users"] if multiplex else ["ping", "roundtrip", "echo", "get_users"]
    want += ["lookup(missing)", "lookup(down)", "lookup(x)"]
    assert calls == want, detail
    by_call = {line["call"]: line for line in lines}
    assert by_call["roundtrip"]["result"] is True
    assert by_call["echo"]["result"] == 100 * 1024
    assert by_call["get_users"]["result"] == 100
    assert by_call["lookup(missing)"]["error_type"] == "NotFound"
    assert by_call["lookup(missing)"]["message"] == "missing"
    assert by_call["lookup(down)"]["error_type"] == "Unavailable"
    assert by_call["lookup(down)"]["message"] == "backend down"
    assert by_call["lookup(x)"]["result"] == "value-of-x"
    if multiplex:
        assert by_call["add"]["result"] == 5
    assert all(line["conn"] == 1 for line in lines), detail


@pytest.mark.parametrize("multiplex", [False, True], ids=["plain", "multiplex"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_oneway_then_call(go_client, make_server, transport, protocol, multiplex):
    handler = Handler()
    server = make_server(transport, protocol, multiplex, handler)
    args = ["-multiplex"] if multiplex else []
    lines, detail = run_client(go_client, server, transport, protocol, "oneway_then_call", *args)
    assert [line["call"] for line in lines] == ["log_event", "ping", "count"], detail
    assert all(line["ok"] for line in lines), detail
    event = lines[0]["result"]
    assert event.startswith("go-oneway-"), detail
    # Apache Thrift Go (v0.22) sends a oneway call with message type CALL (1),
    # not ONEWAY (4): a proxy cannot tell from the wire that no reply comes.
    assert lines[0]["wire_message_type"] == 1, detail
    assert lines[2]["result"] == 1, detail  # the oneway event arrived before count()
    assert handler.events == {event: 1}
    assert {line["conn"] for line in lines} == {1}, detail


def test_ping_loop_keeps_going_after_application_errors(go_client, make_server):
    server = make_server(handler=Handler(ping_mode="app_error"))
    lines, detail = run_client(go_client, server, "framed", "binary", "ping_loop", "-count", "3")
    assert [line["iter"] for line in lines] == [1, 2, 3], detail
    for line in lines:
        assert line["ok"] is False, detail
        assert line["error_type"] == "TApplicationException", detail
        assert line["app_error_type"] == 6, detail  # INTERNAL_ERROR
        assert line["conn"] == 1, detail  # the connection stayed usable


def test_ping_loop_reconnects_once_after_transport_error(go_client, make_server):
    server = make_server(handler=Handler(ping_mode="drop_second"))
    lines, detail = run_client(go_client, server, "framed", "binary", "ping_loop", "-count", "4")
    assert [line["call"] for line in lines] == ["ping", "ping", "reconnect", "ping", "ping"], detail
    assert [line["ok"] for line in lines] == [True, False, True, True, True], detail
    assert lines[1]["error_type"] == "TTransportException", detail
    assert [line["conn"] for line in lines] == [1, 1, 2, 2, 2], detail
    assert [line.get("iter") for line in lines] == [1, 2, None, 3, 4], detail


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_errors_scenario_reports_application_exception(go_client, make_server, transport):
    server = make_server(transport, "compact", handler=Handler(ping_mode="app_error"))
    lines, detail = run_client(go_client, server, transport, "compact", "errors")
    assert len(lines) == 1, detail
    line = lines[0]
    assert (line["call"], line["ok"], line["error_type"]) == ("ping", False, "TApplicationException"), detail
    assert line["app_error_type"] == 6, detail
    assert line["message"], detail


def test_errors_scenario_transport_failure_exits_1(go_client, make_server):
    # A server that drops the connection at once: not an expected outcome.
    server = make_server(handler=Handler(ping_mode="drop_second"))
    server.handler.pings = 1  # the next ping is the "second": dropped
    lines, detail = run_client(go_client, server, "framed", "binary", "errors", expect_rc=1)
    assert len(lines) == 1 and lines[0]["error_type"] == "TTransportException", detail


def test_connect_failure_exits_1(go_client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        proc = subprocess.run(
            [go_client, "-addr", f"127.0.0.1:{port}", "-scenario", "errors"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1, proc
    (line,) = [json.loads(s) for s in proc.stdout.splitlines()]
    assert line["call"] == "connect" and line["ok"] is False, line


def test_bad_flags_exit_2(go_client):
    proc = subprocess.run([go_client, "-transport", "http"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
