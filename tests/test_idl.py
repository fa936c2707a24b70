"""A listener's `idl:`: parsing (proxy.idl) and what it turns on — oneway methods sent as CALL,
retries on exceptions named in the IDL, every IDL method its own metrics label — plus clear
errors for an IDL that does not parse and for exception names nothing can resolve."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness import (
    oneway_as_call_then_call,
    ROOT,
    Handler,
    Proxy,
    ThriftServer,
    Unavailable,
    client,
    config_text,
)
from proxy import config as cfgmod
from proxy.codec import MessageType
from proxy.idl import IdlError, config_problems, load
from proxy.metrics import Metrics

IDL = ROOT / "tests" / "idl" / "sidecar_test.thrift"
# A config "file" in config/: `../tests/idl/...` is relative to it (nothing is written there).
CONFIG_NAME = str(ROOT / "config" / "idl-test.yaml")
IDL_KEY = "\n    idl: ../tests/idl/sidecar_test.thrift"


def _loads(text: str) -> cfgmod.Config:
    return cfgmod.loads(text, CONFIG_NAME)


def _proxy(text: str, monkeypatch, filename: str = CONFIG_NAME, **kw) -> Proxy:
    """The in-process proxy, with its config read as if from `filename` (relative paths)."""
    real = cfgmod.loads
    monkeypatch.setattr(cfgmod, "loads", lambda t, _name="<string>": real(t, filename))
    return Proxy(text, **kw)


def _config_checks_idl() -> bool:
    """Does config loading check IDL references (the rule `config_problems` states)?"""
    text = config_text(["127.0.0.1:1"]).replace(
        "      - cluster: up", "      - cluster: up\n        retry: {attempts: 2, idempotent: true, on_exceptions: [Unavailable]}")
    try:
        cfgmod.loads(text)
    except cfgmod.ConfigError:
        return True
    return False


needs_config_rule = pytest.mark.skipif(
    not _config_checks_idl(), reason="proxy/config.py does not call proxy.idl.config_problems yet")


# ---------------------------------------------------------------------------- parsing

def test_parses_the_test_idl():
    idl = load(IDL)
    assert list(idl.services) == ["TestService", "AdminService"]
    test = idl.services["TestService"]
    assert list(test.methods) == ["ping", "roundtrip", "echo", "get_users", "lookup", "sleep",
                                  "log_event", "incr", "count"]
    assert test.methods["log_event"].oneway is True
    assert [m.name for m in test.methods.values() if m.oneway] == ["log_event"]
    assert dict(test.methods["lookup"].exceptions) == {"NotFound": 1, "Unavailable": 2}
    assert dict(test.methods["ping"].exceptions) == {}
    assert idl.method_names() == {"ping", "roundtrip", "echo", "get_users", "lookup", "sleep",
                                  "log_event", "incr", "count", "version", "add"}
    assert idl.oneway_methods() == {"log_event", "TestService:log_event"}
    assert idl.exception_ids()["lookup"] == {"NotFound": 1, "Unavailable": 2}
    assert {"lookup", "TestService:lookup", "AdminService:add"} <= idl.known_methods()


def test_the_result_is_frozen():
    idl = load(IDL)
    with pytest.raises(Exception):
        idl.services["TestService"].methods["lookup"].exceptions["Other"] = 3  # type: ignore[index]
    with pytest.raises(Exception):
        idl.path = Path("x")  # type: ignore[misc]


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_includes_extends_and_a_reparse_sees_an_edited_include(tmp_path, monkeypatch):
    _write(tmp_path, {
        "main.thrift": 'include "common/base.thrift"\n'
                       "service Main extends base.Base {\n"
                       "  string get(1: string k) throws (2: base.Gone gone),\n"
                       "  oneway void fire(1: string e),\n"
                       "}\n",
        "common/base.thrift": "exception Gone { 1: string why }\n"
                              "service Base { i32 base_call() throws (3: Gone g) }\n",
    })
    monkeypatch.chdir(ROOT)  # includes never resolve against the working directory
    idl = load(tmp_path / "main.thrift")
    assert list(idl.services) == ["Main"]  # the included file's own service is not the listener's
    assert idl.method_names() == {"get", "fire", "base_call"}
    assert idl.oneway_methods() == {"fire", "Main:fire"}
    assert idl.exception_ids() == {"get": {"Gone": 2}, "fire": {}, "base_call": {"Gone": 3}}

    (tmp_path / "common/base.thrift").write_text(
        "exception Gone { 1: string why }\nservice Base { oneway void base_call() }\n")
    assert load(tmp_path / "main.thrift").oneway_methods() == {"fire", "Main:fire", "base_call",
                                                                "Main:base_call"}


def test_a_name_in_two_services_is_oneway_or_retried_only_where_they_agree(tmp_path):
    _write(tmp_path, {"two.thrift": "exception E { 1: string w }\nexception F { 1: string w }\n"
                                    "service A { oneway void ev(), void get() throws (1: E e, 2: F f) }\n"
                                    "service B { void ev(), void get() throws (1: E e, 3: F f) }\n"})
    idl = load(tmp_path / "two.thrift")
    assert idl.oneway_methods() == {"A:ev"}  # a bare `ev` may be B's, which replies
    assert idl.exception_ids()["get"] == {"E": 1}


@pytest.mark.parametrize("files,where,message", [
    ({"x.thrift": "struct A {\n  1: i32 a,\n}\nservice S { void f( }\n"}, "x.thrift:4", "syntax error at '}'"),
    ({"x.thrift": "service S {\n  void f(\n"}, "x.thrift", "syntax error: unexpected end of file"),
    ({"x.thrift": "service S {\n  Foo f()\n}\n"}, "x.thrift:2", "No type found: 'Foo'"),
    ({"x.thrift": "service S {\n  void f() $\n}\n"}, "x.thrift:2", "Illegal character '$'"),
    ({"x.thrift": 'include "gone.thrift"\nservice S { void f() }\n'}, "x.thrift",
     'include "gone.thrift" not found'),
    ({"x.thrift": 'include "sub/b.thrift"\nservice S { void f() }\n',
      "sub/b.thrift": "struct B {\n  1: i32 x,\n  2 i32 y\n}\n"}, "sub/b.thrift:3", "syntax error at 'i32'"),
    ({"x.thrift": "struct A { 1: i32 a }\n"}, "x.thrift", "declares no service"),
    ({"x.thrift": "// nothing here yet\n"}, "x.thrift", "declares no service"),
    ({"x.thrift": ""}, "x.thrift", "declares no service"),
    ({"x.thrift": 'include "big.thrift"\nservice S { void f() }\n',
      "big.thrift": "// padding\n" * 400_000}, "big.thrift", "larger than 4 MiB"),
])
def test_errors_name_the_file_and_line(tmp_path, files, where, message):
    _write(tmp_path, files)
    with pytest.raises(IdlError) as e:
        load(tmp_path / "x.thrift")
    assert str(e.value).startswith(f"{tmp_path / where}: ") and message in str(e.value), str(e.value)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(IdlError, match=r"nope\.thrift: no such file"):
        load(tmp_path / "nope.thrift")
    (tmp_path / "d.thrift").mkdir()
    with pytest.raises(IdlError, match="d.thrift: must be a regular file; it is a directory"):
        load(tmp_path / "d.thrift")


def _let_go(fifo: Path) -> None:
    """Whoever waits in `open()` of `fifo` to read gets it (and EOF); no one: nothing."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no reader waits
        pass


def _load_in_a_thread(path: Path, fifo: Path) -> IdlError | Exception | None:
    """`load(path)` given 10 s; the error it raised (None: it parsed). A load still waiting
    after that, in `open()` of the FIFO, is let go (a writer opens and closes it) and fails."""
    out: list = []

    def run() -> None:
        try:
            load(path)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        _let_go(fifo)
        t.join(10)
        pytest.fail(f"load({path.name}) waited in open() on {fifo.name} until a writer came")
    return out[0]


@pytest.mark.parametrize("top", [
    'include "pipe.thrift"\nservice S { void f() }\n',
    'include"pipe.thrift"\nservice S { void f() }\n',  # (no space: the parser's tokens need none)
    'cpp_include "x\\" /*"\ninclude "pipe.thrift"\ncpp_include "*/"\nservice S { void f() }\n',
    'include "sub/ok.thrift"\nservice S { void f() }\n',   # (sub/ok.thrift includes it)
])
def test_an_include_that_is_a_fifo_is_refused_before_anything_opens_it(tmp_path, top):
    _write(tmp_path, {"x.thrift": top, "sub/ok.thrift": 'include "pipe.thrift"\nstruct A { 1: i32 a }\n'})
    os.mkfifo(tmp_path / "pipe.thrift")  # (sub/ finds it in the top file's folder, as the parser does)
    e = _load_in_a_thread(tmp_path / "x.thrift", tmp_path / "pipe.thrift")
    assert isinstance(e, IdlError), e
    assert str(e).startswith(f"{tmp_path / 'pipe.thrift'}: must be a regular file; it is a FIFO"), str(e)
    assert str(e).endswith(f"(included by way of {tmp_path / 'x.thrift'})"), str(e)


def test_includes_that_open_too_many_files_are_refused(tmp_path):
    from proxy.idl import MAX_IDL_FILES
    files = {f"t{i}.thrift": f"struct T{i} {{ 1: i32 x }}\n" for i in range(MAX_IDL_FILES)}
    files["x.thrift"] = "".join(f'include "t{i}.thrift"\n' for i in range(MAX_IDL_FILES)) + "service S { void f() }\n"
    _write(tmp_path, files)
    with pytest.raises(IdlError) as e:
        load(tmp_path / "x.thrift")
    assert str(e.value) == f"{tmp_path / 'x.thrift'}: its includes open more than {MAX_IDL_FILES} files"


def test_an_include_in_a_comment_or_a_string_is_not_followed(tmp_path):
    _write(tmp_path, {"x.thrift": '/* include "pipe.thrift" */\n// include "pipe.thrift"\n'
                                  '# include "pipe.thrift"\n'
                                  'const string NOTE = "include pipe.thrift"\nservice S { void f() }\n'})
    os.mkfifo(tmp_path / "pipe.thrift")
    assert _load_in_a_thread(tmp_path / "x.thrift", tmp_path / "pipe.thrift") is None


# ---------------------------------------------------------------------------- config checks

def _route_retry(text: str, retry: str) -> str:
    return text.replace("      - cluster: up", f"      - cluster: up\n        retry: {retry}")


def test_config_problems_names_without_idl_unknown_names_and_broken_idls(tmp_path):
    base = config_text(["127.0.0.1:1"])
    ok = _loads(_route_retry(base.replace("    protocol: binary", "    protocol: binary" + IDL_KEY),
                             "{attempts: 2, idempotent: true, on_exceptions: [Unavailable, 1]}"))
    assert ok.listeners[0].idl.resolve() == IDL  # relative to the config file
    assert config_problems(ok) == []

    loc = ("listeners", 0, "routes", 0, "retry", "on_exceptions", 0)
    no_idl = cfgmod.Config.model_validate(
        yaml_load(_route_retry(base, "{attempts: 2, idempotent: true, on_exceptions: [Unavailable]}")))
    assert config_problems(no_idl) == [(loc, "exception name 'Unavailable' needs the listener's idl "
                                             "(or give the result field id)")]

    typo = cfgmod.Config.model_validate(
        yaml_load(_route_retry(base.replace("    protocol: binary", f"    protocol: binary\n    idl: {IDL}"),
                               "{attempts: 2, idempotent: true, on_exceptions: [Unavailible]}")))
    assert config_problems(typo) == [(loc, "no method in sidecar_test.thrift declares exception "
                                           "'Unavailible' (did you mean 'Unavailable'?)")]

    (tmp_path / "bad.thrift").write_text("service S {\n  void f(\n}\n")
    broken = cfgmod.Config.model_validate(
        yaml_load(base.replace("    protocol: binary", f"    protocol: binary\n    idl: {tmp_path / 'bad.thrift'}")))
    ((where, message),) = config_problems(broken)
    assert where == ("listeners", 0, "idl") and message.startswith(f"{tmp_path / 'bad.thrift'}:3: syntax error")


def test_method_names_the_idl_does_not_declare_and_oneway_methods_it_replies_to_are_problems():
    """A config hunt: with an idl, `oneway_methods: [lookup]` (a method with a reply: every
    lookup hung, its reply dropped), `match: {method: lokup}` and `idempotent: [lookp]` (typos:
    never applied) all passed check-config. Globs that match an IDL method pass."""
    base = config_text(["127.0.0.1:1"]).replace("    protocol: binary", f"    protocol: binary\n    idl: {IDL}")
    text = base.replace("    routes:\n      - cluster: up", """    oneway_methods: [lookup, log_event, TestService:lookup, log_evnt]
    routes:
      - match: {method: lokup}
        cluster: up
      - match: {method: "zz_*"}
        cluster: up
      - match: {method: "[lp]*"}
        cluster: up
      - cluster: up
        retry: {attempts: 2, idempotent: [lookp, "e*"]}""")
    problems = config_problems(cfgmod.Config.model_validate(yaml_load(text)))
    one = ("listeners", 0, "oneway_methods")
    not_oneway = ("is not oneway in sidecar_test.thrift: its replies would be dropped and its clients left "
                  "waiting (the idl's oneway methods need no listing)")
    assert problems == [
        ((*one, 0), f"'lookup' {not_oneway}"),
        ((*one, 2), f"'TestService:lookup' {not_oneway}"),
        ((*one, 3), "method 'log_evnt' matches no method of sidecar_test.thrift (did you mean 'log_event'?)"),
        (("listeners", 0, "routes", 0, "match", "method"),
         "method 'lokup' matches no method of sidecar_test.thrift (did you mean 'lookup'?)"),
        (("listeners", 0, "routes", 1, "match", "method"), "method 'zz_*' matches no method of sidecar_test.thrift"),
        (("listeners", 0, "routes", 3, "retry", "idempotent", 0),
         "method 'lookp' matches no method of sidecar_test.thrift (did you mean 'lookup'?)"),
    ], problems


def test_oneway_methods_are_exact_names_not_globs():
    with pytest.raises(cfgmod.ConfigError) as info:
        _loads(config_text(["127.0.0.1:1"]).replace("    routes:", "    oneway_methods: ['log_*']\n    routes:"))
    assert info.value.errors == [
        f"{CONFIG_NAME}:8: listeners[0].oneway_methods[0]: exact method names only, not globs ('log_*'): a glob "
        "that caught a method with a reply would leave its clients waiting; list each, or give the "
        "listener its idl (which says which methods are oneway)"]


def yaml_load(text: str):
    import yaml
    return yaml.safe_load(text)


@needs_config_rule
def test_check_config_reports_idl_problems_with_their_lines(tmp_path):
    (tmp_path / "bad.thrift").write_text("service S {\n  void f(\n}\n")
    text = _route_retry(config_text(["127.0.0.1:1"]).replace(
        "    protocol: binary", "    protocol: binary\n    idl: bad.thrift"), "{attempts: 2, idempotent: true, on_exceptions: [Unavailable]}")
    (tmp_path / "sidecar.yaml").write_text(text)
    r = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(tmp_path / "sidecar.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert f"sidecar.yaml:8: listeners[0].idl: {tmp_path / 'bad.thrift'}:3: syntax error" in r.stderr, r.stderr

    (tmp_path / "sidecar.yaml").write_text(text.replace("    idl: bad.thrift\n", ""))
    r = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(tmp_path / "sidecar.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "listeners[0].routes[0].retry.on_exceptions[0]: exception name " \
                                 "'Unavailable' needs the listener's idl" in r.stderr, r.stderr


def test_idl_problems_are_reported_with_the_config_s_other_errors(tmp_path):
    """Every problem in one go: a broken IDL, and an exception name that needs an IDL, are
    said next to an error elsewhere in the file, not only once that one is fixed."""
    (tmp_path / "bad.thrift").write_text("service S {\n  void f(\n}\n")
    (tmp_path / "sidecar.yaml").write_text("""\
listeners:
  - name: test
    service: TestService
    listen: 127.0.0.1:0
    idl: bad.thrift
    routes:
      - cluster: up
  - name: other
    listen: 127.0.0.1:0
    routes:
      - cluster: up
        retry: {attempts: 2, idempotent: true, on_exceptions: [Unavailable]}
clusters:
  - name: up
    endpoints: [127.0.0.1:1]
    load_balancer: sideways
""")
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(tmp_path / "sidecar.yaml")
    said = "\n".join(e.value.errors)
    assert f"sidecar.yaml:5: listeners[0].idl: {tmp_path / 'bad.thrift'}:3: syntax error" in said, said
    assert ("sidecar.yaml:12: listeners[1].routes[0].retry.on_exceptions[0]: exception name 'Unavailable' "
            "needs the listener's idl") in said, said
    assert "sidecar.yaml:16: clusters[0].load_balancer: " in said, said


# ---------------------------------------------------------------------------- the server refuses

def test_server_refuses_exception_names_without_idl():
    text = _route_retry(config_text(["127.0.0.1:1"]), "{attempts: 2, idempotent: true, on_exceptions: [Unavailable]}")
    config = cfgmod.Config.model_validate(yaml_load(text))  # bypasses the config-level rule
    with pytest.raises(ValueError, match=r"listener test: routes\[0\]\.retry: .*need the listener's idl"):
        _build_server(config)


def test_server_refuses_an_idl_that_does_not_parse(tmp_path):
    (tmp_path / "bad.thrift").write_text("service S {\n  void f(\n}\n")
    text = config_text(["127.0.0.1:1"]).replace("    protocol: binary",
                                                f"    protocol: binary\n    idl: {tmp_path / 'bad.thrift'}")
    config = cfgmod.Config.model_validate(yaml_load(text))
    with pytest.raises(ValueError, match=rf"listener test: idl: {tmp_path / 'bad.thrift'}:3: syntax error"):
        _build_server(config)


def _build_server(config: cfgmod.Config) -> None:
    from proxy.server import Server

    async def build() -> None:
        server = Server(config, asyncio.get_running_loop())
        try:
            server.build_listener(config.listeners[0])
        finally:
            for c in server.clusters.values():
                c.close()

    asyncio.run(build())


# ---------------------------------------------------------------------------- live

class _Answers(Handler):
    """An upstream that is never down: lookup("down") answers."""

    def lookup(self, key):
        self._hit("lookup")
        return f"{self.name}:{key}"


def test_retry_on_an_exception_named_in_the_idl(monkeypatch):
    down, fine = ThriftServer(name="down"), ThriftServer(handler=_Answers("fine"))
    text = _route_retry(config_text([down.address, fine.address]).replace(
        "    protocol: binary", "    protocol: binary" + IDL_KEY),
        "{attempts: 2, idempotent: true, on_exceptions: [Unavailable]}")
    try:
        with _proxy(text, monkeypatch) as p:
            assert p.config.listeners[0].idl.resolve() == IDL  # relative to the config file
            with client(p.port()) as c:
                results = [c.lookup("down") for _ in range(6)]
            stats = p.server.listeners["test"].pipeline.stats
    finally:
        down.stop()
        fine.stop()
    assert results == ["fine:down"] * 6
    assert down.handler.calls >= 1 and stats["retries"] == down.handler.calls


def test_without_the_name_in_on_exceptions_it_is_not_retried(monkeypatch):
    down = ThriftServer(name="down")
    text = _route_retry(config_text([down.address]).replace("    protocol: binary", "    protocol: binary" + IDL_KEY),
                        "{attempts: 2, idempotent: true, on_exceptions: [NotFound]}")
    try:
        with _proxy(text, monkeypatch) as p:
            with client(p.port()) as c:
                with pytest.raises(Unavailable):
                    c.lookup("down")
            assert p.server.listeners["test"].pipeline.stats["retries"] == 0
    finally:
        down.stop()


def test_oneway_from_the_idl_sent_as_call_does_not_block(monkeypatch):
    up = ThriftServer()
    try:
        with _proxy(config_text([up.address], extra_listener=IDL_KEY), monkeypatch) as p:
            r = oneway_as_call_then_call(p.port())
            assert r.seqid == 4 and r.type == MessageType.REPLY
    finally:
        up.stop()


def test_every_idl_method_is_a_known_metrics_method(monkeypatch):
    metrics = Metrics()
    svc = metrics.service("TestService", max_methods=0)  # any name not known counts as _OTHER
    up = ThriftServer()
    try:
        with _proxy(config_text([up.address], extra_listener=IDL_KEY), monkeypatch, metrics=metrics) as p:
            assert p.server.metrics.services["TestService"] is svc
            assert load(IDL).known_methods() <= set(svc.by_name)
            with client(p.port()) as c:
                c.ping()
                c.lookup("k")
                c.log_event("e")
                assert c.count("e") == 1
            deadline = time.monotonic() + 5
            while sum(svc.by_name["count"].outcomes.values()) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            page = metrics.exposition().decode()
    finally:
        up.stop()
    for method in ("ping", "lookup", "log_event", "count"):
        assert svc.by_name[method].outcomes == {"success": 1}, method
    assert svc.other.outcomes == {}
    assert 'thrift_sidecar_calls_total{method="lookup",outcome="success",service="TestService"} 1.0' in page


@needs_config_rule
@pytest.mark.parametrize("broken", ["syntax", "fifo include"])
def test_a_reload_with_a_broken_idl_is_rejected_and_the_old_config_serves(tmp_path, monkeypatch, broken):
    shutil.copy(IDL, tmp_path / "svc.thrift")
    up = ThriftServer()
    path = tmp_path / "sidecar.yaml"
    text = config_text([up.address], extra_listener="\n    idl: svc.thrift")
    path.write_text(text)
    try:
        with _proxy(text, monkeypatch, filename=str(path), path=str(path)) as p:
            before = p.server.listeners["test"].pipeline
            if broken == "syntax":
                (tmp_path / "svc.thrift").write_text("service S {\n  void f(\n}\n")
            else:  # before: the reload waited in open() on the loop's thread, and nothing was served
                os.mkfifo(tmp_path / "types.thrift")
                (tmp_path / "svc.thrift").write_text('include "types.thrift"\n' + IDL.read_text())
            try:
                ok = asyncio.run_coroutine_threadsafe(p.server.reload(), p.loop).result(10)
            finally:
                if broken != "syntax":
                    _let_go(tmp_path / "types.thrift")
            assert ok is False and p.server.reloads == {"ok": 0, "failed": 1}
            assert p.server.listeners["test"].pipeline is before
            with client(p.port()) as c:
                assert c.lookup("k") == "upstream:k"
    finally:
        up.stop()
