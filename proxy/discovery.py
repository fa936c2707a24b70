"""Endpoint discovery: where a cluster's endpoints come from, kept current.

    endpoints: [a:1, {address: b:2, weight: 3}]     static: fixed at load
    endpoints: {dns: {name: users.ns.svc:9090, refresh: 5s}}
                 every A and AAAA record becomes an endpoint on that port; re-resolved
                 every `refresh` (Kubernetes headless services)
    endpoints: {file: /etc/sidecar/users.yaml}
                 a YAML list of `host:port` or `{address: host:port, weight: N}`, watched

A source hands each new set to `Cluster.set_endpoints`, which keeps what stays
(pools, counters, breakers) and retires what went (see `proxy.cluster`); an
unchanged set is not handed on. A failed or empty resolution, and a missing,
unparsable or empty file, keep the last good set and log why: losing every
endpoint because DNS hiccuped or a file was half-written would turn a blip
into an outage. (To empty a cluster, point its route elsewhere.)

File watching polls `stat()` of the path every `interval` (0.5 s): device,
inode, size and mtime of what the path resolves to *now*, plus the resolved
path itself. A Kubernetes ConfigMap volume updates by writing a new
`..2026_...` directory and atomically renaming the `..data` symlink over the
old one; the file's path goes through `..data`, so its resolved target (and
inode) change at that instant even though nothing was written to the old
file. Polling needs no platform API and catches edits in place, renames and
symlink swaps alike; inotify would watch the old inode through a swap.

An endpoints file is opened with O_NONBLOCK and must be a regular file: a FIFO
would block `open()`, on the loop's thread, until some writer came.

The resolver is injected (`async resolver(host) -> iterable of addresses`);
the default asks the system (`getaddrinfo`, A and AAAA) on discovery's own
few threads. A round waits at most `timeout` for its lookup, but a system
lookup cannot be stopped: it keeps its thread until the resolver answers. So
a source has at most one lookup in flight (running or queued); while it is,
rounds are skipped (failed rounds: the last good set stays). And the system
resolver runs one lookup per host name at a time: whoever asks for a name
whose lookup is still running (another cluster, or the source a reload built
in place of the one that started it) waits for that one. A hung resolver so
holds at most one of discovery's threads per host name, however often the
config is reloaded, and never one of the loop's (uvloop's libuv pool lets
lookups use 2 of its 4 threads, and every connect to a host name needs one).

    round:  lookup running? --yes--> fail "previous lookup ... still running"
               | no
            start lookup --> wait <= timeout --answer--> apply (or fail: none, error)
                                  `--timeout--> fail; the lookup runs on, unawaited

The loops are lifecycle tasks: `start()` runs the first round (bounded)
before the listeners open, `close()` cancels (the lookup too).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from time import monotonic
from typing import Awaitable, Callable, Iterable

from proxy import config as cfgmod
from proxy.endpoint import Endpoint

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[Iterable[str]]]
Spec = tuple[str, int, int]  # host, port, weight

FILE_POLL_INTERVAL = 0.5
MAX_ENDPOINTS_FILE = 4 * 1024 * 1024  # bytes; a bigger file is refused
LOOKUP_THREADS = 4  # discovery's own resolver threads, for the whole process


class LookupThreads:
    """A few daemon threads that run blocking lookups, so that hung ones hold these and not
    the loop's. Daemon: a lookup the resolver never answers must not keep the process from
    exiting (a ThreadPoolExecutor joins its threads at exit). Threads start as work comes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # loops on several threads may submit (tests do)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, args))
        with self.lock:
            if len(self.threads) < self.size:
                thread = threading.Thread(target=self._work, name=f"discovery-lookup-{len(self.threads)}",
                                          daemon=True)
                thread.start()
                self.threads.append(thread)
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            if future.set_running_or_notify_cancel():  # (False: cancelled while it queued)
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the awaiting round reports it
                    future.set_exception(e)


# One pool for the process, as the threads it bounds are the process's.
_lookups = LookupThreads(LOOKUP_THREADS)


# host name -> its system lookup while queued or running, shared by everyone who asks meanwhile
_running: dict[str, Future] = {}
_running_lock = threading.Lock()


def _lookup(host: str) -> Future:
    """`host`'s system lookup: the one still running, or a new one. Nobody cancels it (others
    may be waiting on it); a waiter that gives up just stops waiting."""
    with _running_lock:
        future = _running.get(host)
        if future is not None:
            return future
        future = _running[host] = _lookups.submit(
            socket.getaddrinfo, host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    future.add_done_callback(lambda f: _forget(host, f))  # (at once, here, if it is done already)
    return future


def _forget(host: str, future: Future) -> None:
    with _running_lock:
        if _running.get(host) is future:
            del _running[host]


async def system_resolver(host: str) -> list[str]:
    """Every A and AAAA address of `host` (the system resolver, on discovery's own threads).
    Cancelling this leaves the lookup to whoever else waits for it (see `_lookup`)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def answered(lookup: Future) -> None:  # on a lookup thread, or here if done already
        try:
            loop.call_soon_threadsafe(_hand_over, lookup, waiter)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    _lookup(host).add_done_callback(answered)
    infos = await waiter
    return [info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]


def _hand_over(lookup: Future, waiter: asyncio.Future) -> None:
    if waiter.done():  # (its round was cancelled)
        return
    if lookup.cancelled():  # (not by us; whoever did, this round has no answer)
        waiter.set_exception(OSError("the lookup was cancelled"))
        return
    e = lookup.exception()
    if e is not None:
        waiter.set_exception(e)
    else:
        waiter.set_result(lookup.result())


def static_endpoints(eps: Iterable[cfgmod.Endpoint]) -> list[Endpoint]:
    return [Endpoint(e.address.host, e.address.port, e.weight) for e in eps]


class Source:
    """One cluster's endpoint source: first round in `start()`, then `_loop()` as a task."""

    kind = "?"

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.task: asyncio.Task | None = None
        self.closed = False  # (a round still running then changes nothing, and starts no loop)
        self.current: tuple[Spec, ...] | None = None  # the last good set, sorted
        self.last_error: str | None = None
        self.updates = 0
        self.failures = 0
        self.last_update = 0.0

    def inherit(self, old: Source) -> None:
        """Start from `old`'s last good set: this source replaces it for the same endpoints
        config (a reload rebuilt the cluster for another key). Its first round then updates the
        set as any round does, or keeps it if discovery fails just then: a half-written file or
        a DNS hiccup during a reload must not leave the rebuilt cluster with no endpoints."""
        if old.current is not None and self.current is None:
            self.current = old.current
            self.last_error = old.last_error
            self.cluster.set_endpoints([Endpoint(h, p, w) for h, p, w in old.current])

    async def start(self) -> None:
        await self.refresh()
        if not self.closed:  # (closed while the first round ran: a reload or a stop came)
            self.task = asyncio.get_running_loop().create_task(self._loop(), name=f"discovery:{self.cluster.name}")

    def close(self) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def refresh(self) -> None:
        raise NotImplementedError

    async def _loop(self) -> None:
        raise NotImplementedError

    # -- shared bookkeeping ---------------------------------------------------

    def apply(self, specs: Iterable[Spec], origin: str) -> bool:
        """A good set: hand it to the cluster if it differs from the current one (not once
        the source is closed: a round that finishes after it hands nothing on)."""
        if self.closed:
            return False
        if self.last_error is not None:
            log.info("cluster %s: %s works again", self.cluster.name, origin)
        self.last_error = None
        new = tuple(sorted(set(specs)))
        if new == self.current:
            return False
        before = {(h, p) for h, p, _ in self.current or ()}
        after = {(h, p) for h, p, _ in new}
        self.current = new
        self.updates += 1
        self.last_update = monotonic()
        self.cluster.set_endpoints([Endpoint(h, p, w) for h, p, w in new])
        log.info("cluster %s: %d endpoints from %s (added %s; removed %s)", self.cluster.name, len(new),
                 origin, _labels(after - before) or "none", _labels(before - after) or "none")
        return True

    def fail(self, origin: str, why: str) -> None:
        """A bad round: keep the last good set; say why (again only when the reason changes)."""
        self.failures += 1
        kept = len(self.current or ())
        level = logging.WARNING if why != self.last_error else logging.DEBUG
        log.log(level, "cluster %s: %s: %s; keeping the last good set (%d endpoints)",
                self.cluster.name, origin, why, kept)
        self.last_error = why

    def snapshot(self) -> dict:
        return {"kind": self.kind, "endpoints": len(self.current or ()), "updates": self.updates,
                "failures": self.failures, "last_error": self.last_error}


class DnsSource(Source):
    kind = "dns"

    def __init__(self, cluster, host: str, port: int, refresh: float, resolver: Resolver | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(cluster)
        self.host = host
        self.port = port
        self.interval = refresh
        self.resolver = resolver or system_resolver
        # A round waits at most this long for its lookup (a hung resolver must not stall it).
        self.timeout = timeout if timeout is not None else min(max(refresh, 1.0), 10.0)
        self.origin = f"dns {host}:{port}"
        self.lookup: asyncio.Future | None = None  # the resolver's call in flight, or its last

    def close(self) -> None:
        super().close()
        if self.lookup is not None:
            self.lookup.cancel()  # (stops waiting; the system lookup ends alone, see `_lookup`)

    async def refresh(self) -> None:
        if self.lookup is not None and not self.lookup.done():
            self.fail(self.origin, f"previous lookup of {self.host} still running, "
                                   f"more than {self.timeout:g}s after it started")
            return
        self.lookup = asyncio.ensure_future(self.resolver(self.host))
        try:
            async with asyncio.timeout(self.timeout):
                # shield: a timeout leaves the lookup running (a thread cannot be stopped),
                # for the next round to see
                addresses = await asyncio.shield(self.lookup)
            addresses = {str(a) for a in addresses}
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self.lookup.add_done_callback(_dropped)
            self.fail(self.origin, f"resolution timed out after {self.timeout:g}s")
            return
        except Exception as e:  # noqa: BLE001 - any resolver failure keeps the last good set
            self.fail(self.origin, f"resolution failed: {_why(e)}")
            return
        if not addresses:
            self.fail(self.origin, "resolution returned no addresses")
            return
        self.apply(((a, self.port, 1) for a in addresses), self.origin)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()


def file_signature(path: Path) -> tuple | None:
    """What changes when the file at `path` (through any symlinks) changes; None if missing."""
    try:
        st = os.stat(path)
        real = os.path.realpath(path)
    except OSError:
        return None
    return (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def parse_endpoints_file(text: str, filename: str = "<endpoints file>") -> list[Spec]:
    """A YAML list of `host:port` or `{address: host:port, weight: N}`, by the config's rules
    (`config.load_endpoints_text`); raises ValueError with every problem, each said as config
    errors are (`FILE:LINE: [i].key: rule`), joined by "; "."""
    try:
        endpoints = cfgmod.load_endpoints_text(text, filename)
    except cfgmod.ConfigError as e:
        raise ValueError("; ".join(e.errors)) from None
    return [(ep.address.host, ep.address.port, ep.weight) for ep in endpoints]


def read_endpoints_file(path: Path) -> bytes:
    """The bytes of the regular file at `path`; raises OSError or ValueError. Opened with
    O_NONBLOCK so that a FIFO (or a device) is refused instead of blocking the caller, the
    loop, in `open()` until a writer comes."""
    raw, kind = cfgmod.read_regular(path, MAX_ENDPOINTS_FILE + 1)
    if kind is not None:
        raise ValueError(f"not a regular file ({kind})")
    if len(raw) > MAX_ENDPOINTS_FILE:
        raise ValueError(f"larger than {MAX_ENDPOINTS_FILE} bytes")
    return raw


def _read_and_parse(path: Path) -> list[Spec]:
    return parse_endpoints_file(read_endpoints_file(path).decode("utf-8"), str(path))


class FileSource(Source):
    kind = "file"

    def __init__(self, cluster, path: Path, interval: float = FILE_POLL_INTERVAL) -> None:
        super().__init__(cluster)
        self.path = Path(path)
        self.interval = interval
        self.signature: tuple | None = None
        self.origin = f"endpoints file {self.path}"

    async def refresh(self) -> None:
        sig = file_signature(self.path)
        self.signature = sig
        if sig is None:
            self.fail(self.origin, "missing or unreadable")
            return
        try:  # (in a worker thread: 50,000 endpoints take seconds to check, and the loop serves)
            specs = await asyncio.to_thread(_read_and_parse, self.path)
        except OSError as e:
            self.fail(self.origin, e.strerror or str(e))
            return
        except (ValueError, UnicodeDecodeError) as e:
            self.fail(self.origin, str(e))
            return
        except Exception as e:  # noqa: BLE001 - our bug, not the file's: still the last good set
            log.exception("%s: reading it failed", self.origin)
            self.fail(self.origin, f"unexpected error: {e!r}")
            return
        self.apply(specs, self.origin)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if file_signature(self.path) != self.signature:
                await self.refresh()


def make_source(cluster, endpoints: cfgmod.Endpoints, resolver: Resolver | None = None) -> Source | None:
    """The source for a cluster's `endpoints` config; None for a static list."""
    if endpoints.dns is not None:
        d = endpoints.dns
        return DnsSource(cluster, d.name.host, d.name.port, d.refresh, resolver)
    if endpoints.file is not None:
        return FileSource(cluster, endpoints.file)
    return None


def _dropped(lookup: asyncio.Future) -> None:
    """A lookup its round gave up on: its late answer is not used, nor its error said."""
    if not lookup.cancelled():
        lookup.exception()


def _labels(keys) -> str:
    return ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in sorted(keys))


def _why(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
