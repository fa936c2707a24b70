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
from collections.abc import Iterator
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
                 config: Callable[[], dict[str, Any]], metrics: Callable[[], Awaitable[bytes]]) -> None:
        self.ready = ready
        self.stats = stats
        self.config = config
        self.metrics = metrics


def _app(sources: AdminSources, endpoints: set[str]) -> web.Application:
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
        return web.Response(text=json.dumps(sources.config(), indent=2, default=str) + "\n",
                            content_type="application/json")

    handlers = {"/ready": ready, "/live": live, "/metrics": metrics, "/stats": stats, "/config": config}
    app = web.Application()
    for path in endpoints:
        app.router.add_get(path, handlers[path])
    return app


SLICE = 0.002  # seconds of JSON formatting between two turns of the loop


_ENCODER = json.JSONEncoder(indent=2, default=str)  # (json.dumps's, made once)
_BIG = 64  # entries of a container worth its own pieces


def pretty_json(obj: Any, indent: str = "", depth: int = 0) -> Iterator[str]:
    """`json.dumps(obj, indent=2, default=str)` in pieces: the top two levels, and any dict or
    list of more than 64 entries or holding one, go out an entry at a time; the rest (a
    cluster's snapshot, say) is one piece. Each container split is copied before its entries
    are formatted (a live dict that grows between two pieces is not an error); joined, the
    pieces are json.dumps's text, byte for byte."""
    is_dict = isinstance(obj, dict)
    if not (is_dict or isinstance(obj, list)) or not obj or (is_dict and not all(isinstance(k, str) for k in obj)) or (
            depth >= 2 and len(obj) <= _BIG
            and not any(isinstance(v, (dict, list)) and len(v) > _BIG for v in (obj.values() if is_dict else obj))):
        text = _ENCODER.encode(obj)
        yield text.replace("\n", "\n" + indent) if indent else text
        return
    inner = indent + "  "
    items = list(obj.items()) if is_dict else list(obj)
    yield "{" if is_dict else "["
    sep = "\n"
    for item in items:
        if is_dict:
            key, value = item
            yield f"{sep}{inner}{_ENCODER.encode(key)}: "
        else:
            value = item
            yield sep + inner
        yield from pretty_json(value, inner, depth + 1)
        sep = ",\n"
    yield f"\n{indent}{'}' if is_dict else ']'}"


async def pretty_json_async(obj: Any) -> str:
    """`pretty_json` joined, the loop running other work every SLICE seconds of formatting."""
    out = []
    clock = time.perf_counter
    until = clock() + SLICE
    for piece in pretty_json(obj):
        out.append(piece)
        if clock() > until:
            await asyncio.sleep(0)
            until = clock() + SLICE
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
                                logger=http_log)
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
