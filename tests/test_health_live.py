"""Active health checks against real upstreams that answer wrong: garbage replies, unknown
methods, an endpoint whose check cannot even start. A check that fails for any reason is that
endpoint's failed check with a reason worth logging; the checker itself never stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct

import pytest

from harness import Proxy, RawUpstream, ThriftServer, wait_for
from proxy.codec import Framing, Protocol
from proxy.endpoint import Endpoint
from proxy.health import check_once

STRICT = 0x80010000


def framed(body: bytes) -> bytes:
    return struct.pack("!i", len(body)) + body


def head(mtype: int, name: bytes = b"ping", seqid: int = 1) -> bytes:
    return struct.pack("!Ii", STRICT | mtype, len(name)) + name + struct.pack("!i", seqid)


# A REPLY whose result struct is cut after one field-type byte (a reviewer's find: it escaped
# check_once as a ProtocolError and ended the cluster's checker task).
TRUNCATED_RESULT = framed(head(2) + b"\x0b")


class Replies(RawUpstream):
    """Answers each request with `self.reply` (bytes), then closes."""

    reply = TRUNCATED_RESULT

    def _one(self, c) -> None:
        with contextlib.suppress(OSError):
            c.recv(4096)
            c.sendall(self.reply)
            c.close()


def cfg(addresses, method="ping") -> str:
    return f"""
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:0
    routes:
      - cluster: up
clusters:
  - name: up
    endpoints: [{", ".join(addresses)}]
    load_balancer: round_robin
    transport: framed
    protocol: binary
    health_check: {{interval: 200ms, timeout: 200ms, method: {method}}}
"""


def check(port: int, method: str = "ping") -> str | None:
    return asyncio.run(check_once("127.0.0.1", port, method, Framing.FRAMED, Protocol.BINARY, 5.0))


def test_garbage_replies_are_failed_checks_never_exceptions():
    up = Replies()
    rng = random.Random(7)
    try:
        up.reply = TRUNCATED_RESULT
        assert check(up.port) == "bad reply: truncated result field header"
        for _ in range(150):
            if rng.random() < 0.25:
                up.reply = rng.randbytes(rng.randrange(1, 40))
            else:
                up.reply = framed(head(rng.choice([1, 2, 3, 4, 7])) + rng.randbytes(rng.randrange(0, 4)))
            why = check(up.port)  # never raises
            assert why is None or isinstance(why, str) and why, up.reply.hex()
    finally:
        up.close()


def test_an_unknown_method_is_logged_with_the_exception_type_and_message():
    up = ThriftServer()
    try:
        assert check(up.port, "no_such_method") == (
            "TApplicationException UNKNOWN_METHOD: Unknown function no_such_method")
        up.handler.throw = {"ping"}
        assert check(up.port).startswith("TApplicationException INTERNAL_ERROR")
    finally:
        up.stop()


def test_a_garbage_reply_takes_only_its_endpoint_out_and_checking_goes_on(caplog):
    """One endpoint answers garbage: it is taken out, and the checker keeps checking the others
    (one is taken out and brought back meanwhile)."""
    odd = Replies()
    toggled = ThriftServer(name="toggled")
    well = ThriftServer(name="well")
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.health"):
            with Proxy(cfg([odd.address, toggled.address, well.address])) as p:
                cluster = p.server.clusters["up"]
                checker = p.server.health["up"]
                ep_odd, ep_toggled, _ = sorted(cluster.endpoints, key=lambda e: [odd.port, toggled.port,
                                                                                  well.port].index(e.port))
                wait_for(lambda: not ep_odd.healthy, 5, "the garbage answering endpoint to be taken out")
                toggled.handler.throw = {"ping"}
                wait_for(lambda: not ep_toggled.healthy, 5, "the failing endpoint to be taken out")
                toggled.handler.throw = set()
                wait_for(lambda: ep_toggled.healthy, 5, "the endpoint passing again to be brought back")
                assert not checker.task.done()
                assert not ep_odd.healthy
                # checks are their own filter: they never feed the breaker (proxy.breaker)
                assert ep_odd.breaker.snapshot()["window_calls"] == 0
                assert ep_odd.breaker.state_name == "closed"
        lines = [r.getMessage() for r in caplog.records if r.name == "proxy.health"]
        assert any(f"{odd.address} in cluster up failed: bad reply: truncated result field header" in m
                   for m in lines), lines
    finally:
        odd.close()
        toggled.stop()
        well.stop()


def test_a_check_that_raises_is_a_failed_check_logged_and_the_others_go_on(caplog):
    """An endpoint whose check raises what check_once does not expect (here: a host name the IDNA
    codec refuses, UnicodeError) fails its own check, logged with the traceback; the other
    endpoints are still checked, round after round."""
    toggled = ThriftServer(name="toggled")
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.health"):
            with Proxy(cfg([toggled.address])) as p:
                cluster = p.server.clusters["up"]
                checker = p.server.health["up"]
                (ep,) = cluster.endpoints
                bad = Endpoint("a" * 64 + ".invalid", 9)
                p.call(cluster.set_endpoints, [ep, bad])
                wait_for(lambda: not bad.healthy, 5, "the endpoint whose check raises to be taken out")
                toggled.handler.throw = {"ping"}
                wait_for(lambda: not ep.healthy, 5, "the other endpoint to be checked (taken out)")
                toggled.handler.throw = set()
                wait_for(lambda: ep.healthy, 5, "the other endpoint to be checked (brought back)")
                assert not checker.task.done()
        raised = [r for r in caplog.records if r.name == "proxy.health" and r.exc_info]
        assert raised and raised[0].getMessage().endswith(f"{bad.label} in cluster up raised")
        lines = [r.getMessage() for r in caplog.records if r.name == "proxy.health"]
        assert any(f"{bad.label} in cluster up failed: check raised UnicodeError" in m for m in lines), lines
    finally:
        toggled.stop()


def test_stats_say_the_panic_is_over_once_health_is_back_without_a_call():
    """Both endpoints fail their checks: a call finds the cluster panicking. Both pass again:
    /stats says it is not panicking any more, with no call in between (before, the flag was
    only updated by the next call's pick)."""
    from harness import client, free_ports

    pa, pb = free_ports(2)
    with Proxy(cfg([f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"])) as p:
        def state() -> tuple[bool, list]:
            up = p.call(p.server.snapshot)["clusters"]["up"]
            return up["panicking"], sorted(p.call(lambda: [e.healthy for e in p.server.clusters["up"].endpoints]))

        wait_for(lambda: state()[1] == [False, False], timeout=5, what="both endpoints out")
        with pytest.raises(Exception), client(p.port()) as c:
            c.ping()  # (nothing listens: the call fails, the pick finds the cluster panicking)
        assert state() == (True, [False, False])
        a, b = ThriftServer(port=pa), ThriftServer(port=pb)
        try:
            wait_for(lambda: state()[1] == [True, True], timeout=5, what="both endpoints back")
            assert state()[0] is False, "/stats still says the cluster panics"
        finally:
            a.stop()
            b.stop()
