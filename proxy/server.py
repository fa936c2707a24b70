"""The composition root: builds everything from the config and runs it.

Config → clusters (endpoints, balancer, pools) → routes → pipelines →
listeners. Nothing else constructs these objects, and nothing is global:
each piece gets what it needs passed in. Lifecycle work (startup, signals,
drain) uses tasks and awaits; the per-call path lives in protocol callbacks.

Drain (an outbound sidecar): on SIGTERM/SIGINT `/ready` turns 503, existing
and new local connections keep being served, and the process exits once no
client connection has been open for `DRAIN_GRACE` seconds, or at
`drain_timeout`. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import signal
import sys
import time
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
from proxy.listener import ListenerSettings, ListenerState
from proxy.pipeline import Pipeline
from proxy.pool import PoolSettings
from proxy.router import HeaderMatch, Route, Router, method_matcher
from proxy.sockets import raise_nofile_limit
from proxy.tls import client_context

log = logging.getLogger("proxy")

DRAIN_GRACE = 1.0  # seconds without any client connection before a drain ends
SPAN_FLUSH_TIMEOUT = 5.0  # seconds to export queued spans at shutdown
WATCH_INTERVAL = 1.0  # seconds between config file checks (reload: {watch: true})


def _framing(name: str | None) -> Framing | None:
    if name is None or name == "auto":
        return None
    return Framing(name)


def _protocol(name: str | None) -> Protocol | None:
    if name is None or name == "auto":
        return None
    return Protocol(name)


def build_cluster(c: cfgmod.Cluster, loop: asyncio.AbstractEventLoop, rng: random.Random,
                  resolver: Resolver | None = None) -> Cluster:
    """A cluster and its endpoint source; TLS files are read here, so each config load re-reads them."""
    endpoints = static_endpoints(c.endpoints.static) if c.endpoints.static is not None else []
    pool = PoolSettings(max_connections=c.pool.max_connections, idle_timeout=c.pool.idle_timeout,
                        acquire_timeout=c.pool.acquire_timeout, connect_timeout=c.connect_timeout,
                        max_reply_size=c.max_reply_size, stream_threshold=c.stream_threshold)
    cluster = Cluster(c.name, loop, endpoints, make_balancer(c.load_balancer, rng=rng), pool,
                      framing=_framing(c.transport), protocol=_protocol(c.protocol),
                      ssl=client_context(c.tls, c.name) if c.tls is not None else None,
                      server_name=c.tls.server_name if c.tls is not None else None,
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
            import re
            route.headers = [HeaderMatch(name, h.exact, re.compile(h.regex) if h.regex else None, h.present)
                             for name, h in m.header.items()]
    return route


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
            telemetry = Telemetry(config.tracing)
        self.telemetry = telemetry
        if telemetry is not None and telemetry.queue is not None:
            self.metrics.watch_exporter(telemetry.queue)
        self.lag = LoopLagMonitor(self.loop)
        self.admin: AdminServer | None = None
        self.clusters: dict[str, Cluster] = {}
        self._cluster_cfg: dict[str, cfgmod.Cluster] = {}
        self.health: dict[str, HealthChecker] = {}
        self.listeners: dict[str, ListenerState] = {}
        self.servers: dict[str, asyncio.base_events.Server] = {}
        self._listen_cfg: dict[str, cfgmod.Listener] = {}
        self.ready = False
        self.draining = False
        self.reloads = {"ok": 0, "failed": 0}
        self._reload_lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._build_clusters(config)

    # -- building ----------------------------------------------------------------------

    def _build_clusters(self, config: cfgmod.Config) -> tuple[dict[str, Cluster], list[Cluster]]:
        """Clusters for `config`: unchanged ones reused; returns (new ones, retired ones)."""
        clusters: dict[str, Cluster] = {}
        fresh: dict[str, Cluster] = {}
        for c in config.clusters:
            old = self.clusters.get(c.name)
            if old is not None and self._cluster_cfg.get(c.name) == c:
                clusters[c.name] = old
                continue
            cluster = build_cluster(c, self.loop, self.rng, self.resolver)
            resilience.attach(cluster, c, monotonic)
            clusters[c.name] = fresh[c.name] = cluster
        retired = [c for name, c in self.clusters.items() if clusters.get(name) is not c]
        self.clusters = clusters
        self._cluster_cfg = {c.name: c for c in config.clusters}
        return fresh, retired

    def build_listener(self, lc: cfgmod.Listener) -> ListenerState:
        return ListenerState(self._settings(lc), self._pipeline(lc), self.loop)

    def _settings(self, lc: cfgmod.Listener) -> ListenerSettings:
        return ListenerSettings(
            name=lc.name, framing=_framing(lc.transport), protocol=_protocol(lc.protocol),
            max_frame_size=lc.max_frame_size, max_connections=lc.max_connections,
            request_read_timeout=lc.request_read_timeout, idle_timeout=lc.idle_timeout)

    def _pipeline(self, lc: cfgmod.Listener) -> Pipeline:
        """The listener's request path; ValueError naming the listener if its IDL is unusable or
        a route's `on_exceptions` names cannot be resolved (the IDL is read on every build)."""
        from proxy.idl import IdlError, load as load_idl

        router = Router([build_route(r, i, self.clusters, self.rng) for i, r in enumerate(lc.routes)])
        try:
            idl = load_idl(lc.idl) if lc.idl is not None else None
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
                                            self.telemetry, self.lag, self.config.logging.access_log)
        if self.telemetry is not None:
            hooks = TraceHooks(self.telemetry)
            pipeline.on_begin = hooks.begin
            pipeline.on_send = hooks.send
        return pipeline

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.lag.start()
        await self._start_admin()
        await self._start_clusters(self.clusters.values())
        for lc in self.config.listeners:
            await self._open(lc)
        if self.config.reload.watch and self.path:
            self._watch = self.loop.create_task(self._watch_file())
        self.ready = True

    async def _start_clusters(self, clusters) -> None:
        clusters = list(clusters)
        await asyncio.gather(*(c.start() for c in clusters))  # first discovery round
        for c in clusters:
            hc = self._cluster_cfg[c.name].health_check
            if hc is not None:
                checker = self.health[c.name] = HealthChecker(c, hc.method, hc.interval, hc.timeout)
                checker.start()

    async def _open(self, lc: cfgmod.Listener, state: ListenerState | None = None) -> None:
        state = state or self.build_listener(lc)
        srv = await self.loop.create_server(
            state.protocol_factory, lc.listen.host, lc.listen.port, backlog=lc.backlog, reuse_address=True)
        self.listeners[lc.name] = state
        self.servers[lc.name] = srv
        self._listen_cfg[lc.name] = lc
        log.info("listener %s on %s (%s/%s)", lc.name, self.address(lc.name), lc.transport, lc.protocol)

    async def _start_admin(self) -> None:
        cfg = self.config
        if cfg.admin is None and cfg.metrics_listen is None:
            return
        self.admin = AdminServer(AdminSources(ready=lambda: self.ready and not self.draining,
                                              stats=self.snapshot, config=lambda: self.config.effective(),
                                              metrics=self.metrics.exposition))
        if cfg.admin is not None:
            await self.admin.start("admin", cfg.admin.listen.host, cfg.admin.listen.port)
            if cfg.admin.health_listen is not None:
                await self.admin.start("health", cfg.admin.health_listen.host, cfg.admin.health_listen.port)
        if cfg.metrics_listen is not None:
            await self.admin.start("metrics", cfg.metrics_listen.host, cfg.metrics_listen.port)

    def address(self, listener: str) -> tuple[str, int]:
        """The bound (host, port) of a listener (port 0 in config picks a free one)."""
        sock = self.servers[listener].sockets[0]
        return sock.getsockname()[:2]

    # -- reload ------------------------------------------------------------------------

    async def reload(self) -> bool:
        """Re-read the config file; apply it if valid, else log its errors and keep serving."""
        if not self.path:
            return False
        try:
            config = cfgmod.load(self.path)
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
        return await self.apply(config)

    async def apply(self, config: cfgmod.Config) -> bool:
        """Swap to `config` atomically, as seen by new calls; calls in flight finish on the old one."""
        async with self._reload_lock:
            old_clusters, old_cfg = self.clusters, self._cluster_cfg
            try:
                fresh, retired = self._build_clusters(config)
            except Exception as e:  # e.g. unreadable TLS files: keep the old generation
                self.clusters, self._cluster_cfg = old_clusters, old_cfg
                self.reloads["failed"] += 1
                log.error("reload rejected: %s", e)
                return False
            await self._start_clusters(fresh.values())
            prev_config = self.config
            self.config = config
            new_names = {lc.name for lc in config.listeners}
            for name in [n for n in self.listeners if n not in new_names]:
                self._close_listener(name)
            for lc in config.listeners:
                old = self._listen_cfg.get(lc.name)
                if old is not None and old.listen == lc.listen and old.backlog == lc.backlog:
                    state = self.listeners[lc.name]
                    state.pipeline = self._pipeline(lc)   # new calls; in-flight ones keep theirs
                    state.settings = self._settings(lc)   # new connections
                    self._listen_cfg[lc.name] = lc
                    continue
                if old is not None:
                    self._close_listener(lc.name)
                try:
                    await self._open(lc)
                except OSError as e:
                    log.error("reload: listener %s cannot listen on %s: %s", lc.name, lc.listen, e.strerror)
            for c in retired:
                checker = self.health.pop(c.name, None)
                if checker is not None and checker.cluster is c:
                    checker.close()
                c.close()  # idle connections now; busy ones when their exchange ends
            if config.tracing != prev_config.tracing and self._own_telemetry:
                log.warning("tracing settings changed: they take effect at the next restart")
            self.reloads["ok"] += 1
            log.info("reloaded %s: %d listener(s), %d cluster(s) (%d rebuilt)", self.path or "config",
                     len(config.listeners), len(config.clusters), len(fresh))
            return True

    def _close_listener(self, name: str) -> None:
        """Stop accepting; connections already open keep being served until they close."""
        srv = self.servers.pop(name, None)
        if srv is not None:
            srv.close()
        self._listen_cfg.pop(name, None)
        self.listeners.pop(name, None)

    async def _watch_file(self) -> None:
        """Reload when the file changes, including Kubernetes ConfigMap symlink swaps."""
        import os

        def stamp():
            try:
                real = os.path.realpath(self.path)
                st = os.stat(real)
                return (real, st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                return None

        last = stamp()
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            now = stamp()
            if now is not None and now != last:
                last = now
                log.info("config file changed: reloading")
                await self.reload()

    # -- drain and stop ----------------------------------------------------------------

    def request_stop(self) -> None:
        """First signal: drain. Second: stop now."""
        if self.draining:
            log.info("second signal: exiting now")
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
            open_conns = sum(len(s.connections) for s in self.listeners.values())
            now = time.monotonic()
            if open_conns == 0:
                quiet_since = quiet_since or now
                if now - quiet_since >= DRAIN_GRACE:
                    break
            else:
                quiet_since = None
            await asyncio.sleep(0.05)
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def close(self) -> None:
        self.ready = False
        if self._watch is not None:
            self._watch.cancel()
        for srv in self.servers.values():
            srv.close()
        for state in self.listeners.values():
            for conn in list(state.connections):
                if conn.transport is not None:
                    conn.transport.close()
        for h in self.health.values():
            h.close()
        for c in self.clusters.values():
            c.close()
        for srv in self.servers.values():
            try:
                async with asyncio.timeout(1.0):
                    await srv.wait_closed()
            except TimeoutError:
                pass
        self.lag.stop()
        splice.close_idle_pipes()
        if self.admin is not None:
            await self.admin.close()
        if self.telemetry is not None and self._own_telemetry:  # spans flushed with a bounded timeout
            flushed = await self.loop.run_in_executor(None, self.telemetry.shutdown, SPAN_FLUSH_TIMEOUT)
            if not flushed:
                log.warning("spans not all exported within %.0fs at shutdown", SPAN_FLUSH_TIMEOUT)

    def snapshot(self) -> dict[str, Any]:
        """/stats: listeners, clusters (endpoints, breakers, pools, budgets, limits), health, exporter."""
        clusters = {}
        for name, c in self.clusters.items():
            snap = c.snapshot()
            snap["retry_budget"] = c.budget.snapshot()
            snap["limits"] = c.limits.snapshot()
            for ep, ep_snap in zip(c.endpoints, snap["endpoints"]):
                ep_snap["healthy"] = ep.healthy
                if ep.breaker is not None:
                    ep_snap["breaker_detail"] = ep.breaker.snapshot()
            clusters[name] = snap
        out = {
            "ready": self.ready and not self.draining, "draining": self.draining, "reloads": self.reloads,
            "listeners": {name: {**s.stats, **s.pipeline.stats, "connections": len(s.connections),
                                 "in_flight": sum(len(conn.queue) for conn in s.connections)}
                          for name, s in self.listeners.items()},
            "clusters": clusters,
            "health_checks": {name: h.stats for name, h in self.health.items()},
            "loop_lag_max_ms": round(self.lag.max_lag_ns / 1e6, 3),
            # Python's small-object blocks in use: what a leak of Python objects grows, without
            # the allocator's RSS swings (tools/soak.py watches it)
            "python_allocated_blocks": sys.getallocatedblocks(),
        }
        if self.telemetry is not None and self.telemetry.queue is not None:
            q = self.telemetry.queue
            out["span_export"] = {"queued": q.size, "dropped": getattr(q, "dropped", None),
                                  "failed": getattr(q, "failed", None)}
        return out


def setup_logging(cfg: cfgmod.Logging) -> None:
    level = getattr(logging, cfg.level.upper())
    handler = logging.StreamHandler(sys.stderr)
    if cfg.format == "json":
        from proxy.logs import JsonFormatter
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


async def serve(config: cfgmod.Config, path: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    server = Server(config, loop, path=path)
    await server.start()
    gc.freeze()  # start-up objects out of the collector's way: no 20-40 ms full collections on the loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(server.reload()))
    try:
        await server.wait_stopped()
    finally:
        await server.close()
    log.info("stopped")
    return 0


def run_from_file(path: str) -> int:
    try:
        config = cfgmod.load(path)
    except cfgmod.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 2
    setup_logging(config.logging)
    raise_nofile_limit()
    return run(config, path)


def run(config: cfgmod.Config, path: str | None = None) -> int:
    import uvloop
    return uvloop.run(serve(config, path))
