"""`thrift-sidecar demo` (what `make demo` runs), its config, and its two helper commands.

The demo is run as `make demo` runs it, as a separate process (`python -m proxy demo`): it must
finish by itself within a minute, print the hop table with a verdict naming `write_response`
(the slow-reading client), and leave no process behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest

from jaeger import jaeger_server  # noqa: F401 - the fixture (a real Jaeger, shared per session)

ROOT = Path(__file__).resolve().parent.parent
PARENT_ENV = "THRIFT_SIDECAR_DEMO_PARENT"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running any more
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _descendants_of(parent_pid: int) -> list[int]:
    """Processes started by the demo: they carry its pid in their environment (Linux /proc)."""
    marker = f"{PARENT_ENV}={parent_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if _alive(pid)]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    started = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "proxy", "demo", "--out", str(out)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        pytest.fail(f"the demo did not end within 90 s:\n{output}")
    return {"rc": p.returncode, "seconds": time.monotonic() - started, "output": output, "out": out,
            "pid": p.pid}


def test_demo_completes_within_a_minute(demo_run):
    assert demo_run["rc"] == 0, demo_run["output"]
    assert demo_run["seconds"] < 60, demo_run["output"]


def test_demo_prints_the_hop_table_and_names_write_response(demo_run):
    out = demo_run["output"]
    lines = out.splitlines()
    assert re.search(r"^hops: \d+ calls from .*spans\.jsonl, by method( \(\d+ streamed\))?$", out, re.M), out
    assert "UserService/get_users:" in out and "UserService/ping:" in out, out
    header = [ln for ln in lines if ln.split() == ["hop", "calls", "p50", "ms", "p99", "ms", "share"]]
    assert len(header) >= 2, out
    for hop in ("read_request", "acquire", "write_upstream", "service_time", "read_response", "write_response"):
        assert re.search(rf"^  {hop} +\d+ +[\d.]+ +[\d.]+ +[\d.]+%$", out, re.M), (hop, out)
    # the client made the large calls and the slow reader, and nothing failed
    assert re.search(r"get_users\(5499\) +2 calls", out), out
    assert re.search(r"slow reader: 127\.0\.0\.1:\d+ read 5,499 users", out), out
    assert re.search(r"^demo-client: \d+ calls .* 0 failed$", out, re.M), out
    # the verdict (hops') names write_response: the slow reader dominates
    verdicts = [ln for ln in lines if ln.startswith("verdict: ")]
    assert len(verdicts) == 1, out
    assert verdicts[0].startswith("verdict: write_response is "), out
    assert "UserService/get_users" in verdicts[0] and "slow to read" in verdicts[0], out
    # ... and the slow reader's own call is found in the spans with write_response dominant
    assert re.search(r"^the slow reader's call \(127\.0\.0\.1:\d+\): UserService/get_users \d+ ms, "
                     r"of which write_response \d+ ms", out, re.M), out
    # balancing and retries show in the traces: both upstreams got attempts, some calls retried
    m = re.search(r"upstream attempts per endpoint: (\S+) (\d+), (\S+) (\d+); (\d+) calls retried", out)
    assert m and int(m.group(2)) > 0 and int(m.group(4)) > 0 and int(m.group(5)) > 0, out


def test_demo_writes_spans_and_the_waterfall(demo_run):
    out_dir = demo_run["out"]
    assert (out_dir / "spans.jsonl").stat().st_size > 0
    html = out_dir / "hops.html"
    assert html.stat().st_size > 0 and f"waterfall of the worst 5 calls: {html}" in demo_run["output"]
    assert "verdict: write_response" in html.read_text()
    if shutil.which("chromium"):  # `make test` installs it; the PNG is optional otherwise
        png = out_dir / "hops.png"
        assert f"png: {png}" in demo_run["output"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_leaves_no_process_behind(demo_run):
    out = demo_run["output"]
    pids = [int(p) for p in re.findall(r"\(pid (\d+)", out) + re.findall(r"client +pid (\d+)", out)]
    pids = [p for p in pids if p != demo_run["pid"]]
    assert len(pids) >= 3, out  # two upstreams and the client
    assert not [p for p in pids if _alive(p)], out
    if sys.platform.startswith("linux"):
        assert _descendants_of(demo_run["pid"]) == []


def test_demo_also_exports_to_jaeger_with_the_variable(jaeger_server, tmp_path):  # noqa: F811
    env = {**os.environ, "THRIFT_SIDECAR_DEMO_OTLP": f"http://{jaeger_server.otlp_grpc}"}
    r = subprocess.run([sys.executable, "-m", "proxy", "demo", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"^OTLP \S+: (\d+) spans exported, 0 not", r.stdout, re.M)
    assert m, r.stdout
    ids = set()
    with open(tmp_path / "spans.jsonl") as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    ids.update(sp["traceId"] for sp in ss["spans"] if sp.get("kind") == 2)  # SERVER
    assert len(ids) > 100
    traces = jaeger_server.wait_for_spans("thrift-sidecar-demo", int(m.group(1)))
    assert ids <= {t["traceID"] for t in traces}


def test_config_demo_yaml_is_the_packaged_one():
    packaged = resources.files("proxy").joinpath("data", "demo.yaml").read_bytes()
    assert (ROOT / "config" / "demo.yaml").read_bytes() == packaged


def test_demo_config_checks():
    r = subprocess.run([sys.executable, "-m", "proxy", "check-config", "config/demo.yaml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "cluster users: 127.0.0.1:9191, 127.0.0.1:9192 (least_request, framed/binary)" in r.stdout


def test_rendered_config_changes_only_addresses_and_the_span_file(tmp_path):
    from proxy import config as cfgmod
    from proxy.demo import packaged_config_text, render_config

    text = packaged_config_text()
    original = cfgmod.loads(text, "demo.yaml").effective()
    rendered = render_config(text, ["127.0.0.1:1111", "127.0.0.1:2222"], tmp_path / "s.jsonl").effective()
    assert rendered["listeners"][0]["listen"] == "127.0.0.1:0"
    assert rendered["admin"]["listen"] == "127.0.0.1:0"
    assert [e["address"] for e in rendered["clusters"][0]["endpoints"]] == ["127.0.0.1:1111", "127.0.0.1:2222"]
    assert rendered["tracing"]["path"] == str(tmp_path / "s.jsonl")
    for cfg in (original, rendered):
        cfg["listeners"][0]["listen"] = cfg["admin"]["listen"] = cfg["tracing"]["path"] = None
        cfg["clusters"][0]["endpoints"] = None
    assert rendered == original


def _upstream(*extra: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "proxy", "demo-upstream", "--host", "127.0.0.1", "--port", "0",
                          *extra], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    m = re.search(r"UserService on (127\.0\.0\.1:\d+) ", line)
    assert m, line
    return p, m.group(1)


@pytest.mark.parametrize("framing,protocol", [("framed", "binary"), ("buffered", "compact"),
                                              ("header", "binary")])
def test_demo_client_against_demo_upstream(framing, protocol):
    """The two commands compose and Kubernetes run work on their own (no sidecar between)."""
    p, address = _upstream("--framing", framing, "--protocol", protocol)
    try:
        r = subprocess.run([sys.executable, "-m", "proxy", "demo-client", "--target", address, "--count", "30",
                            "--framing", framing, "--protocol", protocol], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(r"^demo-client: 33 calls on 4 connections \+ 1 slow reader in [\d.]+ s, 0 failed$",
                         r.stdout, re.M), r.stdout
        assert "slow reader: 127.0.0.1:" in r.stdout
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_demo_client_forever_stops_on_sigterm_and_counts_unavailable():
    p, address = _upstream("--fail-every", "3")
    try:
        c = subprocess.Popen([sys.executable, "-m", "proxy", "demo-client", "--target", address, "--count", "12",
                              "--no-slow-reader", "--large", "0", "--forever", "--interval", "0.1"],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
        first = c.stdout.readline()
        c.send_signal(signal.SIGTERM)
        assert c.wait(20) == 0
        rest = c.stdout.read()
        c.stdout.close()
        # the upstream's declared exception reaches the client directly (no sidecar to retry)
        assert re.search(r"failed: \d+ × get_users: Unavailable", first + rest), first + rest
    finally:
        for proc in (p,):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_demo_client_refuses_a_bad_target():
    r = subprocess.run([sys.executable, "-m", "proxy", "demo-client", "--target", "nohostport"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


@pytest.mark.skipif(shutil.which("thrift") is None, reason="needs the Thrift compiler")
def test_committed_demo_code_matches_the_idl(tmp_path):
    subprocess.run(["thrift", "--gen", "py", "-out", str(tmp_path), str(ROOT / "proxy/data/user_service.thrift")],
                   check=True, timeout=60)
    for name in ("__init__.py", "constants.py", "ttypes.py", "UserService.py"):
        generated = (tmp_path / "user_service" / name).read_text()
        committed = (ROOT / "proxy/demo_gen/user_service" / name).read_text()
        strip = re.compile(r"^# Autogenerated by Thrift Compiler \(.*\)$", re.M)  # any compiler version
        assert strip.sub("", committed) == strip.sub("", generated), name


def test_demo_upstream_takes_get_users_with_arguments_left_out():
    """A client may leave out `count` or `sleep_ms` (they arrive as None): an answer, not a crash."""
    from proxy.demo_upstream import Handler

    h = Handler(prebuild=10)
    assert len(h.get_users(3, None)) == 3
    assert h.get_users(None, None) == []
    assert len(h.get_users(2, -5)) == 2  # a negative sleep is no sleep


def test_demo_out_that_cannot_be_a_folder_is_one_line_and_exit_2(tmp_path):
    """`--out` naming a file (or anything that cannot be made a folder) is said in one line,
    exit 2, as every subcommand's bad argument is, before anything starts. Before: a
    FileExistsError traceback and exit 1."""
    afile = tmp_path / "afile"
    afile.write_text("")
    r = subprocess.run([sys.executable, "-m", "proxy", "demo", "--out", str(afile), "--calls", "5", "--no-png"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == f"demo: --out {afile}: File exists", r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "upstreams" not in r.stdout
