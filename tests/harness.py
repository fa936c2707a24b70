"""Real parts for tests: Apache Thrift servers and clients generated from tests/idl, and the proxy.

- `ThriftServer`: a generated TestService (+ AdminService when multiplexed) on
  127.0.0.1, any framing × protocol, one thread per connection; it can be
  stopped and restarted on the same port, and can close idle connections.
- `client(...)`: a generated client over a real socket.
- `Proxy`: the sidecar in a thread with its own uvloop loop (in-process, so
  tests can inspect it), or `ProxyProcess`: `python -m proxy run -c FILE`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEN = ROOT / "tests" / "gen"
if str(GEN) not in sys.path:
    sys.path.insert(0, str(GEN))

from sidecar_test import AdminService, TestService  # noqa: E402
from sidecar_test.ttypes import Color, Everything, Inner, NotFound, Unavailable, User  # noqa: E402
from thrift.protocol import (  # noqa: E402
    TBinaryProtocol,
    TCompactProtocol,
    THeaderProtocol,
    TMultiplexedProtocol,
)
from thrift.TMultiplexedProcessor import TMultiplexedProcessor  # noqa: E402
from thrift.transport import THeaderTransport, TSocket, TTransport  # noqa: E402

FRAMINGS = ("framed", "buffered", "header")
PROTOCOLS = ("binary", "compact")
HEADER_TYPES = [THeaderTransport.THeaderClientType.HEADERS,
                THeaderTransport.THeaderClientType.FRAMED_BINARY,
                THeaderTransport.THeaderClientType.UNFRAMED_BINARY,
                THeaderTransport.THeaderClientType.FRAMED_COMPACT,
                THeaderTransport.THeaderClientType.UNFRAMED_COMPACT]


def proc_status(pid: int, key: str) -> int:
    """A /proc/PID/status field in KiB (VmRSS, VmHWM): the proxy's memory, measured from outside."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> int:
    """Start the process's peak RSS (VmHWM) afresh and return its RSS now, in KiB: the base to
    measure a later VmHWM against. A VmHWM left from before (start-up, an earlier test) would
    otherwise count as growth once the RSS fell below it. Where the kernel refuses the reset
    (clear_refs needs Linux 4.0 and the process's owner), the old peak is the base: only growth
    past it counts."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return proc_status(pid, "VmHWM")
    return proc_status(pid, "VmRSS")


def turns_while(make_awaitable) -> tuple:
    """Run `make_awaitable()` on a fresh asyncio loop beside a task that counts its own turns:
    (the result, the count). The counter runs once before the awaitable starts, so 1 means it
    never let other work run."""

    async def main():
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        result = await make_awaitable()
        done = True
        await t
        return result, ticks

    return asyncio.run(main())


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def free_port() -> int:
    """One free port. For several at once use `free_ports(n)`: calls in a row may repeat a port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_window_client(port: int, rcvbuf: int = 64 * 1024) -> socket.socket:
    """A raw client socket to the proxy on 127.0.0.1:`port` whose receive buffer is set to
    `rcvbuf` before it connects (so no autotuning): a large reply backs up in the proxy's
    kernel until the test reads it, and the proxy's backpressure and ack tracking show."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    return s


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are chosen, so none repeats."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:`port`. A probe that connected to itself
    (TCP simultaneous open: the kernel gave it the very port it dials while nobody listens
    there yet) does not count."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as probe:
            return probe.getsockname() != probe.getpeername()
    except OSError:
        return False


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `cond` every 20 ms until it holds; fail after `timeout` seconds (generous: these
    machines are busy, and a condition that never holds still fails)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def make_users(count: int) -> list:
    return [User(id=i, username=f"user{i}", email=f"user{i}@example.com", first_name=f"First{i}",
                 last_name=f"Last{i}", is_staff=i % 7 == 0, date_joined=1_600_000_000 + i,
                 attrs={"team": f"t{i % 13}", "tz": "UTC"}) for i in range(count)]


def everything() -> Everything:
    return Everything(
        b=True, i8v=-8, i16v=-1600, i32v=2_000_000_000, i64v=-(2 ** 62), d=3.25, s="héllo ✓",
        bin=bytes(range(256)), strs=["a", "", "c"], ints={1, 2, 3}, inners={"x": Inner(n=1, label="one")},
        inner=Inner(n=2, label="two", values=[1, -2, 3]), color=Color.BLUE, nested=[[1], [], [2, 3]],
        maybe=Inner(n=3, label="three"), deep={7: [Inner(n=4, label="four")]}, doubles=[0.5, -1e300],
        tags={"t1", "t2"})


class Handler:
    """TestService + AdminService; thread-safe counters for at-most-once checks."""

    def __init__(self, name: str = "upstream") -> None:
        self.name = name
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.events: list[str] = []
        self.calls = 0
        self.sleep_ms = 0
        self.drop_after: set[str] = set()  # methods that run, then lose the connection unanswered
        self.throw: set[str] = set()       # methods that raise (a TApplicationException reply)
        self.local = threading.local()     # .sock: the connection the current call came on

    def _hit(self, method: str = "") -> None:
        with self.lock:
            self.calls += 1
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1000)
        if method in self.throw:
            raise RuntimeError(f"{method} is failing on purpose")

    def _maybe_drop(self, method: str) -> None:
        if method in self.drop_after:
            sock = getattr(self.local, "sock", None)
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionAbortedError("dropped after reading the request")

    def ping(self):
        self._hit("ping")

    def roundtrip(self, e):
        self._hit()
        return e

    def echo(self, payload):
        self._hit()
        return payload

    def get_users(self, count, sleep_ms):
        self._hit()
        if sleep_ms:
            time.sleep(sleep_ms / 1000)
        return make_users(count)

    def lookup(self, key):
        self._hit("lookup")
        self._maybe_drop("lookup")
        if key == "missing":
            raise NotFound(what=key, code=404)
        if key == "down":
            raise Unavailable(reason="maintenance")
        return f"{self.name}:{key}"

    def sleep(self, ms):
        self._hit()
        time.sleep(ms / 1000)
        return ms

    def log_event(self, event):
        self._hit()
        with self.lock:
            self.events.append(event)
            self.counts["event:" + event] = self.counts.get("event:" + event, 0) + 1

    def incr(self, key):
        self._hit("incr")
        with self.lock:
            n = self.counts.get(key, 0) + 1
            self.counts[key] = n
        self._maybe_drop("incr")
        return n

    def count(self, key):
        self._hit()
        with self.lock:
            return self.counts.get(key, 0) + self.counts.get("event:" + key, 0)

    # AdminService
    def version(self):
        return self.name

    def add(self, a, b):
        return a + b


def _protocol_factory(framing: str, protocol: str):
    if framing in ("header", "framed_header"):
        return THeaderProtocol.THeaderProtocolFactory(
            HEADER_TYPES, default_protocol=2 if protocol == "compact" else 0)
    if protocol == "compact":
        return TCompactProtocol.TCompactProtocolAcceleratedFactory()
    if protocol == "binary_nonstrict":
        return TBinaryProtocol.TBinaryProtocolFactory(strictRead=False, strictWrite=False)
    return TBinaryProtocol.TBinaryProtocolAcceleratedFactory()


def _wrap_transport(framing: str, trans):
    if framing in ("framed", "framed_header"):
        return TTransport.TFramedTransport(trans)
    if framing == "buffered":
        return TTransport.TBufferedTransport(trans)
    return trans  # THeaderProtocol wraps it


class ThriftServer:
    """A real generated Thrift server on 127.0.0.1, one thread per connection."""

    def __init__(self, framing: str = "framed", protocol: str = "binary", multiplexed: bool = False,
                 handler: Handler | None = None, port: int = 0, idle_close: float | None = None,
                 name: str = "upstream") -> None:
        self.framing = framing
        self.protocol = protocol
        self.handler = handler or Handler(name)
        self.multiplexed = multiplexed
        self.idle_close = idle_close
        self.port = port
        self.connections = 0           # accepted so far
        self._lsock: socket.socket | None = None
        self._held: socket.socket | None = None  # the port while down (stop(hold_port=True))
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._running = False
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _processor(self):
        ts = TestService.Processor(self.handler)
        if not self.multiplexed:
            return ts
        mp = TMultiplexedProcessor()
        mp.registerProcessor("TestService", ts)
        mp.registerProcessor("AdminService", AdminService.Processor(self.handler))
        return mp

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # (beside a stop(hold_port=True)'s socket)
        s.bind(("127.0.0.1", self.port))
        s.listen(512)
        self.port = s.getsockname()[1]
        self._lsock = s
        if self._held is not None:  # listening again: the port is ours without it
            self._held.close()
            self._held = None
        self._running = True
        threading.Thread(target=self._accept_loop, args=(s,), daemon=True).start()

    def _accept_loop(self, lsock: socket.socket) -> None:
        while self._running:
            try:
                c, _ = lsock.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(c)
                self.connections += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        ts = TSocket.TSocket()
        ts.setHandle(c)
        trans = _wrap_transport(self.framing, ts)
        prot = _protocol_factory(self.framing, self.protocol).getProtocol(trans)
        processor = self._processor()
        self.handler.local.sock = c
        try:
            while True:
                if self.idle_close is not None:
                    c.settimeout(self.idle_close)
                    try:
                        if not c.recv(1, socket.MSG_PEEK):
                            break
                    except (socket.timeout, TimeoutError):
                        break
                    c.settimeout(None)
                processor.process(prot, prot)
        except Exception:
            pass
        finally:
            with self._lock:
                self._conns.discard(c)
            try:
                c.close()
            except OSError:
                pass

    def stop(self, hold_port: bool = False) -> None:
        """Close the listener and every connection (the upstream is down).

        `hold_port`: the port stays bound (a socket that does not listen: connecting to it is
        refused, as to a closed port) until start() listens on it again. Without it, a
        connection's own end could take the freed port meanwhile (an ephemeral port, the
        proxy's or a client's, even the proxy dialling this port), and start() could not bind
        it: a restart on the same port fails now and then."""
        self._running = False
        if hold_port and self._lsock is not None and self._held is None:
            held = socket.socket()
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            held.bind(("127.0.0.1", self.port))  # (before the listener closes: no moment unbound)
            self._held = held
        elif not hold_port and self._held is not None:  # (down for good: the port goes too)
            self._held.close()
            self._held = None
        if self._lsock is not None:
            try:  # wakes the thread blocked in accept(); close() alone leaves it listening
                self._lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._lsock.close()
            self._lsock = None
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def restart(self) -> None:
        self.stop()
        self.start()


class Client:
    """A generated client over a real socket (context manager)."""

    def __init__(self, port: int, framing: str = "framed", protocol: str = "binary",
                 service: str | None = None, host: str = "127.0.0.1", timeout: float = 10.0,
                 headers: dict[str, str] | None = None) -> None:
        self.sock = TSocket.TSocket(host, port)
        self.sock.setTimeout(timeout * 1000)
        self.trans = _wrap_transport(framing, self.sock)
        if framing in ("header", "framed_header"):
            prot = THeaderProtocol.THeaderProtocol(self.trans, HEADER_TYPES,
                                                   default_protocol=2 if protocol == "compact" else 0)
            for k, v in (headers or {}).items():
                prot.set_header(k.encode(), v.encode())
            self.header_protocol = prot
        else:
            prot = _protocol_factory(framing, protocol).getProtocol(self.trans)
            self.header_protocol = None
        self.protocol = prot
        svc = service or "TestService"
        if service is not None:
            prot = TMultiplexedProtocol.TMultiplexedProtocol(prot, service)
        cls = AdminService.Client if svc == "AdminService" else TestService.Client
        self.client = cls(prot)
        self.trans.open()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def close(self) -> None:
        self.trans.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RawUpstream:
    """A hand-written upstream on a free port: each accepted connection is served by
    `_one(conn)` in its own thread (which may leave it open); `connections` counts accepts;
    `close()` closes the listener and every connection."""

    def __init__(self) -> None:
        self.calls = 0
        self.connections = 0
        self.conns: list[socket.socket] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self.conns.append(c)
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        raise NotImplementedError

    def requests(self, c: socket.socket, framing: str = "framed", protocol: str = "binary"):
        """(name, seqid) of each request read from `c`, until it closes."""
        from proxy.codec import Decoder, Framing, Protocol

        dec = Decoder(Framing(framing), Protocol(protocol))
        while True:
            call = dec.next_message()
            if call is None:
                try:
                    data = c.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                dec.feed(data)
                continue
            self.calls += 1
            yield call.name.encode(), call.seqid

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.close()


def client(port: int, framing: str = "framed", protocol: str = "binary", **kw) -> Client:
    return Client(port, framing, protocol, **kw)


# -- the proxy -------------------------------------------------------------------------------


def config_text(upstreams: list[str], listen_port: int = 0, transport: str = "framed",
                protocol: str = "binary", cluster_transport: str | None = None, extra_listener: str = "",
                extra_cluster: str = "", extra_top: str = "", lb: str = "round_robin") -> str:
    eps = ", ".join(upstreams)
    ct = f"\n    transport: {cluster_transport}" if cluster_transport else ""
    return f"""{extra_top}
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:{listen_port}
    transport: {transport}
    protocol: {protocol}{extra_listener}
    routes:
      - cluster: up
clusters:
  - name: up
    endpoints: [{eps}]
    load_balancer: {lb}{ct}{extra_cluster}
"""


class Proxy:
    """The sidecar in a background thread with its own uvloop loop (in-process)."""

    def __init__(self, text: str, **server_kwargs) -> None:
        """`server_kwargs` go to Server (e.g. `resolver=` for DNS discovery)."""
        from proxy import config as cfgmod
        from proxy.server import Server
        import uvloop

        self.config = cfgmod.loads(text, "test.yaml")
        self.loop = uvloop.new_event_loop()
        self.server = None
        started = threading.Event()
        self._error = None

        def run() -> None:
            asyncio.set_event_loop(self.loop)

            async def main() -> None:
                try:
                    self.server = Server(self.config, self.loop, **server_kwargs)
                    await self.server.start()
                except BaseException as e:  # pragma: no cover - surfaced below
                    self._error = e
                    started.set()
                    return
                started.set()
                await self.server.wait_stopped()
                await self.server.close()

            self.loop.run_until_complete(main())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)
        if self._error:
            raise self._error

    def port(self, listener: str = "test") -> int:
        return self.server.address(listener)[1]

    def call(self, fn, *args):
        """Run fn(*args) on the proxy's loop and return its result."""
        fut = asyncio.run_coroutine_threadsafe(_as_coro(fn, *args), self.loop)
        return fut.result(10)

    def stop(self) -> None:
        if self.server is not None:
            self.loop.call_soon_threadsafe(self.server._stop.set)
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


async def _as_coro(fn, *args):
    return fn(*args)


class ProxyProcess:
    """`python -m proxy run -c FILE` as a new user would run it."""

    def __init__(self, text: str, ports: list[int], env: dict | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="sidecar-")
        self.path = Path(self.dir) / "sidecar.yaml"
        self.path.write_text(text)
        self.log = open(Path(self.dir) / "sidecar.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy", "run", "-c", str(self.path)],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 15
        for port in ports:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"proxy exited: {self.output()}")
                if listening(port):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"proxy did not listen on {port}: {self.output()}")
                time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self, sig=15, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -- raw wire helpers (seqid-level checks) ----------------------------------------------------

STRICT_REPLY = 0x80010002  # strict binary version | REPLY


def reply_bytes(name: bytes, seqid: int, payload: bytes = b"raw") -> bytes:
    """A framed strict-binary REPLY whose result is field 0 (a string)."""
    body = (struct.pack("!Ii", STRICT_REPLY, len(name)) + name + struct.pack("!i", seqid)
            + b"\x0b\x00\x00" + struct.pack("!i", len(payload)) + payload + b"\x00")
    return struct.pack("!i", len(body)) + body


def request_bytes(framing: str, protocol: str, method: str, *args, seqid: int = 1,
                  service: str | None = None, idl: str | None = None) -> bytes:
    """The exact bytes a generated client writes for `method(*args)`: `service`'s client,
    multiplexed; `idl` names the service whose client writes it unmultiplexed (default
    TestService)."""
    buf = TTransport.TMemoryBuffer()
    if framing in ("header", "framed_header"):
        trans = TTransport.TFramedTransport(buf) if framing == "framed_header" else buf
        prot = THeaderProtocol.THeaderProtocol(trans, HEADER_TYPES, default_protocol=2 if protocol == "compact" else 0)
    else:
        trans = _wrap_transport(framing, buf)
        prot = _protocol_factory(framing, protocol).getProtocol(trans)
    if service is not None:
        prot = TMultiplexedProtocol.TMultiplexedProtocol(prot, service)
    cls = AdminService.Client if (service or idl) == "AdminService" else TestService.Client
    c = cls(prot)
    c._seqid = seqid
    getattr(c, "send_" + method)(*args)
    return buf.getvalue()


def read_messages(sock: socket.socket, count: int, framing=None, protocol=None, timeout: float = 10.0,
                  max_size: int | None = None):
    """Read `count` messages from a raw socket with the proxy's own decoder (`max_size`: its
    limit, if not the default max frame size)."""
    from proxy.codec import Decoder, Framing, Protocol

    dec = Decoder(Framing(framing) if framing else None, Protocol(protocol) if protocol else None,
                  *(() if max_size is None else (max_size,)))
    out = []
    sock.settimeout(timeout)
    while len(out) < count:
        m = dec.next_message()
        if m is not None:
            out.append(m)
            continue
        data = sock.recv(1 << 20)
        if not data:
            raise EOFError(f"closed after {len(out)} of {count} messages")
        dec.feed(data)
    return out


def oneway_as_call_then_call(port: int):
    """Send log_event as a CALL (as Apache Thrift Go does for oneway methods), then count() on the
    same connection; return the one reply. A proxy that waits for log_event's reply blocks here."""
    from proxy.codec import MessageType

    call_bytes = bytearray(request_bytes("framed", "binary", "log_event", "as-call", seqid=3))
    call_bytes[4 + 3] = MessageType.CALL  # the type byte of the strict binary head
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(bytes(call_bytes) + request_bytes("framed", "binary", "count", "as-call", seqid=4))
        (reply,) = read_messages(s, 1, timeout=5)
    return reply


def app_exception(msg):
    """Decode the TApplicationException carried by an EXCEPTION message."""
    from thrift.Thrift import TApplicationException

    payload = bytes(msg.payload())
    prot_cls = TCompactProtocol.TCompactProtocol if msg.protocol.value == "compact" else TBinaryProtocol.TBinaryProtocol
    p = prot_cls(TTransport.TMemoryBuffer(payload))
    p.readMessageBegin()
    x = TApplicationException()
    x.read(p)
    return x
