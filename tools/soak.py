#!/usr/bin/env python3
"""Soak: a bounded run of mixed calls through the sidecar while upstreams restart at random.

    python tools/soak.py --duration 600          # `make soak`
    python tools/soak.py --duration 60 --json    # what tests/test_soak.py runs

The sidecar runs as its own process (`python -m proxy run`, as users run it); three real Apache
Thrift upstreams (tests/harness.py's ThriftServer) run in this process, and one of them at a
time is stopped (every connection closed) and started again at random. Eight client connections
make a mix of calls: ping, lookup (also the declared NotFound), get_users and echo of various
sizes, count, incr (not idempotent), oneway log_event, and pipelined batches. Idempotent
methods are retried by the route; incr is not. Warm-up is half the run (at most 60 s); its
first half makes only the largest calls on every connection at once, so the allocator reaches
the high-water mark the mix will need (without it, glibc's heap keeps creeping up for ~2 minutes
before it levels off: 68 -> 84 MiB, then flat for the rest of a 10-minute run).

Reported: calls and failures by kind; lost idempotent calls (an idempotent call whose client got
an error or a wrong result: must be 0); incr at most once (no key ran twice on the upstreams);
oneway delivery; the proxy's memory and open fds after warm-up and at the end, each the median
of 5 s of samples under load. Memory, two ways, both one-sided (a leak grows; ending lower is fine):
  - Python's allocated blocks (/stats `python_allocated_blocks`): what a leak of Python objects
    grows, free of allocator noise (they move ~1% under the mix); at most 5% above the warm-up value.
  - RSS (/proc/PID): glibc's heap wanders ~57-75 MiB under this mix (the big replies), more than
    10% in a minute, so RSS is held to the high-water mark the warm-up reached (its heavy part is
    there to reach it): at most 10% above the warm-up's largest sample. A native leak passes it.
Open fds follow the pools (upstream connections open on demand, close when idle or when their
upstream restarts: 30-75 fds in one run), so the raw count is reported with a 10% + 5 verdict,
and what must hold is the count of fds *not* held by a client or upstream connection (from
/proc/PID/fd less /stats' connection counts): within ±5 of its warm-up value — a leaked socket
or file shows there, pool sizes do not.

Streamed replies (over stream_threshold) cut mid-stream by a restart close the client's
connection by design (DESIGN.md: once reply bytes went out, nothing else can be said); the
soak makes a few such calls and counts them apart ("streamed_cut"), not as idempotent calls.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "gen"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from harness import ProxyProcess, ThriftServer, client, free_port, open_fds, proc_status  # noqa: E402
from sidecar_test.ttypes import NotFound  # noqa: E402
from thrift.Thrift import TApplicationException  # noqa: E402

RSS_TOLERANCE = 0.10
BLOCKS_TOLERANCE = 0.05  # the mix moves them ~1%
FD_TOLERANCE = 0.10
FD_SLACK = 5
WINDOW = 5.0  # seconds of samples whose median is compared
STREAM_USERS = 12_000  # ~1.3 MB reply: streams (over the config's stream_threshold, 1 MiB)


def sidecar_config(port: int, admin: int, endpoints: list[str]) -> str:
    eps = ", ".join(endpoints)
    return f"""
admin: {{listen: 127.0.0.1:{admin}}}
logging: {{format: json, level: warning}}
listeners:
  - name: soak
    service: TestService
    listen: 127.0.0.1:{port}
    transport: framed
    protocol: binary
    oneway_methods: [log_event]
    routes:
      - match: {{method: incr}}          # not idempotent: never retried once written
        cluster: up
        timeout: 10s
      - match: {{method: log_event}}
        cluster: up
      - cluster: up                       # everything else is idempotent
        timeout: 10s
        retry: {{attempts: 4, idempotent: true, per_try_timeout: 3s, backoff: {{base: 10ms, max: 100ms}}}}
clusters:
  - name: up
    endpoints: [{eps}]
    transport: framed
    protocol: binary
    load_balancer: least_request
    connect_timeout: 250ms
    # 1 MiB, not the 64 KiB default: the mix's 100-900 KB replies are read whole, so a restart
    # can only fail them in ways a retry covers; only `streamed` (~1.3 MB) streams, and a
    # restart that cuts it mid-stream closes the connection by design (counted apart)
    stream_threshold: 1MiB
    pool: {{max_connections: 24, idle_timeout: 5s, acquire_timeout: 3s}}
    limits: {{max_pending: 512, max_requests: 1024, max_retries: 256}}
    circuit_breaker: {{consecutive_failures: 3, open_for: 500ms, max_open_for: 2s, max_open_percent: 67}}
    retry_budget: {{ratio: 0.5, min_per_second: 200, window: 10s}}
"""


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = Counter()          # by method
        self.failures = Counter()       # by kind
        self.lost_idempotent: list[str] = []
        self.incr = {}                  # key -> "ok" | failure kind
        self.oneway_sent: list[str] = []
        self.streamed = Counter()
        self.pipelined = 0

    def fail(self, kind: str, method: str, idempotent: bool, detail: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            if idempotent:
                self.lost_idempotent.append(f"{method}: {kind}: {detail[:300]}")


def _kind(e: Exception) -> str:
    if isinstance(e, TApplicationException):
        msg = e.message or ""
        if msg.startswith("thrift-sidecar: not sent:"):
            return "not_sent"
        if msg.startswith("thrift-sidecar: may have run:"):
            return "may_have_run"
        if msg.startswith("thrift-sidecar:"):
            return "proxy_error"
        return "app_exception"
    if isinstance(e, AssertionError):
        return "wrong_result"
    return "connection"


class Worker(threading.Thread):
    def __init__(self, n: int, port: int, stop: threading.Event, tally: Tally, seed: int,
                 heavy_until: float = 0.0) -> None:
        super().__init__(daemon=True, name=f"soak-client-{n}")
        self.heavy_until = heavy_until  # until then (monotonic), only the largest calls
        self.n = n
        self.port = port
        self.stop_ = stop
        self.tally = tally
        self.rng = random.Random(seed * 1000 + n)
        self.seq = 0
        self.c = None

    def _client(self):
        if self.c is None:
            self.c = client(self.port, timeout=20)
        return self.c

    def _drop(self) -> None:
        if self.c is not None:
            try:
                self.c.close()
            except Exception:  # noqa: BLE001
                pass
            self.c = None

    def run(self) -> None:
        ops = [(self.ping, 10), (self.lookup, 20), (self.missing, 3), (self.get_users, 12), (self.echo, 15),
               (self.count, 5), (self.incr, 8), (self.log_event, 6), (self.pipelined, 8), (self.streamed, 1)]
        fns = [f for f, _ in ops]
        weights = [w for _, w in ops]
        heavy = [self.echo_largest, self.get_users_largest, self.streamed]
        while not self.stop_.is_set():
            if time.monotonic() < self.heavy_until:
                fn = self.rng.choice(heavy)
            else:
                fn = self.rng.choices(fns, weights)[0]
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - classified and counted
                kind = _kind(e)
                method = fn.__name__
                if method == "streamed":
                    with self.tally.lock:
                        self.tally.streamed["cut" if kind == "connection" else kind] += 1
                    if kind != "connection":
                        self.tally.fail(kind, method, True, repr(e))
                else:
                    self.tally.fail(kind, method, method not in ("incr", "log_event"), repr(e))
                if kind in ("connection", "wrong_result"):
                    self._drop()  # the stream may be out of step: start afresh
        self._drop()

    def _count(self, method: str, n: int = 1) -> None:
        with self.tally.lock:
            self.tally.calls[method] += n

    def _key(self) -> str:
        self.seq += 1
        return f"w{self.n}-{self.seq}"

    # the mix -------------------------------------------------------------------------------

    def ping(self) -> None:
        self._count("ping")
        self._client().ping()

    def lookup(self) -> None:
        self._count("lookup")
        key = self._key()
        got = self._client().lookup(key)
        assert got.endswith(":" + key) and got.startswith("u"), got

    def missing(self) -> None:
        self._count("lookup")
        try:
            self._client().lookup("missing")
        except NotFound as e:
            assert e.code == 404
            return
        raise AssertionError("lookup('missing') did not raise NotFound")

    def get_users(self) -> None:
        self._count("get_users")
        n = self.rng.choice((0, 1, 10, 100, 1000, 4000))
        users = self._client().get_users(n, 0)
        assert len(users) == n and (n == 0 or users[-1].id == n - 1), len(users)

    def echo(self) -> None:
        self._count("echo")
        size = self.rng.choice((0, 100, 10_000, 100_000, 900_000))
        payload = self.rng.randbytes(size)
        assert self._client().echo(payload) == payload

    def echo_largest(self) -> None:
        self._count("echo")
        payload = self.rng.randbytes(900_000)
        assert self._client().echo(payload) == payload

    def get_users_largest(self) -> None:
        self._count("get_users")
        assert len(self._client().get_users(4000, 0)) == 4000

    def count(self) -> None:
        self._count("count")
        assert self._client().count(self._key()) >= 0

    def incr(self) -> None:
        key = "incr-" + self._key()
        self._count("incr")
        try:
            n = self._client().incr(key)
        except Exception as e:
            with self.tally.lock:
                self.tally.incr[key] = _kind(e)
            raise
        with self.tally.lock:
            self.tally.incr[key] = "ok"
        assert n == 1, n

    def log_event(self) -> None:
        event = "ev-" + self._key()
        self._count("log_event")
        self._client().log_event(event)
        with self.tally.lock:
            self.tally.oneway_sent.append(event)

    def pipelined(self) -> None:
        """k requests written back to back on one connection, then k replies read in order."""
        c = self._client().client
        k = self.rng.randint(2, 16)
        plan = []
        for _ in range(k):
            kind = self.rng.choice(("ping", "lookup", "get_users"))
            if kind == "ping":
                c.send_ping()
                plan.append(("ping", None))
            elif kind == "lookup":
                key = self._key()
                c.send_lookup(key)
                plan.append(("lookup", key))
            else:
                n = self.rng.choice((1, 50, 500))
                c.send_get_users(n, 0)
                plan.append(("get_users", n))
        self._count("pipelined", k)
        with self.tally.lock:
            self.tally.pipelined += 1
        errors = []
        for kind, arg in plan:  # read every reply even after an error, to stay in step
            try:
                if kind == "ping":
                    c.recv_ping()
                elif kind == "lookup":
                    got = c.recv_lookup()
                    assert got.endswith(":" + arg), got
                else:
                    assert len(c.recv_get_users()) == arg
            except TApplicationException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def streamed(self) -> None:
        self._count("streamed")
        users = self._client().get_users(STREAM_USERS, 0)
        assert len(users) == STREAM_USERS
        with self.tally.lock:
            self.tally.streamed["ok"] += 1


class Restarter(threading.Thread):
    """Stops one upstream at a time (closing its connections), waits, starts it again."""

    def __init__(self, servers: list[ThriftServer], stop: threading.Event, seed: int,
                 every: tuple[float, float], down: tuple[float, float]) -> None:
        super().__init__(daemon=True, name="soak-restarter")
        self.servers = servers
        self.stop_ = stop
        self.rng = random.Random(seed)
        self.every = every
        self.down = down
        self.restarts = 0

    def run(self) -> None:
        while not self.stop_.wait(self.rng.uniform(*self.every)):
            s = self.rng.choice(self.servers)
            s.stop()
            time.sleep(self.rng.uniform(*self.down))
            s.start()
            self.restarts += 1


def run(duration: float, connections: int = 8, seed: int = 1, warmup: float | None = None,
        restart_every: tuple[float, float] = (1.0, 4.0), down_for: tuple[float, float] = (0.2, 1.5),
        log=print, proxy_env: dict | None = None) -> dict:
    warmup = warmup if warmup is not None else min(max(duration / 2, 5.0), 60.0)
    servers = [ThriftServer("framed", "binary", name=f"u{i}") for i in range(3)]
    port, admin = free_port(), free_port()
    proxy = ProxyProcess(sidecar_config(port, admin, [s.address for s in servers]), [port, admin], env=proxy_env)
    pid = proxy.proc.pid
    stop = threading.Event()
    tally = Tally()
    samples: list[tuple[float, int, int, int, int]] = []  # (t, rss kB, fds, fds not held by connections, blocks)
    t0 = time.monotonic()
    try:
        # Warm-up: first the largest calls on every connection at once (the allocator reaches the
        # high-water mark the mix will need), then the mix; the baseline is taken at `warmup`.
        # After it, glibc's heap takes ~25 s to settle (RSS falls from the peak, then creeps up
        # ~8 MiB to a plateau): the heavy part is kept short so the baseline lands on the plateau.
        heavy_until = t0 + min(warmup / 2, 10.0)
        workers = [Worker(i, port, stop, tally, seed, heavy_until) for i in range(connections)]
        for w in workers:
            w.start()
        restarter = Restarter(servers, stop, seed, restart_every, down_for)
        restarter.start()
        next_log = t0 + 10
        while True:
            now = time.monotonic()
            t = now - t0
            samples.append((t, proc_status(pid, "VmRSS"), *_fds_and_blocks(pid, admin)))
            if now >= next_log:
                with tally.lock:
                    total = sum(tally.calls.values())
                    failed = sum(tally.failures.values())
                log(f"  {t:5.0f}s  calls {total:7d}  failures {failed:4d}  restarts {restarter.restarts:3d}  "
                    f"RSS {samples[-1][1] / 1024:6.1f} MiB  fds {samples[-1][2]}  blocks {samples[-1][4]}")
                next_log += 10 if duration <= 200 else 30
            if t >= duration:
                break
            time.sleep(min(1.0, duration - t))
        stop.set()
        restarter.join(10)
        for w in workers:
            w.join(30)
        for s in servers:  # every upstream up, so the last counts can be read from the handlers
            if s._lsock is None:
                s.start()
        stats = _get_json(f"http://127.0.0.1:{admin}/stats")
    finally:
        stop.set()
        code = proxy.stop()
        for s in servers:
            s.stop()
    output = proxy.output()

    # medians over WINDOW seconds (one sample a second): after warm-up, and at the end of the load
    warm = [s for s in samples if warmup - WINDOW <= s[0] <= warmup] or samples[:1]
    end = [s for s in samples if s[0] >= samples[-1][0] - WINDOW]
    rss_warm = statistics.median(s[1] for s in warm)
    rss_end = statistics.median(s[1] for s in end)
    fds_warm = statistics.median(s[2] for s in warm)
    fds_end = statistics.median(s[2] for s in end)
    other_warm = statistics.median(s[3] for s in warm)
    other_end = statistics.median(s[3] for s in end)
    rss_peak_warm = max(s[1] for s in samples if s[0] <= warmup)
    rss_ok = rss_end <= (1 + RSS_TOLERANCE) * rss_peak_warm
    blocks_warm = statistics.median(s[4] for s in warm)
    blocks_end = statistics.median(s[4] for s in end)
    blocks_ok = blocks_end - blocks_warm <= BLOCKS_TOLERANCE * blocks_warm
    fds_ok = abs(fds_end - fds_warm) <= FD_TOLERANCE * fds_warm + FD_SLACK
    other_ok = abs(other_end - other_warm) <= FD_SLACK

    ran = Counter()
    events = set()
    for s in servers:
        with s.handler.lock:
            for k, v in s.handler.counts.items():
                if k.startswith("incr-"):
                    ran[k] += v
            events.update(s.handler.events)
    twice = sorted(k for k, v in ran.items() if v > 1)
    incr_ok_missing = sorted(k for k, r in tally.incr.items() if r == "ok" and ran.get(k, 0) != 1)
    listener = stats["listeners"]["soak"]
    report = {
        "duration_s": round(time.monotonic() - t0, 1),
        "connections": connections,
        "upstream_restarts": restarter.restarts,
        "calls": sum(tally.calls.values()),
        "calls_by_method": dict(tally.calls),
        "pipelined_batches": tally.pipelined,
        "failures_by_kind": dict(tally.failures),
        "lost_idempotent": len(tally.lost_idempotent),
        "lost_idempotent_examples": tally.lost_idempotent[:10],
        "incr": {"calls": len(tally.incr), "ok": sum(1 for r in tally.incr.values() if r == "ok"),
                 "failed_by_kind": dict(Counter(r for r in tally.incr.values() if r != "ok")),
                 "ran_twice": len(twice), "ok_but_not_run_once": len(incr_ok_missing)},
        "oneway": {"sent": len(tally.oneway_sent), "delivered": len(events & set(tally.oneway_sent))},
        "streamed": dict(tally.streamed),
        "proxy": {"retries": listener.get("retries"), "errors": listener.get("errors"),
                  "retries_refused_budget": listener.get("retries_refused_budget"),
                  "retries_refused_limit": listener.get("retries_refused_limit"),
                  "timeouts": listener.get("timeouts"), "exit_code": code,
                  "tracebacks": output.count("Traceback")},
        "rss_mib": {"after_warmup": round(rss_warm / 1024, 1), "end": round(rss_end / 1024, 1),
                    "max": round(max(s[1] for s in samples) / 1024, 1),
                    "warmup_peak": round(rss_peak_warm / 1024, 1),
                    "change_pct": round(100 * (rss_end - rss_warm) / rss_warm, 1),
                    "under_warmup_peak_plus_10pct": rss_ok},
        "python_blocks": {"after_warmup": blocks_warm, "end": blocks_end,
                          "change_pct": round(100 * (blocks_end - blocks_warm) / blocks_warm, 1),
                          "grew_at_most_5pct": blocks_ok},
        "fds": {"after_warmup": fds_warm, "end": fds_end, "min": min(s[2] for s in samples),
                "max": max(s[2] for s in samples), "within_10pct_plus_5": fds_ok,
                "not_connections_after_warmup": other_warm, "not_connections_end": other_end,
                "not_connections_within_5": other_ok},
        "warmup_s": warmup,
    }
    report["ok"] = (report["lost_idempotent"] == 0 and not twice and not incr_ok_missing and rss_ok and blocks_ok
                    and other_ok
                    and report["proxy"]["tracebacks"] == 0 and code == 0)
    return report


def _fds_and_blocks(pid: int, admin: int) -> tuple[int, int, int]:
    """The proxy's open fds, how many of them are not client or upstream connections, and
    Python's allocated blocks in it."""
    before = open_fds(pid)
    stats = _get_json(f"http://127.0.0.1:{admin}/stats")
    after = open_fds(pid)
    conns = sum(lis["connections"] for lis in stats["listeners"].values())
    conns += sum(pool["open"] for c in stats["clusters"].values() for ep in c["endpoints"] for pool in ep["pools"])
    conns += 1  # this /stats request's own connection
    return after, round((before + after) / 2) - conns, stats["python_allocated_blocks"]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def format_report(r: dict) -> str:
    lines = [
        f"soak: {r['duration_s']}s, {r['connections']} connections, 3 upstreams, "
        f"{r['upstream_restarts']} upstream restarts",
        f"  calls: {r['calls']}  " + "  ".join(f"{k} {v}" for k, v in sorted(r["calls_by_method"].items()))
        + f"  (pipelined batches {r['pipelined_batches']})",
        "  failures by kind: " + (", ".join(f"{k} {v}" for k, v in sorted(r["failures_by_kind"].items())) or "none"),
        f"  lost idempotent calls: {r['lost_idempotent']}"
        + "".join(f"\n    {x}" for x in r["lost_idempotent_examples"]),
        f"  incr (not idempotent): {r['incr']['calls']} calls, {r['incr']['ok']} ok, failed "
        f"{r['incr']['failed_by_kind'] or 0}; ran twice: {r['incr']['ran_twice']}; "
        f"ok but not run exactly once: {r['incr']['ok_but_not_run_once']}",
        f"  oneway: {r['oneway']['delivered']} of {r['oneway']['sent']} delivered",
        f"  streamed replies: {r['streamed'] or 'none'}",
        f"  proxy: retries {r['proxy']['retries']}, errors {r['proxy']['errors']}, refused by budget "
        f"{r['proxy']['retries_refused_budget']}, by max_retries {r['proxy']['retries_refused_limit']}, "
        f"timeouts {r['proxy']['timeouts']}, tracebacks in its log {r['proxy']['tracebacks']}, "
        f"exit {r['proxy']['exit_code']}",
        f"  proxy RSS: {r['rss_mib']['after_warmup']} MiB after {r['warmup_s']:.0f}s warm-up, "
        f"{r['rss_mib']['end']} MiB at the end ({r['rss_mib']['change_pct']:+.1f}%, max "
        f"{r['rss_mib']['max']}; warm-up peak {r['rss_mib']['warmup_peak']}): "
        f"{'at most' if r['rss_mib']['under_warmup_peak_plus_10pct'] else 'MORE than'} 10% above the warm-up peak",
        f"  python blocks: {r['python_blocks']['after_warmup']:.0f} after warm-up, {r['python_blocks']['end']:.0f} "
        f"at the end ({r['python_blocks']['change_pct']:+.1f}%): "
        f"{'grew at most' if r['python_blocks']['grew_at_most_5pct'] else 'grew MORE than'} 5%",
        f"  proxy open fds: {r['fds']['after_warmup']:.0f} after warm-up, {r['fds']['end']:.0f} at the end "
        f"(range {r['fds']['min']}-{r['fds']['max']}): "
        f"{'within' if r['fds']['within_10pct_plus_5'] else 'NOT within'} 10% + 5 (pool sizes vary)",
        f"  proxy fds not held by a client or upstream connection: {r['fds']['not_connections_after_warmup']:.0f}"
        f" after warm-up, {r['fds']['not_connections_end']:.0f} at the end: "
        f"{'within' if r['fds']['not_connections_within_5'] else 'NOT within'} ±5",
        f"  verdict: {'PASS' if r['ok'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (600)")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the baseline sample "
                    "(default: a third of the run, 5-60 s; its first half makes only the largest calls)")
    ap.add_argument("--json", action="store_true", help="also print the report as JSON")
    args = ap.parse_args(argv)
    print(f"soak: {args.duration:.0f}s of mixed calls over {args.connections} connections, 3 upstreams "
          "restarting at random", flush=True)
    report = run(args.duration, args.connections, args.seed, args.warmup,
                 log=lambda s: print(s, flush=True))
    print(format_report(report))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
