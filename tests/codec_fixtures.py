"""Wire fixtures for the codec tests, produced by the Apache Thrift Python library.

Every byte string here was written by Apache Thrift itself: requests by the
generated clients' `send_*` over a TMemoryBuffer wrapped in the framing and
protocol under test, replies and exceptions by the generated Processor (or a
TMultiplexedProcessor) running a real handler on those requests. Nothing is
hand-assembled, so a codec that agrees with these bytes agrees with Thrift.

A `Wire` is one cell of the framing x protocol matrix (zlib THeader is a cell
of its own). `plain` is the same message written by the bare protocol onto a
TMemoryBuffer: what `Message.payload()` must return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from thrift.Thrift import TApplicationException, TMessageType
from thrift.TMultiplexedProcessor import TMultiplexedProcessor
from thrift.protocol.TBinaryProtocol import TBinaryProtocol, TBinaryProtocolAccelerated
from thrift.protocol.TCompactProtocol import TCompactProtocol, TCompactProtocolAccelerated
from thrift.protocol.THeaderProtocol import THeaderProtocol
from thrift.protocol.TMultiplexedProtocol import TMultiplexedProtocol
from thrift.transport.THeaderTransport import THeaderClientType, THeaderTransformID
from thrift.transport.TTransport import TBufferedTransport, TFramedTransport, TMemoryBuffer

from proxy.codec import Framing, Protocol
from sidecar_test import AdminService, TestService
from sidecar_test.ttypes import Color, Everything, Inner, NotFound, Unavailable, User

# -- the matrix ----------------------------------------------------------------


@dataclass(frozen=True)
class Wire:
    framing: Framing
    protocol: Protocol
    zlib: bool = False

    @property
    def id(self) -> str:
        z = "+zlib" if self.zlib else ""
        return f"{self.framing.value}{z}-{self.protocol.value}"

    @property
    def autodetectable(self) -> bool:
        return self.protocol is not Protocol.BINARY_NONSTRICT


F, P = Framing, Protocol
WIRES: list[Wire] = [
    Wire(F.FRAMED, P.BINARY), Wire(F.FRAMED, P.COMPACT), Wire(F.FRAMED, P.BINARY_NONSTRICT),
    Wire(F.BUFFERED, P.BINARY), Wire(F.BUFFERED, P.COMPACT), Wire(F.BUFFERED, P.BINARY_NONSTRICT),
    Wire(F.HEADER, P.BINARY), Wire(F.HEADER, P.COMPACT),
    Wire(F.FRAMED_HEADER, P.BINARY), Wire(F.FRAMED_HEADER, P.COMPACT),
    Wire(F.HEADER, P.BINARY, zlib=True), Wire(F.HEADER, P.COMPACT, zlib=True),
    Wire(F.FRAMED_HEADER, P.BINARY, zlib=True), Wire(F.FRAMED_HEADER, P.COMPACT, zlib=True),
]
WIRE_IDS = [w.id for w in WIRES]

THEADER_HEADERS = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                   "x-deadline-ms": "250"}


def base_protocol(protocol: Protocol, trans, accelerated: bool = True):
    if protocol is Protocol.COMPACT:
        return (TCompactProtocolAccelerated if accelerated else TCompactProtocol)(trans)
    cls = TBinaryProtocolAccelerated if accelerated else TBinaryProtocol
    return cls(trans, strictRead=False, strictWrite=protocol is Protocol.BINARY)


def writer(wire: Wire, buf: TMemoryBuffer, headers: dict[str, str] | None = None):
    """An Apache Thrift protocol writing `wire` onto buf (flushed per message)."""
    if wire.framing is Framing.FRAMED:
        return base_protocol(wire.protocol, TFramedTransport(buf))
    if wire.framing is Framing.BUFFERED:
        return base_protocol(wire.protocol, TBufferedTransport(buf))
    under = buf if wire.framing is Framing.HEADER else TFramedTransport(buf)
    proto = THeaderProtocol(under, [THeaderClientType.HEADERS], default_protocol=wire.protocol.header_id)
    if wire.zlib:
        proto.add_transform(THeaderTransformID.ZLIB)
    for k, v in (headers or {}).items():
        proto.set_header(k.encode(), v.encode())
    return proto


def reader(wire: Wire, data: bytes):
    """An Apache Thrift protocol reading `wire` from data."""
    buf = TMemoryBuffer(data)
    if wire.framing is Framing.FRAMED:
        return base_protocol(wire.protocol, TFramedTransport(buf))
    if wire.framing is Framing.BUFFERED:
        return base_protocol(wire.protocol, TBufferedTransport(buf))
    under = buf if wire.framing is Framing.HEADER else TFramedTransport(buf)
    return THeaderProtocol(under, [THeaderClientType.HEADERS])


def write(wire: Wire, fn, headers=None, service: str | None = None) -> bytes:
    """What Apache Thrift writes when fn(protocol) sends one message in `wire`."""
    buf = TMemoryBuffer()
    proto = writer(wire, buf, headers)
    if service is not None:
        proto = TMultiplexedProtocol(proto, service)
    fn(proto)
    return buf.getvalue()


def write_plain(protocol: Protocol, fn, service: str | None = None) -> bytes:
    """The bare protocol message (no framing, no buffering)."""
    buf = TMemoryBuffer()
    proto = base_protocol(protocol, buf)
    if service is not None:
        proto = TMultiplexedProtocol(proto, service)
    fn(proto)
    return buf.getvalue()


# -- the services' handler -----------------------------------------------------

_FIRST = ["Ada", "Alan", "Barbara", "Dennis", "Edsger", "Frances", "Grace", "Ken", "Margaret", "Niklaus"]
_LAST = ["Lovelace", "Turing", "Liskov", "Ritchie", "Dijkstra", "Allen", "Hopper", "Thompson", "Hamilton", "Wirth"]
_DEPTS = ["engineering", "sales", "support", "finance", "research"]
_LOCALES = ["en_US", "de_DE", "fr_FR", "ja_JP", "pt_BR"]


def make_user(i: int) -> User:
    """User number i (0-based), as bench/go/internal/tconf/users.go builds it."""
    uid = i + 1
    return User(
        id=uid, username=f"user{uid:06d}", email=f"user{uid:06d}@example.com",
        first_name=_FIRST[i % 10], last_name=_LAST[(i // 10) % 10], is_staff=i % 17 == 0,
        date_joined=1500000000 + uid * 3600,
        attrs={"department": _DEPTS[i % 5], "locale": _LOCALES[i % 5], "team": f"team-{i % 40:02d}"},
    )


def make_users(n: int) -> list[User]:
    return [make_user(i) for i in range(n)]


class Handler:
    def ping(self):
        return None

    def roundtrip(self, e):
        return e

    def echo(self, payload):
        return payload

    def get_users(self, count, sleep_ms):
        return make_users(count)

    def lookup(self, key):
        if key == "missing":
            raise NotFound(what=key, code=404)
        if key == "down":
            raise Unavailable(reason="backend down")
        return f"value-of-{key}"

    def sleep(self, ms):
        return ms

    def log_event(self, event):
        return None

    def incr(self, key):
        return 1

    def count(self, key):
        return 0

    def version(self):
        return "1.0"

    def add(self, a, b):
        return a + b


def everything() -> Everything:
    """One value of every type the IDL has, containers and nesting included."""
    inner = Inner(n=-7, label="inner", values=[1, -2, 2**40])
    return Everything(
        b=True, i8v=-128, i16v=-32768, i32v=2**31 - 1, i64v=-(2**63), d=3.5, s="héllo", bin=b"\x00\xff\x80",
        strs=["a", "", "ccc"], ints={1, -1, 300}, inners={"x": inner, "y": Inner(n=0, label="")},
        inner=Inner(n=1, label="one", values=[]), color=Color.BLUE, nested=[[1, 2], [], [3]],
        maybe=None, deep={5: [inner, inner], -5: []}, doubles=[0.0, -1.25], tags={"t1", "t2"},
    )


# -- fixtures ------------------------------------------------------------------


@dataclass(frozen=True)
class Fixture:
    key: str
    wire: Wire
    data: bytes               # exactly what Apache Thrift wrote for `wire`
    plain: bytes              # the bare protocol message (Message.payload())
    name: str
    type: int
    seqid: int
    headers: dict = field(default_factory=dict)
    result: object = "n/a"    # Message.result_field() for REPLY fixtures

    @property
    def service(self) -> str | None:
        return self.name.split(":", 1)[0] if ":" in self.name else None

    @property
    def method(self) -> str:
        return self.name.split(":", 1)[-1]


def _client(cls, seqid: int):
    def make(proto):
        c = cls.Client(proto)
        c._seqid = seqid
        return c
    return make


def _send(cls, seqid: int, method: str, *args):
    return lambda proto: getattr(_client(cls, seqid)(proto), "send_" + method)(*args)


def _send_unknown(seqid: int):
    def fn(proto):
        proto.writeMessageBegin("no_such_method", TMessageType.CALL, seqid)
        TestService.ping_args().write(proto)
        proto.writeMessageEnd()
        proto.trans.flush()
    return fn


def _processor(multiplexed: bool):
    h = Handler()
    if not multiplexed:
        return TestService.Processor(h)
    mp = TMultiplexedProcessor()
    mp.registerProcessor("TestService", TestService.Processor(h))
    mp.registerProcessor("AdminService", AdminService.Processor(h))
    return mp


def process(wire: Wire, request_plain: bytes, multiplexed: bool = False, headers=None) -> tuple[bytes, bytes]:
    """Run the generated Processor on a request; returns (reply in `wire`, reply plain)."""
    out = []
    for framed_as_wire in (True, False):
        iprot = base_protocol(wire.protocol, TMemoryBuffer(request_plain))
        buf = TMemoryBuffer()
        oprot = writer(wire, buf, headers) if framed_as_wire else base_protocol(wire.protocol, buf)
        _processor(multiplexed).process(iprot, oprot)
        out.append(buf.getvalue())
    return out[0], out[1]


# (key, service class, multiplexed service name, seqid, method, args, reply?, reply result_field)
_CALLS = [
    ("ping", TestService, None, 1, "ping", (), None),
    ("lookup-ok", TestService, None, 2, "lookup", ("k1",), 0),
    ("lookup-notfound", TestService, None, 3, "lookup", ("missing",), 1),
    ("lookup-unavailable", TestService, None, 4, "lookup", ("down",), 2),
    ("roundtrip", TestService, None, 2**31 - 1, "roundtrip", (everything(),), 0),
    ("get_users", TestService, None, 300, "get_users", (3, 0), 0),
    ("echo", TestService, None, 128, "echo", (b"\x00" * 200 + b"xyz",), 0),
    ("mux-ping", TestService, "TestService", 16384, "ping", (), None),
    ("mux-add", AdminService, "AdminService", 77, "add", (2, 40), 0),
]
_ONEWAYS = [
    ("log_event", TestService, None, 9, "log_event", ("started",)),
    ("mux-log_event", TestService, "TestService", 10, "log_event", ("mux started",)),
]


@lru_cache(maxsize=None)
def fixtures(wire: Wire) -> dict[str, Fixture]:
    """All fixture messages of one wire, in a stable order (requests, then replies)."""
    out: dict[str, Fixture] = {}
    hdrs = THEADER_HEADERS if wire.framing.is_header else {}

    def add(key, fn, name, mtype, seqid, service=None, headers=None, result="n/a"):
        data = write(wire, fn, headers if wire.framing.is_header else None, service)
        plain = write_plain(wire.protocol, fn, service)
        out[key] = Fixture(key, wire, data, plain, name, mtype, seqid,
                           dict(headers or {}) if wire.framing.is_header else {}, result)
        return plain

    for key, cls, svc, seqid, method, args, result in _CALLS:
        name = f"{svc}:{method}" if svc else method
        # Headers on some requests only, so both shapes of THeader block are covered.
        h = hdrs if key in ("ping", "lookup-ok", "mux-ping", "roundtrip") else None
        plain = add(f"{key}-call", _send(cls, seqid, method, *args), name, TMessageType.CALL, seqid, svc, h)
        data, rplain = process(wire, plain, multiplexed=svc is not None)
        out[f"{key}-reply"] = Fixture(f"{key}-reply", wire, data, rplain, method, TMessageType.REPLY,
                                      seqid, {}, result)
    for key, cls, svc, seqid, method, args in _ONEWAYS:
        name = f"{svc}:{method}" if svc else method
        add(f"{key}-oneway", _send(cls, seqid, method, *args), name, TMessageType.ONEWAY, seqid, svc, hdrs)
    plain = add("unknown-call", _send_unknown(11), "no_such_method", TMessageType.CALL, 11)
    data, rplain = process(wire, plain)
    out["unknown-exception"] = Fixture("unknown-exception", wire, data, rplain, "no_such_method",
                                       TMessageType.EXCEPTION, 11)
    return out


def fixture_list(wire: Wire) -> list[Fixture]:
    return list(fixtures(wire).values())


# Small messages, for property tests that feed byte by byte.
SMALL_KEYS = ["ping-call", "ping-reply", "lookup-ok-call", "lookup-ok-reply", "lookup-notfound-reply",
              "log_event-oneway", "mux-add-call", "mux-add-reply", "unknown-exception", "get_users-reply",
              "roundtrip-call"]


@lru_cache(maxsize=None)
def echo_call(wire: Wire, size: int) -> tuple[bytes, bytes]:
    """(wire bytes, plain bytes) of echo(payload) with a `size`-byte payload."""
    payload = (bytes(range(256)) * (size // 256 + 1))[:size]
    fn = _send(TestService, 5, "echo", payload)
    return write(wire, fn), write_plain(wire.protocol, fn)


@lru_cache(maxsize=None)
def echo_reply(wire: Wire, size: int) -> tuple[bytes, bytes]:
    """(wire bytes, plain bytes) of the Processor's reply to echo_call(wire, size)."""
    return process(wire, echo_call(wire, size)[1])


@lru_cache(maxsize=None)
def users_reply(wire: Wire, count: int) -> tuple[bytes, bytes]:
    """(wire bytes, plain bytes) of the reply to get_users(count)."""
    req = write_plain(wire.protocol, _send(TestService, 6, "get_users", count, 0))
    return process(wire, req)


def application_exception(wire: Wire, name: str, seqid: int, app_type: int, message: str) -> bytes:
    """What an Apache Thrift server writes for a TApplicationException in `wire`."""
    def fn(proto):
        proto.writeMessageBegin(name, TMessageType.EXCEPTION, seqid)
        TApplicationException(app_type, message).write(proto)
        proto.writeMessageEnd()
        proto.trans.flush()
    return write(wire, fn)

