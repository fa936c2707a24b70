"""The resilience counters come back to idle however a call ends, over real sockets.

`limits` (requests, pending, retries), each endpoint's `outstanding` and breaker (probe slots),
the pools' open/busy/waiting connections and the retry budget: after the calls below end in the
unusual ways (the client resets mid-call, a retry refused at once, clients that go away, a
backoff past the deadline, waits given up), every counter is back where it started and the
next calls are served. Each test failed before the fix it covers.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from harness import (Proxy, RawUpstream, ThriftServer, app_exception, client, free_port, read_messages,
                     reply_bytes, request_bytes)


class Scripted(RawUpstream):
    """Each request (numbered from 1) is answered ("reply"), left unanswered ("hang") or its
    connection closed ("close"), as `behave(n, name)` says."""

    def __init__(self, behave) -> None:
        self.behave = behave
        self.n = 0
        self.lock = threading.Lock()
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        for name, seqid in self.requests(c):
            with self.lock:
                self.n += 1
                n = self.n
            what = self.behave(n, name)
            if what == "reply":
                c.sendall(reply_bytes(name, seqid))
            elif what == "close":
                c.close()
                return


def _reset(s: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed client's kernel does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _send(port: int, method: str, *args, seqid: int = 1) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(request_bytes("framed", "binary", method, *args, seqid=seqid))
    return s


def _answer(s: socket.socket, timeout: float = 5.0) -> str:
    (m,) = read_messages(s, 1, timeout=timeout)
    return app_exception(m).message if m.type == 3 else "ok"


def _config(upstream: str, route: str = "", cluster: str = "") -> str:
    """One listener, one route to cluster `up` (`route`, `cluster`: their extra keys)."""
    return f"""
listeners:
  - name: test
    listen: 127.0.0.1:0
    routes:
      - cluster: up{route}
clusters:
  - name: up
    endpoints: [{upstream}]{cluster}
"""


def _state(p, cluster: str = "up") -> dict:
    """What must be back to idle: limits, and per endpoint outstanding, breaker, probes, pools."""
    c = p.call(p.server.snapshot)["clusters"][cluster]
    limits = {k: c["limits"][k] for k in ("requests", "pending", "retries")}
    eps = [(e["outstanding"], e["breaker"], e["breaker_detail"]["probes"],
            [(pl["busy"], pl["waiting"]) for pl in e["pools"]]) for e in c["endpoints"]]
    return {"limits": limits, "endpoints": eps, "budget_retries": c["retry_budget"]["retries"]}


def _idle(state: dict) -> bool:
    return (all(v == 0 for v in state["limits"].values())
            and all(out == 0 and probes == 0 and all(pl == (0, 0) for pl in pools)
                    for out, _, probes, pools in state["endpoints"]))


def _settle(p, within: float = 3.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        state = _state(p)
        if _idle(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.mark.parametrize("probe", [False, True], ids=["closed", "half_open_probe"])
def test_client_reset_while_the_upstream_is_silent_frees_the_connection(probe):
    """The client resets while its request waits for a reply that never comes: the upstream
    connection is closed at once (nothing would bound the wait: the route timeout goes with the
    call), the endpoint is not blamed, and a half-open probe slot is given back. Before: the
    pool's only connection stayed busy forever (every later call: no connection within
    acquire_timeout), or the breaker stayed half-open with its probe slot taken."""
    if probe:  # the first request's connection is closed (a failure: the breaker opens)
        up = Scripted(lambda n, name: {1: "close", 2: "hang"}.get(n, "reply"))
    else:
        up = Scripted(lambda n, name: "hang" if n == 1 else "reply")
    breaker = "\n    circuit_breaker: {consecutive_failures: 1, open_for: 200ms}" if probe else ""
    with Proxy(_config(up.address, "\n        timeout: 300ms",
                       "\n    pool: {max_connections: 1, acquire_timeout: 200ms}" + breaker)) as p:
        port = p.port()
        if probe:
            with _send(port, "lookup", "k") as s:
                assert "may have run" in _answer(s)
            assert _state(p)["endpoints"][0][1] == "open"
            time.sleep(0.3)  # past open_for: the next call is the half-open probe
        s = _send(port, "lookup", "k", seqid=7)
        time.sleep(0.15)
        state = _state(p)
        assert state["endpoints"][0][0] == 1  # written, waiting for its reply
        if probe:
            assert state["endpoints"][0][1:3] == ("half_open", 1)
        _reset(s)
        state = _settle(p)
        assert _idle(state), state
        expected = "half_open" if probe else "closed"  # (the client's going says nothing about it)
        assert state["endpoints"][0][1] == expected, state
        for seqid in range(3):
            with _send(port, "lookup", "k", seqid=seqid) as s2:
                assert _answer(s2) == "ok"
        assert _idle(_settle(p))
    up.close()


def test_a_retry_refused_at_once_leaves_its_retry_slot_once():
    """max_pending 1: call B's retry waits for the only connection (a retry slot taken); call C
    is refused by max_pending, retries, and is refused again. Before: C's retry gave its slot
    back twice, so B's retry ending raised inside the pipeline: B was never answered and its
    max_requests slot never came back."""
    up = Scripted(lambda n, name: "hang" if n == 1 else "reply")
    with Proxy(_config(up.address, "\n        retry: {attempts: 2, backoff: {base: 50ms, max: 50ms}}",
                       "\n    pool: {max_connections: 1, acquire_timeout: 400ms}"
                       "\n    limits: {max_pending: 1, max_requests: 4, max_retries: 16}")) as p:
        port = p.port()
        a = _send(port, "lookup", "k", seqid=1)  # holds the only connection: no reply
        time.sleep(0.1)
        b = _send(port, "lookup", "k", seqid=2)  # waits, times out at 400 ms, retries: waits again
        time.sleep(0.55)
        assert _state(p)["limits"]["retries"] == 1
        c = _send(port, "lookup", "k", seqid=3)
        assert "max_pending" in _answer(c)
        assert _state(p)["limits"]["retries"] == 1  # B's retry still holds its slot
        assert "acquire_timeout" in _answer(b)      # B answered (before: never)
        for u in up.conns:
            u.shutdown(socket.SHUT_RDWR)
        assert "may have run" in _answer(a)
        for s in (a, b, c):
            s.close()
        assert _idle(_settle(p)), _state(p)
        for seqid in range(5):  # max_requests 4: a leaked slot would refuse some of these
            with _send(port, "lookup", "k", seqid=seqid) as s:
                assert _answer(s) == "ok"
    up.close()


def _client_gone_upload(port: int, how: str) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(request_bytes("framed", "binary", "echo", os.urandom(2_000_000), seqid=1)[:300_000])
    time.sleep(0.2)
    if how == "reset":
        _reset(s)
        return
    s.shutdown(socket.SHUT_WR)  # half-closed inside its request: answered "bad request"
    assert "bad request" in _answer(s)
    s.close()


def _client_gone_reply(port: int, how: str) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(request_bytes("framed", "binary", "get_users", 30000, 0, seqid=1))
    s.recv(1)  # the reply streams: the client takes a byte, then resets
    time.sleep(0.3)
    _reset(s)


@pytest.mark.parametrize("gone", [("upload", "reset"), ("upload", "half-close"), ("reply", "reset")],
                         ids=["reset_mid_request", "half_close_mid_request", "reset_mid_streamed_reply"])
def test_clients_that_go_away_do_not_open_a_healthy_endpoints_breaker(gone):
    """consecutive_failures 3: three clients leave in the middle of a streaming request or
    reply. The endpoint did nothing wrong: its breaker stays closed and the next call goes
    through (before: open, "no endpoint available")."""
    srv = ThriftServer(name="healthy")
    with Proxy(_config(srv.address, cluster="\n    circuit_breaker: "
                                            "{consecutive_failures: 3, open_for: 30s, max_open_percent: 100}")) as p:
        port = p.port()
        where, how = gone
        for _ in range(3):
            (_client_gone_upload if where == "upload" else _client_gone_reply)(port, how)
            time.sleep(0.2)
        state = _settle(p)
        assert state["endpoints"][0][1] == "closed", state
        assert _idle(state), state
        with client(port) as c:
            assert c.lookup("y") == "healthy:y"
    srv.stop()


def test_a_retry_whose_backoff_passes_the_deadline_spends_no_budget():
    """The backoff (up to 20 s, full jitter) would pass the route deadline (200 ms): no retry
    happens (but for a rare short draw), and none is paid for. Before: each such call withdrew
    from the retry budget, which then refused another route's real retry."""
    dead = f"127.0.0.1:{free_port()}"  # connect refused: not sent, always retryable
    with Proxy(f"""
listeners:
  - name: test
    listen: 127.0.0.1:0
    routes:
      - match: {{method: lookup}}
        cluster: up
        timeout: 200ms
        retry: {{attempts: 2, backoff: {{base: 20s, max: 20s}}}}
      - cluster: up
        retry: {{attempts: 2, backoff: {{base: 1ms, max: 1ms}}}}
clusters:
  - name: up
    endpoints: [{dead}]
    circuit_breaker: {{consecutive_failures: 0, failure_rate: 0.0}}
    retry_budget: {{ratio: 0.0, min_per_second: 0.5, window: 10s}}
""") as p:
        port = p.port()
        for seqid in range(6):
            with _send(port, "lookup", "k", seqid=seqid) as s:
                assert "connect to" in _answer(s)
        stats = p.call(p.server.snapshot)
        retried = stats["listeners"]["test"]["retries"]  # (full jitter: a rare short backoff retries)
        assert retried <= 2, retried
        assert stats["clusters"]["up"]["retry_budget"]["retries"] == retried  # paid only for retries made
        with _send(port, "count", "k") as s:
            assert "connect to" in _answer(s)
        snap = p.call(p.server.snapshot)
        stats = snap["listeners"]["test"]
        assert (stats["retries"], stats["retries_refused_budget"]) == (retried + 1, 0)
        # the cluster counts them too, and /metrics shows its counts
        assert (snap["clusters"]["up"]["retries"], snap["clusters"]["up"]["retries_refused_budget"]) == (retried + 1, 0)
        page = p.call(p.server.metrics.exposition).decode()
        assert f'thrift_sidecar_retries_total{{cluster="up"}} {retried + 1}.0' in page, page
        assert 'thrift_sidecar_retries_refused_total{cluster="up",reason="budget"} 0.0' in page


def test_waits_given_up_leave_the_pools_queue():
    """50 calls time out waiting for the pool's only (busy) connection: none stays queued.
    Before: each stayed in the pool's waiters, holding its call and request, counted as
    `waiting` in /stats, until a connection came free."""
    up = Scripted(lambda n, name: "hang" if name == b"sleep" else "reply")
    with Proxy(f"""
listeners:
  - name: test
    listen: 127.0.0.1:0
    routes:
      - match: {{method: sleep}}
        cluster: up
      - cluster: up
        timeout: 100ms
clusters:
  - name: up
    endpoints: [{up.address}]
    pool: {{max_connections: 1, acquire_timeout: 5s}}
""") as p:
        port = p.port()
        holder = _send(port, "sleep", 1, seqid=1)  # holds the only connection
        time.sleep(0.1)
        for seqid in range(50):
            with _send(port, "lookup", "k", seqid=seqid) as s:
                assert "route timeout 100ms while waiting for a connection" in _answer(s)
        (pool,) = p.server.clusters["up"].endpoints[0].pools.values()
        assert len(pool.waiters) == 0
        assert _state(p)["endpoints"][0][3] == [(1, 0)]  # the holder's connection, no one waiting
        holder.close()
    up.close()


def test_a_held_request_started_by_a_reply_finds_the_replys_max_requests_slot_free():
    """max_requests 1, max_inflight 1, two pipelined pings: the second is held until the first
    is answered, and writing that reply starts it. The first call's slot must be free by then
    (a review found an early version of a hot-path change released it after the write: the
    second ping failed with "max_requests 1 calls in flight")."""
    up = ThriftServer()
    try:
        with Proxy(_config(up.address, cluster="\n    limits: {max_requests: 1}")) as p:
            state = p.server.listeners["test"]
            object.__setattr__(state.settings, "max_inflight", 1)
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "ping", seqid=1)
                          + request_bytes("framed", "binary", "ping", seqid=2))
                s.settimeout(5)
                replies = read_messages(s, 2)
            stats = state.pipeline.stats
    finally:
        up.stop()
    assert [m.type for m in replies] == [2, 2], replies
    assert stats["limit_rejections"] == 0


def _completed(p) -> list:
    """The calls the test listener's pipeline records from now on (as metrics, spans and the
    access log see them), in the order they finish."""
    done = []
    p.server.listeners["test"].pipeline.on_complete = done.append
    return done


def test_requests_held_at_max_inflight_are_recorded_and_never_started_when_the_client_resets():
    """max_inflight 1; one write carries sleep(300) then three incr; the client resets at 100 ms.
    Reading is paused (the held requests), so the reset shows only when sleep's reply is
    written: nothing is started after that (the upstream never sees an incr for a client that
    is gone), and each held incr is still recorded, client_gone. Before: the failed write
    resumed reading and started the first incr upstream, and the other two vanished from every
    record (found by a conservation hunt)."""
    up = ThriftServer()
    try:
        with Proxy(_config(up.address).replace("    routes:", "    max_inflight: 1\n    routes:")) as p:
            done = _completed(p)
            s = socket.create_connection(("127.0.0.1", p.port()))
            s.sendall(request_bytes("framed", "binary", "sleep", 300, seqid=1) + b"".join(
                request_bytes("framed", "binary", "incr", "k", seqid=i) for i in (2, 3, 4)))
            time.sleep(0.1)
            _reset(s)
            deadline = time.monotonic() + 5
            while len(done) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # (an incr started late would reach the upstream by now)
            stats = dict(p.server.listeners["test"].pipeline.stats)
    finally:
        up.stop()
    assert up.handler.calls == 1  # sleep only: no incr ran
    got = sorted((c.msg.seqid, c.msg.name, c.outcome, c.error_type) for c in done)
    assert got == [(1, "sleep", "success", "not_delivered")] + [
        (i, "incr", "client_gone", "client_gone") for i in (2, 3, 4)], got
    assert all("held back at max_inflight" in c.error for c in done if c.msg.name == "incr")
    assert stats["calls"] == 4 and stats["client_gone"] == 3, stats


def test_client_gone_counts_only_calls_without_an_answer():
    """sleep(300), then two pings answered behind it; the client resets at 100 ms: /stats'
    client_gone is 1 (the sleep), as calls_total{outcome="client_gone"} and the spans say; the
    pings, answered but never written, are not_delivered. Before: 3 (every call cancelled)."""
    up = ThriftServer()
    try:
        with Proxy(_config(up.address)) as p:
            done = _completed(p)
            s = socket.create_connection(("127.0.0.1", p.port()))
            s.sendall(request_bytes("framed", "binary", "sleep", 300, seqid=1) + b"".join(
                request_bytes("framed", "binary", "ping", seqid=i) for i in (2, 3)))
            deadline = time.monotonic() + 5
            while up.handler.calls < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)
            _reset(s)
            while len(done) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            stats = dict(p.server.listeners["test"].pipeline.stats)
    finally:
        up.stop()
    got = sorted((c.msg.seqid, c.outcome, c.error_type) for c in done)
    assert got == [(1, "client_gone", "client_gone"), (2, "success", "not_delivered"),
                   (3, "success", "not_delivered")], got
    assert stats["client_gone"] == 1, stats
