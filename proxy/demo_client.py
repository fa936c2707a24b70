"""`thrift-sidecar demo-client`: a mix of UserService calls, as an application would make them.

Owns: one round of calls (pings, small `get_users`, a few 5,499-user `get_users` of about 1 MB,
and one deliberately slow-reading client), on a few concurrent connections made with Apache
Thrift's generated client; the round's summary; repeating rounds with `--forever` until SIGTERM.
Leaves to others: the service (`proxy.demo_upstream`), running the whole demo (`proxy.demo`).

    thrift-sidecar demo-client --target 127.0.0.1:9090                 # one round, then exit
    thrift-sidecar demo-client --target sidecar:9090 --forever          # compose / Kubernetes app

The slow reader asks for the 5,499 users through a socket with a small receive buffer
(SO_RCVBUF 16 KiB, set before connecting) and reads its reply 16 KiB at a time, pausing 20 ms
after each: the sidecar's `write_response` hop, which ends only when the client has acknowledged
every byte, is where its time goes. Its summary line names its own address
(`slow reader: 127.0.0.1:PORT ...`), the `network.peer.*` of its SERVER span.

Exit status: 0 when every call of the round succeeded, 1 otherwise; with `--forever`, 0 on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import math
import queue
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

LARGE_COUNT = 5499          # the large call: about 1 MB of users
SLOW_CHUNK = 16 * 1024      # the slow reader reads this much ...
SLOW_PAUSE = 0.020          # ... then pauses this long
SLOW_RCVBUF = 16 * 1024     # its socket's receive buffer
SOCKET_TIMEOUT = 30.0


def parse_target(target: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host, port); ValueError otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{target!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _connect(host: str, port: int, rcvbuf: int | None = None) -> socket.socket:
    last: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if rcvbuf is not None:  # before connect: the window is agreed in the handshake
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(SOCKET_TIMEOUT)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise last or OSError(f"cannot resolve {host}")


def _paced_socket_class():
    from thrift.transport import TSocket, TTransport

    class PacedSocket(TSocket.TSocket):
        """A TSocket that reads at most `chunk` bytes, then pauses `pause` seconds: a slow reader."""

        def __init__(self, sock: socket.socket, chunk: int, pause: float) -> None:
            super().__init__()
            self.setHandle(sock)
            self.chunk, self.pause = chunk, pause
            self.budget = chunk
            self.received = 0

        def read(self, sz: int) -> bytes:
            if self.budget <= 0:
                time.sleep(self.pause)
                self.budget = self.chunk
            data = self.handle.recv(min(sz, self.budget))
            if not data:
                raise TTransport.TTransportException(TTransport.TTransportException.END_OF_FILE,
                                                     "the sidecar closed the connection")
            self.budget -= len(data)
            self.received += len(data)
            return data

    return PacedSocket


class Connection:
    """A generated UserService client on one TCP connection."""

    def __init__(self, host: str, port: int, framing: str, protocol: str, slow: bool = False) -> None:
        from thrift.transport import TSocket

        from proxy.demo_gen.user_service import UserService
        from proxy.demo_upstream import protocol_factory, wrap_transport

        sock = _connect(host, port, SLOW_RCVBUF if slow else None)
        self.sock = sock
        self.local = sock.getsockname()[:2]
        if slow:
            self.tsock = _paced_socket_class()(sock, SLOW_CHUNK, SLOW_PAUSE)
        else:
            self.tsock = TSocket.TSocket()
            self.tsock.setHandle(sock)
        self.trans = wrap_transport(framing, self.tsock)
        self.client = UserService.Client(protocol_factory(framing, protocol).getProtocol(self.trans))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _address(addr: tuple) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Round:
    """What one round of calls did."""

    latencies: dict[str, list[float]] = field(default_factory=dict)   # label → seconds
    failures: dict[str, int] = field(default_factory=dict)            # error kind → count
    slow: str = ""                                                    # the slow reader's summary
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, label: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(label, []).append(seconds)

    def failed(self, label: str, e: BaseException) -> None:
        kind = f"{label}: {type(e).__name__}"
        message = getattr(e, "message", None) or getattr(e, "reason", None) or str(e)
        if message:
            kind += f" ({str(message)[:80]})"
        with self.lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1

    @property
    def calls(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    @property
    def failed_calls(self) -> int:
        return sum(self.failures.values())


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[max(1, math.ceil(p / 100 * len(s))) - 1]


def plan(count: int, large: int, rng: random.Random) -> list[tuple[str, tuple]]:
    """The round's calls: (label, (method, args)); about half pings, half small get_users."""
    calls: list[tuple[str, tuple]] = []
    for _ in range(count):
        if rng.random() < 0.45:
            calls.append(("ping", ("ping", ())))
        else:
            n = rng.choice((1, 5, 10, 25, 50, 100, 250))
            calls.append(("get_users", ("get_users", (n, rng.choice((0, 0, 1, 2, 5))))))
    step = max(1, len(calls) // (large + 1))
    for i in range(large):  # spread the large calls through the round
        calls.insert(min(len(calls), (i + 1) * step + i), (f"get_users({LARGE_COUNT})",
                                                          ("get_users", (LARGE_COUNT, 0))))
    return calls


def _worker(host: str, port: int, args, work: queue.Queue, result: Round, stop: threading.Event) -> None:
    conn: Connection | None = None
    try:
        while not stop.is_set():
            try:
                label, (method, call_args) = work.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = Connection(host, port, args.framing, args.protocol)
                reply = getattr(conn.client, method)(*call_args)
                if method == "get_users" and len(reply) != call_args[0]:
                    raise ValueError(f"asked for {call_args[0]} users, got {len(reply)}")
                result.ok(label, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                result.failed(label, e)
                if not _declared(e) and conn is not None:  # the connection may be broken
                    conn.close()
                    conn = None
    finally:
        if conn is not None:
            conn.close()


def _declared(e: BaseException) -> bool:
    from proxy.demo_gen.user_service.ttypes import Unavailable

    return isinstance(e, Unavailable)


def _slow_reader(host: str, port: int, args, result: Round) -> None:
    label = "slow reader"
    t0 = time.perf_counter()
    try:
        conn = Connection(host, port, args.framing, args.protocol, slow=True)
    except OSError as e:
        result.failed(label, e)
        return
    try:
        users = conn.client.get_users(LARGE_COUNT, 0)
        seconds = time.perf_counter() - t0
        result.ok(label, seconds)
        result.slow = (f"slow reader: {_address(conn.local)} read {len(users):,} users "
                       f"({conn.tsock.received:,} bytes) {SLOW_CHUNK // 1024} KiB per {SLOW_PAUSE * 1000:.0f} ms "
                       f"through a {SLOW_RCVBUF // 1024} KiB receive buffer in {seconds:.2f} s")
    except Exception as e:  # noqa: BLE001
        result.failed(label, e)
    finally:
        conn.close()


def run_round(host: str, port: int, args, rng: random.Random, stop: threading.Event) -> Round:
    result = Round()
    work: queue.Queue = queue.Queue()
    for item in plan(args.count, args.large, rng):
        work.put(item)
    threads = [threading.Thread(target=_worker, args=(host, port, args, work, result, stop), daemon=True)
               for _ in range(max(1, args.connections))]
    if args.slow_reader:
        threads.insert(0, threading.Thread(target=_slow_reader, args=(host, port, args, result), daemon=True))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)  # short joins: signals are handled in the main thread meanwhile
    result.seconds = time.perf_counter() - t0
    return result


def report(result: Round, args, verbose: bool) -> list[str]:
    head = (f"demo-client: {result.calls + result.failed_calls} calls on {args.connections} connections"
            + (" + 1 slow reader" if args.slow_reader else "")
            + f" in {result.seconds:.2f} s, {result.failed_calls} failed")
    lines = [head]
    if verbose:
        for label in sorted(result.latencies, key=lambda k: (k == "slow reader", k)):
            v = result.latencies[label]
            lines.append(f"  {label:<18}{len(v):>5} calls   p50 {_pct(v, 50) * 1000:8.2f} ms"
                         f"   p99 {_pct(v, 99) * 1000:8.2f} ms")
    for kind, n in sorted(result.failures.items()):
        lines.append(f"  failed: {n} × {kind}")
    if result.slow:
        lines.append(("  " if verbose else "  ") + result.slow)
    return lines


def main(args) -> int:
    """`demo-client`: one round of calls (or rounds until SIGTERM with --forever)."""
    from proxy.demo_upstream import die_with_parent

    die_with_parent()
    try:
        host, port = parse_target(args.target)
    except ValueError as e:
        print(f"demo-client: --target: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop.is_set():
            raise SystemExit(0)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rng = random.Random(args.seed)
    rounds = 0
    while True:
        result = run_round(host, port, args, rng, stop)
        rounds += 1
        try:
            for line in report(result, args, verbose=not args.forever or rounds == 1):
                print(line, flush=True)
        except BrokenPipeError:  # nobody reads the output any more
            return 0 if result.failed_calls == 0 else 1
        if not args.forever:
            return 0 if result.failed_calls == 0 and result.calls > 0 else 1
        if stop.wait(args.interval):
            return 0


if __name__ == "__main__":  # `python -m proxy.demo_client`: the same as `thrift-sidecar demo-client`
    from proxy.cli import main as _cli_main
    sys.exit(_cli_main(["demo-client", *sys.argv[1:]]))
