"""The command line as a user meets it: check-config exit codes, `run -c` serving and draining."""

from __future__ import annotations

import signal
import os
import subprocess
import sys
import time

import pytest

from harness import ROOT, ProxyProcess, ThriftServer, client, config_text, free_port, listening


def _cli(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=60, env=None if env is None else {**os.environ, **env})


def test_check_config_valid_exits_0_with_summary():
    r = _cli("check-config", "config/example.yaml")
    assert r.returncode == 0, r.stderr
    assert "listener" in r.stdout and "max_frame_size" in r.stdout  # effective defaults are printed


def test_check_config_takes_the_file_as_run_does_too():
    same = _cli("check-config", "-c", "config/example.yaml")
    assert same.returncode == 0 and same.stdout == _cli("check-config", "config/example.yaml").stdout
    both = _cli("check-config", "config/example.yaml", "-c", "config/minimal.yaml")
    assert both.returncode == 2 and "not allowed with argument FILE" in both.stderr


def test_run_takes_the_file_as_check_config_does_too_and_demo_modules_run_with_dash_m(tmp_path):
    """`run FILE` as well as `run -c FILE` (before: "-c/--config is required", where check-config
    took either); `python -m proxy.demo_upstream --help` prints the usage (before: nothing, exit 0)."""
    absent = tmp_path / "absent.yaml"
    a, b = _cli("run", str(absent)), _cli("run", "-c", str(absent))
    assert a.returncode == b.returncode == 2 and a.stderr == b.stderr == f"{absent}:0: (file): No such file or directory\n"
    both = _cli("run", str(absent), "-c", str(absent))
    assert both.returncode == 2 and "not allowed with argument FILE" in both.stderr
    for module, command in (("proxy.demo_upstream", "demo-upstream"), ("proxy.demo_client", "demo-client")):
        r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: thrift-sidecar {command} "), (module, r.stdout, r.stderr)


@pytest.mark.parametrize("args, says", [
    (("demo-upstream", "--port", "99999"), "argument --port: must be 0-65535"),
    (("demo-upstream", "--port", "-1"), "argument --port: must be 0-65535"),
    (("hops", "--spans", "x.jsonl", "--limit", "-1"), "argument --limit: must be at least 1"),
    (("demo", "--calls", "0"), "argument --calls: must be at least 1"),
    (("demo-client", "--target", "127.0.0.1:1", "--connections", "x"), "argument --connections: not a whole number"),
    # an empty path: before, a traceback (run/check-config FILE), ':0: (file)' (-c), or --jaeger blamed (hops)
    (("run", ""), "argument FILE: empty: give a file's path"),
    (("check-config", ""), "argument FILE: empty: give a file's path"),
    (("check-config", "-c", ""), "argument -c/--config: empty: give a file's path"),
    (("hops", "--spans", ""), "argument --spans: empty: give a file's path"),
    (("hops", "--jaeger", ""), "argument --jaeger: empty: give a URL"),
])
def test_out_of_range_numbers_are_usage_errors_not_tracebacks(args, says):
    r = _cli(*args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_check_config_invalid_exits_2_with_file_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("listeners:\n  - listen: 127.0.0.1:70000\n    routes:\n      - cluster: nope\n")
    r = _cli("check-config", str(bad))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert f"{bad}:2: listeners[0].listen: port must be 0-65535" in lines[0], r.stderr
    assert any(line.startswith(f"{bad}:4: listeners[0].routes[0].cluster:") and "nope" in line
               for line in lines), r.stderr


def test_check_config_missing_file_exits_2(tmp_path):
    r = _cli("check-config", str(tmp_path / "absent.yaml"))
    assert r.returncode == 2 and "absent.yaml" in r.stderr


def test_run_bad_config_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("listeners: []\n")
    r = _cli("run", "-c", str(bad))
    assert r.returncode == 2 and "bad.yaml:1: listeners" in r.stderr


def test_run_listen_port_in_use_exits_2_with_file_line_error(tmp_path):
    """A listener's port taken by another process: one line said like a config error, no traceback."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = tmp_path / "busy.yaml"
        cfg.write_text(f"listeners:\n  - name: a\n    listen: 127.0.0.1:{port}\n    routes: [{{cluster: c}}]\n"
                       "clusters: [{name: c, endpoints: [127.0.0.1:2]}]\n")
        r = _cli("run", "-c", str(cfg))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"{cfg}:3: listeners[0].listen: cannot listen on 127.0.0.1:{port}: address already in use"), r.stderr


@pytest.mark.parametrize("extra,env,line,expected", [
    ("    tls: {ca: nope.pem}\n", {}, 8, "clusters[0].tls.ca: cannot use {dir}/nope.pem: No such file or directory"),
    ("tracing: {exporter: jsonl, path: /nonexistent/dir/s.jsonl}\n", {}, 8,
     "tracing.path: cannot open /nonexistent/dir/s.jsonl: No such file or directory"),
    ("tracing: {exporter: otlp, endpoint: 'https://127.0.0.1:4317'}\n",
     {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"}, 8,
     "tracing.exporter: cannot open /nonexistent/ca.pem: No such file or directory (a file named by an "
     "OTEL_EXPORTER_OTLP_* variable)"),
    ("tracing: {exporter: otlp, otlp_protocol: http}\n", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://[bad"}, 8,
     "tracing.exporter: cannot set up the OTLP exporter: Invalid IPv6 URL (from the OTEL_EXPORTER_OTLP_* variables)"),
], ids=["tls_ca_missing", "span_file_folder_missing", "otlp_env_certificate_missing", "otlp_env_endpoint_bad"])
def test_run_with_a_file_it_cannot_use_exits_2_with_file_line_error(tmp_path, extra, env, line, expected):
    """`run` cannot start with a valid file: one line said like a config error, exit 2, no
    traceback (before: a traceback and exit 1; an OTLP certificate named by the environment was
    blamed on tracing.path). check-config says the same for the files the config names: a warning,
    an error with --strict (before: nothing, so a check let through what `run` then refused); the
    environment's OTLP settings are `run`'s to try."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("listeners:\n  - name: a\n    listen: 127.0.0.1:0\n    routes: [{cluster: c}]\n"
                   "clusters:\n  - name: c\n    endpoints: [127.0.0.1:2]\n" + extra)
    said = f"{cfg}:{line}: " + expected.format(dir=tmp_path)
    r = _cli("run", "-c", str(cfg), env=env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == said, r.stderr
    c = _cli("check-config", "--strict", str(cfg), env=env)
    if "OTEL_EXPORTER" in expected:
        assert c.returncode == 0, c.stderr
    else:
        assert (c.returncode, c.stderr.strip()) == (2, said), c.stderr
        c = _cli("check-config", str(cfg), env=env)  # (without --strict: a warning)
        assert c.returncode == 0 and c.stderr.strip() == (
            f"warning: {said} (`run` would refuse it on this machine; --strict makes this an error)"), c.stderr


def test_check_config_says_every_file_run_could_not_use_and_notes_a_missing_endpoints_file(tmp_path):
    """--strict: two clusters' TLS files (one missing, one not PEM) and a span file in a folder
    that is a file: all said at once, FILE:LINE: key: why, exit 2, nothing created. A missing
    endpoints file is allowed (file discovery waits for it) but warned of, even with --strict, as is
    an invalid one."""
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    (tmp_path / "afile").write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("listeners:\n  - name: a\n    listen: 127.0.0.1:0\n    routes: [{cluster: c}]\n"
                   "clusters:\n"
                   "  - name: c\n    endpoints: [127.0.0.1:2]\n    tls: {ca: nope.pem}\n"
                   "  - name: d\n    endpoints: [127.0.0.1:3]\n    tls: {ca: junk.pem}\n"
                   "tracing: {exporter: jsonl, path: afile/s.jsonl}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = _cli("check-config", "--strict", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"{cfg}:8: clusters[0].tls.ca: cannot use {tmp_path}/nope.pem: No such file or directory",
        f"{cfg}:11: clusters[1].tls.ca: cannot use {tmp_path}/junk.pem: NO_CERTIFICATE_OR_CRL_FOUND",
        f"{cfg}:12: tracing.path: cannot open afile/s.jsonl: Not a directory"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    cfg.write_text("listeners:\n  - name: a\n    listen: 127.0.0.1:0\n    routes: [{cluster: c}]\n"
                   "clusters:\n  - name: c\n    endpoints: {file: later.yaml}\n")
    r = _cli("check-config", "--strict", str(cfg))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"warning: {cfg}:7: clusters[0].endpoints.file: {tmp_path}/later.yaml does "
                                     "not exist (yet): cluster 'c' has no endpoints until it does"], r.stderr
    # one that exists is checked: each problem at its line (before: nothing said, exit 0 with no endpoints)
    (tmp_path / "later.yaml").write_text("- {address: 127.0.0.1:1, wieght: 2}\n- 127.0.0.1:99999\n")
    r = _cli("check-config", "--strict", str(cfg))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"warning: {cfg}:7: clusters[0].endpoints.file: cluster 'c' has no endpoints until {tmp_path}/later.yaml "
        "is fixed:",
        f"warning: {tmp_path}/later.yaml:1: [0].wieght: unknown key (did you mean 'weight'?)",
        f"warning: {tmp_path}/later.yaml:2: [1]: port must be 1-65535"], r.stderr


def test_run_with_an_unresolvable_listen_host_says_why(tmp_path):
    cfg = tmp_path / "h.yaml"
    cfg.write_text("listeners:\n  - name: a\n    listen: nosuchhost.invalid:9093\n    routes: [{cluster: c}]\n"
                   "clusters:\n  - name: c\n    endpoints: [127.0.0.1:2]\n")
    r = _cli("run", "-c", str(cfg))
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{cfg}:3: listeners[0].listen: cannot listen on nosuchhost.invalid:9093: "), last
    assert "unknown error" not in last, last


def _sighup_caught(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    except FileNotFoundError:
        pass
    return False


def test_sighup_while_starting_is_a_reload_once_up_not_the_end_of_the_process(tmp_path):
    """SIGHUP's default action ends a process. The proxy handles it from before its heavy
    imports (long before it listens): one sent while it starts is a reload once it is up.
    Before: handled only after startup, so a reload asked for meanwhile (a config watcher, an
    operator) killed it."""
    up = ThriftServer()
    port = free_port()
    cfg = tmp_path / "s.yaml"
    cfg.write_text(config_text([up.address], listen_port=port))
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "run", "-c", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 15
        while not _sighup_caught(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline
            assert not listening(port), "listening before SIGHUP is handled"
            time.sleep(0.001)
        early = not listening(port)  # (still starting: nearly always, unless this test was descheduled)
        proc.send_signal(signal.SIGHUP)
        while not listening(port):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with client(port) as c:
            assert c.lookup("x") == "upstream:x"
        time.sleep(0.3)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=20)[0]
        up.stop()
    if early:
        assert "SIGHUP received while starting: reloading now" in out, out
    assert "reloaded" in out, out


def test_run_serves_then_drains_on_sigterm():
    up = ThriftServer()
    port = free_port()
    try:
        with ProxyProcess(config_text([up.address], listen_port=port) + "drain_timeout: 5s\n", [port]) as p:
            with client(port) as c:
                assert c.lookup("x") == "upstream:x"
            t0 = time.monotonic()
            rc = p.stop(signal.SIGTERM)
            assert rc == 0, p.output()
            assert time.monotonic() - t0 < 5
    finally:
        up.stop()


@pytest.mark.parametrize("closed", [(1,), (2,), (0,), (0, 1, 2)], ids=[">&-", "2>&-", "<&-", "all three"])
def test_run_started_without_standard_fds_serves_and_stops_cleanly(tmp_path, closed):
    """`thrift-sidecar run -c F >&-`: before, a socket took fd 1 and libuv aborted the process
    when it closed it (`uv__close: Assertion fd > STDERR_FILENO`, exit 134) — here at the drain."""
    up = ThriftServer()
    port = free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(config_text([up.address], listen_port=port))
    err = open(tmp_path / "stderr", "w+")

    def close_fds():
        for fd in closed:
            os.close(fd)
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "run", "-c", str(cfg)], cwd=ROOT,
                            stdout=err, stderr=err, preexec_fn=close_fds)
    try:
        deadline = time.monotonic() + 15
        while not listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        for _ in range(3):  # new connections each time: fds come and go
            with client(port) as c:
                assert c.lookup("x") == "upstream:x"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        up.stop()
    out = (tmp_path / "stderr").read_text()
    assert rc == 0 and "Assertion" not in out, (rc, out)


def test_python_dash_m_and_console_script_agree():
    r1 = _cli("--help")
    exe = ROOT / ".venv" / "bin" / "thrift-sidecar"
    assert r1.returncode == 0 and "check-config" in r1.stdout
    if exe.exists():
        r2 = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=30)
        assert r2.stdout.replace("thrift-sidecar", "X") == r1.stdout.replace("thrift-sidecar", "X")


def test_readme_documents_every_span_attribute_key():
    from proxy import spans

    readme = (ROOT / "README.md").read_text()
    keys = [v for k, v in vars(spans).items() if k.isupper() and isinstance(v, str)
            and v[:1].isalpha() and "." in v and not v.startswith("http")]
    missing = [k for k in keys if f"`{k}`" not in readme and f"`{k}," not in readme and f" `{k}`" not in readme]
    assert keys and not missing, missing
    assert spans.SEMCONV_VERSION in readme


def test_check_config_into_a_pipe_closed_early_says_nothing_more():
    """`check-config F | head -1`: the reader leaves after a line. Before: a BrokenPipeError
    traceback on stderr (exit 1), in some runs. Here the pipe is closed before anything is
    written, so it happens every time."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "proxy", "check-config", "config/example.yaml"], cwd=ROOT,
                           stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert r.returncode == 1 and r.stderr == "", r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("args", [["check-config", "config/minimal.yaml"], ["--help"], ["--version"],
                                  ["run", "--help"]])
def test_output_into_a_full_disk_is_said_in_a_line_and_fails(args):
    """Also argparse's help and version texts (before: argparse dropped the error, exit 0). With
    stdout buffered, as a user's shell has it (not PYTHONUNBUFFERED): the error comes at the
    flush, which at exit was an "Exception ignored" traceback and exit 120."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == "thrift-sidecar: cannot write the output: No space left on device\n", r.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "1e300", "soon"])
def test_demo_client_refuses_an_interval_it_could_not_wait(value):
    r = _cli("demo-client", "--target", "127.0.0.1:1", "--interval", value)
    assert r.returncode == 2 and "argument --interval: " in r.stderr, r.stderr
    assert ("must be 0-86400 seconds" if value != "soon" else "not a number of seconds: 'soon'") in r.stderr


def test_version_is_the_installed_package_s():
    from importlib.metadata import version
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout == f"thrift-sidecar {version('thrift-sidecar')}\n", r


def test_an_open_file_limit_below_what_the_config_may_use_is_said_at_the_start(tmp_path):
    """Run under a 200-descriptor limit with the default max_connections (10,000): the start says
    the limit is too low and what to do. Past it, libuv closes new client connections unanswered
    and nothing reaches the proxy's code: before, the log never said why clients were reset (the
    lifecycle hunt). With enough descriptors for the config, nothing is said."""
    import resource

    from proxy import config as cfgmod
    from proxy.server import fd_limit_note

    up = ThriftServer()
    port = free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(config_text([up.address], listen_port=port))
    small = cfgmod.loads(config_text([up.address]).replace("    routes", "    max_connections: 100\n    routes"))
    assert fd_limit_note(small, 100 + 64 + 64) is None  # the listener's 100, the pool's 64, the spare
    assert fd_limit_note(small, 100 + 64 + 63) is not None

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    proc = subprocess.Popen([sys.executable, "-m", "proxy", "run", "-c", str(cfg)], cwd=ROOT, preexec_fn=limit,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        up.stop()
    assert "the open-file limit (200) is below what the config may use (10128:" in out, out
    assert proc.returncode == 0
