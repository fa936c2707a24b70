"""`thrift-sidecar hops` on span files recorded from synthetic calls.

The span files are made the way the sidecar makes them: real `Call`/`Attempt` objects with
hand-set hop timestamps (as in `test_telemetry_fixtures`), handed to `Telemetry.finished`, whose
export queue builds the spans and writes them with the jsonl exporter. Then `hops` must name the
hop each scenario made slow, in its verdict (the last line of its output):

    slow service          service_time
    slow reader, large    write_response (a streamed reply; the client paused the stream)
    slow reader, small    write_response (a small reply the client reads after a pause)
    slow upstream stream  read_response  (a streamed reply; the upstream was slow to send)
    pool exhaustion       acquire
    slow sender           read_request
    loop stall            loop lag (even though the stall stretched service_time)
    pipelined             queued
    retries               backoff

`test_hops_jaeger` reuses these scenario builders against a real Jaeger.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from proxy import spans
from proxy.calls import NOT_SENT, SUCCESS, TIMEOUT, Call
from proxy.config import Tracing
from proxy.endpoint import Endpoint
from proxy.hops import analyse, load_jsonl, rebuild_calls
from proxy.telemetry import Telemetry

import test_telemetry_fixtures as fx

ROOT = Path(__file__).resolve().parent.parent

SERVICE = "TestService"
BASE = fx.BASE
ms = fx.ms
CLIENT1 = SimpleNamespace(peer=("127.0.0.1", 51515))
CLIENT2 = SimpleNamespace(peer=("127.0.0.1", 51516))
EP1 = Endpoint("127.0.0.1", 9191)
EP2 = Endpoint("127.0.0.2", 9192)
EP3 = Endpoint("127.0.0.3", 9193)
SPACING = 2000.0  # ms between the starts of consecutive synthetic calls


# --------------------------------------------------------------------------------------------
# Building calls


def build(i: int, *, method: str = "get_user", read_request: float = 0.1, attempts=None,
          backoff: float = 0.0, queued: float = 0.0, write_response: float = 0.3, handed: float = 0.01,
          stream: dict | None = None, loop_lag: float = 0.0, reply_size: int = 300, conn=CLIENT1) -> Call:
    """The i-th call of a scenario (starting i·SPACING ms after BASE); durations in ms.

    `attempts`: dicts of `ep, acquire, write, service, read, outcome` (`service=None`: failed
    before a reply, e.g. `acquire` refused); a `backoff` separates consecutive attempts.
    `stream`: `{read, tail, paused, waited}` makes the last reply streamed: write_response starts
    with the first reply byte and ends `tail` ms after the last one was read.
    """
    t0 = i * SPACING
    c = Call(conn, fx.FakeMsg(method, seqid=i + 1, size=120), BASE + ms(t0), BASE + ms(t0 + read_request))
    c.route = fx.route(slow_call=10.0)
    at = t0 + read_request + 0.001
    specs = attempts or [{}]
    for n, spec in enumerate(specs, 1):
        last = n == len(specs)
        ep = spec.get("ep", EP1)
        service = spec.get("service", 10.0)
        read = None if (last and stream) else spec.get("read", 0.2)
        a = fx.attempt(c, ep, n, at, acquire=spec.get("acquire", 0.05), write=spec.get("write", 0.05),
                       service=service, read=read, outcome=spec.get("outcome", SUCCESS), reply_size=reply_size)
        if service is None and spec.get("fail_after") is not None:
            a.t_reply = (a.t_written or a.t_acquired or a.t_acquire) + ms(spec["fail_after"])
        if n > 1:
            a.retry_reason = specs[n - 2].get("outcome", TIMEOUT)
        end = a.t_reply or a.t_written or a.t_acquired or a.t_acquire
        if not last:
            b0 = end + ms(0.01)
            c.backoffs.append((b0, b0 + ms(backoff)))
            at = (b0 + ms(backoff) - BASE) / 1e6 + 0.01
    a = c.attempts[-1]
    c.written = True
    c.outcome = SUCCESS
    c.reply = b"r" * min(reply_size, 1000)
    c.reply_size = reply_size
    if stream:
        a.t_reply = a.t_first_reply + ms(stream["read"])
        c.streamed = True
        c.client_paused_ns = ms(stream.get("paused", 0.0))
        c.upstream_wait_ns = ms(stream.get("waited", 0.0))
        c.t_done = a.t_first_reply + ms(0.05)
        c.t_write = a.t_first_reply + ms(0.06)
        c.t_handed = a.t_reply + ms(0.5)
        c.t_acked = a.t_reply + ms(stream.get("tail", 1.0))
    else:
        c.t_done = a.t_reply + ms(0.02)
        c.t_write = c.t_done + ms(queued or 0.005)
        c.waited = bool(queued)
        c.t_handed = c.t_write + ms(min(handed, write_response))
        c.t_acked = c.t_write + ms(write_response)
    c.loop_lag_ns = ms(loop_lag)
    return c


def shift(c: Call, ns: int) -> Call:
    """Move a call (every timestamp) `ns` later."""
    c.t_start += ns
    c.t_framed += ns
    for a in c.attempts:
        for f in ("t_acquire", "t_acquired", "t_written", "t_first_reply", "t_reply"):
            if getattr(a, f):
                setattr(a, f, getattr(a, f) + ns)
    c.backoffs = [(b0 + ns, b1 + ns) for b0, b1 in c.backoffs]
    for f in ("t_done", "t_write", "t_handed", "t_acked"):
        if getattr(c, f):
            setattr(c, f, getattr(c, f) + ns)
    return c


def _jitter(rng: random.Random, x: float) -> float:
    return round(x * rng.uniform(0.8, 1.25), 3)


def slow_service(n=20, seed=1):
    rng = random.Random(seed)
    return [build(i, attempts=[{"service": _jitter(rng, 250.0)}]) for i in range(n)]


def slow_reader_large(n=12, seed=2):
    """15 MB replies streamed to a client that reads slowly: the stream is held back by the client."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        read = _jitter(rng, 400.0)
        calls.append(build(i, method="list_users", reply_size=15_000_000, attempts=[{"service": 20.0}],
                           stream={"read": read, "tail": 60.0, "paused": read * 0.85, "waited": 8.0}))
    return calls


def slow_upstream_stream(n=12, seed=3):
    """15 MB replies the upstream sends slowly to a fast client: read_response, not write_response."""
    rng = random.Random(seed)
    return [build(i, method="list_users", reply_size=15_000_000, attempts=[{"service": 20.0}],
                  stream={"read": _jitter(rng, 400.0), "tail": 0.5, "paused": 1.0, "waited": 350.0})
            for i in range(n)]


def slow_reader_small(n=20, seed=4):
    """A 300-byte reply the kernel takes at once; the client acknowledges it only after a pause."""
    rng = random.Random(seed)
    return [build(i, attempts=[{"service": 5.0}], write_response=_jitter(rng, 300.0), handed=0.01)
            for i in range(n)]


def pool_exhaustion(n=20, seed=5):
    rng = random.Random(seed)
    return [build(i, attempts=[{"acquire": _jitter(rng, 150.0), "service": 5.0}]) for i in range(n)]


def slow_sender(n=20, seed=6):
    rng = random.Random(seed)
    return [build(i, read_request=_jitter(rng, 200.0), attempts=[{"service": 5.0}]) for i in range(n)]


def loop_stall(n=10, seed=7):
    """A 200 ms stall of the proxy's loop while the upstream answered in 5 ms: service_time looks
    long, but the loop lag says whose fault it is."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        stall = _jitter(rng, 200.0)
        calls.append(build(i, attempts=[{"service": 5.0 + stall}], loop_lag=stall))
    return calls


def pipelined(n=20, seed=8):
    rng = random.Random(seed)
    return [build(i, attempts=[{"service": 5.0}], queued=_jitter(rng, 120.0)) for i in range(n)]


def retries(n=20, seed=9):
    """Connects refused at once, then a 100 ms backoff before the attempt that works."""
    rng = random.Random(seed)
    fail = {"ep": EP2, "acquire": 0.3, "write": None, "service": None, "outcome": NOT_SENT}
    return [build(i, attempts=[fail, {"ep": EP1, "service": 5.0}], backoff=_jitter(rng, 100.0))
            for i in range(n)]


def acquire_timeout(n=20, seed=11):
    """A saturated pool: every call waits acquire_timeout (~300 ms) for a connection it never
    gets, and is answered not_sent. The attempt has no t_acquired, only its end (t_reply)."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        c = build(i, attempts=[{"acquire": None, "service": None, "fail_after": _jitter(rng, 300.0),
                                "outcome": NOT_SENT}])
        c.written = False
        c.outcome = c.error_type = NOT_SENT
        c.error = "not sent: no connection to 127.0.0.1:9191 within acquire_timeout 300ms (1 busy)"
        calls.append(c)
    return calls


def connect_hang(n=20, seed=12):
    """The first endpoint's connects hang until connect_timeout (~300 ms); 50 ms backoff; the
    retry on another endpoint answers in 5 ms."""
    rng = random.Random(seed)
    hang = {"ep": EP2, "acquire": None, "service": None, "outcome": NOT_SENT}
    return [build(i, attempts=[dict(hang, fail_after=_jitter(rng, 300.0)), {"ep": EP1, "service": 5.0}],
                  backoff=50.0) for i in range(n)]


def one_slow_endpoint(n=30, seed=10):
    """Round robin over three endpoints; 127.0.0.2:9192 takes 150 ms, the others 5 ms."""
    rng = random.Random(seed)
    eps = (EP1, EP2, EP3)
    calls = []
    for i in range(n):
        ep = eps[i % 3]
        service = _jitter(rng, 150.0 if ep is EP2 else 5.0)
        calls.append(build(i, attempts=[{"ep": ep, "service": service}], conn=(CLIENT1, CLIENT2)[i % 2]))
    return calls


SCENARIOS = {
    "slow_service": (slow_service, spans.SERVICE_TIME, "the upstream itself is slow"),
    "slow_reader_large": (slow_reader_large, spans.WRITE_RESPONSE, "the client is slow to read its reply"),
    "slow_reader_small": (slow_reader_small, spans.WRITE_RESPONSE, "the client is slow to read its reply"),
    "slow_upstream_stream": (slow_upstream_stream, spans.READ_RESPONSE,
                             "the reply is large or the upstream sends it slowly"),
    "pool_exhaustion": (pool_exhaustion, spans.ACQUIRE, "the pool is exhausted or connects are slow"),
    "slow_sender": (slow_sender, spans.READ_REQUEST, "the client is slow to send its request"),
    "loop_stall": (loop_stall, "loop lag", "the proxy's own event loop is stalled"),
    "pipelined": (pipelined, spans.QUEUED, "pipelined calls wait behind a slow earlier call"),
    "retries": (retries, spans.BACKOFF, "retries are adding delay"),
    # before: no acquire span for a lease never got, so these read "(between hops) ... the proxy's own work"
    "acquire_timeout": (acquire_timeout, spans.ACQUIRE, "the pool is exhausted or connects are slow"),
    "connect_hang": (connect_hang, spans.ACQUIRE, "the pool is exhausted or connects are slow"),
}


# --------------------------------------------------------------------------------------------
# Span files and running the command


def export(calls, tracing: Tracing, clock_offset_ns: int | None = None, seed: int = 7,
           listener: str = "users") -> Telemetry:
    """Hand finished calls to Telemetry (its queue builds the spans and exports them); flushed."""
    if clock_offset_ns is None:
        clock_offset_ns = 1_700_000_000_000_000_000 - BASE  # a fixed epoch: reproducible files
    tel = Telemetry(tracing, clock_offset_ns=clock_offset_ns, rng=random.Random(seed))
    for c in calls:
        assert tel.finished(c, SERVICE, listener) == "head"
    assert tel.shutdown(20.0), "span export did not finish"
    assert tel.queue.dropped == 0 and tel.queue.failed == 0
    return tel


def write_span_file(path, calls) -> str:
    export(calls, Tracing(exporter="jsonl", path=str(path), sample_ratio=1.0))
    return str(path)


def hops(*args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "proxy", "hops", *map(str, args)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def verdict_of(output: str) -> str:
    last = output.rstrip("\n").splitlines()[-1]
    assert last.startswith("verdict: "), output
    return last


# --------------------------------------------------------------------------------------------
# Verdicts


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_verdict_names_the_slow_hop(tmp_path, scenario):
    make, hop, meaning = SCENARIOS[scenario]
    calls = make()
    path = write_span_file(tmp_path / "spans.jsonl", calls)
    r = hops("--spans", path)
    verdict = verdict_of(r.stdout)
    assert verdict.startswith(f"verdict: {hop} is "), r.stdout
    assert verdict.endswith(f": {meaning}"), verdict
    method = calls[0].msg.method
    assert f"{SERVICE}/{method}" in verdict, verdict
    pct = int(re.search(r" is (\d+)% of ", verdict).group(1))
    assert 50 <= pct <= 100, verdict
    assert f"{len(calls)} calls" in r.stdout


def test_loop_lag_takes_precedence_only_when_it_dominates(tmp_path):
    # the same 200 ms service_time, but the loop lagged only 20 ms: the upstream is to blame
    rng = random.Random(3)
    calls = [build(i, attempts=[{"service": _jitter(rng, 205.0)}], loop_lag=20.0) for i in range(10)]
    r = hops("--spans", write_span_file(tmp_path / "spans.jsonl", calls))
    assert verdict_of(r.stdout).startswith("verdict: service_time is "), r.stdout
    assert "loop lag*" in r.stdout  # shown in the table, marked as overlapping


def test_streamed_overlap_is_counted_once(tmp_path):
    """fx.call_streamed: read 300 ms overlapping write_response; the client paused 250 ms of it."""
    path = write_span_file(tmp_path / "spans.jsonl", [fx.call_streamed()])
    (call,) = rebuild_calls(load_jsonl(path))
    rr, wr = call.raw[spans.READ_RESPONSE], call.raw[spans.WRITE_RESPONSE]
    assert rr == ms(300) and wr == ms(300) + ms(40) - ms(0.06)
    assert call.overlap == ms(300) - ms(0.06)
    assert call.overlap_to == spans.WRITE_RESPONSE
    assert call.accounted[spans.READ_RESPONSE] == ms(0.06)
    assert call.accounted[spans.WRITE_RESPONSE] == wr
    assert sum(call.accounted.values()) <= call.total
    # the other way round when the stream waited for the upstream rather than the client
    c = fx.call_streamed()
    c.client_paused_ns, c.upstream_wait_ns = ms(5), ms(280)
    (call,) = rebuild_calls(load_jsonl(write_span_file(tmp_path / "other.jsonl", [c])))
    assert call.overlap_to == spans.READ_RESPONSE
    assert call.accounted[spans.READ_RESPONSE] == ms(300)
    assert call.accounted[spans.WRITE_RESPONSE] == ms(40) + ms(0.06) - ms(0.06)


def test_streamed_request_overlap_is_counted_once(tmp_path):
    """A request streamed upstream as it arrived: read_request (the client sending) runs over
    the attempt's acquire and write_upstream. Who was slow decides where the overlap counts."""
    from proxy.calls import Upload

    def streamed(held_ms: float) -> Call:
        c = build(0, read_request=400.0, attempts=[{"acquire": 1.0, "write": 1.0, "service": 5.0}])
        a = c.attempts[0]
        a.t_acquire = c.t_start + ms(0.1)  # routed from its head, at once
        a.t_acquired = a.t_acquire + ms(1.0)
        a.t_written = c.t_framed + ms(0.05)  # the last piece written as it came
        a.t_first_reply = a.t_written + ms(5.0)
        a.t_reply = a.t_first_reply + ms(0.2)
        c.t_done = a.t_reply + ms(0.02)
        c.t_write = c.t_done + ms(0.005)
        c.t_handed = c.t_write + ms(0.01)
        c.t_acked = c.t_write + ms(0.3)
        c.upload = Upload(None, 6_000_000, [])
        c.upload.held_ns = ms(held_ms)
        return c

    ov_acquire = ms(1.0)
    ov_write = (ms(400.0) - ms(1.1))  # from t_acquired to t_framed
    # the client sent slowly: the overlap stays in read_request
    (call,) = rebuild_calls(load_jsonl(write_span_file(tmp_path / "slow_client.jsonl", [streamed(0.0)])))
    assert call.server.attrs[spans.REQUEST_STREAMED] is True
    assert call.accounted[spans.READ_REQUEST] == call.raw[spans.READ_REQUEST] == ms(400.0)
    assert call.accounted[spans.ACQUIRE] == 0
    assert call.accounted[spans.WRITE_UPSTREAM] == call.raw[spans.WRITE_UPSTREAM] - ov_write == ms(0.05)
    assert sum(call.accounted.values()) <= call.total
    # the proxy held the client back most of that time (the upstream was not taking bytes)
    (call,) = rebuild_calls(load_jsonl(write_span_file(tmp_path / "slow_upstream.jsonl", [streamed(390.0)])))
    assert call.accounted[spans.READ_REQUEST] == ms(400.0) - ov_acquire - ov_write
    assert call.accounted[spans.WRITE_UPSTREAM] == call.raw[spans.WRITE_UPSTREAM]
    assert sum(call.accounted.values()) <= call.total
    r = hops("--spans", tmp_path / "slow_upstream.jsonl")
    assert verdict_of(r.stdout).startswith("verdict: write_upstream is "), r.stdout


def test_by_endpoint_names_the_slow_upstream(tmp_path):
    calls = one_slow_endpoint()
    path = write_span_file(tmp_path / "spans.jsonl", calls)
    r = hops("--spans", path, "--by", "endpoint")
    verdict = verdict_of(r.stdout)
    assert verdict.startswith("verdict: service_time is "), verdict
    assert "of calls to 127.0.0.2:9192: the upstream itself is slow" in verdict
    for ep in ("127.0.0.1:9191", "127.0.0.2:9192", "127.0.0.3:9193"):
        assert f"calls to {ep}: 10 calls" in r.stdout
    # by method the same calls are one group, and the verdict names the method instead
    v = verdict_of(hops("--spans", path).stdout)
    assert v.startswith("verdict: service_time is ") and f"of {SERVICE}/get_user:" in v
    # by client: two connections
    out = hops("--spans", path, "--by", "client").stdout
    assert "calls from 127.0.0.1:51515: 15 calls" in out and "calls from 127.0.0.1:51516: 15 calls" in out


def test_by_endpoint_counts_a_retried_call_where_it_was_slow(tmp_path):
    timed_out = {"ep": EP2, "service": None, "fail_after": 500.0, "outcome": TIMEOUT}
    calls = [build(i, attempts=[timed_out, {"ep": EP1, "service": 5.0}], backoff=5.0) for i in range(4)]
    r = hops("--spans", write_span_file(tmp_path / "spans.jsonl", calls), "--by", "endpoint")
    assert "calls to 127.0.0.2:9192: 4 calls" in r.stdout
    assert "calls to 127.0.0.1:9191" not in r.stdout
    assert "2 attempts" in r.stdout


def _table(output: str, group: str) -> dict[str, list[str]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{group}:"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        name, *cols = re.split(r"\s{2,}", line.strip())
        rows[name] = cols
    return rows


def test_table_numbers_exact(tmp_path):
    """Three calls, service_time 10/20/30 ms; every other hop as in `build`'s defaults.

    Total = 0.1 read_request + 0.001 gap + .05 acquire + .05 write_upstream + S service + .2
    read_response + .02 + .005 (reply ready → written) + .3 write_response = S + 0.726 ms.
    """
    calls = [build(i, attempts=[{"service": s}]) for i, s in enumerate((30.0, 10.0, 20.0))]
    calls.append(build(3, method="ping", attempts=[{"service": 1.0}]))
    r = hops("--spans", write_span_file(tmp_path / "spans.jsonl", calls))
    assert "hops: 4 calls" in r.stdout
    t = _table(r.stdout, f"{SERVICE}/get_user")
    assert re.search(rf"^{SERVICE}/get_user: 3 calls$", r.stdout, re.M)
    assert t["total"] == ["3", "20.726", "30.726", "100.0%"]
    assert t["service_time"] == ["3", "20.000", "30.000", f"{60 / 62.178 * 100:.1f}%"]
    assert t["read_request"] == ["3", "0.100", "0.100", f"{0.3 / 62.178 * 100:.1f}%"]
    assert t["acquire"][:3] == ["3", "0.050", "0.050"]
    assert t["write_response"][:3] == ["3", "0.300", "0.300"]
    assert t["(between hops)"][:3] == ["3", "0.026", "0.026"]
    assert "queued" not in t and "backoff" not in t
    ping = _table(r.stdout, f"{SERVICE}/ping")
    assert ping["total"] == ["1", "1.726", "1.726", "100.0%"]
    # the same numbers through the API
    report = analyse(rebuild_calls(load_jsonl(tmp_path / "spans.jsonl")))
    g = next(g for g in report.groups if g.key == f"{SERVICE}/get_user")
    assert len(g.calls) == 3 and g.row("total").p50 == ms(20.726) and g.row("service_time").p99 == ms(30)
    # worst calls: largest totals first, with the dominant hop and the trace id
    worst = r.stdout.split("worst 4 calls:")[1].splitlines()[2:6]
    assert [w.split()[0] for w in worst] == ["30.726", "20.726", "10.726", "1.726"]
    assert all(w.split()[1] == "service_time" for w in worst[:3])
    assert report.worst[0].trace_id in worst[0]


def test_client_chosen_names_print_with_control_characters_escaped(tmp_path):
    """A method name is the client's: `hops` prints it (group heading and worst calls) with
    control characters escaped, so it can neither forge table lines nor send terminal escapes."""
    evil = "get\x1b[31mred\nverdict= all is well"
    r = hops("--spans", write_span_file(tmp_path / "spans.jsonl", [build(0, method=evil)]))
    assert "\x1b" not in r.stdout and "\nverdict= all is well" not in r.stdout
    assert f"{SERVICE}/get\\x1b[31mred\\x0averdict= all is well: 1 calls" in r.stdout
    assert r.stdout.count("get\\x1b[31mred") >= 2  # its group, the worst calls (and the verdict)


def test_method_filter_and_worst_n(tmp_path):
    calls = slow_service(6) + [build(100 + i, method="ping", attempts=[{"service": 1.0}]) for i in range(3)]
    path = write_span_file(tmp_path / "spans.jsonl", calls)
    r = hops("--spans", path, "--method", "ping", "--worst", "2")
    assert "hops: 3 calls" in r.stdout and "worst 2 calls:" in r.stdout
    assert "get_user" not in r.stdout
    r = hops("--spans", path, "--method", f"{SERVICE}/get_*")
    assert "hops: 6 calls" in r.stdout
    r = hops("--spans", path, "--method", "nothing", check=False)
    assert r.returncode == 1 and verdict_of(r.stdout) == "verdict: no calls to analyse"


def test_a_line_cut_short_is_skipped_and_said_the_rest_is_read(tmp_path):
    """A span file whose writer died mid-line (or whose disk filled, before the exporter cut such
    lines back): the good lines are analysed, the bad one is named on stderr. Before, one bad
    line made the whole file unreadable (found by an exporter hunt)."""
    path = write_span_file(tmp_path / "spans.jsonl", slow_reader_large(3))
    text = Path(path).read_text()
    first, rest = text.split("\n", 1)
    Path(path).write_text(first + "\n" + first[: len(first) // 2] + "\n" + rest)
    r = hops("--spans", path)
    assert f"{path}:2: not JSON" in r.stderr and "(line skipped)" in r.stderr
    assert re.search(rf"^{SERVICE}/list_users: 3 calls", r.stdout, re.M), r.stdout


def test_lines_of_another_shape_are_skipped_and_said(tmp_path):
    """Valid JSON in a shape the sidecar never writes (a field of another type; a key protojson
    left out; a BOM): the line is skipped and named, the rest analysed. Before, each aborted
    `hops` with a traceback, exit 1 ("no calls")."""
    import json

    path = write_span_file(tmp_path / "spans.jsonl", slow_reader_large(3))
    first = Path(path).read_text().split("\n", 1)[0]
    good = len(Path(path).read_text().splitlines())

    def odd(mutate) -> str:
        o = json.loads(first)
        mutate(o["resourceSpans"][0]["scopeSpans"][0]["spans"])
        return json.dumps(o)

    lines = [odd(lambda ss: ss[0].update(startTimeUnixNano="x")),
             odd(lambda ss: ss[0].update(attributes={"a": 1})),
             odd(lambda ss: ss[0]["attributes"].append({"key": "sidecar.attempt", "value": {"intValue": "abc"}})),
             json.dumps({"resourceSpans": ["x"]})]
    kept = odd(lambda ss: ss[0]["attributes"].append({"value": {"stringValue": "no key"}}))  # read
    Path(path).write_text("\ufeff" + Path(path).read_text() + "\n".join(lines + [kept]) + "\n", encoding="utf-8")
    r = hops("--spans", path)
    for n in range(4):
        assert re.search(rf"{re.escape(path)}:{good + 1 + n}: not an ExportTraceServiceRequest: \w+Error", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert re.search(rf"^{SERVICE}/list_users: 6 calls", r.stdout, re.M), r.stdout  # the first line's, and kept's


def test_json_objects_that_are_no_request_are_skipped_and_said(tmp_path):
    """A JSON object with no resourceSpans (`{"foo": 1}`, or a span as `exporter: console` prints
    it) is no request: skipped and named, like any other line of another shape. Before: read as
    a request with no spans, silently ("0 calls", nothing on stderr)."""
    import json

    path = write_span_file(tmp_path / "spans.jsonl", slow_reader_large(3))
    good = len(Path(path).read_text().splitlines())
    console = {"name": "UserService/list_users", "context": {"trace_id": "0x1", "span_id": "0x2"},
               "kind": "SpanKind.SERVER"}
    with open(path, "a") as f:
        f.write(json.dumps({"foo": 1}) + "\n" + json.dumps(console) + "\n")
    r = hops("--spans", path)
    assert f"{path}:{good + 1}: not an ExportTraceServiceRequest: no resourceSpans (line skipped)" in r.stderr, r.stderr
    assert (f"{path}:{good + 2}: not an ExportTraceServiceRequest: no resourceSpans (a span object, as "
            "exporter console prints them: hops reads the file exporter jsonl writes) (line skipped)") in r.stderr
    assert re.search(rf"^{SERVICE}/list_users: 3 calls", r.stdout, re.M), r.stdout
    only = tmp_path / "console.jsonl"
    only.write_text(json.dumps(console) + "\n")
    r = hops("--spans", str(only), check=False)
    assert r.returncode == 2 and "a span object, as exporter console prints them" in r.stderr, r.stderr


def test_server_spans_of_other_instrumentation_are_no_calls(tmp_path):
    """A collector's file holds an instrumented upstream's spans too: its SERVER span is a child
    of our CLIENT attempt. It is no call of the sidecar's (before: counted as one, with all its
    time "between hops", blaming the proxy), and is said to be skipped."""
    import json

    path = write_span_file(tmp_path / "spans.jsonl", slow_service(4))
    before = hops("--spans", path).stdout
    objs = [json.loads(ln) for ln in Path(path).read_text().splitlines()]
    theirs = []
    for o in objs:
        for ss in o["resourceSpans"][0]["scopeSpans"]:
            for sp in ss["spans"]:
                if sp["kind"] == 3:  # CLIENT: the upstream's SERVER span under it
                    theirs.append({**sp, "parentSpanId": sp["spanId"], "spanId": "ab" * 8, "kind": 2,
                                   "name": "get_user", "attributes": []})
    assert theirs
    other = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "users"}}]},
                                "scopeSpans": [{"scope": {"name": "opentelemetry.instrumentation.thrift"},
                                                "spans": theirs}]}]}
    with open(path, "a") as f:
        f.write(json.dumps(other) + "\n")
    r = hops("--spans", path)
    assert r.stdout.splitlines()[2:] == before.splitlines()[2:], r.stdout
    assert f"{len(theirs)} SERVER span(s) of other instrumentation skipped" in r.stderr


def test_bad_input_exits_2(tmp_path):
    r = hops("--spans", tmp_path / "absent.jsonl", check=False)
    assert r.returncode == 2 and "absent.jsonl" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n["x"]\n')
    r = hops("--spans", bad, check=False)
    assert r.returncode == 2 and "bad.jsonl:1: not JSON" in r.stderr  # no good line at all
    r = hops("--jaeger", "http://127.0.0.1:1", check=False)
    assert r.returncode == 2 and "--service" in r.stderr
    r = hops("--spans", bad, "--jaeger", "http://x", check=False)
    assert r.returncode == 2  # argparse: one source only


@pytest.mark.parametrize("flag", [("--service", "sidecar"), ("--limit", "5"), ("--lookback", "5m")])
def test_jaeger_only_filters_with_a_span_file_are_refused_not_ignored(tmp_path, flag):
    """--service, --limit and --lookback filter what Jaeger returns; a span file is read whole.
    Before: they were accepted with --spans and silently did nothing (a user who asked for the
    last 5 minutes got the whole file's hour)."""
    path = write_span_file(tmp_path / "spans.jsonl", slow_reader_large(2))
    assert hops("--spans", path).returncode == 0
    r = hops("--spans", path, *flag, check=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr == (f"thrift-sidecar hops: {flag[0]} go with --jaeger; --spans reads the whole file "
                        "(filter by method with --method)\n")


# --------------------------------------------------------------------------------------------
# The HTML waterfall


def _html_report(tmp_path, worst=5):
    calls = slow_reader_large(4) + retries(3) + loop_stall(2)
    for i, c in enumerate(calls):  # distinct start times across the three scenarios
        shift(c, ms(i * 3 * SPACING))
    path = write_span_file(tmp_path / "spans.jsonl", calls)
    html = tmp_path / "hops.html"
    r = hops("--spans", path, "--worst", worst, "--html", html)
    return path, html, r


def test_html_waterfall_has_a_row_per_span_of_the_worst_calls(tmp_path):
    path, html, r = _html_report(tmp_path)
    text = html.read_text(encoding="utf-8")
    assert "<script" not in text and "http://" not in text.replace("http://www.w3.org", "")
    root = ET.fromstring(text.split("\n", 1)[1])  # well-formed (after the doctype)
    report = analyse(rebuild_calls(load_jsonl(path)), worst=5)
    divs = [d for d in root.iter("div") if d.get("class") == "call"]
    assert [d.get("data-trace-id") for d in divs] == [c.trace_id for c in report.worst]
    for d, call in zip(divs, report.worst):
        rows = [g for g in d.iter("g") if "span" in (g.get("class") or "").split()]
        assert sorted(g.get("data-span-id") for g in rows) == sorted(s.span_id for s in call.all_spans())
        assert rows[0].get("data-kind") == "server"
        names = {g.get("data-name") for g in rows}
        assert names >= {spans.ACQUIRE, spans.SERVICE_TIME, spans.WRITE_RESPONSE}
        for g in rows:  # every bar is inside the svg and labelled in ms
            rect = g.find("rect")
            assert float(rect.get("width")) >= 1 and float(rect.get("x")) >= 0
            assert any(re.search(r"\d ms", t.text or "") for t in g.iter("text"))
    legend = [d for d in root.iter("div") if d.get("class") == "legend"][0]
    assert all(h in "".join(legend.itertext()) for h in spans.HOPS)
    assert r.stdout.splitlines()[-1] in text  # the verdict is on the page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_html_page_stays_well_formed_with_control_characters_in_a_method_name(tmp_path):
    """A client chooses its method name, control characters included (ESC, \\x01): the page
    shows them escaped, as the text table does, and stays well-formed XML. Before: they went
    into the page as they came, which XML 1.0 forbids (a parse error in any XML reader)."""
    path = write_span_file(tmp_path / "evil.jsonl", [build(0, method="get\x1b[31mred\x01")])
    html = tmp_path / "evil.html"
    r = hops("--spans", path, "--html", html)
    assert r.returncode == 0, r.stderr
    text = html.read_text(encoding="utf-8")
    assert "\x1b" not in text and "\x01" not in text
    root = ET.fromstring(text.split("\n", 1)[1])
    assert any("get\\x1b[31mred\\x01" in (t.text or "") for t in root.iter())


def test_html_renders_in_headless_chromium(tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: `apt-get install -y chromium` (Debian's package); "
                        "the Makefile's test target installs it")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    _, html, _ = _html_report(tmp_path, worst=3)
    png = tmp_path / "hops.png"
    r = subprocess.run([str(ROOT / "tools" / "screenshot.sh"), str(html), str(png)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 900)
    # the browser's DOM has every row the file has (nothing failed to parse)
    profile = tmp_path / "profile"
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                          "--no-first-run", "--disable-background-networking", "--disable-component-update",
                          "--disable-sync", f"--user-data-dir={profile}", "--dump-dom", html.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rows_in_file = html.read_text(encoding="utf-8").count('<g class="span ')
    assert rows_in_file > 10 and dom.stdout.count('<g class="span ') == rows_in_file
