"""Discovery sources without sockets: DNS with a resolver the test controls, files with swaps.

Invariants: a failed, timed-out or empty resolution and a missing, unparsable,
empty or non-regular (FIFO) file keep the last good set and log why; a source has
one lookup in flight at most, and a hung system lookup holds none of the loop's
threads; nothing blocks the loop; an unchanged set is not handed to the cluster; a
Kubernetes-style `..data` symlink swap is noticed; the cluster keeps the objects
(pools, counters) of endpoints that stay and retires the rest without failing a
call that waits for one of their connections.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from proxy import config as cfgmod
from proxy.balancer import make_balancer
from proxy.cluster import Cluster
from proxy.discovery import (
    DnsSource,
    FileSource,
    LookupThreads,
    file_signature,
    make_source,
    parse_endpoints_file,
    system_resolver,
)
from proxy.endpoint import Endpoint
from proxy.pool import PoolSettings
from proxy.server import build_cluster


def make_cluster(loop=None) -> Cluster:
    return Cluster("users", loop, [], make_balancer("round_robin", rng=random.Random(1)), PoolSettings())


def keys(cluster) -> list[tuple[str, int, int]]:
    return sorted((ep.host, ep.port, ep.weight) for ep in cluster.endpoints)


class Resolver:
    """Answers what the test says; raises what the test says; "hang": waits for `released`."""

    def __init__(self, *addresses: str) -> None:
        self.answer: object = list(addresses)
        self.calls = 0
        self.released = asyncio.Event()

    async def __call__(self, host: str):
        self.calls += 1
        if self.answer == "hang":
            await self.released.wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return list(self.answer)


# -- DNS --------------------------------------------------------------------------------------


def test_dns_set_follows_the_resolver_and_keeps_objects(caplog):
    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        res = Resolver("10.0.0.1", "10.0.0.2")
        src = DnsSource(cluster, "users.ns.svc", 9090, refresh=60, resolver=res)
        await src.refresh()
        assert keys(cluster) == [("10.0.0.1", 9090, 1), ("10.0.0.2", 9090, 1)]
        kept = next(ep for ep in cluster.endpoints if ep.host == "10.0.0.2")
        kept.outstanding = 3
        res.answer = ["10.0.0.2", "10.0.0.3", "fd00::3", "10.0.0.3"]   # duplicates collapse
        await src.refresh()
        assert keys(cluster) == [("10.0.0.2", 9090, 1), ("10.0.0.3", 9090, 1), ("fd00::3", 9090, 1)]
        assert next(ep for ep in cluster.endpoints if ep.host == "10.0.0.2") is kept and kept.outstanding == 3
        changes = cluster.stats["endpoint_changes"]
        await src.refresh()                                               # same answer: no change
        assert cluster.stats["endpoint_changes"] == changes
    with caplog.at_level(logging.INFO, logger="proxy.discovery"):
        asyncio.run(main())
    assert "added 10.0.0.3:9090, [fd00::3]:9090; removed 10.0.0.1:9090" in caplog.text


@pytest.mark.parametrize("answer,why", [
    (OSError(-2, "Name or service not known"), "resolution failed: Name or service not known"),
    ([], "resolution returned no addresses"),
])
def test_dns_failure_keeps_the_last_good_set(caplog, answer, why):
    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        res = Resolver("10.0.0.1")
        src = DnsSource(cluster, "users.ns.svc", 9090, refresh=60, resolver=res, timeout=0.05)
        await src.refresh()
        res.answer = answer
        await src.refresh()
        await src.refresh()
        assert keys(cluster) == [("10.0.0.1", 9090, 1)]
        assert src.failures == 2 and src.last_error == why
        res.answer = ["10.0.0.4"]
        await src.refresh()
        assert keys(cluster) == [("10.0.0.4", 9090, 1)] and src.last_error is None
    with caplog.at_level(logging.INFO, logger="proxy.discovery"):
        asyncio.run(main())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1   # said once, not every refresh
    assert f"users: dns users.ns.svc:9090: {why}; keeping the last good set (1 endpoints)" in warnings[0].message
    assert "works again" in caplog.text


def test_a_hung_lookup_is_not_asked_again_while_it_runs(caplog):
    """A round gives up on its lookup after `timeout`, but a system lookup keeps its thread
    until the resolver answers. Rounds while it runs start no other lookup and keep the last
    good set (before, each round started one more: two hung, and uvloop had no thread left for
    any lookup, connects' included); once it has returned, the next round asks again."""
    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        res = Resolver("10.0.0.1")
        src = DnsSource(cluster, "users.ns.svc", 9090, refresh=60, resolver=res, timeout=0.05)
        await src.refresh()
        res.answer = "hang"
        await src.refresh()
        assert src.last_error == "resolution timed out after 0.05s"
        await src.refresh()
        await src.refresh()
        assert res.calls == 2 and src.failures == 3 and keys(cluster) == [("10.0.0.1", 9090, 1)]
        assert src.last_error == ("previous lookup of users.ns.svc still running, "
                                  "more than 0.05s after it started")
        res.answer = OSError(-3, "Temporary failure in name resolution")
        res.released.set()                 # it fails at last: no round waits for it, none says so
        await asyncio.sleep(0.01)
        res.answer = ["10.0.0.4"]
        await src.refresh()
        gc.collect()                       # (an error never retrieved is told when collected)
        assert res.calls == 3 and keys(cluster) == [("10.0.0.4", 9090, 1)] and src.last_error is None
        res.answer = "hang"
        res.released.clear()
        await src.refresh()
        hung = src.lookup
        src.close()                        # the lookup goes with its source
        await asyncio.sleep(0)
        assert hung.cancelled()
    with caplog.at_level(logging.INFO, logger="proxy.discovery"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings    # each reason once (timed out, still running; timed out)
    assert "after it started; keeping the last good set (1 endpoints)" in warnings[1]


HANG_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* getaddrinfo("hang.test") blocks while $HANG_FLAG exists, as with a DNS server that never
   answers; each such call appends a line to $HANG_LOG. Other names go to the real one. */
int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res) {
    if (node && strcmp(node, "hang.test") == 0) {
        FILE *log = fopen(getenv("HANG_LOG"), "a");
        if (log) { fputs("lookup\n", log); fclose(log); }
        while (access(getenv("HANG_FLAG"), F_OK) == 0) usleep(10000);
        return EAI_AGAIN;
    }
    int (*real)(const char *, const char *, const struct addrinfo *, struct addrinfo **) =
        (int (*)(const char *, const char *, const struct addrinfo *, struct addrinfo **))
        dlsym(RTLD_NEXT, "getaddrinfo");
    return real(node, service, hints, res);
}
"""

HANG_CHILD = """
import asyncio, random, time
import uvloop
from proxy.balancer import make_balancer
from proxy.cluster import Cluster
from proxy.discovery import DnsSource
from proxy.pool import PoolSettings

async def main():
    loop = asyncio.get_running_loop()
    cluster = Cluster("c", loop, [], make_balancer("round_robin", rng=random.Random(1)), PoolSettings())
    src = DnsSource(cluster, "hang.test", 9090, refresh=0.02, timeout=0.05)  # the system resolver
    await src.start()
    deadline = time.monotonic() + 30
    while src.failures < 10 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    print("failures", src.failures, "|", src.last_error, flush=True)
    await asyncio.wait_for(loop.getaddrinfo("localhost", 80), 10)  # what a connect to a name does
    print("connect-time lookup answered", flush=True)
    src.close()

uvloop.run(main())
print("loop closed", flush=True)  # and the process exits though hang.test's lookup hangs on
"""


def _with_hung_resolver(tmp_path: Path, script: str) -> tuple[str, Path]:
    """Run `script` in a child Python whose getaddrinfo("hang.test") hangs (HANG_SHIM) until it
    exits; its output (it must exit 0) and the file with a line per such lookup."""
    (tmp_path / "shim.c").write_text(HANG_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", tmp_path / "shim.so", tmp_path / "shim.c", "-ldl"],
                   check=True)
    flag, lookups = tmp_path / "hang.flag", tmp_path / "lookups.log"
    flag.touch()
    env = {**os.environ, "LD_PRELOAD": str(tmp_path / "shim.so"), "HANG_FLAG": str(flag),
           "HANG_LOG": str(lookups)}
    try:
        child = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent,
                               env=env, capture_output=True, text=True, timeout=90)
    finally:
        flag.unlink()
    out = child.stdout + child.stderr
    assert child.returncode == 0, out
    return out, lookups


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the getaddrinfo shim")
def test_hung_system_lookups_leave_connect_time_lookups_alone(tmp_path):
    """The real system resolver, hung (an LD_PRELOAD shim), under uvloop in a child process:
    ten rounds make one lookup, on discovery's threads; `loop.getaddrinfo` (what a connect to
    a host name uses) still answers; the process exits with that lookup still hung."""
    out, lookups = _with_hung_resolver(tmp_path, HANG_CHILD)
    assert "still running" in out and "connect-time lookup answered" in out and "loop closed" in out
    assert lookups.read_text().count("lookup") == 1, out


RELOAD_CHILD = """
import asyncio, time
import uvloop
from proxy import config as cfgmod
from proxy.server import Server

TEXT = '''
listeners:
  - {name: a, service: S, listen: 127.0.0.1:0, routes: [{cluster: up}]}
clusters:
  - name: up
    endpoints: {dns: {name: hang.test:9090, refresh: 1s}}
    connect_timeout: %ds
  - name: twin
    endpoints: {dns: {name: hang.test:9091, refresh: 1s}}
'''

async def main():
    server = Server(cfgmod.loads(TEXT % 1, "test.yaml"), asyncio.get_running_loop())
    await server.start()
    for i in range(2, 7):  # each reload rebuilds cluster `up`, and with it its DNS source
        await server.apply(cfgmod.loads(TEXT % i, "test.yaml"))
        print("reloaded", i, flush=True)
    for name in ("up", "twin"):
        src = server.clusters[name].discovery
        deadline = time.monotonic() + 30
        while "still running" not in (src.last_error or "") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        print(name, "|", src.last_error, flush=True)
    await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo("localhost", 80), 10)
    print("connect-time lookup answered", flush=True)
    await server.close()

uvloop.run(main())
print("loop closed", flush=True)
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the getaddrinfo shim")
def test_reloads_and_clusters_share_a_hung_lookup_of_the_same_name(tmp_path):
    """A real Server whose two clusters resolve the same hung name (an LD_PRELOAD shim), and
    five reloads that each rebuild one of them (a new DNS source each): one system lookup in
    all, so one of discovery's threads held, not one per source a reload left behind (before,
    each rebuilt source started its own: after four reloads every thread hung, and a cluster
    whose name did answer waited behind them). Every source says its lookup is still running."""
    out, lookups = _with_hung_resolver(tmp_path, RELOAD_CHILD)
    assert "reloaded 6" in out and "connect-time lookup answered" in out and "loop closed" in out, out
    assert out.count("still running") >= 2, out
    assert lookups.read_text().count("lookup") == 1, out


def test_lookup_threads_are_few_and_daemons():
    """Hung lookups hold at most `size` threads, daemon ones (they must not keep the process
    from exiting); more wait their turn, and one whose round gave up while it waited never runs."""
    pool = LookupThreads(2)
    release = threading.Event()
    hung = [pool.submit(release.wait) for _ in range(3)]
    dropped = hung.pop()
    waiting = pool.submit(int, "7")
    assert dropped.cancel() and not waiting.done()
    assert [t.daemon for t in pool.threads] == [True, True]
    assert [t.name for t in pool.threads] == ["discovery-lookup-0", "discovery-lookup-1"]
    release.set()
    assert waiting.result(timeout=30) == 7 and all(f.result(timeout=30) for f in hung)
    assert len(pool.threads) == 2


def test_dns_loop_refreshes_every_interval_and_stops_on_close():
    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        res = Resolver("10.0.0.1")
        src = DnsSource(cluster, "h", 1, refresh=0.02, resolver=res)
        await src.start()
        res.answer = ["10.0.0.9"]
        # 3+ rounds after start()'s own; polled, as a busy machine may run the loop late
        deadline = asyncio.get_running_loop().time() + 5
        while res.calls < 4 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert keys(cluster) == [("10.0.0.9", 1, 1)] and res.calls >= 4
        src.close()
        await asyncio.sleep(0.05)
        calls = res.calls
        await asyncio.sleep(0.2)  # 10 intervals: a loop still running would have asked again
        assert res.calls == calls and src.task is None
    asyncio.run(main())


def test_system_resolver_finds_localhost():
    addrs = asyncio.run(system_resolver("localhost"))
    assert "127.0.0.1" in addrs or "::1" in addrs


# -- files ------------------------------------------------------------------------------------


def test_parse_endpoints_file():
    assert parse_endpoints_file("- 10.0.0.1:9090\n- {address: '[::1]:9091', weight: 3}\n") == [
        ("10.0.0.1", 9090, 1), ("::1", 9091, 3)]
    for text, why in [
        ("", "<endpoints file>:1: (root): no endpoints (the file is empty)"),
        ("[]", "<endpoints file>:1: (root): needs at least one endpoint"),
        ("a: 1", "<endpoints file>:1: (root): must be a YAML list"),
        ("- 10.0.0.1:0", "<endpoints file>:1: [0]: port must be 1-65535"),
        ("- {address: 10.0.0.1:1, weight: 0}", "<endpoints file>:1: [0].weight: must be at least 1"),
        # every problem, each at its line, in the config's words (before: the first only, pydantic's
        # "Extra inputs are not permitted", no line)
        ("- 10.0.0.1:1\n- {address: 10.0.0.1:2,\n   wieght: 2}\n- 10.0.0.1:99999",
         "<endpoints file>:3: [1].wieght: unknown key (did you mean 'weight'?); "
         "<endpoints file>:4: [2]: port must be 1-65535"),
        ("- 10.0.0.1:1\n- 10.0.0.1:1", "<endpoints file>:2: [1]: duplicate endpoint 10.0.0.1:1"),
        ("- [", "<endpoints file>:1: (root): invalid YAML"),
        ("- 7", "<endpoints file>:1: [0]: endpoint must be host:port"),
        # (a RecursionError before: the discovery task died silently, the set frozen)
        ("[" * 2000 + "]" * 2000, "<endpoints file>:1: (root): invalid YAML: nested too deeply"),
        ("- {address: 10.0.0.1:1, weight: %s}" % ("9" * 400), "<endpoints file>:1: [0].weight: must be"),
    ]:
        with pytest.raises(ValueError) as e:
            parse_endpoints_file(text)
        assert why in str(e.value), (text, str(e.value))


def configmap(root: Path, name: str, text: str) -> None:
    """Write `text` as Kubernetes' atomic writer does: new dir, then swap the ..data symlink."""
    stamp = root / f"..{name}"
    stamp.mkdir()
    (stamp / "endpoints.yaml").write_text(text)
    tmp = root / "..data_tmp"
    os.symlink(stamp.name, tmp)
    os.replace(tmp, root / "..data")          # the atomic step
    link = root / "endpoints.yaml"
    if not link.is_symlink():
        os.symlink("..data/endpoints.yaml", link)


def test_file_symlink_swap_is_noticed(tmp_path):
    configmap(tmp_path, "2026_01", "- 10.0.0.1:9090\n")
    path = tmp_path / "endpoints.yaml"
    sig = file_signature(path)
    old_dir = tmp_path / "..2026_01"
    configmap(tmp_path, "2026_02", "- 10.0.0.2:9090\n")        # same size, maybe same mtime
    assert file_signature(path) != sig
    os.remove(old_dir / "endpoints.yaml")
    old_dir.rmdir()

    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        src = FileSource(cluster, path, interval=0.02)
        await src.start()
        assert keys(cluster) == [("10.0.0.2", 9090, 1)]
        configmap(tmp_path, "2026_03", "- {address: 10.0.0.2:9090, weight: 5}\n- 10.0.0.3:9090\n")
        await asyncio.sleep(0.15)
        assert keys(cluster) == [("10.0.0.2", 9090, 5), ("10.0.0.3", 9090, 1)]
        path.parent.joinpath("..2026_03", "endpoints.yaml").write_text("- 10.0.0.4:1\n")  # edit in place
        await asyncio.sleep(0.15)
        assert keys(cluster) == [("10.0.0.4", 1, 1)]
        src.close()
    asyncio.run(main())


def test_an_endpoints_file_is_read_and_checked_off_the_loop(tmp_path, monkeypatch):
    """20,000 endpoints take ~1 s to check: in a worker thread, while the loop goes on (before:
    on the loop, which served nothing meanwhile)."""
    import threading
    from proxy import discovery as discmod
    path = tmp_path / "eps.yaml"
    path.write_text("".join(f"- 10.0.{i // 250}.{i % 250 + 1}:9090\n" for i in range(20_000)))
    where: list[str] = []
    real = discmod.parse_endpoints_file

    def parse(*args):
        where.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(discmod, "parse_endpoints_file", parse)

    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        src = FileSource(cluster, path, interval=60)
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        await src.start()
        ticker.cancel()
        src.close()
        return len(keys(cluster)), ticks

    n, ticks = asyncio.run(main())
    assert n == 20_000
    assert where and where[0] != threading.main_thread().name, where
    assert ticks >= 3, ticks  # (the loop ran while the file was checked)


def test_a_source_closed_during_its_first_round_starts_no_loop_and_sets_nothing(tmp_path):
    """A stop or reload closes the source while its first round reads the file (in a thread):
    the round's result is dropped and no discovery task is left running (a review found one)."""
    path = tmp_path / "eps.yaml"
    path.write_text("".join(f"- 10.1.{i // 250}.{i % 250 + 1}:9090\n" for i in range(20_000)))

    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        src = FileSource(cluster, path, interval=0.02)
        starting = asyncio.ensure_future(src.start())
        await asyncio.sleep(0.05)
        assert not starting.done()  # (still checking the file)
        src.close()
        await starting
        await asyncio.sleep(0.1)
        return src.task, keys(cluster)

    task, endpoints = asyncio.run(main())
    assert task is None and endpoints == []


def test_bad_or_missing_file_keeps_the_last_good_set(tmp_path, caplog):
    path = tmp_path / "eps.yaml"
    path.write_text("- 10.0.0.1:9090\n- 10.0.0.2:9090\n")

    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        src = FileSource(cluster, path, interval=0.02)
        await src.start()
        good = keys(cluster)
        for bad in ("- 10.0.0.1:9090\n- [oops", "[]\n", "- 10.0.0.1:99999\n"):
            path.write_text(bad)
            await asyncio.sleep(0.1)
            assert keys(cluster) == good
        path.unlink()
        await asyncio.sleep(0.1)
        assert keys(cluster) == good
        path.write_text("- 10.0.0.3:9090\n")
        await asyncio.sleep(0.1)
        assert keys(cluster) == [("10.0.0.3", 9090, 1)]
        src.close()
    with caplog.at_level(logging.INFO, logger="proxy.discovery"):
        asyncio.run(main())
    text = caplog.text
    assert f"endpoints file {path}: {path}:2: (root): invalid YAML" in text
    assert f"{path}:1: (root): needs at least one endpoint; keeping the last good set (2 endpoints)" in text
    assert f"{path}:1: [0]: port must be 1-65535" in text
    assert "missing or unreadable; keeping the last good set" in text


def test_file_missing_at_start_starts_empty_then_follows(tmp_path):
    path = tmp_path / "later.yaml"

    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        src = FileSource(cluster, path, interval=0.02)
        await src.start()
        assert cluster.endpoints == [] and cluster.pick() is None
        path.write_text("- 127.0.0.1:1\n")
        await asyncio.sleep(0.1)
        assert keys(cluster) == [("127.0.0.1", 1, 1)]
        src.close()
    asyncio.run(main())


class FifoWriter:
    """Opens the FIFO at `path` for writing once someone waits to read it, after `after`
    seconds: a loop blocked in `open()` there (the bug) then fails the test instead of hanging
    it. `.needed` says it had to."""

    def __init__(self, path: Path, after: float = 5.0) -> None:
        self.path, self.after, self.needed = path, after, False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.stop.wait(self.after)
        while not self.stop.wait(0.05):
            try:
                if stat.S_ISFIFO(os.stat(self.path).st_mode):
                    os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
                    self.needed = True
            except OSError as e:
                assert e.errno in (errno.ENXIO, errno.ENOENT)  # no reader waits (yet)

    def __enter__(self) -> FifoWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_a_fifo_endpoints_file_is_refused_without_blocking_the_loop(tmp_path, caplog):
    """A FIFO swapped in at the path, or there at startup (`check-config` refuses that, not a
    swap later), is a failed round that keeps the last good set. Before, `open()` waited for a
    writer on the loop's thread: no call was served, not even SIGTERM."""
    path = tmp_path / "eps.yaml"
    path.write_text("- 10.0.0.1:9090\n")

    async def main():
        loop = asyncio.get_running_loop()
        cluster = make_cluster(loop)
        src = FileSource(cluster, path, interval=0.02)
        await src.start()
        os.mkfifo(tmp_path / "eps.fifo")
        os.replace(tmp_path / "eps.fifo", path)
        deadline = loop.time() + 30
        while src.failures == 0 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert keys(cluster) == [("10.0.0.1", 9090, 1)] and src.last_error == "not a regular file (a FIFO)"
        src.close()
        at_start = make_cluster(loop)
        first = FileSource(at_start, path)
        await first.start()
        first.close()
        assert at_start.endpoints == [] and first.last_error == "not a regular file (a FIFO)"

    with FifoWriter(path) as writer, caplog.at_level(logging.INFO, logger="proxy.discovery"):
        asyncio.run(main())
    assert not writer.needed, "the loop waited in open() for a writer"
    assert f"endpoints file {path}: not a regular file (a FIFO); keeping the last good set (1 endpoints)" \
        in caplog.text


# -- the composition root wires sources ----------------------------------------------------


def cluster_cfg(endpoints_yaml: str, base: Path) -> cfgmod.Cluster:
    text = f"""
listeners: [{{listen: 127.0.0.1:0, routes: [{{cluster: c}}]}}]
clusters:
  - name: c
    endpoints: {endpoints_yaml}
"""
    return cfgmod.loads(text, str(base / "sidecar.yaml")).clusters[0]


def test_build_cluster_makes_the_configured_source(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        res = Resolver("10.1.1.1")
        c = build_cluster(cluster_cfg("{dns: {name: 'users.ns:7000', refresh: 250ms}}", tmp_path), loop,
                          random.Random(1), resolver=res)
        assert isinstance(c.discovery, DnsSource) and c.discovery.interval == 0.25
        await c.start()
        assert keys(c) == [("10.1.1.1", 7000, 1)]
        assert c.snapshot()["discovery"]["kind"] == "dns"
        c.close()
        assert c.discovery.task is None
        (tmp_path / "eps.yaml").write_text("- 10.2.2.2:1\n")
        f = build_cluster(cluster_cfg("{file: eps.yaml}", tmp_path), loop, random.Random(1))
        assert isinstance(f.discovery, FileSource) and f.discovery.path == tmp_path / "eps.yaml"
        await f.start()
        assert keys(f) == [("10.2.2.2", 1, 1)]
        f.close()
        s = build_cluster(cluster_cfg("[10.3.3.3:1]", tmp_path), loop, random.Random(1))
        assert s.discovery is None and keys(s) == [("10.3.3.3", 1, 1)]
    asyncio.run(main())
    assert make_source(None, cfgmod.Endpoints.model_validate(["1.2.3.4:5"])) is None


# -- the cluster side of a change --------------------------------------------------------------


class FakePool:
    def __init__(self) -> None:
        self.waiters = []
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeWaiter:
    done = False


def test_removed_endpoint_pools_close_once_no_call_waits():
    async def main():
        cluster = make_cluster(asyncio.get_running_loop())
        a, b = Endpoint("10.0.0.1", 1), Endpoint("10.0.0.2", 1)
        cluster.set_endpoints([a, b])
        idle, waited = FakePool(), FakePool()
        waiter = FakeWaiter()
        waited.waiters.append(waiter)
        a.pools["x"] = idle
        b.pools["x"] = waited
        added = []
        cluster.endpoint_setup = added.append
        c = Endpoint("10.0.0.3", 1)
        cluster.set_endpoints([Endpoint("10.0.0.2", 1, 4), c])
        assert cluster.endpoints[0] is b and b.weight == 4 and added == [c]
        assert a.removed and idle.closed and not b.removed  # an idle pool closes at once
        cluster.set_endpoints([c])
        assert b.removed
        assert not waited.closed                  # a call waits for one of its connections
        await asyncio.sleep(0.08)
        assert not waited.closed
        waiter.done = True                        # it got one (or gave up)
        await asyncio.sleep(0.08)
        assert waited.closed
        assert {cluster.pick() for _ in range(5)} == {c}
    asyncio.run(main())
