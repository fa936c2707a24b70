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
import time

import pytest

from harness import Proxy, RawUpstream, ThriftServer, config_text, free_port, wait_for
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


def cfg(addresses, method="ping", protocol="binary") -> str:
    return config_text(addresses, protocol=protocol, cluster_transport="framed",
                       extra_cluster=f"\n    protocol: {protocol}\n    health_check: "
                                     f"{{interval: 200ms, timeout: 200ms, method: {method}}}")


def check(port: int, method: str = "ping") -> str | None:
    return asyncio.run(check_once("127.0.0.1", port, method, Framing.FRAMED, Protocol.BINARY, 5.0))


def test_a_reply_in_another_framing_is_said_in_the_clusters_terms():
    """A health check's reply that comes unframed where the cluster says framed: the failure
    names the cluster's setting, as a call's would. Before: "bad reply: bad request: invalid
    frame length -2147418110" (a request's words, of a reply)."""
    up = Replies()
    try:
        up.reply = framed(head(2))[4:] + b"\x00"  # a REPLY to ping, without its length prefix
        assert check(up.port) == ("bad reply: an unframed binary message where the transport is framed "
                                  "(set the cluster's transport to buffered)")
    finally:
        up.close()


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


def test_an_endpoint_discovery_adds_takes_calls_only_once_its_first_check_passes(tmp_path, caplog):
    """The endpoints file gains `bad` (its check method fails, its other methods work) and `slow`
    (its check takes 1 s, then passes). Checks run every hour: only the check each gets when it
    joins can decide. Neither takes a call before a check passed (before: both took their share
    at once, and `bad` kept its share until the next round, an hour later); `/stats` says they
    wait; `slow` takes calls once its check passes; `bad` never does."""
    from harness import Handler, client

    class Counting(Handler):
        def __init__(self, name: str, ping_s: float = 0.0) -> None:
            super().__init__(name)
            self.echoes = 0
            self.ping_s = ping_s

        def ping(self):
            time.sleep(self.ping_s)
            super().ping()

        def echo(self, payload):
            with self.lock:
                self.echoes += 1
            return super().echo(payload)

    good = ThriftServer(handler=Counting("good"))
    bad = ThriftServer(handler=Counting("bad"))
    bad.handler.throw = {"ping"}
    slow = ThriftServer(handler=Counting("slow", ping_s=1.0))
    eps = tmp_path / "endpoints.yaml"
    eps.write_text(f"- {good.address}\n")
    text = cfg([]).replace("endpoints: []", f"endpoints: {{file: {eps}}}").replace(
        "interval: 200ms, timeout: 200ms", "interval: 1h, timeout: 5s")
    try:
        with caplog.at_level(logging.INFO, logger="proxy.health"), Proxy(text) as p, client(p.port()) as c:
            cluster = p.server.clusters["up"]

            def ep(server):
                return next((e for e in cluster.endpoints if e.port == server.port), None)

            def echo(n: int) -> None:
                for _ in range(n):
                    assert c.echo(b"x") == b"x"

            wait_for(lambda: ep(good) is not None and not ep(good).pending, 5, "the first endpoint checked")
            echo(10)
            eps.write_text(f"- {good.address}\n- {bad.address}\n- {slow.address}\n")
            wait_for(lambda: ep(bad) is not None and ep(slow) is not None, 5, "the added endpoints")
            assert ep(slow).pending
            shown = {e["address"]: e for e in p.call(p.server.snapshot)["clusters"]["up"]["endpoints"]}
            assert shown[slow.address]["health_check"] == "pending" and shown[slow.address]["healthy"] is False
            assert "health_check" not in shown[good.address]
            echo(30)  # (while slow's check runs)
            assert ep(slow).pending, "the test needs slow's first check still running"
            assert (bad.handler.echoes, slow.handler.echoes, good.handler.echoes) == (0, 0, 40)
            wait_for(lambda: not ep(slow).pending and not ep(bad).pending, 5, "both first checks")
            assert ep(slow).healthy and not ep(bad).healthy
            echo(40)
            assert bad.handler.echoes == 0
            assert slow.handler.echoes == 20  # (round robin over good and slow)
            assert not p.call(p.server.snapshot)["clusters"]["up"]["panicking"]
        lines = [r.getMessage() for r in caplog.records if r.name == "proxy.health"]
        assert any(f"{bad.address} in cluster up failed: TApplicationException" in m
                   and m.endswith("kept out (its first check)") for m in lines), lines
        assert any(f"first health check of {slow.address} in cluster up passes: in" in m for m in lines), lines
    finally:
        for s in (good, bad, slow):
            s.stop()


def test_a_cluster_whose_every_endpoint_waits_for_its_first_check_still_takes_calls():
    """Unknown beats none: endpoints that all wait for their first check (a cluster whose every
    address changed at once) take the calls until a check says otherwise."""
    from harness import Handler, client

    class SlowPing(Handler):
        def ping(self):
            time.sleep(1.0)
            super().ping()

    up = ThriftServer(handler=SlowPing("up"))
    try:
        with Proxy(cfg([]).replace("endpoints: []", f"endpoints: [{up.address}]").replace(
                "interval: 200ms, timeout: 200ms", "interval: 1h, timeout: 5s")) as p, client(p.port()) as c:
            (ep,) = p.server.clusters["up"].endpoints
            assert ep.pending
            assert c.echo(b"x") == b"x"
            assert ep.pending, "the test needs the first check still running"
            wait_for(lambda: ep.healthy and not ep.pending, 5, "the first check")
    finally:
        up.stop()


@pytest.mark.parametrize("unhealthy, healthy", [(1, 1), (3, 2)])
def test_thresholds_take_an_endpoint_out_and_back_after_that_many_checks_in_a_row(unhealthy, healthy):
    """The checker's rule, fed results directly: `unhealthy_threshold` checks in a row that got
    no answer take an endpoint out, `healthy_threshold` passes in a row bring it back; a result
    that agrees with the endpoint's state starts the count again. Its first check decides alone,
    and an answer that says it is not well (an exception) takes it out at once (Envoy's too)."""
    from types import SimpleNamespace

    from proxy.health import HealthChecker

    checker = HealthChecker(SimpleNamespace(name="c", checker=None), "ping", 1.0, 1.0, unhealthy, healthy)
    ep = Endpoint("127.0.0.1", 9)
    checker.adopt(ep)  # (not started: pending, its first check is the first result)
    trail = []
    for passed in [False, True,                          # first check fails: out at once; then one pass
                   True, True, False, True, True, True,  # back after `healthy` passes in a row
                   False, False, True, False, False, False, False]:
        checker._record(ep, None if passed else "no reply within 5ms")
        trail.append(ep.healthy)
    if (unhealthy, healthy) == (1, 1):
        assert trail == [False, True, True, True, False, True, True, True,
                         False, False, True, False, False, False, False]
    else:
        assert trail == [False, False, True, True, True, True, True, True,
                         True, True, True, True, True, False, False]
    # (the first check's "kept out" is no change of state: only later flips are counted)
    flips = sum(a != b for a, b in zip(trail, trail[1:]))
    assert checker.stats["taken_out"] + checker.stats["brought_back"] == flips
    assert not ep.pending
    for _ in range(healthy):
        checker._record(ep, None)
    assert ep.healthy
    checker._record(ep, "TApplicationException INTERNAL_ERROR: down for maintenance")
    assert not ep.healthy  # (an answer: at once, whatever the threshold)


def test_thresholds_are_read_from_the_config_and_logged(caplog):
    """unhealthy_threshold 2: a check the server answers with an exception takes the endpoint
    out at once; two passes bring it back; with the server gone (connects refused) the first
    failed check is logged (1 of 2) and the second takes it out."""
    up = ThriftServer(name="up")
    port = up.port
    text = cfg([up.address]).replace("method: ping}", "method: ping, unhealthy_threshold: 2, healthy_threshold: 2}")
    try:
        with caplog.at_level(logging.INFO, logger="proxy.health"), Proxy(text) as p:
            checker = p.server.health["up"]
            (ep,) = p.server.clusters["up"].endpoints
            assert (checker.unhealthy_threshold, checker.healthy_threshold) == (2, 2)
            wait_for(lambda: ep.healthy and not ep.pending, 5, "the first check")
            failures = checker.stats["failures"]
            up.handler.throw = {"ping"}
            wait_for(lambda: not ep.healthy, 5, "the answered check")
            assert checker.stats["taken_out"] == 1 and checker.stats["failures"] == failures + 1
            up.handler.throw = set()
            wait_for(lambda: ep.healthy, 5, "two passing checks")
            assert checker.stats["brought_back"] == 1
            up.stop()
            wait_for(lambda: not ep.healthy, 5, "two refused connects")
            assert checker.stats["taken_out"] == 2
        lines = [r.getMessage() for r in caplog.records if r.name == "proxy.health"]
        assert any("failed: connect failed:" in m and m.endswith("(1 of 2 in a row to take it out)")
                   for m in lines), lines
        assert any(m.startswith(f"health check ping() of 127.0.0.1:{port} in cluster up failed (2 in a row): "
                                "connect failed") for m in lines), lines
    finally:
        up.stop()


def test_a_rebuilt_cluster_s_endpoints_keep_their_check_streak():
    """unhealthy_threshold 3, the server gone: each reload that rebuilds the cluster starts a new
    checker, whose first round checks at once. The endpoint's failed checks in a row go on from
    the old cluster's (1, 2, then 3: out). Were the streak not carried, every rebuild would count
    from 0 again and the endpoint would stay in, its connects refused, for as long as reloads
    come more often than the threshold's checks (here: every round is a rebuild's first)."""
    from proxy import config as cfgmod

    up = ThriftServer(name="up")
    port = free_port()

    def text(timeout_ms: int) -> str:
        return (cfg([up.address]).replace("127.0.0.1:0", f"127.0.0.1:{port}")
                .replace("interval: 200ms, timeout: 200ms, method: ping}",
                         f"interval: 1h, timeout: {timeout_ms}ms, method: ping, unhealthy_threshold: 3}}"))

    try:
        with Proxy(text(200)) as p:
            (ep,) = p.server.clusters["up"].endpoints
            wait_for(lambda: ep.healthy and not ep.pending, 5, "the first check")
            up.stop()
            seen = []
            for n in (1, 2, 3):  # (each reload changes the check's timeout: the cluster is rebuilt)
                checks = p.server.health["up"].stats["checks"]
                assert asyncio.run_coroutine_threadsafe(
                    p.server.apply(cfgmod.loads(text(200 + n), "test.yaml")), p.loop).result(20)
                checker = p.server.health["up"]
                (ep,) = p.server.clusters["up"].endpoints
                wait_for(lambda: checker.stats["checks"] > checks, 5, f"rebuild {n}'s first round")
                seen.append(p.call(lambda: (ep.healthy, ep.streak)))
            assert seen == [(True, 1), (True, 2), (False, 0)]
            assert checker.stats["taken_out"] == 1
    finally:
        up.stop()


def test_metrics_show_each_clusters_endpoints_by_state_its_connections_and_checks():
    """/metrics, per cluster: `good` available, `sick` failing its check, `flaky` (its check
    passes, its lookups fail) ejected by its breaker, `slow` pending (its first check takes
    1 s); not panicking (max_open_percent 100); connections busy/idle; checks by result. A
    scrape changes nothing: the open breaker stays open however often it is looked at."""
    from prometheus_client.parser import text_string_to_metric_families
    from thrift.Thrift import TApplicationException

    from harness import Handler, client

    class SlowPing(Handler):
        def ping(self):
            time.sleep(1.0)
            super().ping()

    good, sick, flaky = ThriftServer(name="good"), ThriftServer(name="sick"), ThriftServer(name="flaky")
    slow = ThriftServer(handler=SlowPing("slow"))
    sick.handler.throw = {"ping"}
    flaky.handler.throw = {"lookup"}
    text = cfg([good.address, sick.address, flaky.address]) + (
        "    circuit_breaker: {consecutive_failures: 2, open_for: 60s, max_open_percent: 100}\n")

    def scrape() -> dict:
        out = {}
        for fam in text_string_to_metric_families(p.call(p.server.metrics.exposition).decode()):
            for s in fam.samples:
                if s.labels.get("cluster") == "up":
                    out[(s.name, s.labels.get("state") or s.labels.get("result"))] = s.value
        return out
    try:
        with Proxy(text) as p:
            cluster = p.server.clusters["up"]
            by_port = {ep.port: ep for ep in cluster.endpoints}
            wait_for(lambda: not any(ep.pending for ep in cluster.endpoints) and not by_port[sick.port].healthy,
                     5, "the first checks")
            with client(p.port()) as c:
                for i in range(8):
                    try:
                        c.lookup(f"k{i}")
                    except TApplicationException:
                        pass
            assert by_port[flaky.port].breaker.state_name == "open"
            p.call(cluster.set_endpoints, [*cluster.endpoints, Endpoint("127.0.0.1", slow.port)])
            m = scrape()
            assert {k[1]: v for k, v in m.items() if k[0] == "thrift_sidecar_cluster_endpoints"} == {
                "available": 1, "ejected": 1, "failing_health_check": 1, "pending_health_check": 1}
            assert m[("thrift_sidecar_cluster_panicking", None)] == 0
            assert m[("thrift_sidecar_breaker_transitions_total", None)] >= 1
            assert m[("thrift_sidecar_health_checks_total", "failed")] >= 1
            assert m[("thrift_sidecar_health_checks_total", "passed")] >= 2
            assert m[("thrift_sidecar_upstream_connections", "busy")] == 0
            assert m[("thrift_sidecar_upstream_connections", "idle")] >= 1
            for _ in range(3):
                scrape()
            assert by_port[flaky.port].breaker.state_name == "open"
            # a pending endpoint whose breaker opened is judged out, as a pick judges it: ejected
            ep_slow = next(e for e in cluster.endpoints if e.port == slow.port)

            def fail_twice():
                for _ in range(2):
                    ep_slow.breaker.record(False, ep_slow.breaker.on_pick())
            p.call(fail_twice)
            assert ep_slow.pending, "the test needs slow's first check still running"
            m = scrape()
            assert {k[1]: v for k, v in m.items() if k[0] == "thrift_sidecar_cluster_endpoints"} == {
                "available": 1, "ejected": 2, "failing_health_check": 1, "pending_health_check": 0}
    finally:
        for s in (good, sick, flaky, slow):
            s.stop()


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_check_seqids_wrap_within_an_i32(protocol):
    """Each check takes the next seqid; past 2**31-1 they start again at 1. Before: the next
    check could not be encoded (binary) or came back negative (compact), and every check of
    every endpoint failed from then on (~6 h for 1,000 endpoints checked every 10 ms)."""
    up = ThriftServer(protocol=protocol)
    text = cfg([up.address], protocol=protocol)
    try:
        with Proxy(text) as p:
            checker = p.server.health["up"]
            (ep,) = p.server.clusters["up"].endpoints
            wait_for(lambda: checker.stats["checks"] >= 1, 5, "a first check")
            p.call(setattr, checker, "_seqid", 2**31 - 3)
            wait_for(lambda: checker.stats["checks"] >= 6, 5, "checks past the wrap")
            assert checker.stats["failures"] == 0 and ep.healthy
            assert 1 <= checker._seqid < 100
    finally:
        up.stop()


def test_a_hung_endpoint_s_check_holds_back_no_other_endpoint_s_result():
    """Three endpoints: one accepts and never answers, one is live, one refuses. With checks
    every 2 s and a 2 s timeout, the live endpoint is in (and the refusing one out) as soon as
    their own checks answer, not when the hung one's times out; and the next round starts an
    interval after the last one started, not after its slowest check. Before: all three stayed
    pending for 2 s (results recorded once the round's slowest check ended; calls went to the
    hung one meanwhile), and rounds came every 4 s."""
    class Hung(RawUpstream):
        def _one(self, c) -> None:
            with contextlib.suppress(OSError):
                while c.recv(4096):
                    pass

    hung, live = Hung(), ThriftServer()
    refused = f"127.0.0.1:{free_port()}"
    try:
        text = cfg([hung.address, live.address, refused]).replace(
            "interval: 200ms, timeout: 200ms", "interval: 2s, timeout: 2s")
        with Proxy(text) as p:
            eps = {ep.label: ep for ep in p.server.clusters["up"].endpoints}
            t0 = time.monotonic()
            wait_for(lambda: p.call(lambda: not eps[live.address].pending and not eps[refused].pending), 1.9,
                     "the live and the refusing endpoints' first checks")
            took = time.monotonic() - t0
            assert p.call(lambda: (eps[live.address].healthy, eps[refused].healthy, eps[hung.address].pending)) \
                == (True, False, True)
            checks = p.call(lambda: p.server.clusters["up"].checker.stats["checks"])
            time.sleep(2.6)
            # by ~2.7 s: the hung one's first check timed out (2 s), and the second round (2 s)
            # checked the live and the refusing ones again
            more = p.call(lambda: p.server.clusters["up"].checker.stats["checks"]) - checks
        print(f"live in after {took:.2f} s; {more} checks in 2.6 s")
        assert more >= 3, more
    finally:
        hung.close()
        live.stop()
