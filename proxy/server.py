"""The composition root: builds everything from the config and runs it.

Config → clusters (endpoints, balancer, pools) → routes → pipelines →
listeners. Nothing else constructs these objects, and nothing is global:
each piece gets what it needs passed in. Lifecycle work (startup, signals,
drain) uses tasks and awaits; the per-call path lives in protocol callbacks.

Reload: the new config is checked, its clusters built and every new listening
socket bound before anything is swapped; a failure (a TLS file, an IDL, a port
in use) leaves the old config serving. A listener whose address is unchanged
keeps its socket and its connections (a rename re-keys it); a moved one keeps
its connections on the new config, and takes over the socket of a listener that
left its new address (`_Acceptor`), never that listener's connections. A cluster
a reload replaces is retired: its discovery and health check stop at once, and
its pools close only once no call is in flight on it (retries included). Connections of a listener a reload
removed keep being served on the config they were accepted with, each closed
once idle (no call in flight), the rest at the reload's `drain_timeout` (open
calls answered, as at a stop); drain and `/stats` count them.

Drain (an outbound sidecar): on SIGTERM/SIGINT `/ready` turns 503, existing
and new local connections keep being served, and the process exits once no
client connection has been open for `DRAIN_GRACE` seconds, or at
`drain_timeout`. A second signal exits at once (spans still queued are not
waited for).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from proxy import config as cfgmod
from proxy import resilience
from proxy import splice
from proxy.clock import monotonic
from proxy.balancer import make_balancer
from proxy.cluster import Cluster
from proxy.codec import Framing, Protocol
from proxy.admin import AdminServer, AdminSources
from proxy.health import HealthChecker
from proxy.looplag import LoopLagMonitor
from proxy.metrics import Metrics
from proxy.observe import CallRecorder, TraceHooks
from proxy.telemetry import Telemetry
from proxy.discovery import Resolver, make_source, static_endpoints
from proxy.listener import ListenerSettings, ListenerState, WaitingBudget
from proxy.pipeline import Pipeline
from proxy.pool import PoolSettings
from proxy.router import HeaderMatch, Route, Router, compile_regex, method_matcher
from proxy.sockets import raise_nofile_limit
from proxy.tls import TlsError, client_context

log = logging.getLogger("proxy")

DRAIN_GRACE = 1.0  # seconds without any client connection before a drain ends
CLOSE_GRACE = 1.0  # seconds a stop waits for client connections to take their last replies
SPAN_FLUSH_TIMEOUT = 5.0  # seconds to export queued spans at shutdown
WATCH_INTERVAL = 1.0  # seconds between config file checks (reload: {watch: true})
RELOAD_READ_TIMEOUT = 30.0  # seconds a reload's file may take to be read and checked
RETIRED_QUIET = 2.0  # seconds a connection of a listener a reload removed may sit idle before it is closed
RETIRE_POLL = 0.1  # seconds between checks whether retired clusters and listeners are still used


class StartError(Exception):
    """The config is valid but cannot be started with (a file it names cannot be read, an
    address cannot be listened on); `line(path)` says it as config errors are said:
    `FILE:LINE: key.path: message` (the CLI exits 2, no traceback)."""

    def __init__(self, loc: tuple, message: str) -> None:
        self.loc = loc
        self.message = message
        super().__init__(message)

    def line(self, path: str | None) -> str:
        key = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in self.loc).lstrip(".")
        if path is None:
            return f"<config>:1: {key}: {self.message}"
        return f"{path}:{cfgmod.line_of_key(path, self.loc)}: {key}: {self.message}"


def _tls_start_error(config: cfgmod.Config, e: TlsError) -> StartError:
    """A cluster's TLS files cannot be used: said at its `tls` key."""
    i = next((i for i, c in enumerate(config.clusters) if c.name == e.cluster), 0)
    return StartError(("clusters", i, "tls", e.field), f"cannot use {e.detail}")


def start_problems(config: cfgmod.Config) -> list[StartError]:
    """What `run` would refuse in a valid config, found without starting anything (for
    `check-config`): a cluster's TLS files that cannot be used, a span file that cannot be
    opened. (Addresses are not tried: one free now may be taken at start, and the reverse.)"""
    problems: list[StartError] = []
    for c in config.clusters:
        if c.tls is not None:
            try:
                client_context(c.tls, c.name)
            except TlsError as e:
                problems.append(_tls_start_error(config, e))
    return problems + tracing_problems(config)


def tracing_problems(config: cfgmod.Config) -> list[StartError]:
    """The part of `start_problems` a reload checks on its own (tracing is a restart's setting):
    a span file that cannot be opened."""
    t = config.tracing
    if t.exporter == "jsonl" and t.path is not None:
        why = _cannot_append(Path(t.path))
        if why:
            return [StartError(("tracing", "path"), f"cannot open {t.path}: {why}")]
    return []


def _cannot_append(path: Path) -> str | None:
    """Why a file could not be opened to append to (created if missing), or None; nothing is created."""
    if path.exists():
        if path.is_dir():
            return os.strerror(errno.EISDIR)
        return None if os.access(path, os.W_OK) else os.strerror(errno.EACCES)
    parent = path.parent
    if not parent.is_dir():
        return os.strerror(errno.ENOENT if not parent.exists() else errno.ENOTDIR)
    return None if os.access(parent, os.W_OK | os.X_OK) else os.strerror(errno.EACCES)


class ListenError(StartError):
    """A configured address cannot be listened on at startup."""

    def __init__(self, loc: tuple, host: str, port: int, error: OSError, why_more: str = "") -> None:
        # (a gaierror's errno is negative: its strerror says it, os.strerror does not)
        why = os.strerror(error.errno) if error.errno and error.errno > 0 else (error.strerror or str(error))
        super().__init__(loc, f"cannot listen on {host}:{port}: {why[:1].lower()}{why[1:]}{why_more}")

    @classmethod
    def of_listener(cls, i: int, lc: cfgmod.Listener, error: OSError, why_more: str = "") -> ListenError:
        """Listener `i` (`lc`, of the config) cannot listen on its address."""
        return cls(("listeners", i, "listen"), lc.listen.host, lc.listen.port, error, why_more)


async def _in_own_thread(fn, timeout: float):
    """`fn()` in a new daemon thread: its result or exception, or TimeoutError after `timeout`
    seconds (the thread is then left to finish; being a daemon, it never holds up the exit,
    as a stuck thread of the loop's default executor would)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=run, name="reload-read", daemon=True).start()
    async with asyncio.timeout(timeout):
        return await done  # (a timeout cancels it: a late result is dropped by `settle`)


class _Slot:
    """One listener of a config being applied: its socket (kept or newly bound) and state."""

    __slots__ = ("lc", "state", "server", "acceptor", "pipeline", "settings", "reused", "fresh_server")

    def __init__(self, lc: cfgmod.Listener) -> None:
        self.lc = lc
        self.state: ListenerState | None = None
        self.server = None
        self.acceptor: _Acceptor | None = None  # the server's (it is given `state` at the commit)
        self.pipeline: Pipeline | None = None
        self.settings: ListenerSettings | None = None
        self.reused = False        # the state is an existing listener's (its pipeline is swapped)
        self.fresh_server = False  # bound by this reload (not serving until it commits)


class _Acceptor:
    """A listening socket's protocol factory: each connection it accepts belongs to the listener
    state it holds now. A reload that moves a listener onto the address another one leaves keeps
    that socket (no gap in accepting) and gives it the moved listener's state; the old state
    goes on only with the connections it has (retired, or its own listener's elsewhere)."""

    __slots__ = ("state",)

    def __init__(self, state: ListenerState) -> None:
        self.state = state

    def __call__(self):
        return self.state.protocol_factory()


def _framing(name: str | None) -> Framing | None:
    if name is None or name == "auto":
        return None
    return Framing(name)


def _protocol(name: str | None) -> Protocol | None:
    if name is None or name == "auto":
        return None
    return Protocol(name)


def _tls_name(c: cfgmod.Cluster) -> str | None:
    """The name a cluster's upstream certificates must carry (and SNI): `tls.server_name`, else,
    for DNS discovery, the name looked up (its endpoints are its addresses, and a certificate
    names the service, not each IP), else None: each endpoint's own host."""
    if c.tls is None:
        return None
    if c.tls.server_name is None and c.endpoints.dns is not None:
        return c.endpoints.dns.name.host
    return c.tls.server_name


def build_cluster(c: cfgmod.Cluster, loop: asyncio.AbstractEventLoop, rng: random.Random,
                  resolver: Resolver | None = None) -> Cluster:
    """A cluster and its endpoint source; TLS files are read here, so each config load re-reads them."""
    endpoints = static_endpoints(c.endpoints.static) if c.endpoints.static is not None else []
    pool = PoolSettings(max_connections=c.pool.max_connections, idle_timeout=c.pool.idle_timeout,
                        acquire_timeout=c.pool.acquire_timeout, max_age=c.pool.max_age, connect_timeout=c.connect_timeout,
                        max_reply_size=c.max_reply_size, stream_threshold=c.stream_threshold)
    cluster = Cluster(c.name, loop, endpoints, make_balancer(c.load_balancer, rng=rng), pool,
                      framing=_framing(c.transport), protocol=_protocol(c.protocol),
                      ssl=client_context(c.tls, c.name) if c.tls is not None else None,
                      server_name=_tls_name(c),
                      max_open_percent=c.circuit_breaker.max_open_percent)
    cluster.discovery = make_source(cluster, c.endpoints, resolver)
    return cluster


def build_route(r: cfgmod.Route, index: int, clusters: dict[str, Cluster], rng: random.Random) -> Route:
    targets = r.targets
    route = Route(clusters=[clusters[name] for name, _ in targets], weights=[w for _, w in targets],
                  strip_service=r.strip_service, settings=r, rng=rng, index=index)
    m = r.match
    if m is not None:
        route.method = method_matcher(m.method) if m.method is not None else None
        route.service = m.service
        route.invert = m.invert
        if m.header:
            route.headers = [HeaderMatch(name, h.exact, compile_regex(h.regex) if h.regex else None, h.present)
                             for name, h in m.header.items()]
    return route


def _carry_endpoints(old: Cluster, new: Cluster) -> None:
    """The endpoints a rebuilt cluster keeps (same host and port) go on with what the old ones
    learnt: their breaker's ejection (else every reload put an ejected endpoint straight back,
    its open time reset), their latency estimate (shared: the old one's calls still in flight
    go on feeding it)."""
    was = {ep.key: ep for ep in old.endpoints}
    for ep in new.endpoints:
        prev = was.get(ep.key)
        if prev is None:
            continue
        ep.ewma = prev.ewma
        if ep.breaker is not None and prev.breaker is not None:
            ep.breaker.inherit(prev.breaker)


def _same_source(a: cfgmod.Endpoints, b: cfgmod.Endpoints) -> bool:
    """The same discovery source (DNS name or file), however often it is asked."""
    if a.dns is not None and b.dns is not None:
        return a.dns.name == b.dns.name
    return a.file is not None and a.file == b.file


class Server:
    """Everything one config file describes, running on one loop; reloadable.

    Process-wide (kept across reloads): metrics, the span exporter, the loop-lag
    monitor, admin. Per config: clusters (reused when their config is unchanged,
    so pools and breaker state survive), routers and pipelines (swapped into the
    listeners; calls in flight keep the pipeline they started with).
    """

    def __init__(self, config: cfgmod.Config, loop: asyncio.AbstractEventLoop | None = None,
                 rng: random.Random | None = None, resolver: Resolver | None = None,
                 metrics: Metrics | None = None, telemetry: Telemetry | None = None,
                 path: str | None = None) -> None:
        self.config = config
        self.path = path
        self.loop = loop or asyncio.get_running_loop()
        self.rng = rng or random.Random()
        self.resolver = resolver
        # Metrics and the span exporter outlive a config reload; tests may pass their own.
        self.metrics = metrics or Metrics()
        self._own_telemetry = telemetry is None
        if telemetry is None and config.tracing.exporter != "none":
            try:
                telemetry = Telemetry(config.tracing)
            except OSError as e:
                if config.tracing.exporter == "jsonl":  # e.g. its folder does not exist, or is read-only
                    raise StartError(("tracing", "path"), f"cannot open {e.filename or config.tracing.path}: "
                                                          f"{e.strerror or e}") from None
                # the OTLP exporter's files are named by OTEL_EXPORTER_OTLP_* variables only
                raise StartError(("tracing", "exporter"), f"cannot open {e.filename}: {e.strerror or e} (a file "
                                 "named by an OTEL_EXPORTER_OTLP_* variable)") from None
            except ValueError as e:  # e.g. an OTEL_EXPORTER_OTLP_*ENDPOINT that is not a URL
                raise StartError(("tracing", "exporter"), f"cannot set up the OTLP exporter: {e} (from the "
                                 "OTEL_EXPORTER_OTLP_* variables)") from None
        self.telemetry = telemetry
        if telemetry is not None and telemetry.queue is not None:
            self.metrics.watch_exporter(telemetry.queue)
        # What /metrics and /stats show: the clusters as of the last start or committed reload
        # (`self.clusters` holds a reload's new ones while they start, before what the old ones
        # knew of their endpoints' health is carried over).
        self._shown: dict[str, Cluster] = {}
        self.metrics.watch_clusters(lambda: [(c, self.health.get(name)) for name, c in self._shown.items()])
        self.metrics.watch_listeners(lambda: list(self.listeners.items()))
        self.lag = LoopLagMonitor(self.loop)
        self.admin: AdminServer | None = None
        self.clusters: dict[str, Cluster] = {}
        self._cluster_cfg: dict[str, cfgmod.Cluster] = {}
        self.health: dict[str, HealthChecker] = {}
        self._checks_ending: set[asyncio.Task] = set()  # stopped health checkers' tasks, till they end
        self.listeners: dict[str, ListenerState] = {}
        self.servers: dict[str, asyncio.base_events.Server] = {}
        self.acceptors: dict[str, _Acceptor] = {}  # each listener's server's (by listener name)
        self._listen_cfg: dict[str, cfgmod.Listener] = {}
        self.ready = False
        self.draining = False
        self.reloads = {"ok": 0, "failed": 0}
        self._reload_lock = asyncio.Lock()  # held by `apply`
        self._read_lock = asyncio.Lock()  # held by `reload` around reading the file and `apply`
        self._watch: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._reloads_ignored = 0  # reloads asked for while draining (logged once)
        self._hurry = asyncio.Event()  # a second signal: exit without waiting for anything more
        self.owns_logging = False      # the process's logging is ours to reconfigure on reload
        # Retired by a reload and still used: listeners' states with connections open, clusters
        # with calls in flight (or routed to by such a listener). Closed once unused.
        self._retired_listeners: list[ListenerState] = []
        self.waiting = WaitingBudget()  # large replies read whole to wait their turn, all listeners'
        self._retiring: list[Cluster] = []
        self._retire_timer: asyncio.TimerHandle | None = None
        try:
            self._build_clusters(config)
        except TlsError as e:
            if self.telemetry is not None and self._own_telemetry:
                self.telemetry.shutdown(0.0)
            raise _tls_start_error(config, e) from None

    # -- building ----------------------------------------------------------------------

    def _build_clusters(self, config: cfgmod.Config) -> tuple[dict[str, Cluster], list[Cluster], list]:
        """Clusters for `config`: unchanged ones reused; returns (new ones, retired ones, and
        (cluster, context) for each reused one with TLS: its files read again, as a new cluster's
        are, for `Cluster.renew_tls` once the reload commits: rotated certificates and CAs take
        effect on new connections, and an unreadable file rejects the reload)."""
        clusters: dict[str, Cluster] = {}
        fresh: dict[str, Cluster] = {}
        renewed: list = []
        for c in config.clusters:
            old = self.clusters.get(c.name)
            if old is not None and self._cluster_cfg.get(c.name) == c:
                clusters[c.name] = old
                if c.tls is not None:
                    renewed.append((old, client_context(c.tls, c.name)))
                continue
            cluster = build_cluster(c, self.loop, self.rng, self.resolver)
            resilience.attach(cluster, c, monotonic)
            if old is not None:  # its counters go on (also what calls still on the old one add)
                cluster.stats = old.stats
                if old.limits is not None and cluster.limits is not None:
                    cluster.limits.overflow = old.limits.overflow
            if (old is not None and old.discovery is not None and cluster.discovery is not None
                    and _same_source(self._cluster_cfg[c.name].endpoints, c.endpoints)):
                cluster.discovery.inherit(old.discovery)  # (its last good set)
            clusters[c.name] = fresh[c.name] = cluster
        retired = [c for name, c in self.clusters.items() if clusters.get(name) is not c]
        self.clusters = clusters
        self._cluster_cfg = {c.name: c for c in config.clusters}
        return fresh, retired, renewed

    def build_listener(self, lc: cfgmod.Listener, config: cfgmod.Config | None = None) -> ListenerState:
        return ListenerState(self._settings(lc), self._pipeline(lc, config), self.loop, self.waiting)

    def _settings(self, lc: cfgmod.Listener) -> ListenerSettings:
        return ListenerSettings(
            name=lc.name, framing=_framing(lc.transport), protocol=_protocol(lc.protocol),
            max_frame_size=lc.max_frame_size, max_connections=lc.max_connections,
            request_read_timeout=lc.request_read_timeout, idle_timeout=lc.idle_timeout,
            max_inflight=lc.max_inflight, max_inflight_bytes=lc.max_inflight_bytes)

    def _pipeline(self, lc: cfgmod.Listener, config: cfgmod.Config | None = None) -> Pipeline:
        """The listener's request path; ValueError naming the listener if its IDL is unusable or
        a route's `on_exceptions` names cannot be resolved (the IDL as the config's checks read
        it: `Listener.parsed_idl`)."""
        from proxy.idl import IdlError

        router = Router([build_route(r, i, self.clusters, self.rng) for i, r in enumerate(lc.routes)])
        try:
            idl = lc.parsed_idl
        except IdlError as e:
            raise ValueError(f"listener {lc.name}: idl: {e}") from None
        # the IDL's oneway methods, so clients that send them as CALL need no `oneway_methods`
        oneway = frozenset(lc.oneway_methods) | (idl.oneway_methods() if idl is not None else frozenset())
        try:
            pipeline = Pipeline(lc.name, router, oneway, self.loop, self.rng,
                                exception_ids=idl.exception_ids() if idl is not None else None)
        except ValueError as e:
            raise ValueError(f"listener {lc.name}: {e}") from None
        known = [r.match.method for r in lc.routes
                 if r.match is not None and r.match.method and not any(c in r.match.method for c in "*?[")]
        if idl is not None:  # every IDL method has its own label, never `_OTHER`
            known += sorted(idl.known_methods())
        pipeline.on_complete = CallRecorder(lc.service, lc.name, self.metrics.service(lc.service, known),
                                            self.telemetry, self.lag,
                                            (config or self.config).logging.access_log)
        if self.telemetry is not None:
            hooks = TraceHooks(self.telemetry)
            pipeline.on_begin = hooks.begin
            pipeline.on_send = hooks.send
        return pipeline

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Admin, clusters, listeners; ListenError if an address cannot be listened on."""
        self.lag.start()
        await self._start_admin()
        await self._start_clusters(self.clusters.values())
        for i, lc in enumerate(self.config.listeners):
            try:
                await self._open(lc)
            except OSError as e:
                raise ListenError.of_listener(i, lc, e) from None
        self._set_watch(self.config)
        self.ready = True

    async def _start_clusters(self, clusters, replaced: dict[str, Cluster] | None = None) -> None:
        """First discovery round, then each one's health checker (a replaced cluster's checker,
        if still running, is closed first: one checker per cluster name). A replaced cluster's
        endpoints that its checks took out stay out until the new checker says otherwise: its
        first round takes up to its timeout for an endpoint that does not answer. Endpoints no
        check has answered for yet are `pending` until the first round does. Endpoints a
        cluster in `replaced` (by name) had go on with its breakers and latency estimates."""
        clusters = list(clusters)
        await asyncio.gather(*(c.start() for c in clusters))  # first discovery round
        for c in clusters:
            prev = replaced.get(c.name) if replaced else None
            if prev is not None:
                _carry_endpoints(prev, c)
            old = self.health.pop(c.name, None)
            if old is not None:
                self._stop_checker(old)
            hc = self._cluster_cfg[c.name].health_check
            if hc is not None:
                checker = self.health[c.name] = HealthChecker(c, hc.method, hc.interval, hc.timeout,
                                                                   hc.unhealthy_threshold, hc.healthy_threshold)
                if old is not None:
                    checker.stats = old.stats  # (counters /metrics shows go on across the rebuild)
                was = {ep.key: ep for ep in old.cluster.endpoints} if old is not None else {}
                for ep in c.endpoints:
                    prev = was.get(ep.key)
                    if prev is None or prev.pending:
                        checker.adopt(ep)  # (its first round checks it)
                    else:  # (what its checks knew: out, and how many in a row disagreed)
                        ep.healthy, ep.streak = prev.healthy, prev.streak
                checker.start()
        self._shown = dict(self.clusters)

    async def _bind(self, lc: cfgmod.Listener, acceptor: _Acceptor, start_serving: bool = True):
        return await self.loop.create_server(
            acceptor, lc.listen.host, lc.listen.port, backlog=lc.backlog, reuse_address=True,
            start_serving=start_serving)

    async def _open(self, lc: cfgmod.Listener, state: ListenerState | None = None) -> None:
        state = state or self.build_listener(lc)
        acceptor = _Acceptor(state)
        srv = await self._bind(lc, acceptor)
        self.listeners[lc.name] = state
        self.servers[lc.name] = srv
        self.acceptors[lc.name] = acceptor
        self._listen_cfg[lc.name] = lc
        log.info("listener %s on %s (%s/%s)", lc.name, "%s:%d" % self.address(lc.name), lc.transport, lc.protocol)

    async def _start_admin(self) -> None:
        cfg = self.config
        if cfg.admin is None and cfg.metrics_listen is None:
            return
        self.admin = AdminServer(AdminSources(ready=lambda: self.ready and not self.draining,
                                              stats=self.snapshot, config=lambda: self.config,
                                              metrics=self.metrics.exposition_async))
        sites = []
        if cfg.admin is not None:
            sites.append(("admin", ("admin", "listen"), cfg.admin.listen))
            if cfg.admin.health_listen is not None:
                sites.append(("health", ("admin", "health_listen"), cfg.admin.health_listen))
        if cfg.metrics_listen is not None:
            sites.append(("metrics", ("metrics_listen",), cfg.metrics_listen))
        for kind, loc, addr in sites:
            try:
                await self.admin.start(kind, addr.host, addr.port)
            except OSError as e:
                raise ListenError(loc, addr.host, addr.port, e) from None

    def address(self, listener: str) -> tuple[str, int]:
        """The bound (host, port) of a listener (port 0 in config picks a free one)."""
        sock = self.servers[listener].sockets[0]
        return sock.getsockname()[:2]

    # -- reload ------------------------------------------------------------------------

    async def reload(self) -> bool:
        """Re-read the config file; apply it if valid, else log its errors and keep serving.

        The file is read and checked (YAML, every rule, the IDLs it names) in a thread of its
        own, so a large config does not hold the loop, and given RELOAD_READ_TIMEOUT: a check
        that hangs fails its reload instead of every later one, and cannot hold up the exit (a
        daemon thread). Reloads run one at a time, in the order asked."""
        if not self.path:
            return False
        async with self._read_lock:
            return await self._reload()

    async def _reload(self) -> bool:
        if self.draining:
            self._reloads_ignored += 1
            if self._reloads_ignored == 1:  # (once: a reloader may send a SIGHUP a millisecond)
                log.warning("reload of %s ignored: the proxy is draining to stop (and any more "
                            "until it stops)", self.path)
            return False
        try:
            config = await _in_own_thread(lambda: cfgmod.load(self.path, again=True), RELOAD_READ_TIMEOUT)
        except TimeoutError:
            self.reloads["failed"] += 1
            log.error("reload rejected: reading and checking %s took more than %gs (left to finish in its "
                      "thread); the old config keeps serving", self.path, RELOAD_READ_TIMEOUT)
            return False
        except cfgmod.ConfigError as e:
            self.reloads["failed"] += 1
            log.error("reload rejected: %s has %d error(s); the old config keeps serving",
                      self.path, len(e.errors), extra={"fields": {"errors": e.errors}})
            for line in e.errors:
                log.error("reload rejected: %s", line)
            return False
        except OSError as e:
            self.reloads["failed"] += 1
            log.error("reload rejected: cannot read %s: %s", self.path, e.strerror)
            return False
        except Exception:  # noqa: BLE001 - a bug of ours reading the file: still not applied
            self.reloads["failed"] += 1
            log.exception("reload rejected: reading %s failed unexpectedly; the old config keeps serving",
                          self.path)
            return False
        return await self.apply(config)

    async def reload_logged(self) -> None:
        """`reload` for SIGHUP and the file watch: a bug of ours in it is logged (the watch goes
        on), not left in a task nobody awaits."""
        try:
            await self.reload()
        except Exception:  # noqa: BLE001 - reload logs its own rejections; this is the rest
            log.exception("reload of %s failed unexpectedly", self.path)

    async def apply(self, config: cfgmod.Config) -> bool:
        """Swap to `config` atomically, as seen by new calls; calls in flight finish on the old one.

        Everything that can fail is done first (clusters built, pipelines built, new sockets
        bound but not serving); on a failure the old config keeps serving untouched."""
        async with self._reload_lock:
            if self.draining:  # (the drain began while the file was read)
                log.warning("reload ignored: the proxy is draining to stop")
                return False
            old_clusters, old_cfg = self.clusters, self._cluster_cfg
            slots: list[_Slot] = []
            try:
                if config.tracing != self.config.tracing and self._own_telemetry:
                    # (a restart's setting, but one `run` would refuse: refused now, not at the restart)
                    problems = tracing_problems(config)
                    if problems:
                        raise problems[0]
                try:
                    fresh, retired, renewed = self._build_clusters(config)
                except TlsError as e:
                    raise _tls_start_error(config, e) from None
                slots = self._plan_listeners(config)
                for slot in slots:
                    if slot.server is None:
                        slot.acceptor = _Acceptor(slot.state)
                        try:
                            slot.server = await self._bind(slot.lc, slot.acceptor, start_serving=False)
                        except OSError as e:
                            i = next(i for i, lc in enumerate(config.listeners) if lc is slot.lc)
                            raise self._listen_error(i, slot.lc, e) from None
                        slot.fresh_server = True
            except Exception as e:  # e.g. unreadable TLS files, a bad IDL, a port in use
                for slot in slots:
                    if slot.fresh_server:
                        slot.server.close()
                if self.clusters is not old_clusters:
                    for c in self.clusters.values():
                        if old_clusters.get(c.name) is not c:
                            c.close()  # built for this config, never started
                self.clusters, self._cluster_cfg = old_clusters, old_cfg
                self.reloads["failed"] += 1
                # (said as `run` says it at start: FILE:LINE: key.path: message, where it has a key)
                log.error("reload rejected: %s; the old config keeps serving",
                          e.line(self.path) if isinstance(e, StartError) else e)
                return False
            # -- commit: nothing below fails the reload
            for cluster, ctx in renewed:
                cluster.renew_tls(ctx)
            await self._start_clusters(fresh.values(), old_clusters)  # replaced clusters' checkers closed first
            prev_config = self.config
            self.config = config
            old_servers, old_states = self.servers, self.listeners
            self.servers, self.listeners, self.acceptors = {}, {}, {}
            for slot in slots:
                state = slot.state
                if slot.reused:
                    # the listener's counters go on; calls in flight keep the pipeline they started with
                    stats = state.pipeline.stats
                    for key, value in slot.pipeline.stats.items():
                        stats.setdefault(key, value)
                    slot.pipeline.stats = stats
                    state.pipeline = slot.pipeline   # new calls
                    state.settings = slot.settings   # new connections
                slot.acceptor.state = state  # (a kept socket's new connections: this listener's)
                self.servers[slot.lc.name] = slot.server
                self.acceptors[slot.lc.name] = slot.acceptor
                self.listeners[slot.lc.name] = state
            self._listen_cfg = {lc.name: lc for lc in config.listeners}
            kept_servers = {id(srv) for srv in self.servers.values()}
            for srv in old_servers.values():
                if id(srv) not in kept_servers:
                    srv.close()  # stops accepting; its connections stay open
            kept_states = {id(st) for st in self.listeners.values()}
            for name, state in old_states.items():
                if id(state) not in kept_states and state.connections:
                    log.info("listener %s removed: its %d open connection(s) are served on the old config, "
                             "each closed once no call is on it (at most %gs: drain_timeout)",
                             name, len(state.connections), config.drain_timeout)
                    self._retired_listeners.append(state)
                    state.drain_by = (time.monotonic() + config.drain_timeout, config.drain_timeout)
                    for conn in state.connections:
                        conn.close_when_quiet(RETIRED_QUIET)
            for slot in slots:
                if slot.fresh_server:
                    await slot.server.start_serving()
                    log.info("listener %s on %s (%s/%s)", slot.lc.name, "%s:%d" % self.address(slot.lc.name),
                             slot.lc.transport, slot.lc.protocol)
            for c in retired:
                checker = self.health.get(c.name)
                if checker is not None and checker.cluster is c:
                    del self.health[c.name]
                    self._stop_checker(checker)
                c.retire()  # discovery stops now; its pools close once no call is on it
                self._retiring.append(c)
            if self._retire_timer is not None:  # (one chain of sweeps, however many reloads)
                self._retire_timer.cancel()
            self._sweep_retired()
            self._set_watch(config)
            self.config = self._changed_at_restart(prev_config, config)
            self.reloads["ok"] += 1
            log.info("reloaded %s: %d listener(s), %d cluster(s) (%d rebuilt)", self.path or "config",
                     len(config.listeners), len(config.clusters), len(fresh))
            return True

    def _listen_error(self, i: int, lc: cfgmod.Listener, error: OSError) -> ListenError:
        """A reload's listener `i` cannot bind; said with the reason when the port is the running
        config's own (a listener moved to another host on the same port: the old socket is
        closed only once the new one is bound)."""
        if error.errno == errno.EADDRINUSE:
            for name, old in self._listen_cfg.items():
                if old.listen.port == lc.listen.port and old.listen != lc.listen:
                    return ListenError.of_listener(
                        i, lc, error, f" (by this proxy's listener {name} on {old.listen.host}:{old.listen.port}: "
                                      "a reload cannot move a listener to another host on the same port; "
                                      "restart, or move it in two reloads through another port)")
        return ListenError.of_listener(i, lc, error)

    def _plan_listeners(self, config: cfgmod.Config) -> list[_Slot]:
        """Each listener of `config` with its pipeline, and the socket and state it goes on with.

        Sockets: a listener on the address an old listener's socket is bound to keeps that
        socket (the same name first), so accepting never stops; else one is bound later.
        States (a state's connections get the config of the listener it belongs to): a listener
        the old config has keeps its own, wherever it listens now; a new name on the address
        of an old listener this config no longer has is that listener renamed, and takes its
        state; any other new listener gets a fresh one. The socket a listener keeps is handed
        its state at the commit (`_Acceptor`): a listener moved onto the address another one
        left never takes that one's connections. ValueError naming the listener if a pipeline
        cannot be built."""
        old_cfg = self._listen_cfg
        names = {lc.name for lc in config.listeners}
        slots = [_Slot(lc) for lc in config.listeners]
        taken: set[str] = set()  # old listeners whose socket goes on
        source: dict[int, str] = {}
        for i, slot in enumerate(slots):
            old = old_cfg.get(slot.lc.name)
            if old is not None and old.listen == slot.lc.listen:
                taken.add(slot.lc.name)
                source[i] = slot.lc.name
        for i, slot in enumerate(slots):
            if i in source or slot.lc.listen.port == 0:  # port 0: any free port, never the same one
                continue
            for name, old in old_cfg.items():
                if name not in taken and old.listen == slot.lc.listen:
                    taken.add(name)
                    source[i] = name
                    break
        for i, slot in enumerate(slots):
            lc = slot.lc
            slot.pipeline = self._pipeline(lc, config)
            slot.settings = self._settings(lc)
            name = source.get(i)
            if name is not None:
                slot.server, slot.acceptor = self.servers[name], self.acceptors[name]
                old = old_cfg[name]
                if old.backlog != lc.backlog:
                    log.warning("listener %s: backlog %d takes effect at the next restart (its socket is "
                                "kept, with backlog %d)", lc.name, lc.backlog, old.backlog)
            if lc.name in old_cfg:  # its own state, its connections with it (moved or not)
                slot.state, slot.reused = self.listeners[lc.name], True
                if name is not None and name != lc.name:
                    log.info("listener %s moved to %s:%d, the address of listener %s (removed or moved): "
                             "that socket goes on, for %s's new connections", lc.name, lc.listen.host,
                             lc.listen.port, name, lc.name)
            elif name is not None and name not in names:  # a rename: the same socket and connections
                slot.state, slot.reused = self.listeners[name], True
                log.info("listener %s renamed %s: same socket, same connections", name, lc.name)
            else:
                slot.state = ListenerState(slot.settings, slot.pipeline, self.loop, self.waiting)
        return slots

    def _changed_at_restart(self, prev: cfgmod.Config, config: cfgmod.Config) -> cfgmod.Config:
        """Apply logging changes; warn about the settings a reload cannot change. Returns the
        config now in effect (what admin `/config` shows): `config`, with those settings as they
        still are (`prev`'s) until the restart."""
        if config.logging != prev.logging:
            if self.owns_logging:
                setup_logging(config.logging)
                log.info("logging: format %s, level %s", config.logging.format, config.logging.level)
        if config.tracing != prev.tracing and self._own_telemetry:
            log.warning("tracing settings changed: they take effect at the next restart")
        if config.admin != prev.admin or config.metrics_listen != prev.metrics_listen:
            log.warning("admin settings changed (admin, metrics_listen): they take effect at the next restart")
        return config.model_copy(update={"tracing": prev.tracing, "admin": prev.admin,
                                         "metrics_listen": prev.metrics_listen})

    def _sweep_retired(self) -> None:
        """Drain the listeners a reload removed: each connection closes once quiet for
        RETIRED_QUIET (armed at the reload: `close_when_quiet`), and those left at the reload's
        `drain_timeout` close as a stop closes them (open calls answered). Their calls meanwhile
        use the clusters they were routed to, whose discovery and health checks stopped: the
        drain bounds how long. Forget retired listeners whose connections all closed; close
        retired clusters that no call is on and no retired listener routes to; check again later
        while any remain."""
        self._retire_timer = None
        now = time.monotonic()
        for state in self._retired_listeners:
            deadline, timeout = state.drain_by or (now, 0.0)
            if now < deadline:
                continue
            for conn in list(state.connections):
                # (every one, also one closing once its calls are answered: a client that
                # half-closed after its request waits for it; not one shut down already)
                t = conn.transport
                if t is not None and not t.is_closing():
                    conn.shut_down(f"drain_timeout {timeout:g}s passed",
                                   f"its listener {state.settings.name} was removed by a reload")
        self._retired_listeners = [s for s in self._retired_listeners if s.connections]
        routed = {id(c) for s in self._retired_listeners for r in s.pipeline.router.routes for c in r.clusters}
        still = []
        for c in self._retiring:
            if id(c) in routed or c.in_use():
                still.append(c)
            else:
                c.close()
                log.info("cluster %s replaced by a reload: closed (no call on it any more)", c.name)
        self._retiring = still
        if self._retired_listeners or self._retiring:
            self._retire_timer = self.loop.call_later(RETIRE_POLL, self._sweep_retired)

    def _set_watch(self, config: cfgmod.Config) -> None:
        """Start or stop watching the config file as `reload.watch` says."""
        if config.reload.watch and self.path:
            if self._watch is None:
                self._watch = self.loop.create_task(self._watch_file())
        elif self._watch is not None:
            task, self._watch = self._watch, None
            if task is not asyncio.current_task():  # else the watch loop ends by itself
                task.cancel()

    def _watched(self) -> list[str]:
        """The files a reload reads again: the config file, and those the running config names
        (TLS certificates, keys and CAs, which cert-manager and the like rotate in place; the
        listeners' IDLs). A discovery file has a watch of its own."""
        paths = [self.path]
        for lc in self.config.listeners:
            if lc.idl is not None:
                paths.append(str(lc.idl))
        for cc in self.config.clusters:
            if cc.tls is not None:
                paths += [str(p) for p in (cc.tls.ca, cc.tls.cert, cc.tls.key) if p is not None]
        return paths

    async def _watch_file(self) -> None:
        """Reload when the config file or a file it names changes (`_watched`), including
        Kubernetes ConfigMap and Secret symlink swaps; ends when a reload turns `reload.watch` off."""
        def stamp(path: str):
            try:
                real = os.path.realpath(path)
                st = os.stat(real)
                return (real, st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                return None

        def stamps() -> dict:
            return {path: stamp(path) for path in self._watched()}

        last = stamps()
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            now = stamps()
            if now != last and None not in now.values():  # (a file mid-swap: looked at again next time)
                changed = [path for path, st in now.items() if last.get(path) != st]
                last = now
                log.info("%s changed: reloading", ", ".join(changed))
                await self.reload_logged()
                if self._watch is not asyncio.current_task():  # the new config turned watching off
                    return
                # (the new config may name other files: as they are now; a change during the reload
                # to one watched before is seen next time)
                last = {path: last[path] if path in last else stamp(path) for path in self._watched()}

    # -- drain and stop ----------------------------------------------------------------

    def request_stop(self) -> None:
        """First signal: drain. Second: stop now."""
        if self.draining:
            log.info("second signal: exiting now (spans still queued are not waited for)")
            self._hurry.set()
            self._stop.set()
            return
        self.draining = True
        log.info("draining: serving local clients until none is connected for %.1fs or %.1fs pass",
                 DRAIN_GRACE, self.config.drain_timeout)
        self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout
        quiet_since = None
        while time.monotonic() < deadline and not self._stop.is_set():
            open_conns = sum(len(s.connections) for s in self._all_listener_states())
            now = time.monotonic()
            if open_conns == 0:
                quiet_since = quiet_since or now
                if now - quiet_since >= DRAIN_GRACE:
                    break
            else:
                quiet_since = None
            await asyncio.sleep(0.05)
        self._stop.set()

    def _all_listener_states(self) -> list[ListenerState]:
        """Current listeners' states, then those of listeners a reload removed (still connected)."""
        return list(self.listeners.values()) + self._retired_listeners

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    def _stop_checker(self, checker: HealthChecker) -> None:
        task = checker.close()
        if task is not None and not task.done():
            self._checks_ending.add(task)
            task.add_done_callback(self._checks_ending.discard)

    async def close(self) -> None:
        self.ready = False
        if self._watch is not None:
            self._watch.cancel()
        if self._retire_timer is not None:
            self._retire_timer.cancel()
            self._retire_timer = None
        for srv in self.servers.values():
            srv.close()
        if self._hurry.is_set():
            why = "a second signal"
        elif self.draining:
            why = f"drain_timeout {self.config.drain_timeout:g}s passed"
        else:
            why = "stopped"
        for state in self._all_listener_states():
            for conn in list(state.connections):
                conn.shut_down(why)
        for h in self.health.values():
            self._stop_checker(h)
        for c in list(self.clusters.values()) + self._retiring:
            c.close()
        self._retiring = []
        for srv in self.servers.values():
            try:
                async with asyncio.timeout(1.0):
                    await srv.wait_closed()  # (uvloop's does not wait for the connections)
            except TimeoutError:
                pass
        await self._cut_unflushed()
        if self._checks_ending:
            await asyncio.wait(self._checks_ending, timeout=1.0)
        self.lag.stop()
        splice.close_idle_pipes()
        if self.telemetry is not None and self._own_telemetry:  # spans flushed with a bounded timeout
            await self._flush_spans()
        if self.admin is not None:
            await self._close_admin()

    async def _cut_unflushed(self) -> None:
        """Connections still open CLOSE_GRACE after `shut_down` (at once after a second signal)
        hold replies their clients did not take (a stopped or slow reader; a reply still
        streaming): reset them now, so that each such call is recorded as not delivered (metrics, access
        log, and a span flushed below) instead of vanishing with the process."""
        states = self._all_listener_states()
        deadline = time.monotonic() + CLOSE_GRACE
        while (any(state.connections for state in states) and not self._hurry.is_set()
               and time.monotonic() < deadline):
            await asyncio.sleep(0.02)
        left = [conn for state in states for conn in state.connections if conn.transport is not None]
        for conn in left:
            conn.transport.abort()  # (connection_lost records them, soon: below)
        if left:
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    async def _close_admin(self) -> None:
        """Close the admin server (its requests in progress get admin.SHUTDOWN_TIMEOUT), unless a
        second signal came (before or during): then at once."""
        if self._hurry.is_set():
            return
        close = self.loop.create_task(self.admin.close())
        hurry = self.loop.create_task(self._hurry.wait())
        await asyncio.wait((close, hurry), return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not close.done():
            close.cancel()

    async def _flush_spans(self) -> None:
        """Export queued spans within SPAN_FLUSH_TIMEOUT, unless a second signal came (before or
        during the flush): then exit at once. The flush runs in a daemon thread of its own, so
        nothing at exit waits for an exporter that hangs."""
        import threading

        queue = self.telemetry.queue
        if self._hurry.is_set():
            left = queue.size if queue is not None else 0
            self.telemetry.shutdown(0.0)
            log.warning("spans of %d calls still queued at shutdown not exported: second signal", left)
            return
        done = self.loop.create_future()

        def flush() -> None:
            ok = self.telemetry.shutdown(SPAN_FLUSH_TIMEOUT)
            self.loop.call_soon_threadsafe(lambda: done.done() or done.set_result(ok))

        threading.Thread(target=flush, name="span-flush", daemon=True).start()
        hurry = self.loop.create_task(self._hurry.wait())
        try:
            await asyncio.wait({done, hurry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
        left = queue.size if queue is not None else 0  # (what the flush had not handed over yet)
        if not done.done():
            log.warning("span export at shutdown cut short: second signal (%d calls' spans still queued)", left)
        elif not done.result():
            log.warning("spans not all exported within %.0fs at shutdown: %d calls' spans still queued",
                        SPAN_FLUSH_TIMEOUT, left)

    def snapshot(self) -> dict[str, Any]:
        """/stats: listeners, clusters (endpoints, breakers, pools, budgets, limits), health, exporter.
        All of it new objects (copies, not the server's own dicts): the admin formats it over
        several turns of the loop."""
        clusters = {}
        for name, c in self._shown.items():
            snap = c.snapshot()
            snap["retry_budget"] = c.budget.snapshot()
            snap["limits"] = c.limits.snapshot()
            for ep, ep_snap in zip(c.endpoints, snap["endpoints"]):
                ep_snap["healthy"] = ep.healthy
                if ep.pending:
                    ep_snap["health_check"] = "pending"  # (not checked yet: not counted in or out)
                if ep.breaker is not None:
                    ep_snap["breaker_detail"] = ep.breaker.snapshot()
            clusters[name] = snap
        out = {
            "ready": self.ready and not self.draining, "draining": self.draining, "reloads": dict(self.reloads),
            "listeners": {name: {**s.stats, **s.pipeline.stats, "connections": len(s.connections),
                                 "in_flight": sum(len(conn.queue) for conn in s.connections)}
                          for name, s in self.listeners.items()},
            # listeners a reload removed whose connections are still open (served on the old config)
            "retired_listeners": [{"name": s.settings.name, "connections": len(s.connections),
                                   "in_flight": sum(len(conn.queue) for conn in s.connections)}
                                  for s in self._retired_listeners if s.connections],
            "clusters": clusters,
            # clusters a reload replaced that calls in flight (or retired listeners) still use
            "retiring_clusters": [{"name": c.name, "calls_in_flight": c.limits.requests if c.limits else None}
                                  for c in self._retiring],
            "health_checks": {name: dict(h.stats) for name, h in self.health.items()},
            "loop_lag_max_ms": round(self.lag.max_lag_ns / 1e6, 3),
            # Python's small-object blocks in use: what a leak of Python objects grows, without
            # the allocator's RSS swings (tools/soak.py watches it)
            "python_allocated_blocks": sys.getallocatedblocks(),
        }
        if self.telemetry is not None and self.telemetry.queue is not None:
            q = self.telemetry.queue
            out["span_export"] = {"queued": q.size, "dropped": getattr(q, "dropped", None),
                                  "failed": getattr(q, "failed", None),
                                  # spans (not calls) the collector said it rejected (OTLP partial_success)
                                  "rejected_spans": getattr(q.exporter, "rejected_spans", 0)}
        return out


def setup_logging(cfg: cfgmod.Logging) -> None:
    level = getattr(logging, cfg.level.upper())
    handler = logging.StreamHandler(sys.stderr)
    from proxy.logs import JsonFormatter, TextFormatter
    handler.setFormatter(JsonFormatter() if cfg.format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _ignore_hups(loop: asyncio.AbstractEventLoop) -> None:
    """From the stop on, SIGHUP is ignored. The loop's handler would go with the loop, and
    SIGHUP's default action then ended the process by a signal in the middle of a clean stop (a
    config reloader that sends SIGHUPs while the pod terminates). Blocked meanwhile: one that
    comes between the two calls is dropped, not taken with the default action."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


async def serve(config: cfgmod.Config, path: str | None = None, owns_logging: bool = False,
                early_hups: list | None = None) -> int:
    """Run until stopped; ListenError (after cleaning up) if an address cannot be listened on.
    `early_hups`: SIGHUPs noted while starting (cli.main): one reload once the server is up."""
    loop = asyncio.get_running_loop()
    server = Server(config, loop, path=path)
    server.owns_logging = owns_logging
    try:
        await server.start()
    except StartError:
        await server.close()
        raise
    gc.freeze()  # start-up objects out of the collector's way: no 20-40 ms full collections on the loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(server.reload_logged()))
    if early_hups:
        log.info("SIGHUP received while starting: reloading now")
        loop.create_task(server.reload_logged())
    try:
        await server.wait_stopped()
    finally:
        _ignore_hups(loop)
        await server.close()
    log.info("stopped")
    return 0


FD_SPARE = 64  # descriptors beyond sockets: the config, logs, span file, splice pipes, the loop's own


def fd_limit_note(config: cfgmod.Config, soft: int) -> str | None:
    """A warning when the open-file limit is below what `config` may use: every listener's
    `max_connections`, and each cluster's pool `max_connections` per endpoint (a discovered
    cluster counted as one endpoint). Past the limit, the kernel still completes a client's
    connect and the event loop (libuv) closes it unanswered, with nothing said in the log: so
    say it at the start."""
    need = FD_SPARE + sum(lc.max_connections for lc in config.listeners)
    for c in config.clusters:
        endpoints = len(c.endpoints.static) if c.endpoints.static is not None else 1
        need += c.pool.max_connections * endpoints
    if soft >= need:
        return None
    return (f"the open-file limit ({soft}) is below what the config may use ({need}: the listeners' "
            "max_connections, the pools' max_connections per endpoint, and some spare): past it, new "
            "client connections are closed unanswered and connects fail; raise the limit (ulimit -n, "
            "LimitNOFILE, the container's nofile) or lower max_connections")


def run_from_file(path: str, early_hups: list | None = None) -> int:
    try:
        config = cfgmod.load(path)
    except cfgmod.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 2
    setup_logging(config.logging)
    soft, _ = raise_nofile_limit()
    note = fd_limit_note(config, soft)
    if note:
        log.warning("%s", note)
    try:
        return run(config, path, owns_logging=True, early_hups=early_hups)
    except StartError as e:  # said like a config error: FILE:LINE: key: message
        print(e.line(path), file=sys.stderr)
        return 2


def run(config: cfgmod.Config, path: str | None = None, owns_logging: bool = False,
        early_hups: list | None = None) -> int:
    import uvloop
    return uvloop.run(serve(config, path, owns_logging, early_hups))
