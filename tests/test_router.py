"""Route table: every match kind, precedence (first match wins), weighted splits, and strip_service.

Routes are built from YAML through the composition root's `build_route`, so the
config keys are what is tested. The cached hot path (`Router.route`) must
agree with the plain first-match scan (`Router.match`) for any name and headers
(property test). `strip_service` is checked on Apache Thrift's own bytes in
every framing x protocol cell: the result decodes to the bare name with the
args untouched, and a plain (non-multiplexed) Apache Thrift processor answers it.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thrift.protocol.TBinaryProtocol import TBinaryProtocol
from thrift.transport.TTransport import TMemoryBuffer

import codec_fixtures as cf
from proxy import config as cfgmod
from proxy.codec import Decoder, Framing, Protocol
from proxy.codec.rename import strip_service
from proxy.router import Router
from proxy.server import build_route
from sidecar_test import TestService

CLUSTERS = ("a", "b", "c", "d", "e", "f", "g", "h", "canary")


def router_from(routes_yaml: str, seed: int = 1) -> Router:
    text = f"""
listeners:
  - name: l
    listen: 127.0.0.1:0
    transport: auto  # (header matches need THeader calls: header or auto)
    routes:
{routes_yaml}
clusters:
""" + "".join(f"  - {{name: {c}, endpoints: [127.0.0.1:1]}}\n" for c in CLUSTERS)
    cfg = cfgmod.loads(text, "routes.yaml")
    clusters = {c: c for c in CLUSTERS}  # a route's cluster is whatever object the map holds
    rng = random.Random(seed)
    return Router([build_route(r, i, clusters, rng) for i, r in enumerate(cfg.listeners[0].routes)])


def msg(name: str, headers: dict[str, str] | None = None):
    return SimpleNamespace(name=name, headers=headers or {})


def where(router: Router, name: str, headers=None) -> str | None:
    r = router.route(msg(name, headers))
    if r is None:
        return None
    assert r is router.match(*_split(name), headers or {})
    return r.pick_cluster()


def _split(name):
    svc, sep, method = name.rpartition(":")
    return (svc if sep else None), method


TABLE = """
      - {match: {method: get_user}, cluster: a}
      - {match: {method: "get_*"}, cluster: b}
      - {match: {method: "*_v2"}, cluster: c}
      - {match: {method: "[sd]et_?ser"}, cluster: d}
      - {match: {service: AdminService}, cluster: e}
      - {match: {header: {x-canary: "1"}}, cluster: canary}
      - {match: {header: {x-tenant: {regex: "acme-[0-9]+"}}}, cluster: f}
      - {match: {header: {x-debug: {present: true}}, method: ping}, cluster: g}
      - {match: {method: "*", invert: true}, cluster: h}
      - cluster: a
"""


def test_method_exact_wins_over_later_prefix():
    r = router_from(TABLE)
    assert where(r, "get_user") == "a"
    assert where(r, "get_users") == "b"      # prefix
    assert where(r, "get_") == "b"


def test_method_glob_suffix_and_classes():
    r = router_from(TABLE)
    assert where(r, "lookup_v2") == "c"
    assert where(r, "set_user") == "d"
    assert where(r, "det_xser") == "d"
    assert where(r, "set_users") == "a"     # ? is exactly one character, the glob is anchored
    assert where(r, "xset_user") == "a"


def test_method_match_is_case_sensitive():
    r = router_from(TABLE)
    assert where(r, "Get_user") == "a"      # the default, not the get_ routes
    assert where(r, "GET_USERS") == "a"


def test_multiplexed_service_and_bare_method():
    r = router_from(TABLE)
    assert where(r, "AdminService:version") == "e"
    # the method tests read the bare name, so a multiplexed get_user still matches route 0
    assert where(r, "AdminService:get_user") == "a"
    assert where(r, "TestService:ping") == "a"
    assert where(r, "Other:lookup") == "a"


def test_header_exact_regex_present():
    r = router_from(TABLE)
    assert where(r, "lookup", {"x-canary": "1"}) == "canary"
    assert where(r, "lookup", {"x-canary": "10"}) == "a"
    assert where(r, "lookup", {"x-tenant": "acme-42"}) == "f"
    assert where(r, "lookup", {"x-tenant": "acme-42x"}) == "a"   # regex must match in full
    assert where(r, "ping", {"x-debug": ""}) == "g"               # present, even empty
    assert where(r, "lookup", {"x-debug": "1"}) == "a"            # route 7 also needs method ping
    # earlier routes win over header routes
    assert where(r, "get_user", {"x-canary": "1"}) == "a"


def test_a_header_regex_runs_in_linear_time():
    """`(a+)+` against 28 a's and a '!': Python's backtracking re takes ~13 s (each extra 'a'
    doubles it), holding the event loop and every other client; RE2 answers at once."""
    r = router_from("""
      - {match: {header: {x-tenant: {regex: "(a+)+"}}}, cluster: b}
      - cluster: a
    """)
    t0 = time.monotonic()
    assert where(r, "lookup", {"x-tenant": "a" * 28 + "!"}) == "a"
    assert where(r, "lookup", {"x-tenant": "a" * 100_000 + "!"}) == "a"
    took = time.monotonic() - t0
    assert where(r, "lookup", {"x-tenant": "aaa"}) == "b"
    assert took < 1.0, f"{took:.1f} s to match two header values"


def test_header_absent_and_header_names_exact():
    r = router_from("""
      - {match: {header: {x-auth: {present: false}}}, cluster: b}
      - cluster: a
""")
    assert where(r, "ping") == "b"
    assert where(r, "ping", {"x-auth": "t"}) == "a"
    assert where(r, "ping", {"X-Auth": "t"}) == "b"   # THeader keys are case-sensitive bytes


def test_invert():
    r = router_from("""
      - {match: {method: "get_*", invert: true}, cluster: b}
      - {match: {service: S, header: {h: v}, invert: true}, cluster: c}
      - cluster: a
""")
    assert where(r, "set_x") == "b"
    assert where(r, "get_x") == "c"             # not (S and h=v)
    assert where(r, "S:get_x", {"h": "v"}) == "a"
    assert where(r, "S:get_x", {"h": "w"}) == "c"
    assert where(r, "T:get_x", {"h": "v"}) == "c"


def test_no_default_no_route():
    r = router_from("""
      - {match: {method: ping}, cluster: a}
""")
    assert where(r, "ping") == "a"
    assert where(r, "lookup") is None
    assert where(r, "S:lookup") is None


def test_first_match_wins_even_when_later_routes_are_more_specific():
    r = router_from("""
      - {match: {method: "*"}, cluster: b}
      - {match: {method: ping}, cluster: a}
      - cluster: c
""")
    assert where(r, "ping") == "b"


def test_strip_service_flag_and_settings_reach_the_route():
    r = router_from("""
      - {match: {service: AdminService}, cluster: a, strip_service: true, timeout: 2s}
      - cluster: b
""")
    route = r.route(msg("AdminService:add"))
    assert route.strip_service and route.settings.timeout == 2.0 and route.index == 0
    assert not r.route(msg("add")).strip_service


def test_weighted_split_90_10_over_100k_seeded_picks():
    r = router_from("""
      - weighted: [{cluster: a, weight: 90}, {cluster: canary, weight: 10}]
""")
    route = r.route(msg("x"))
    n = 100_000
    counts = {"a": 0, "canary": 0}
    for _ in range(n):
        counts[route.pick_cluster()] += 1
    # binomial sd at p=0.1: 0.095%; +-0.5% is > 5 sd
    assert abs(counts["canary"] / n - 0.10) < 0.005, counts


def test_weighted_zero_weight_never_picked():
    r = router_from("""
      - weighted: [{cluster: a, weight: 0}, {cluster: b, weight: 3}, {cluster: c, weight: 0}]
""")
    route = r.route(msg("x"))
    assert {route.pick_cluster() for _ in range(10_000)} == {"b"}


NAMES = st.sampled_from(["get_user", "get_users", "set_user", "lookup_v2", "ping", "lookup", "x",
                         "AdminService:version", "AdminService:get_user", "S:ping", "Other:x_v2"])
HEADERS = st.dictionaries(st.sampled_from(["x-canary", "x-tenant", "x-debug", "h"]),
                          st.sampled_from(["1", "10", "acme-1", "acme-x", "", "v"]), max_size=3)


PROPERTY_ROUTER = router_from(TABLE.replace("      - cluster: a\n", "") + """
      - {match: {service: S, header: {h: v}, invert: true}, cluster: c}
""")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(NAMES, HEADERS), min_size=1, max_size=20))
def test_cached_route_agrees_with_first_match_scan(calls):
    r = PROPERTY_ROUTER
    for name, headers in calls:   # repeated names hit the cache
        got = r.route(msg(name, headers))
        assert got is r.match(*_split(name), headers)


def test_names_longer_than_any_method_are_routed_but_not_cached():
    """A client sending 64 KiB names must not make the route cache keep 64 KiB per name
    (before: up to 4,096 of them, ~256 MiB)."""
    r = router_from("""
      - {match: {method: "*"}, cluster: a}
""")
    long_name = "m" * 300
    assert r.route(msg(long_name, {})) is r.routes[0]
    assert r.route(msg("ping", {})) is r.routes[0]
    assert list(r._cache) == ["ping"]


# -- strip_service on Apache Thrift's own bytes ------------------------------------------------

MUX_KEYS = [("mux-ping-call", "ping"), ("mux-add-call", "add"), ("mux-log_event-oneway", "log_event")]


def decode(data: bytes, framing: Framing, protocol: Protocol):
    d = Decoder(framing, protocol)
    d.feed(data)
    m = d.next_message()
    assert m is not None and d.buffered == 0
    return m


def targets(wire: cf.Wire) -> list[Framing]:
    """Framings the stripped message may be written in (protocols are never transcoded)."""
    return [wire.framing, Framing.FRAMED, Framing.BUFFERED, Framing.HEADER, Framing.FRAMED_HEADER]


@pytest.mark.parametrize("wire", cf.WIRES, ids=lambda w: w.id)
@pytest.mark.parametrize("key,bare", MUX_KEYS, ids=[k for k, _ in MUX_KEYS])
def test_strip_service_renames_head_and_keeps_the_rest(wire, key, bare):
    fx = cf.fixtures(wire)[key]
    src = decode(fx.data, wire.framing, wire.protocol)
    assert src.name == fx.name and ":" in src.name
    if wire.protocol is Protocol.COMPACT:
        expected_plain = _compact_rename(fx.plain, fx.name, bare)
    elif wire.protocol is Protocol.BINARY:
        expected_plain = _binary_rename(fx.plain, fx.name, bare, strict=True)
    else:
        expected_plain = _binary_rename(fx.plain, fx.name, bare, strict=False)
    for framing in targets(wire):
        if wire.protocol is Protocol.BINARY_NONSTRICT and framing.is_header:
            continue  # THeader carries strict binary only
        out = strip_service(src, framing)
        m = decode(out, framing, wire.protocol)
        assert (m.name, m.type, m.seqid) == (bare, fx.type, fx.seqid)
        assert bytes(m.payload()) == expected_plain, framing
        if framing.is_header and wire.framing.is_header:
            assert m.headers == fx.headers               # info headers kept
            assert m.header.transforms == ()             # zlib payloads go out inflated
        if framing is wire.framing and not wire.zlib:
            # only the name changed: everything else, THeader block included, keeps its size
            assert len(out) == len(fx.data) - (len(fx.name) - len(bare))


def _binary_rename(plain: bytes, name: str, bare: str, strict: bool) -> bytes:
    import struct
    n = len(name.encode())
    if strict:
        assert struct.unpack("!i", plain[4:8])[0] == n
        return plain[:4] + struct.pack("!i", len(bare)) + bare.encode() + plain[8 + n:]
    assert struct.unpack("!i", plain[:4])[0] == n
    return struct.pack("!i", len(bare)) + bare.encode() + plain[4 + n:]


def _compact_rename(plain: bytes, name: str, bare: str) -> bytes:
    from proxy.codec.heads import read_varint, write_varint
    _, p = read_varint(plain, 2, len(plain))            # seqid
    n, q = read_varint(plain, p, len(plain))            # name length
    assert n == len(name.encode())
    out = bytearray(plain[:p])
    write_varint(out, len(bare))
    return bytes(out) + bare.encode() + plain[q + n:]


@pytest.mark.parametrize("wire", [w for w in cf.WIRES if w.protocol is Protocol.BINARY],
                         ids=lambda w: w.id)
def test_plain_apache_processor_answers_a_stripped_call(wire):
    """The point of strip_service: a non-multiplexed server understands the call."""
    fx = cf.fixtures(wire)["mux-ping-call"]
    out = strip_service(decode(fx.data, wire.framing, wire.protocol), Framing.BUFFERED)
    iprot = TBinaryProtocol(TMemoryBuffer(out))
    obuf = TMemoryBuffer()
    TestService.Processor(cf.Handler()).process(iprot, TBinaryProtocol(obuf))
    reply = decode(obuf.getvalue(), Framing.BUFFERED, Protocol.BINARY)
    assert (reply.name, reply.seqid, reply.type) == ("ping", fx.seqid, 2)


def test_strip_service_without_prefix_is_only_reframed():
    wire = cf.Wire(Framing.FRAMED, Protocol.BINARY)
    fx = cf.fixtures(wire)["ping-call"]
    src = decode(fx.data, wire.framing, wire.protocol)
    assert strip_service(src) == fx.data
    assert strip_service(src, Framing.BUFFERED) == fx.plain


def test_strip_service_keeps_header_block_and_replaces_headers_when_asked():
    wire = cf.Wire(Framing.HEADER, Protocol.COMPACT)
    fx = cf.fixtures(wire)["mux-ping-call"]
    src = decode(fx.data, wire.framing, wire.protocol)
    m = decode(strip_service(src, Framing.HEADER, headers={"k": "v"}), Framing.HEADER, Protocol.COMPACT)
    assert m.headers == {"k": "v"} and m.name == "ping" and m.header.seqid == src.header.seqid
