"""Discovery sources without sockets: DNS with a resolver the test controls, files with swaps.

Invariants: a failed, timed-out or empty resolution and a missing, unparsable or
empty file keep the last good set and log why; an unchanged set is not handed to
the cluster; a Kubernetes-style `..data` symlink swap is noticed; the cluster
keeps the objects (pools, counters) of endpoints that stay and retires the rest
without failing a call that waits for one of their connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from pathlib import Path

import pytest

from proxy import config as cfgmod
from proxy.balancer import make_balancer
from proxy.cluster import Cluster
from proxy.discovery import (
    DnsSource,
    FileSource,
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
    """Answers what the test says; raises what the test says."""

    def __init__(self, *addresses: str) -> None:
        self.answer: object = list(addresses)
        self.calls = 0

    async def __call__(self, host: str):
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "hang":
            await asyncio.sleep(10)
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
    ("hang", "resolution timed out after 0.05s"),
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
        ("", "no endpoints (empty file)"),
        ("[]", "no endpoints (empty list)"),
        ("a: 1", "must be a YAML list"),
        ("- 10.0.0.1:0", "[0]: port must be 1-65535"),
        ("- {address: 10.0.0.1:1, weight: 0}", "[0].weight: Input should be greater than or equal to 1"),
        ("- {address: 10.0.0.1:1, wieght: 2}", "[0].wieght: Extra inputs are not permitted"),
        ("- 10.0.0.1:1\n- 10.0.0.1:1", "[1]: duplicate endpoint 10.0.0.1:1"),
        ("- [", "not valid YAML at line"),
        ("- 7", "[0]: must be host:port"),
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
    assert f"endpoints file {path}: not valid YAML at line 2" in text
    assert "no endpoints (empty list); keeping the last good set (2 endpoints)" in text
    assert "[0]: port must be 1-65535" in text
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
