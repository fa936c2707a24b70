"""Reload and drain at the edges: rebuilt clusters, moved/renamed/removed listeners, ports in use,
health checkers, counters, the file watch, logging, and a second signal during a drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest
from thrift.Thrift import TApplicationException

from harness import (Handler, Proxy, ProxyProcess, ThriftServer, client, free_ports,
                     listening, read_messages, request_bytes, wait_for)
from proxy.codec import MessageType


def _load(text: str):
    from proxy import config as cfgmod
    return cfgmod.loads(text, "test.yaml")


def _apply(p: Proxy, text: str) -> bool:
    """Apply config text on the proxy's loop, as a SIGHUP with that file would."""
    return asyncio.run_coroutine_threadsafe(p.server.apply(_load(text)), p.loop).result(20)


def _snapshot(p: Proxy) -> dict:
    return p.call(p.server.snapshot)


def _one_listener(name: str, port: int, endpoints: str, cluster_extra: str = "", listener_extra: str = "",
                  top: str = "") -> str:
    return f"""{top}
listeners:
  - name: {name}
    service: TestService
    listen: 127.0.0.1:{port}{listener_extra}
    routes:
      - cluster: up
        retry: {{attempts: 2, idempotent: true}}
clusters:
  - name: up
    endpoints: [{endpoints}]
    load_balancer: round_robin{cluster_extra}
"""


def _concurrently(fns) -> list:
    """Run each fn in a thread; (ok, result or error text) per fn, in order."""
    out: list = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - any failure is the result
            out[i] = ("error", getattr(e, "message", None) or repr(e))

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    return threads, out


def test_reload_rebuilding_a_cluster_lets_calls_waiting_for_its_pool_finish():
    """max_connections 1 and 4 slow calls: 3 wait for the pool when a reload rebuilds the
    cluster (connect_timeout only). They are served on the old cluster, whose pool closes after."""
    up = ThriftServer()
    port = free_ports(1)[0]
    pool = "\n    pool: {max_connections: 1, acquire_timeout: 10s}"
    try:
        with Proxy(_one_listener("test", port, up.address, pool + "\n    connect_timeout: 250ms")) as p:
            def slow():
                with client(port) as c:
                    return c.sleep(300)
            threads, out = _concurrently([slow] * 4)
            wait_for(lambda: up.handler.calls >= 1, what="the first call at the upstream")
            old = p.server.clusters["up"]
            assert _apply(p, _one_listener("test", port, up.address, pool + "\n    connect_timeout: 300ms"))
            assert p.server.clusters["up"] is not old
            for t in threads:
                t.join(20)
            assert out == [("ok", 300)] * 4
            wait_for(lambda: _snapshot(p)["retiring_clusters"] == [], what="the old cluster to close")
            old_pools = [pl for ep in old.endpoints for pl in ep.pools.values()]
            assert old_pools and all(pl.closed and pl.open == 0 for pl in old_pools)
            with client(port) as c:  # and the new cluster serves
                assert c.sleep(1) == 1
    finally:
        up.stop()


def test_retry_of_a_call_started_before_a_reload_is_sent_on_its_cluster():
    """The first attempt (on A, which drops it) ends after the reload rebuilt the cluster: the
    retry still gets a connection to B from the call's own cluster."""
    ha = Handler("A")
    ha.drop_after.add("lookup")
    a, b = ThriftServer(handler=ha), ThriftServer(name="B")
    port = free_ports(1)[0]
    eps = f"{a.address}, {b.address}"
    try:
        with Proxy(_one_listener("test", port, eps, "\n    connect_timeout: 250ms")) as p:
            with client(port) as c:  # both pools warm
                assert [c.lookup("w"), c.lookup("w")] == ["B:w", "B:w"]
            ha.sleep_ms = 600
            calls_before = ha.calls

            def call():
                with client(port) as c:
                    return c.lookup("k")
            threads, out = _concurrently([call, call])
            wait_for(lambda: ha.calls > calls_before, what="an attempt at A")
            assert _apply(p, _one_listener("test", port, eps, "\n    connect_timeout: 300ms"))
            for t in threads:
                t.join(20)
            assert out == [("ok", "B:k")] * 2
    finally:
        a.stop()
        b.stop()


def test_connections_of_a_removed_listener_keep_working_on_the_old_config():
    """A reload renames and moves the listener and points the cluster elsewhere: a client still
    connected to the old listener keeps being served (old config) until it closes; /stats
    shows it; then the retired cluster closes."""
    a, b = ThriftServer(name="A"), ThriftServer(name="B")
    port, port2 = free_ports(2)
    try:
        with Proxy(_one_listener("test", port, a.address)) as p:
            kept = client(port)
            assert kept.lookup("k") == "A:k"
            old = p.server.clusters["up"]
            assert _apply(p, _one_listener("test_v2", port2, b.address))
            assert not listening(port)
            with client(port2) as c:
                assert c.lookup("k") == "B:k"
            for _ in range(3):
                assert kept.lookup("k") == "A:k"
            snap = _snapshot(p)
            assert snap["retired_listeners"] == [{"name": "test", "connections": 1, "in_flight": 0}]
            assert [c["name"] for c in snap["retiring_clusters"]] == ["up"]
            kept.close()
            wait_for(lambda: _snapshot(p)["retiring_clusters"] == [], what="the retired cluster to close")
            assert _snapshot(p)["retired_listeners"] == []
            assert all(pl.closed for ep in old.endpoints for pl in ep.pools.values())
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("source", ["dns", "file", "dns-refresh"])
def test_reload_rebuilding_a_cluster_while_its_discovery_fails_keeps_the_last_good_set(source, tmp_path):
    """Discovery fails (DNS down, the endpoints file half-written) and the cluster keeps its last
    good set; a reload then rebuilds that cluster (another key changed; "dns-refresh": the DNS
    refresh itself). The rebuilt cluster's first discovery round fails too: it keeps the set its
    predecessor had, not none. (Before, the reload succeeded and every call failed "not sent:
    cluster 'up' has no endpoints".)"""
    up = ThriftServer()
    dns_up = [True]

    async def resolver(host: str) -> list[str]:
        if not dns_up[0]:
            raise OSError(-3, "Temporary failure in name resolution")
        return ["127.0.0.1"]

    path = tmp_path / "endpoints.yaml"
    path.write_text(f"- address: 127.0.0.1:{up.port}\n")
    def text(connect_timeout: str, refresh: str = "100ms") -> str:
        endpoints = (f"{{dns: {{name: 'users.svc:{up.port}', refresh: {refresh}}}}}" if source != "file"
                     else f"{{file: '{path}'}}")
        return f"""
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:0
    routes: [{{cluster: up}}]
clusters:
  - name: up
    endpoints: {endpoints}
    connect_timeout: {connect_timeout}
"""

    try:
        with Proxy(text("250ms"), resolver=resolver) as p, client(p.port()) as c:
            assert c.lookup("a") == "upstream:a"
            if source != "file":
                dns_up[0] = False
            else:
                path.write_text("- address: [half-writ")
            time.sleep(0.6)  # (a refresh or the file watch has failed by now)
            assert c.lookup("b") == "upstream:b"  # the last good set, kept
            # the cluster is rebuilt
            assert _apply(p, text("250ms", refresh="200ms") if source == "dns-refresh" else text("300ms"))
            assert c.lookup("c") == "upstream:c"
            assert p.call(lambda: len(p.server.clusters["up"].endpoints)) == 1
    finally:
        up.stop()


def test_reload_rebuilding_a_cluster_replaces_its_health_checker():
    up = ThriftServer()
    port = free_ports(1)[0]

    def text(ct: str) -> str:
        return _one_listener("test", port, up.address, f"""
    transport: framed
    protocol: binary
    connect_timeout: {ct}
    health_check: {{interval: 100ms, timeout: 100ms, method: ping}}""")
    try:
        with Proxy(text("250ms")) as p:
            checkers = [p.server.health["up"]]
            for ct in ("260ms", "270ms"):
                assert _apply(p, text(ct))
                checkers.append(p.server.health["up"])
            current = checkers[-1]
            assert len({id(c) for c in checkers}) == 3
            assert current.cluster is p.server.clusters["up"]
            wait_for(lambda: all(c.task.done() for c in checkers[:-1]), timeout=5,
                     what="the replaced checkers to stop")
            assert not current.task.done()
            assert list(_snapshot(p)["health_checks"]) == ["up"]
    finally:
        up.stop()


def _rebuilt(port: int, good: str, dead: str, connect_timeout: str, cluster_extra: str) -> str:
    """A good and a dead endpoint; a reload to another connect_timeout rebuilds the cluster."""
    return _one_listener("test", port, f'"{good}", "{dead}"', f"""
    transport: framed
    protocol: binary
    connect_timeout: {connect_timeout}
    {cluster_extra}""")


def test_a_rebuilt_cluster_keeps_what_its_health_checks_knew():
    """A reload that rebuilds a cluster (here: another connect_timeout) starts a new checker,
    whose first round takes up to its timeout for an endpoint that never answers. Meanwhile the
    endpoint stays out, as the old checker found it; before, the new cluster took it for healthy
    and sent it calls until that first round ended (as Envoy keeps a host's health across a
    cluster update)."""
    up = ThriftServer()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    dead = "127.0.0.1:%d" % silent.getsockname()[1]
    port = free_ports(1)[0]

    def text(ct: str) -> str:
        return _rebuilt(port, up.address, dead, ct, "health_check: {interval: 30s, timeout: 2s, method: ping}")

    def health() -> dict:
        return p.call(lambda: {ep.label: ep.healthy for ep in p.server.clusters["up"].endpoints})
    try:
        with Proxy(text("250ms")) as p:
            wait_for(lambda: health() == {up.address: True, dead: False} and p.call(
                lambda: not any(ep.pending for ep in p.server.clusters["up"].endpoints)), timeout=5,
                what="the first checker to take the silent endpoint out (its check timed out)")
            old = p.call(lambda: p.server.clusters["up"])
            checks = p.call(lambda: dict(p.server.health["up"].stats))
            assert _apply(p, text("300ms"))
            assert p.call(lambda: p.server.clusters["up"]) is not old
            assert health() == {up.address: True, dead: False}  # (the new checker's round is still on)
            # the new checker's counters go on from the old one's (/metrics: counters never go back)
            assert p.call(lambda: p.server.health["up"].stats["checks"]) >= checks["checks"] >= 2
            with client(port) as c:
                assert [c.lookup(f"k{i}") for i in range(6)] == [f"upstream:k{i}" for i in range(6)]
    finally:
        silent.close()
        up.stop()


def test_a_rebuilt_cluster_keeps_its_endpoints_breakers_and_latency():
    """A reload that rebuilds a cluster (another connect_timeout) keeps what its endpoints'
    breakers knew: an ejected endpoint stays out for the rest of its open time, and its next
    opening still doubles. Before, every such reload put it back at once, closed (3 failed calls
    right after it, here), its open time reset. The latency estimate goes on too."""
    up = ThriftServer()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()  # nothing listens: connects are refused
    port = free_ports(1)[0]

    def text(ct: str) -> str:
        return _rebuilt(port, up.address, dead, ct, "circuit_breaker: {consecutive_failures: 2, open_for: 60s}")

    def breakers() -> dict:
        return p.call(lambda: {ep.label: (ep.breaker.state_name, ep.breaker.opened_count)
                               for ep in p.server.clusters["up"].endpoints})
    try:
        with Proxy(text("250ms")) as p:
            with client(port) as c:
                for i in range(8):
                    with contextlib.suppress(TApplicationException):
                        c.lookup(f"k{i}")
            assert breakers()[dead] == ("open", 1)
            old = p.call(lambda: p.server.clusters["up"])
            ewma = p.call(lambda: next(ep.ewma for ep in old.endpoints if ep.label == up.address))
            assert _apply(p, text("300ms"))
            assert p.call(lambda: p.server.clusters["up"]) is not old
            assert breakers() == {up.address: ("closed", 0), dead: ("open", 1)}
            assert p.call(lambda: p.server.clusters["up"].stats["breaker_transitions"]) == \
                old.stats["breaker_transitions"] >= 1  # (/metrics: the counter goes on)
            new = p.call(lambda: next(ep for ep in p.server.clusters["up"].endpoints if ep.label == dead))
            assert new.breaker.open_until == next(ep for ep in old.endpoints if ep.label == dead).breaker.open_until
            assert p.call(lambda: next(ep.ewma for ep in p.server.clusters["up"].endpoints
                                       if ep.label == up.address)) is ewma
            with client(port) as c:
                assert [c.lookup(f"k{i}") for i in range(6)] == [f"upstream:k{i}" for i in range(6)]
    finally:
        up.stop()


def test_a_reload_with_a_span_file_run_could_not_open_is_rejected(caplog, tmp_path):
    """Tracing settings take effect at the next restart, but one `run` would refuse (a span file
    that cannot be opened) is refused by the reload, as `run` says it. Before: applied with a
    warning, and the next restart failed (a config hunt)."""
    up = ThriftServer()
    (port,) = free_ports(1)
    try:
        with Proxy(_one_listener("test", port, up.address)) as p:
            bad = _one_listener("test", port, up.address, top=f"tracing: {{exporter: jsonl, path: '{tmp_path}'}}")
            assert not _apply(p, bad)
            assert f"reload rejected: <config>:1: tracing.path: cannot open {tmp_path}: Is a directory" in caplog.text
            good = bad.replace(f"path: '{tmp_path}'", f"path: '{tmp_path / 'spans.jsonl'}'")
            assert _apply(p, good)
            assert "tracing settings changed: they take effect at the next restart" in caplog.text
            assert p.server.reloads == {"ok": 1, "failed": 1}
    finally:
        up.stop()


def test_reload_moving_a_listener_to_a_port_in_use_keeps_the_old_one(caplog):
    """...and says why as `run` would at start: the key path and the reason (FILE:LINE in a
    process that has a config file; `<config>:1` here), naming this proxy's own listener when
    that is what holds the port."""
    up = ThriftServer()
    port, busy_port = free_ports(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", busy_port))
        busy.listen(1)
        try:
            with Proxy(_one_listener("test", port, up.address)) as p:
                kept = client(port)
                assert not _apply(p, _one_listener("test", busy_port, up.address))
                assert (f"reload rejected: <config>:1: listeners[0].listen: cannot listen on 127.0.0.1:{busy_port}: "
                        "address already in use") in caplog.text
                tls = _one_listener("test", port, up.address, "\n    tls: {ca: /nonexistent/ca.pem}")
                assert not _apply(p, tls)
                assert "reload rejected: <config>:1: clusters[0].tls.ca: cannot use /nonexistent/ca.pem" in caplog.text
                # another host on the same port: the running listener's own socket is in the way
                moved = _one_listener("test", port, up.address).replace(f"127.0.0.1:{port}", f"0.0.0.0:{port}")
                assert not _apply(p, moved)
                assert (f"cannot listen on 0.0.0.0:{port}: address already in use (by this proxy's listener "
                        f"test on 127.0.0.1:{port}: a reload cannot move a listener to another host on the "
                        "same port; restart, or move it in two reloads through another port)") in caplog.text
                assert p.server.reloads == {"ok": 0, "failed": 3}
                assert p.server.config.listeners[0].listen.port == port  # the old config goes on
                assert kept.lookup("k") == "upstream:k"
                with client(port) as c:
                    assert c.lookup("k") == "upstream:k"
                kept.close()
        finally:
            up.stop()


def test_reload_keeps_the_socket_when_only_backlog_or_the_name_changes():
    """Same address: the bound socket is kept (no moment with nothing listening); a rename
    re-keys the listener, its connections and counters go on."""
    up = ThriftServer()
    port = free_ports(1)[0]
    try:
        with Proxy(_one_listener("test", port, up.address, listener_extra="\n    backlog: 100")) as p:
            srv = p.server.servers["test"]
            kept = client(port)
            assert kept.lookup("k") == "upstream:k"
            assert _apply(p, _one_listener("test", port, up.address, listener_extra="\n    backlog: 200"))
            assert p.server.servers["test"] is srv and srv.is_serving()
            assert _apply(p, _one_listener("renamed", port, up.address, listener_extra="\n    backlog: 200"))
            assert p.server.servers["renamed"] is srv and srv.is_serving()
            assert kept.lookup("k") == "upstream:k"
            stats = _snapshot(p)["listeners"]
            assert list(stats) == ["renamed"] and stats["renamed"]["connections"] == 1
            assert stats["renamed"]["calls"] == 2
            kept.close()
    finally:
        up.stop()


def _two_listeners(pa: int | None, pb: int | None, a: str, b: str) -> str:
    """Listener A (routes to cluster a) on port pa and B (cluster b) on pb; None: not there."""
    text = "listeners:\n"
    for name, port in (("A", pa), ("B", pb)):
        if port is not None:
            text += f"""  - name: {name}
    service: TestService
    listen: 127.0.0.1:{port}
    routes:
      - cluster: {name.lower()}
"""
    return text + f"""clusters:
  - name: a
    endpoints: [{a}]
  - name: b
    endpoints: [{b}]
"""


@pytest.mark.parametrize("change", ["swap", "remove B, move A onto its port"])
def test_a_listener_moved_onto_another_ones_address_keeps_its_own_connections(change):
    """Listeners A (cluster a) and B (cluster b) with one client each. A reload that swaps their
    ports, or removes B and moves A onto B's port, keeps each bound socket (no gap in
    accepting) but every connection stays with the listener it was accepted by: A's client
    keeps reaching a (A's new config), B's keeps reaching b (B's new config, or the old one if
    B was removed). New connections go to whoever listens there now. Before: the listener that
    took a socket took its connections too, and they were routed to the other cluster."""
    up_a, up_b = ThriftServer(name="upA"), ThriftServer(name="upB")
    pa, pb = free_ports(2)
    try:
        with Proxy(_two_listeners(pa, pb, up_a.address, up_b.address)) as p:
            ca, cb = client(pa), client(pb)
            assert (ca.lookup("k"), cb.lookup("k")) == ("upA:k", "upB:k")
            sockets = {port: p.server.servers[n] for n, port in (("A", pa), ("B", pb))}
            if change == "swap":
                assert _apply(p, _two_listeners(pb, pa, up_a.address, up_b.address))
                assert p.server.servers["A"] is sockets[pb] and p.server.servers["B"] is sockets[pa]
                with client(pa) as new_b, client(pb) as new_a:
                    assert (new_a.lookup("k"), new_b.lookup("k")) == ("upA:k", "upB:k")
            else:
                assert _apply(p, _two_listeners(pb, None, up_a.address, up_b.address))
                assert p.server.servers["A"] is sockets[pb] and not listening(pa)
                with client(pb) as new_a:
                    assert new_a.lookup("k") == "upA:k"
                snap = _snapshot(p)
                assert snap["retired_listeners"] == [{"name": "B", "connections": 1, "in_flight": 0}]
                assert list(snap["listeners"]) == ["A"] and snap["listeners"]["A"]["connections"] == 1
            for _ in range(3):
                assert (ca.lookup("k"), cb.lookup("k")) == ("upA:k", "upB:k")
            ca.close()
            cb.close()
    finally:
        up_a.stop()
        up_b.stop()


def test_listener_counters_survive_a_reload():
    up = ThriftServer()
    port = free_ports(1)[0]
    text = _one_listener("test", port, up.address)
    try:
        with Proxy(text) as p:
            with client(port) as c:
                for _ in range(5):
                    c.lookup("k")
            wait_for(lambda: _snapshot(p)["listeners"]["test"]["calls"] == 5, what="5 calls counted")
            assert _apply(p, text)
            assert _apply(p, text.replace("attempts: 2", "attempts: 3"))
            with client(port) as c:
                c.lookup("k")
            assert _snapshot(p)["listeners"]["test"]["calls"] == 6
    finally:
        up.stop()


def test_reload_turns_the_file_watch_on_and_off(tmp_path):
    a, b = ThriftServer(name="A"), ThriftServer(name="B")
    port = free_ports(1)[0]
    path = tmp_path / "sidecar.yaml"

    def text(ep: str, watch: str) -> str:
        return _one_listener("test", port, ep, top=f"reload: {{watch: {watch}}}")
    path.write_text(text(a.address, "false"))
    try:
        with Proxy(text(a.address, "false"), path=str(path)) as p:
            assert p.server._watch is None
            path.write_text(text(a.address, "true"))
            assert asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(20)
            path.write_text(text(b.address, "true"))  # no signal: the watch picks it up

            def on_b() -> bool:
                with client(port) as c:
                    return c.lookup("k") == "B:k"
            wait_for(on_b, timeout=15, what="the watched file's change to be applied")
            watch = p.server._watch
            path.write_text(text(b.address, "false"))
            wait_for(lambda: p.server._watch is None and watch.done(), timeout=15,
                     what="the watch to stop when the watched file turns it off")
    finally:
        a.stop()
        b.stop()


def test_a_config_file_turned_fifo_is_refused_by_reload_without_blocking_the_loop(tmp_path, caplog):
    """A reload (SIGHUP, the admin, the file watch) reads the file on the loop's thread: a
    FIFO put in its place would hold the loop in `open()` until a writer came. It is refused,
    the old config keeps serving, and the next reload of a regular file applies. An error's
    line number is not looked up in it either."""
    import os
    from proxy import config as cfgmod
    up = ThriftServer()
    port = free_ports(1)[0]
    path = tmp_path / "sidecar.yaml"
    text = _one_listener("test", port, up.address)
    path.write_text(text)
    try:
        with Proxy(text, path=str(path)) as p:
            path.unlink()
            os.mkfifo(path)
            try:
                assert not asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(5)
                assert cfgmod.line_of_key(path, ("listeners", 0, "listen")) == 1
            finally:  # (before the fix: free the loop from its open() so that the test can end)
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            assert (f"reload rejected: {path}:0: (file): must be a regular file to be read again; "
                    "it is a FIFO now") in caplog.text
            assert p.server.reloads == {"ok": 0, "failed": 1}
            with client(port) as c:
                assert c.lookup("k") == "upstream:k"
            path.unlink()
            path.write_text(text.replace("load_balancer: round_robin", "load_balancer: random"))
            assert asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(20)
            assert p.server.config.clusters[0].load_balancer == "random"
    finally:
        up.stop()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_drain_waits_for_a_call_on_a_listener_a_reload_removed():
    up = ThriftServer()
    port, port2, admin = free_ports(3)

    def text(name: str, lport: int) -> str:
        return _one_listener(name, lport, up.address, top=f"admin: {{listen: 127.0.0.1:{admin}}}\n"
                                                          "drain_timeout: 15s")
    with ProxyProcess(text("test", port), [port, admin]) as p:
        kept = client(port)
        assert kept.lookup("k") == "upstream:k"
        p.path.write_text(text("test_v2", port2))
        p.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: listening(port2), what="the moved listener")
        threads, out = _concurrently([lambda: kept.sleep(2500)])
        wait_for(lambda: up.handler.calls >= 2, what="the slow call at the upstream")
        p.proc.send_signal(signal.SIGTERM)
        threads[0].join(20)
        kept.close()
        rc = p.proc.wait(20)
    up.stop()
    assert out == [("ok", 2500)]
    assert rc == 0


def test_reload_applies_logging_and_warns_admin_changes_wait_for_a_restart():
    up = ThriftServer()
    port, admin, admin2 = free_ports(3)

    def text(adm: int, level: str) -> str:
        return _one_listener("test", port, up.address,
                             top=f"admin: {{listen: 127.0.0.1:{adm}}}\nlogging: {{format: json, level: {level}}}")
    with ProxyProcess(text(admin, "info"), [port, admin]) as p:
        p.path.write_text(text(admin2, "debug"))
        p.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in p.output(), what="the reload")
        with client(port) as c:
            c.lookup("k")
        wait_for(lambda: any('"level": "debug"' in line for line in p.output().splitlines()), timeout=5,
                 what="debug lines after the reload turned debug on")
        assert "take effect at the next restart" in p.output()
        assert listening(admin)
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/config", timeout=5) as r:
            shown = json.load(r)  # the config in effect: the new logging, the admin still running
        assert shown["logging"]["level"] == "debug"
        assert shown["admin"]["listen"] == f"127.0.0.1:{admin}", shown["admin"]
    up.stop()


def test_second_signal_exits_at_once_while_spans_cannot_be_exported():
    """The collector accepts connections and never answers: a second SIGTERM during the drain
    exits without waiting SPAN_FLUSH_TIMEOUT for the spans."""
    from proxy.server import SPAN_FLUSH_TIMEOUT

    up = ThriftServer()
    port, hole_port = free_ports(2)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", hole_port))
        hole.listen(0)
        top = (f"drain_timeout: 30s\ntracing: {{exporter: otlp, otlp_protocol: http, "
               f"endpoint: http://127.0.0.1:{hole_port}/v1/traces, sample_ratio: 1.0}}")
        with ProxyProcess(_one_listener("test", port, up.address, top=top), [port]) as p:
            kept = client(port)
            for _ in range(50):
                kept.lookup("z")
            p.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "draining" in p.output(), what="the drain")
            t0 = time.monotonic()
            p.proc.send_signal(signal.SIGTERM)
            rc = p.proc.wait(30)
            elapsed = time.monotonic() - t0
            kept.close()
            out = p.output()
    up.stop()
    assert rc == 0
    assert elapsed < SPAN_FLUSH_TIMEOUT - 1, elapsed  # ~0.1 s; the flush would take SPAN_FLUSH_TIMEOUT
    # the loss is said with its size
    assert re.search(r"second signal \(\d+ calls' spans still queued\)|spans of \d+ calls still queued", out), out


def test_connections_keep_the_listener_settings_they_were_accepted_under():
    """A reload's listener settings are for new connections. An open one keeps its own: its idle
    timer, armed under idle_timeout 1s, must not read the new 0s ("keep idle connections") as
    "idle too long" and close a client that calls every 0.3 s; a new connection gets the new
    settings (request_read_timeout here)."""
    up = ThriftServer()
    port = free_ports(1)[0]
    text = _one_listener("test", port, up.address, listener_extra="\n    idle_timeout: 1s\n    request_read_timeout: 20s")
    try:
        with Proxy(text) as p:
            with client(port) as kept:
                for i in range(3):
                    assert kept.lookup(f"a{i}") == f"upstream:a{i}"
                    time.sleep(0.3)
                assert _apply(p, text.replace("idle_timeout: 1s", "idle_timeout: 0s").replace(
                    "request_read_timeout: 20s", "request_read_timeout: 10s"))
                for i in range(6):
                    assert kept.lookup(f"b{i}") == f"upstream:b{i}"
                    time.sleep(0.3)
                with client(port) as fresh:
                    assert fresh.lookup("c") == "upstream:c"
                    conns = p.call(lambda: sorted((c.settings.idle_timeout, c.settings.request_read_timeout)
                                                  for c in p.server.listeners["test"].connections))
                assert conns == [(0.0, 10.0), (1.0, 20.0)], conns
            assert _snapshot(p)["listeners"]["test"].get("idle_closed", 0) == 0
    finally:
        up.stop()


def test_a_reload_while_an_unframed_request_arrives_lets_the_new_route_decide_how_it_goes():
    """A buffered `echo` arriving over a reload that sends echo to a framed cluster (which the
    proxy must re-frame, so reads it whole): the new route decides. Before, the threshold worked
    out under the old route (stream past 4 MiB) held, and the new pipeline streamed the client's
    unframed bytes to the framed upstream: the call was lost, and the client told "may have run"."""
    from harness import read_messages, request_bytes
    buf, fr = ThriftServer(framing="buffered", name="BUF"), ThriftServer(framing="framed", name="FR")
    (port,) = free_ports(1)

    def cfg(echo_cluster: str) -> str:
        return f"""
listeners:
  - name: t
    listen: 127.0.0.1:{port}
    transport: buffered
    protocol: binary
    routes:
      - {{match: {{method: echo}}, cluster: {echo_cluster}, retry_buffer: 4MiB}}
      - {{cluster: buf, retry_buffer: 64KiB}}
clusters:
  - name: buf
    endpoints: [{buf.address}]
  - name: fr
    endpoints: [{fr.address}]
    transport: framed
"""
    req = request_bytes("buffered", "binary", "echo", b"z" * 6_000_000, seqid=7)
    try:
        with Proxy(cfg("buf")) as p:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(req[:200_000])
                wait_for(lambda: p.call(lambda: any(c._upload_at > 0 for c in p.server.listeners["t"].connections)),
                         5, "the old route's threshold decided")
                assert _apply(p, cfg("fr"))
                s.sendall(req[200_000:])
                (reply,) = read_messages(s, 1, "buffered", "binary", timeout=15)
    finally:
        buf.stop()
        fr.stop()
    assert reply.seqid == 7 and reply.type == 2, reply  # a REPLY, not "may have run"
    assert (buf.handler.calls, fr.handler.calls) == (0, 1)


def test_a_reload_reads_and_checks_its_file_off_the_loop_and_one_reload_at_a_time(tmp_path, monkeypatch):
    """The file, its YAML, every rule and the IDL it names are read in a worker thread: the
    loop keeps serving while a large config is checked (before: 1,000 endpoints held it for
    ~0.3 s). Two reloads asked at once still apply in the order asked."""
    from proxy import config as cfgmod
    from proxy import idl as idlmod

    up = ThriftServer()
    port = free_ports(1)[0]
    path = tmp_path / "sidecar.yaml"
    (tmp_path / "svc.thrift").write_text("service TestService { string lookup(1: string key) }\n")
    first = _one_listener("test", port, up.address, listener_extra=f"\n    idl: {tmp_path / 'svc.thrift'}")
    path.write_text(first)
    threads: dict[str, set] = {"config": set(), "idl": set()}
    real_load, real_idl = cfgmod.load, idlmod.load

    def config_load(*a, **kw):
        threads["config"].add(threading.current_thread().name)
        return real_load(*a, **kw)

    def idl_load(*a, **kw):
        threads["idl"].add(threading.current_thread().name)
        return real_idl(*a, **kw)

    try:
        with Proxy(first, path=str(path)) as p:
            loop_thread = p.call(lambda: threading.current_thread().name)
            monkeypatch.setattr(cfgmod, "load", config_load)
            monkeypatch.setattr(idlmod, "load", idl_load)
            path.write_text(first.replace("round_robin", "least_request"))
            assert asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(20)
            assert threads["config"] and loop_thread not in threads["config"], threads
            assert threads["idl"] and loop_thread not in threads["idl"], threads
            assert p.server.config.clusters[0].load_balancer == "least_request"

            async def two():  # asked in this order; the second file is written before either reads
                a = asyncio.ensure_future(p.server.reload())
                await asyncio.sleep(0)
                (tmp_path / "next.yaml").write_text(first.replace("round_robin", "random"))
                os.replace(tmp_path / "next.yaml", path)  # (as editors save: never half-written)
                b = asyncio.ensure_future(p.server.reload())
                return await asyncio.gather(a, b)

            assert asyncio.run_coroutine_threadsafe(two(), p.loop).result(20) == [True, True]
            assert p.server.config.clusters[0].load_balancer == "random"
            with client(port) as c:
                assert c.lookup("k") == "upstream:k"
    finally:
        up.stop()


def test_a_reload_asked_while_draining_binds_nothing_and_changes_nothing(tmp_path):
    up = ThriftServer()
    port, other = free_ports(2)
    path = tmp_path / "sidecar.yaml"
    text = _one_listener("test", port, up.address)
    path.write_text(text)
    try:
        with Proxy(text, path=str(path)) as p:
            c = client(port)  # (a connected client keeps the drain going)
            c.__enter__()
            try:
                p.call(p.server.request_stop)
                path.write_text(text.replace("clusters:\n", f"  - name: second\n    listen: 127.0.0.1:{other}\n"
                                                           "    routes: [{cluster: up}]\nclusters:\n"))
                assert not asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(20)
                assert list(p.server.listeners) == ["test"]
                assert not listening(other)
                assert c.lookup("k") == "upstream:k"  # the drain still serves it
            finally:
                c.__exit__(None, None, None)
            # (the drain ends once no client is connected)
            asyncio.run_coroutine_threadsafe(p.server.wait_stopped(), p.loop).result(20)
    finally:
        up.stop()


def test_a_removed_listeners_connections_close_when_quiet_and_at_drain_timeout(monkeypatch):
    """A reload removes the listener. Its connections are still served on the old config, but
    each closes once no call has been on it for RETIRED_QUIET, and any left at the reload's
    drain_timeout closes with its open call answered. Before: they were served indefinitely,
    by a replaced cluster whose discovery and health checks had stopped."""
    from proxy import server as servermod
    monkeypatch.setattr(servermod, "RETIRED_QUIET", 0.6, raising=False)
    up, other = ThriftServer(), ThriftServer(name="B")
    port, port2 = free_ports(2)
    try:
        with Proxy(_one_listener("test", port, up.address, top="drain_timeout: 4s")) as p:
            busy, quiet, slow = client(port), client(port), client(port)
            for c in (busy, quiet, slow):
                assert c.lookup("k") == "upstream:k"
            half = socket.create_connection(("127.0.0.1", port))
            assert _apply(p, _one_listener("test_v2", port2, other.address, top="drain_timeout: 4s"))
            t0 = time.monotonic()
            threads, out = _concurrently([lambda: slow.sleep(8000)])
            # a client that sends its call and half-closes: its connection is closing, its call open
            half.sendall(request_bytes("framed", "binary", "sleep", 8000, seqid=5))
            half.shutdown(socket.SHUT_WR)
            for _ in range(8):  # a call every 0.25 s: never quiet for 0.6 s
                assert busy.lookup("k") == "upstream:k"
                time.sleep(0.25)
            assert time.monotonic() - t0 >= 2.0
            with pytest.raises(Exception):  # closed after 0.6 s without a call
                quiet.lookup("k")
            time.sleep(1.0)  # busy is quiet now
            with pytest.raises(Exception):
                busy.lookup("k")
            threads[0].join(15)
            took = time.monotonic() - t0
            assert out[0][0] == "error" and out[0][1] == (
                "thrift-sidecar: may have run: its listener test was removed by a reload before its reply "
                "(drain_timeout 4s passed)"), out
            assert 3.5 <= took < 8.0, took  # (at the drain deadline, not the call's 8 s)
            half.settimeout(5)
            (answer,) = read_messages(half, 1)
            assert (answer.seqid, answer.type) == (5, MessageType.EXCEPTION)
            assert b"removed by a reload before its reply (drain_timeout 4s passed)" in answer.data
            half.close()
            wait_for(lambda: _snapshot(p)["retired_listeners"] == [] and _snapshot(p)["retiring_clusters"] == [],
                     what="the retired listener and cluster to go")
    finally:
        up.stop()
        other.stop()


def test_reloads_while_a_listener_drains_keep_one_chain_of_sweeps(monkeypatch):
    """Each reload swept retired listeners and clusters at once and started another 100 ms
    chain of sweeps: five reloads, five chains (49 sweeps a second)."""
    from proxy import server as servermod
    up = ThriftServer()
    port, port2 = free_ports(2)
    try:
        with Proxy(_one_listener("test", port, up.address)) as p:
            kept = client(port)
            assert kept.lookup("k") == "upstream:k"
            threads, out = _concurrently([lambda: kept.sleep(3000)])  # (keeps the retired listener)
            wait_for(lambda: up.handler.calls >= 2, what="the slow call at the upstream")
            for i in range(5):
                assert _apply(p, _one_listener(f"v{i}", port2, up.address))
            sweeps = []
            real = servermod.Server._sweep_retired
            monkeypatch.setattr(servermod.Server, "_sweep_retired",
                                lambda self: (sweeps.append(time.monotonic()), real(self)))
            time.sleep(1.0)
            n = len(sweeps)
            threads[0].join(10)
            assert out == [("ok", 3000)]
            assert 1 <= n <= 1.0 / servermod.RETIRE_POLL + 3, n
            kept.close()
    finally:
        up.stop()


def test_a_reload_whose_file_takes_too_long_to_check_fails_and_the_next_one_works(tmp_path, monkeypatch, caplog):
    from proxy import server as servermod
    monkeypatch.setattr(servermod, "RELOAD_READ_TIMEOUT", 0.3)
    up = ThriftServer()
    port = free_ports(1)[0]
    path = tmp_path / "sidecar.yaml"
    text = _one_listener("test", port, up.address)
    path.write_text(text)
    # an IDL whose ~200 includes take the parser well over 0.3 s (a real parse, not a stand-in)
    for i in range(200):
        (tmp_path / f"t{i}.thrift").write_text(f"struct T{i} {{ 1: i32 x, 2: string y }}\n")
    (tmp_path / "svc.thrift").write_text("".join(f'include "t{i}.thrift"\n' for i in range(200))
                                         + "service TestService { string lookup(1: string key) }\n")
    try:
        with Proxy(text, path=str(path)) as p:
            path.write_text(_one_listener("test", port, up.address, listener_extra=f"\n    idl: {tmp_path / 'svc.thrift'}"))
            t0 = time.monotonic()
            assert not asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(20)
            assert time.monotonic() - t0 < 3
            assert any("took more than 0.3s" in r.getMessage() for r in caplog.records)
            with client(port) as c:
                assert c.lookup("k") == "upstream:k"
            monkeypatch.setattr(servermod, "RELOAD_READ_TIMEOUT", 30.0)
            path.write_text(text.replace("round_robin", "random"))
            assert asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(40)
            assert p.server.config.clusters[0].load_balancer == "random"
    finally:
        up.stop()


def test_metrics_and_stats_show_the_old_clusters_until_a_reload_commits_and_counters_go_on():
    """A reload rebuilds a cluster whose first DNS round is slow. While it runs, /metrics and
    /stats still show the old cluster (its counters, its endpoint out), not the new one at 0
    with every endpoint available (Prometheus took that dip for a counter reset); after the
    commit the counters go on from where they were, also what calls still on the old cluster
    add."""
    from proxy import config as cfgmod

    up = ThriftServer()
    asked = []

    async def resolver(host):
        asked.append(host)
        if len(asked) > 1:
            await asyncio.sleep(1.0)  # the reload's first discovery round
        return ["127.0.0.1"]

    def text(ct: str) -> str:
        return f"""
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:0
    routes:
      - cluster: up
clusters:
  - name: up
    endpoints: {{dns: {{name: 'up.svc:{up.port}', refresh: 60s}}}}
    connect_timeout: {ct}
"""

    def shown() -> tuple[str, int, bool]:
        page = p.call(p.server.metrics.exposition).decode()
        retries = re.search(r'thrift_sidecar_retries_total\{cluster="up"\} (\S+)', page).group(1)
        available = re.search(r'thrift_sidecar_cluster_endpoints\{cluster="up",state="available"\} (\S+)',
                              page).group(1)
        snap = p.call(p.server.snapshot)["clusters"]["up"]
        return retries, int(float(available)), snap["retries"]

    try:
        with Proxy(text("1s"), resolver=resolver) as p:
            old = p.server.clusters["up"]

            def bump():
                old.stats["retries"] += 500
                old.endpoints[0].healthy = False  # (as a failed check leaves it)
            p.call(bump)
            assert shown() == ("500.0", 0, 500)
            fut = asyncio.run_coroutine_threadsafe(p.server.apply(cfgmod.loads(text("2s"), "t.yaml")), p.loop)
            time.sleep(0.3)
            assert not fut.done() and p.server.clusters["up"] is not old, "the test needs the reload mid-way"
            assert shown() == ("500.0", 0, 500)
            assert fut.result(20)
            p.call(old.stats.__setitem__, "retries", old.stats["retries"] + 1)  # (a call still on the old one)
            assert shown()[0] == "501.0" and shown()[2] == 501
    finally:
        up.stop()
