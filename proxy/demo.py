"""`thrift-sidecar demo` (and `make demo`): the main job on the embedded default, no outside service.

Owns: running the demo end to end and cleaning up after it. In order:

1. two demo upstreams (`thrift-sidecar demo-upstream`, `proxy.demo_upstream`) as child
   processes on free loopback ports; the second answers one `get_users` in 7 with the declared
   `Unavailable` exception, which the sidecar retries on the other one;
2. the sidecar itself, in this process on uvloop (`proxy.server.Server`), with the config shipped
   in the package (`proxy/data/demo.yaml`, the same file as `config/demo.yaml`), its addresses
   replaced by free loopback ports and its span file by one in the output folder: least_request
   over the two upstreams, retries of the idempotent methods, circuit breakers, health checks,
   every call traced to a JSON-lines span file, admin on a free port;
3. a client process (`thrift-sidecar demo-client`, `proxy.demo_client`) making one round of
   calls through it: pings, small `get_users`, 5,499-user `get_users` (about 1 MB each), and one
   deliberately slow-reading client;
4. the sidecar stops (spans flushed), and `proxy.hops` reads the span file: the hop table, the
   worst calls, the verdict, and the slow reader's own call; the waterfall is written as HTML,
   and as a PNG when chromium is installed (`--no-png` skips it; tools/screenshot.sh in a checkout).

Every child process is stopped in `finally` (SIGTERM, then SIGKILL) and, on Linux, also dies with
this process if it is killed (PR_SET_PDEATHSIG). With `--otlp ENDPOINT` (or the environment
variable THRIFT_SIDECAR_DEMO_OTLP) the spans also go to an OTLP endpoint such as Jaeger's.
Leaves to others: proxying (`proxy.server`), the analysis and its verdict (`proxy.hops`), the
waterfall (`proxy.hops_html`).
"""

from __future__ import annotations

import asyncio
import gc
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from proxy.demo_upstream import PARENT_ENV

OTLP_ENV = "THRIFT_SIDECAR_DEMO_OTLP"
FAIL_EVERY = 7              # the second upstream fails 1 get_users in 7 (retried on the other)
START_TIMEOUT = 15.0        # seconds for an upstream to say where it listens
CLIENT_TIMEOUT = 40.0       # seconds for the client's round; the demo ends well within a minute
STOP_TIMEOUT = 3.0          # seconds between SIGTERM and SIGKILL for a child
OTLP_FLUSH_TIMEOUT = 5.0    # seconds to finish exporting to the OTLP endpoint at the end
SCREENSHOT_TIMEOUT = 20.0   # seconds for chromium to draw the waterfall's PNG
SLOW_READER = re.compile(r"slow reader: (\S+:\d+) ")


def packaged_config_text() -> str:
    """The demo config shipped in the package (config/demo.yaml is the same file)."""
    return resources.files("proxy").joinpath("data", "demo.yaml").read_text(encoding="utf-8")


def render_config(text: str, endpoints: list[str], spans_path: Path, filename: str = "demo.yaml"):
    """The demo config with the demo's own addresses: free ports, these endpoints, this span file."""
    import yaml

    from proxy import config as cfgmod

    data = yaml.safe_load(text)
    data["admin"]["listen"] = "127.0.0.1:0"
    for listener in data["listeners"]:
        listener["listen"] = "127.0.0.1:0"
    data["clusters"][0]["endpoints"] = endpoints
    data["tracing"]["path"] = str(spans_path)
    return cfgmod.loads(yaml.safe_dump(data, sort_keys=False), filename)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env[PARENT_ENV] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"
    # the children import `proxy` the way this process did (an uninstalled checkout too)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _stop_child(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for stream in (p.stdout, p.stderr):
        if stream is not None:
            stream.close()


def spawn_upstream(children: list[subprocess.Popen], fail_every: int = 0) -> subprocess.Popen:
    """A `demo-upstream` child on a free loopback port (it prints where it listens)."""
    cmd = [sys.executable, "-m", "proxy", "demo-upstream", "--host", "127.0.0.1", "--port", "0"]
    if fail_every:
        cmd += ["--fail-every", str(fail_every)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_child_env(), text=True)
    children.append(p)
    return p


def upstream_address(p: subprocess.Popen, deadline: float) -> str:
    """The address a `demo-upstream` child printed on its first line; RuntimeError if it did not."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = p.stdout.readline() if ready else ""
    m = re.search(r" on (\S+:\d+) ", line)
    if not m:
        raise RuntimeError(f"demo-upstream (pid {p.pid}) did not start: {line.strip() or 'no output'}")
    return m.group(1)


class TeeExporter:
    """Spans to the span file (at once) and to an OTLP endpoint (from its own thread, so a slow or
    unreachable endpoint never holds the span file back)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second
        self._q: queue.Queue = queue.Queue(maxsize=1000)
        self.sent = 0
        self.dropped = 0  # not sent: refused, failed or still queued at shutdown
        self._thread = threading.Thread(target=self._run, name="demo-otlp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        while True:
            batch = self._q.get()
            if batch is None:
                return
            try:
                ok = self.second.export(batch) == SpanExportResult.SUCCESS
            except Exception:  # noqa: BLE001 - the OTLP side is best effort
                ok = False
            if ok:
                self.sent += len(batch)
            else:
                self.dropped += len(batch)

    def export(self, spans):
        try:
            self._q.put_nowait(list(spans))
        except queue.Full:
            self.dropped += len(spans)
        return self.first.export(spans)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.first.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.first.shutdown()
        self._q.put(None)
        self._thread.join(OTLP_FLUSH_TIMEOUT)
        while True:  # what the thread never got to
            try:
                batch = self._q.get_nowait()
            except queue.Empty:
                break
            self.dropped += len(batch or ())
        self.second.shutdown()


def make_telemetry(config, otlp: str | None, otlp_protocol: str):
    from proxy.exporter import make_exporter
    from proxy.telemetry import Telemetry

    exporter = make_exporter(config.tracing)
    if otlp:
        remote = make_exporter(config.tracing.model_copy(
            update={"exporter": "otlp", "endpoint": otlp, "otlp_protocol": otlp_protocol}))
        exporter = TeeExporter(exporter, remote)
    return Telemetry(config.tracing, exporter=exporter)


async def _run_sidecar(config, telemetry, client_cmd: list[str], out: list[str]) -> dict:
    """Serve until the client process is done; returns what the demo reports about the sidecar."""
    from proxy.server import Server

    loop = asyncio.get_running_loop()
    server = Server(config, loop, telemetry=telemetry)
    info: dict = {}
    proc = None
    try:
        await server.start()
        # what startup built (config models, imports) stays alive: keep it out of the cyclic
        # GC's full collections, which would otherwise stall the loop for tens of ms mid-call
        gc.freeze()
        host, port = server.address(config.listeners[0].name)
        info["listen"] = f"{host}:{port}"
        admin = server.admin.addresses.get("admin") if server.admin is not None else None
        info["admin"] = f"http://{admin[0]}:{admin[1]}/stats" if admin else None
        print(f"  sidecar   {info['listen']} (in this process, pid {os.getpid()}): least_request over both, "
              f"retries, circuit breakers; admin {info['admin']}", flush=True)
        proc = await asyncio.create_subprocess_exec(
            *client_cmd, "--target", info["listen"], stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL, env=_child_env())
        print(f"  client    pid {proc.pid}: {' '.join(client_cmd[3:])} --target {info['listen']}", flush=True)
        print(flush=True)

        async def relay() -> None:
            assert proc is not None and proc.stdout is not None
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                out.append(line)
                print(line, flush=True)

        try:
            async with asyncio.timeout(CLIENT_TIMEOUT):
                await relay()
                info["client_rc"] = await proc.wait()
        except TimeoutError:
            info["client_rc"] = None
            print(f"demo: the client did not finish within {CLIENT_TIMEOUT:.0f}s", flush=True)
        info["breakers"] = {ep["address"]: ep["breaker"]
                            for c in server.snapshot()["clusters"].values() for ep in c["endpoints"]}
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.close()
        # the spans of every call, flushed to the span file before it is read
        await loop.run_in_executor(None, telemetry.shutdown, 10.0)
    return info


def _analyse(spans_path: Path, slow_reader: str | None, html_path: Path, want_png: bool | None) -> str | None:
    """Print the hop table and the slow reader's call; write the waterfall. Returns the verdict hop."""
    from proxy import hops

    calls = hops.rebuild_calls(hops.load_jsonl(str(spans_path)))
    report = hops.analyse(calls, by="method", worst=5)
    report.source = str(spans_path)

    attempts: dict[str, int] = {}
    retried = 0
    for c in calls:
        for a in c.attempts:
            attempts[a.endpoint] = attempts.get(a.endpoint, 0) + 1
        retried += len(c.attempts) > 1
    spread = ", ".join(f"{ep} {n}" for ep, n in sorted(attempts.items()))
    print(f"traces: {len(calls)} calls; upstream attempts per endpoint: {spread}; "
          f"{retried} calls retried on the other upstream")
    print()
    print(hops.render_text(report))
    if slow_reader:
        mine = [c for c in calls if c.client == slow_reader]
        if mine:
            c = max(mine, key=lambda c: c.total)
            hop, ns = c.dominant()
            print(f"the slow reader's call ({slow_reader}): {c.name} {c.total / 1e6:.0f} ms, of which {hop} "
                  f"{ns / 1e6:.0f} ms ({ns / c.total:.0%}) - trace {c.trace_id}")
    try:
        from proxy.hops_html import render_html
    except ImportError:
        print("waterfall: not written (proxy.hops_html is not available)")
    else:
        html_path.write_text(render_html(report), encoding="utf-8")
        print(f"waterfall of the worst {len(report.worst)} calls: {html_path}")
        if want_png or (want_png is None and _browser() is not None):
            _screenshot(html_path)
    return report.verdict_hop


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def _screenshot(html_path: Path) -> None:
    """The waterfall as a PNG: with the repository's tools/screenshot.sh when there is one (a
    checkout), else headless chromium directly (an installed package)."""
    browser = _browser()
    if browser is None:
        print("png: not written (no chromium on PATH)")
        return
    png = html_path.with_suffix(".png")
    png.unlink(missing_ok=True)
    script = Path(__file__).resolve().parent.parent / "tools" / "screenshot.sh"
    with tempfile.TemporaryDirectory(prefix="demo-chromium-") as profile:
        if script.is_file():
            cmd = [str(script), str(html_path), str(png), "1400,1000"]
        else:
            cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   f"--user-data-dir={profile}", "--hide-scrollbars", "--window-size=1400,1000",
                   f"--screenshot={png.resolve()}", html_path.resolve().as_uri()]
        # its own process group, so a browser that hangs is stopped with everything it started
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            p.wait(SCREENSHOT_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(f"png: {png}" if png.exists() and png.stat().st_size else "png: not written (chromium failed)")


def main(args) -> int:
    """`thrift-sidecar demo`: 0 when the client's calls all succeeded and hops gave a verdict."""
    try:
        return _demo(args)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the children were stopped on the way out
        print("demo: interrupted", file=sys.stderr)
        return 130


def _demo(args) -> int:
    started = time.monotonic()
    out_dir = Path(args.out)
    spans_path = out_dir / "spans.jsonl"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        spans_path.unlink(missing_ok=True)  # the exporter appends
    except OSError as e:  # (a file where the folder should be, no permission, a read-only disk)
        print(f"demo: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    otlp = args.otlp or os.environ.get(OTLP_ENV) or None
    children: list[subprocess.Popen] = []
    print("thrift-sidecar demo: two UserService upstreams, the sidecar, a client mix, then the hop table")
    with ExitStack() as cleanup:
        cleanup.callback(lambda: [_stop_child(p) for p in children])
        # SIGTERM ends the demo like Ctrl-C does: through the cleanup above
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            ups = [spawn_upstream(children), spawn_upstream(children, fail_every=FAIL_EVERY)]
            deadline = time.monotonic() + START_TIMEOUT
            first, second = (upstream_address(p, deadline) for p in ups)
        except RuntimeError as e:
            print(f"demo: {e}", file=sys.stderr)
            return 1
        print(f"  upstream  {first} (pid {ups[0].pid})")
        print(f"  upstream  {second} (pid {ups[1].pid}): 1 get_users in {FAIL_EVERY} answers Unavailable")
        config = render_config(packaged_config_text(), [first, second], spans_path)
        from proxy.server import setup_logging
        setup_logging(config.logging)
        telemetry = make_telemetry(config, otlp, args.otlp_protocol)
        print(f"  spans     {spans_path}" + (f" and OTLP/{args.otlp_protocol} {otlp}" if otlp else ""))
        client_cmd = [sys.executable, "-m", "proxy", "demo-client", "--count", str(args.calls)]
        lines: list[str] = []
        import uvloop
        info = uvloop.run(_run_sidecar(config, telemetry, client_cmd, lines))
        if info.get("breakers"):
            states = ", ".join(f"{ep} {state}" for ep, state in info["breakers"].items())
            print(f"circuit breakers: {states}")
    # every child has exited here
    gone = all(p.returncode is not None for p in children)
    print(f"upstreams stopped: pids {', '.join(str(p.pid) for p in children)}"
          + ("" if gone else " (some did not exit!)"))
    print()
    slow = next((m.group(1) for line in lines if (m := SLOW_READER.search(line))), None)
    if not spans_path.exists():
        print(f"demo: no span file was written ({spans_path})", file=sys.stderr)
        return 1
    verdict_hop = _analyse(spans_path, slow, out_dir / "hops.html", args.png)
    tee = telemetry.exporter if isinstance(telemetry.exporter, TeeExporter) else None
    if tee is not None:
        host = urlsplit(otlp).hostname or "127.0.0.1"
        if tee.sent:
            print(f"OTLP {otlp}: {tee.sent} spans exported, {tee.dropped} not; from Jaeger (its query API, "
                  f"port 16686 unless you moved it): thrift-sidecar hops --jaeger http://{host}:16686 "
                  f"--service {config.tracing.service_name}")
        else:
            print(f"OTLP {otlp}: no span exported ({tee.dropped} not): the log above says why")
    print(f"demo finished in {time.monotonic() - started:.1f} s")
    if info.get("client_rc") != 0 or verdict_hop is None:
        return 1
    return 0
