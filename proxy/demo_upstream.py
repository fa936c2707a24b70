"""`thrift-sidecar demo-upstream`: the demo's Thrift `UserService`, a real Apache Thrift server.

Owns: the service's handler (realistic users: ids, usernames, emails, names, staff flag, join
date, a small attrs map), serving it on one TCP port (one thread per connection, Apache Thrift's
generated processor with the C-accelerated protocols), and stopping on SIGTERM/SIGINT.
Leaves to others: the IDL and its generated code (`proxy/data/user_service.thrift`,
`proxy.demo_gen`), calling it (`proxy.demo_client`), running the whole demo (`proxy.demo`).

    thrift-sidecar demo-upstream --port 9191                       # 0.0.0.0:9191, framed/binary
    thrift-sidecar demo-upstream --host 127.0.0.1 --port 0 --fail-every 7

The first line on stdout says where it listens (`demo-upstream: UserService on HOST:PORT ...`),
so a caller that passed `--port 0` learns the port. `--fail-every N` answers one
`get_users` in N with the declared `Unavailable` exception (result field 1): what the sidecar's
`on_exceptions: [1]` retry turns into a second attempt on the other upstream.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import threading
import time
import unicodedata

FRAMINGS = ("framed", "buffered", "header")
PROTOCOLS = ("binary", "compact")
PREBUILD = 5499     # users built at start: the demo's large call
MAX_USERS = 100_000  # a larger count is refused (the reply would pass the 16 MB frame limit)
PARENT_ENV = "THRIFT_SIDECAR_DEMO_PARENT"  # set by `thrift-sidecar demo`: die with that process

_FIRST = ("Olivia", "Liam", "Emma", "Noah", "Amelia", "Oliver", "Ava", "Elijah", "Sophia", "Lucas",
          "Mia", "Mateo", "Isabella", "Levi", "Charlotte", "Leo", "Harper", "Hiroshi", "Amara", "Kwame",
          "Ingrid", "Rafael", "Priya", "Arjun", "Chiara", "Lars", "Zeynep", "Tomás", "Yuki", "Fatima",
          "Dmitri", "Aisha", "Mei", "Jonas", "Léa", "Kofi", "Saanvi", "Björn", "Nadia", "Emeka")
_LAST = ("Smith", "Johnson", "Garcia", "Müller", "Rossi", "Nguyen", "Kowalski", "Okafor", "Tanaka",
         "Silva", "Andersson", "Dubois", "Novak", "Haddad", "Kim", "Patel", "O'Brien", "Jensen",
         "Fernández", "Ivanova", "Mensah", "Yilmaz", "Cohen", "Schmidt", "Lindqvist", "Moreau",
         "Costa", "Sato", "Chen", "Adeyemi", "Popescu", "Hansen", "Quispe", "Murphy", "Zhou", "Khan")
_DOMAINS = ("example.com", "example.org", "mail.example.net", "corp.example.com")
_TEAMS = ("platform", "payments", "search", "growth", "infra", "mobile", "data", "support")
_ZONES = ("UTC", "Europe/Berlin", "America/New_York", "Asia/Tokyo", "America/Sao_Paulo",
          "Africa/Lagos", "Asia/Kolkata", "Australia/Sydney")
_LOCALES = ("en_US", "de_DE", "pt_BR", "ja_JP", "fr_FR", "hi_IN", "en_GB", "es_ES")
_PLANS = ("free", "pro", "team", "enterprise")
_EPOCH_2012 = 1_325_376_000  # 2012-01-01T00:00:00Z


def _slug(name: str) -> str:
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return ascii_name.lower().replace("'", "")


class Users:
    """The same realistic users for every call: user n (ids from 1) is always the same person.

    Built once, in id order from one seeded generator, up to the largest count asked so far (the
    demo's 5,499 at start), so a call's time is the service serialising and sending its reply,
    not Python building objects.
    """

    def __init__(self, prebuild: int = 0) -> None:
        from proxy.demo_gen.user_service.ttypes import User

        self._User = User
        self._users: list = []
        self._rng = random.Random(5499)
        self._lock = threading.Lock()
        self.first(prebuild)

    def _make(self, uid: int):
        rng = self._rng
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        username = f"{_slug(first)}.{_slug(last)}{uid}"
        attrs = {"team": rng.choice(_TEAMS), "timezone": rng.choice(_ZONES), "locale": rng.choice(_LOCALES)}
        if rng.random() < 0.5:
            attrs["plan"] = rng.choice(_PLANS)
        return self._User(id=uid, username=username, email=f"{username}@{rng.choice(_DOMAINS)}",
                          first_name=first, last_name=last, is_staff=rng.random() < 0.05,
                          date_joined=_EPOCH_2012 + rng.randrange(12 * 365 * 86400), attrs=attrs)

    def first(self, count: int) -> list:
        if count > len(self._users):
            with self._lock:
                self._users.extend(self._make(uid) for uid in range(len(self._users) + 1, count + 1))
        return self._users[:count]


class Handler:
    """UserService: `ping` and `get_users(count, sleep_ms)`."""

    def __init__(self, fail_every: int = 0, prebuild: int = PREBUILD) -> None:
        self.users = Users(prebuild)
        self.fail_every = fail_every
        self.calls = 0
        self._lock = threading.Lock()

    def ping(self) -> None:
        return None

    def get_users(self, count: int, sleep_ms: int) -> list:
        from proxy.demo_gen.user_service.ttypes import Unavailable

        with self._lock:
            self.calls += 1
            n = self.calls
        if self.fail_every and n % self.fail_every == 0:
            raise Unavailable(reason=f"busy (1 get_users in {self.fail_every} fails on purpose)")
        if sleep_ms:  # an argument the client left out arrives as None
            time.sleep(min(max(sleep_ms, 0), 60_000) / 1000)
        return self.users.first(max(0, min(count or 0, MAX_USERS)))


def protocol_factory(framing: str, protocol: str):
    from thrift.protocol import TBinaryProtocol, TCompactProtocol, THeaderProtocol

    if framing == "header":
        from thrift.transport.THeaderTransport import THeaderClientType
        # a THeader server also answers framed and unframed clients in their own framing
        return THeaderProtocol.THeaderProtocolFactory(
            allowed_client_types=(THeaderClientType.HEADERS, THeaderClientType.FRAMED_BINARY,
                                  THeaderClientType.UNFRAMED_BINARY, THeaderClientType.FRAMED_COMPACT,
                                  THeaderClientType.UNFRAMED_COMPACT),
            default_protocol=2 if protocol == "compact" else 0)
    if protocol == "compact":
        return TCompactProtocol.TCompactProtocolAcceleratedFactory()
    return TBinaryProtocol.TBinaryProtocolAcceleratedFactory()


def wrap_transport(framing: str, trans):
    from thrift.transport import TTransport

    if framing == "framed":
        return TTransport.TFramedTransport(trans)
    if framing == "buffered":
        return TTransport.TBufferedTransport(trans)
    return trans  # THeaderProtocol frames by itself


class UpstreamServer:
    """UserService on one listening socket, a thread per connection."""

    def __init__(self, host: str, port: int, framing: str = "framed", protocol: str = "binary",
                 handler: Handler | None = None) -> None:
        from proxy.demo_gen.user_service import UserService

        self.framing, self.protocol = framing, protocol
        self.handler = handler or Handler()
        self.processor = UserService.Processor(self.handler)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(512)
        self.address = self.sock.getsockname()[:2]

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from thrift.transport import TSocket

        ts = TSocket.TSocket()
        ts.setHandle(conn)
        trans = wrap_transport(self.framing, ts)
        prot = protocol_factory(self.framing, self.protocol).getProtocol(trans)
        try:
            while True:
                self.processor.process(prot, prot)
        except Exception:  # the peer closed, or sent garbage: end this connection quietly
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def die_with_parent() -> None:
    """When started by `thrift-sidecar demo`, exit if the demo itself dies (even by SIGKILL)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(0)


def _stop(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough: exit is under way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(0)


def main(args) -> int:
    """`demo-upstream`: serve UserService until SIGTERM/SIGINT (exit 0)."""
    die_with_parent()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server = UpstreamServer(args.host, args.port, args.framing, args.protocol,
                                Handler(fail_every=args.fail_every))
    except OSError as e:
        print(f"demo-upstream: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    host, port = server.address
    shown = f"[{host}]" if ":" in host else host
    extra = f"; 1 get_users in {args.fail_every} fails with Unavailable" if args.fail_every else ""
    print(f"demo-upstream: UserService on {shown}:{port} ({args.framing}/{args.protocol}{extra})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


if __name__ == "__main__":  # `python -m proxy.demo_upstream`: the same as `thrift-sidecar demo-upstream`
    from proxy.cli import main as _cli_main
    sys.exit(_cli_main(["demo-upstream", *sys.argv[1:]]))
