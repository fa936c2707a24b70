"""Admin HTTP endpoints on aiohttp (no hand-written HTTP): /ready /live /metrics /stats /config.

Served on the proxy's own loop. `/ready` is 503 until every listener is up
and from the start of a drain; `/live` is 200 while the loop runs. The
optional health listener serves only /ready and /live (kubelet probes on the
pod IP); `metrics_listen` serves /metrics alone. Loopback-only binding unless
`allow_remote` is checked at config load.

/metrics and /stats are formatted in pieces, the loop serving calls between them: /stats of
1,000 clusters is ~1.7 MB of indented JSON, ~70 ms for `json.dumps(indent=2)` at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.logs import Throttle

log = logging.getLogger(__name__)
# aiohttp's request handlers log here (not to `aiohttp.server`), through `_BadRequests`
http_log = logging.getLogger("proxy.admin.http")

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class AdminSources:
    """What the admin endpoints read; callables so nothing is computed until asked."""

    def __init__(self, ready: Callable[[], bool], stats: Callable[[], dict[str, Any]],
                 config: Callable[[], Any], metrics: Callable[[], Awaitable[bytes]]) -> None:
        self.ready = ready
        self.stats = stats
        self.config = config  # the config in effect: a frozen object with `effective()` (proxy.config.Config)
        self.metrics = metrics


class ConfigText:
    """`/config`'s text, made once per config in effect, in a thread: a frozen config is safe
    to read there, and its dump (~300 ms for 1,000 clusters, pydantic's serializer calling our
    Python ones) then holds the loop for no more than the interpreter's switch interval at a
    time. Before, every request made it on the loop (one 250 ms stall per /config poll)."""

    def __init__(self, config: Callable[[], Any]) -> None:
        self.config = config
        self._of: Any = None
        self._text: asyncio.Future | None = None

    async def text(self) -> str:
        cfg = self.config()
        if cfg is not self._of or self._text is None:
            self._of = cfg
            self._text = asyncio.ensure_future(asyncio.to_thread(_config_json, cfg))
        made = self._text
        try:
            return await asyncio.shield(made)
        except Exception:
            if self._text is made:  # (not cached: the next request tries again)
                self._text = None
            raise


def _config_json(cfg: Any) -> str:
    return json.dumps(cfg.effective(), indent=2, default=str) + "\n"


def _app(sources: AdminSources, endpoints: set[str]) -> web.Application:
    config_text = ConfigText(sources.config)

    async def ready(_req: web.Request) -> web.Response:
        ok = sources.ready()
        return web.Response(status=200 if ok else 503, text="ready\n" if ok else "not ready\n")

    async def live(_req: web.Request) -> web.Response:
        return web.Response(text="live\n")

    async def metrics(_req: web.Request) -> web.Response:
        return web.Response(body=await sources.metrics(), headers={"Content-Type": PROMETHEUS_TYPE})

    async def stats(_req: web.Request) -> web.Response:
        return web.Response(text=await pretty_json_async(sources.stats()) + "\n",
                            content_type="application/json")

    async def config(_req: web.Request) -> web.Response:
        return web.Response(text=await config_text.text(), content_type="application/json")

    handlers = {"/ready": ready, "/live": live, "/metrics": metrics, "/stats": stats, "/config": config}
    app = web.Application()
    for path in endpoints:
        app.router.add_get(path, handlers[path])
    return app


SLICE = 0.002  # seconds of JSON formatting between two turns of the loop
CHUNKS_PER_LOOK = 256  # encoder chunks between two looks at the clock
_ENCODER = json.JSONEncoder(indent=2, default=str)  # (json.dumps's, made once)


async def pretty_json_async(obj: Any) -> str:
    """`json.dumps(obj, indent=2, default=str)`, the loop running other work every SLICE
    seconds of formatting: the encoder's own chunks (`iterencode`, what json.dumps joins when
    it indents), so the text is the same by construction and the cost hardly more. `obj`
    should be the caller's own (a snapshot): a dict of the server's that changed size between
    two slices would stop the encoder, and the text is then made at once instead."""
    out: list[str] = []
    clock = time.perf_counter
    until = clock() + SLICE
    n = 0
    try:
        for chunk in _ENCODER.iterencode(obj):
            out.append(chunk)
            n += 1
            if n == CHUNKS_PER_LOOK:
                n = 0
                if clock() > until:
                    await asyncio.sleep(0)
                    until = clock() + SLICE
    except RuntimeError:  # ("dictionary changed size during iteration")
        return _ENCODER.encode(obj)
    return "".join(out)


class _BadRequests(logging.Filter):
    """A client's malformed HTTP request (aiohttp answers it 400) is the client's fault, not
    ours: one warning line without a traceback, thinned per kind to one per 10 s, instead of
    aiohttp's ERROR with a full traceback per request (a log flood from any port scanner).
    Anything else aiohttp logs (a handler's own exception) goes out as it came."""

    def __init__(self, throttle: Throttle) -> None:
        super().__init__()
        self.throttle = throttle

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        kind = type(exc).__name__
        self.throttle.warn(log, ("bad_http", kind), "admin: bad HTTP request from %s, answered %d: %s",
                           record.args[0] if record.args else "?", exc.code or 400,
                           (exc.message or kind).splitlines()[0][:200])
        return False


ALL = {"/ready", "/live", "/metrics", "/stats", "/config"}
# Seconds a stop waits for admin requests in progress (then cancels them; aiohttp's own default,
# 60 s, twice, let one client that never reads its replies hold the process up two minutes).
SHUTDOWN_TIMEOUT = 0.5
HEALTH = {"/ready", "/live"}
METRICS = {"/metrics"}


class AdminServer:
    """One aiohttp site per configured address (admin, health, metrics)."""

    def __init__(self, sources: AdminSources) -> None:
        self.sources = sources
        self.runners: list[web.AppRunner] = []
        self.addresses: dict[str, tuple[str, int]] = {}
        if not any(isinstance(f, _BadRequests) for f in http_log.filters):
            http_log.addFilter(_BadRequests(Throttle(10.0)))

    async def start(self, kind: str, host: str, port: int) -> tuple[str, int]:
        endpoints = {"admin": ALL, "health": HEALTH, "metrics": METRICS}[kind]
        runner = web.AppRunner(_app(self.sources, endpoints), access_log=None, handle_signals=False,
                                logger=http_log, shutdown_timeout=SHUTDOWN_TIMEOUT)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        self.runners.append(runner)
        sock = site._server.sockets[0]  # the bound address (port 0 picks a free one)
        addr = sock.getsockname()[:2]
        self.addresses[kind] = addr
        log.info("%s endpoints on %s:%d", kind, addr[0], addr[1])
        return addr

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners.clear()
