"""Upstream TLS through the proxy to a real Thrift server behind TLS, with a CA made by the test.

Certificates come from the `openssl` command line (a test CA, a server
certificate for `users.internal` and 127.0.0.1, a client certificate, and a
second CA nobody trusts). The harness's ThriftServer is wrapped: each accepted
socket does a server-side TLS handshake first (mutual TLS when asked).

Shown: calls succeed over TLS and over mutual TLS; a wrong CA and a wrong
server name fail with "not sent" and a log line giving the handshake's reason;
unusable certificate files are refused when the config is built; a new config
load reads the files again. An upstream that closes during the handshake gets
a reason, not a blank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import ssl
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from thrift.Thrift import TApplicationException

from harness import (Proxy, RawUpstream, ThriftServer, app_exception, client, config_text, read_messages,
                     request_bytes, wait_for)
from proxy import config as cfgmod
from proxy.codec import Framing, Protocol
from proxy.health import check_once
from proxy.server import build_cluster
from proxy.tls import TlsError, client_context

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

EXT_CA = "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n"
EXT_SERVER = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
              "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:users.internal,IP:127.0.0.1\n"
              "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
EXT_CLIENT = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
              "extendedKeyUsage=clientAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    (d / f"{name}.ext").write_text(EXT_CA)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def make_leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", EXT_SERVER)
    make_leaf(d, "client", "ca", EXT_CLIENT)
    return d


class TlsThriftServer(ThriftServer):
    """The harness's Thrift server with a TLS handshake on each accepted connection."""

    def __init__(self, ctx: ssl.SSLContext, drain: bool = False, **kw) -> None:
        self.ctx = ctx
        self.drain = drain  # after a failed handshake: FIN, read what the client sent, then close
        self.handshake_errors: list[str] = []
        self.peer_certs: list[dict] = []
        super().__init__(**kw)

    def _serve(self, c) -> None:
        c.settimeout(5)
        try:
            s = self.ctx.wrap_socket(c, server_side=True)
        except (ssl.SSLError, OSError) as e:
            self.handshake_errors.append(str(e))
            if self.drain:  # (a close over unread bytes is a reset, which may beat the alert to the peer)
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_WR)
                    while c.recv(65536):
                        pass
            with self._lock:
                self._conns.discard(c)
            c.close()
            return
        s.settimeout(None)
        self.peer_certs.append(s.getpeercert() or {})
        with self._lock:
            self._conns.discard(c)
            self._conns.add(s)
        super()._serve(s)


def server_ctx(pki: Path, require_client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki / "ca.pem")
    return ctx


def tls_yaml(**kw) -> str:
    items = ", ".join(f"{k}: {v}" for k, v in kw.items())
    return f"\n    tls: {{{items}}}\n    connect_timeout: 2s"


@pytest.mark.parametrize("server_name", ["users.internal", "users.internal.", None],
                         ids=["sni-name", "fully-qualified", "ip-address"])  # (SNI is sent without the dot)
def test_calls_over_tls(pki, server_name):
    up = TlsThriftServer(server_ctx(pki, require_client_cert=False), name="tls-up")
    kw = {"ca": pki / "ca.pem"}
    if server_name:
        kw["server_name"] = server_name
    try:
        with Proxy(config_text([up.address], extra_cluster=tls_yaml(**kw))) as p, client(p.port()) as c:
            assert [c.lookup(f"k{i}") for i in range(20)] == [f"tls-up:k{i}" for i in range(20)]
        assert up.handler.calls == 20 and not up.handshake_errors
    finally:
        up.stop()


def test_calls_over_mutual_tls(pki):
    up = TlsThriftServer(server_ctx(pki, require_client_cert=True), name="mtls-up")
    try:
        yaml = tls_yaml(ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key",
                        server_name="users.internal")
        with Proxy(config_text([up.address], extra_cluster=yaml)) as p, client(p.port()) as c:
            assert c.lookup("x") == "mtls-up:x"
            assert c.echo(b"\x00" * 100_000) == b"\x00" * 100_000
            big = random.Random(5).randbytes(3_000_000)  # streams, over TLS
            assert c.echo(big) == big
        assert up.peer_certs and dict(x[0] for x in up.peer_certs[0]["subject"])["commonName"] == "client"
    finally:
        up.stop()


def test_mutual_tls_server_refuses_a_proxy_without_a_client_cert(pki, caplog):
    """TLS 1.3: the server checks the client certificate after the client's side of the handshake
    is done, so its refusal (an alert) comes after the request was written. The service never saw
    the call: "not sent", naming the alert. Before: "may have run: connection ... lost after the
    request was written", which also forbade retrying a method not declared idempotent."""
    up = TlsThriftServer(server_ctx(pki, require_client_cert=True), name="mtls-up")
    try:
        yaml = tls_yaml(ca=pki / "ca.pem", server_name="users.internal")
        with Proxy(config_text([up.address], extra_cluster=yaml)) as p, client(p.port()) as c:
            with caplog.at_level(logging.WARNING, logger="proxy.upstream"):
                with pytest.raises(TApplicationException) as e:
                    c.lookup("x")
        wait_for(lambda: up.handshake_errors, timeout=5, what="the server's record of the refused handshake")
        assert up.handler.calls == 0
    finally:
        up.stop()
    msg = e.value.message
    if msg.startswith("thrift-sidecar: not sent: connect to"):  # (TLS 1.2, or the alert came first)
        return
    assert msg == (f"thrift-sidecar: not sent: {up.address} refused the TLS connection (tlsv13 alert "
                   "certificate required): the request never reached the service"), msg
    assert "refused the proxy's TLS connection: tlsv13 alert certificate required" in caplog.text


def test_a_refused_tls_connection_is_retried_on_another_endpoint_for_any_method(pki):
    """The refusal is "not sent", so a retry is safe whatever the method: the call goes to the
    endpoint that accepts the proxy (the upstream that refused saw no call)."""
    strict = TlsThriftServer(server_ctx(pki, require_client_cert=True), name="strict")
    open_ = TlsThriftServer(server_ctx(pki, require_client_cert=False), name="open")
    try:
        yaml = tls_yaml(ca=pki / "ca.pem", server_name="users.internal")
        text = config_text([strict.address, open_.address], extra_cluster=yaml).replace(
            "      - cluster: up", "      - cluster: up\n        retry: {attempts: 2}")
        with Proxy(text) as p, client(p.port()) as c:
            for i in range(4):
                assert c.lookup(f"k{i}") == f"open:k{i}"
        wait_for(lambda: strict.handshake_errors, timeout=5, what="the server's record of the refused handshake")
        assert strict.handler.calls == 0
        assert open_.handler.calls == 4
    finally:
        strict.stop()
        open_.stop()


class HeldRelay(RawUpstream):
    """A TCP relay to `target` that passes the client's bytes after its first read (a TLS
    ClientHello) `hold` seconds late: a server slow to verify a client certificate (or a long
    round trip), so the proxy writes on a TLS 1.3 connection well before the server's refusal."""

    def __init__(self, target: tuple[str, int], hold: float) -> None:
        self.target, self.hold = target, hold
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        s = socket.create_connection(self.target)
        self.conns.append(s)
        threading.Thread(target=self._pipe, args=(s, c, 0.0), daemon=True).start()
        self._pipe(c, s, self.hold)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, hold: float) -> None:
        first = True
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not first and hold:
                    time.sleep(hold)
                    hold = 0.0
                first = False
                dst.sendall(data)
        for x in (src, dst):
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)


def test_a_call_after_a_oneway_on_a_refused_connection_is_not_sent(pki):
    """A oneway goes out on a new TLS 1.3 connection, which then sits idle; the next call takes it
    before the server's refusal arrives. Nothing on that connection was answered, so the refusal
    still means the service saw nothing: "not sent" (retryable whatever the method), not "may
    have run". Before: only a connection that never sat idle counted as not answered yet."""
    up = TlsThriftServer(server_ctx(pki, require_client_cert=True), drain=True, name="mtls-up")
    relay = HeldRelay(("127.0.0.1", up.port), hold=0.4)
    try:
        yaml = tls_yaml(ca=pki / "ca.pem", server_name="users.internal") + "\n    pool: {max_connections: 1}"
        want = (f"thrift-sidecar: not sent: 127.0.0.1:{relay.port} refused the TLS connection (tlsv13 alert "
                "certificate required): the request never reached the service")
        with Proxy(config_text([f"127.0.0.1:{relay.port}"], extra_cluster=yaml)) as p:
            for _ in range(3):  # (the relay can lose the alert to a busy machine now and then; before
                # the fix every try was "may have run")
                with socket.create_connection(("127.0.0.1", p.port())) as s:
                    s.sendall(request_bytes("framed", "binary", "log_event", "o", seqid=1))
                    time.sleep(0.1)  # the oneway's connection goes back to the pool, idle
                    s.sendall(request_bytes("framed", "binary", "incr", "k", seqid=2))
                    (reply,) = read_messages(s, 1, timeout=5)
                if app_exception(reply).message == want:
                    break
        assert up.handler.calls == 0
    finally:
        relay.close()
        up.stop()
    assert reply.seqid == 2
    assert app_exception(reply).message == want


def test_oneways_on_a_refused_connection_are_logged_counted_and_blamed(pki, caplog):
    """Oneways written on TLS 1.3 connections the server then refuses never reached the service,
    and no client waits to be told: each refusal is logged, counted (`oneways_refused`) and
    counted against the endpoint by its breaker, as a failed connect is (a oneway's write itself
    gives no verdict: 3 failures of 3). Before: nothing at all; every oneway opened another
    connection that counted as a successful connect."""
    up = TlsThriftServer(server_ctx(pki, require_client_cert=True), name="mtls-up")
    try:
        yaml = (tls_yaml(ca=pki / "ca.pem", server_name="users.internal")
                + "\n    circuit_breaker: {failure_rate: 0.5, min_calls: 3, open_for: 30s}")
        with Proxy(config_text([up.address], extra_cluster=yaml)) as p, client(p.port()) as c:
            with caplog.at_level(logging.WARNING, logger="proxy"):
                for i in range(3):
                    c.log_event(f"e{i}")
                    time.sleep(0.2)
                deadline = time.monotonic() + 5
                while True:
                    (ep,) = p.call(p.server.snapshot)["clusters"]["up"]["endpoints"]
                    refused = sum(pool["oneways_refused"] for pool in ep["pools"])
                    if refused >= 3 or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        wait_for(lambda: up.handshake_errors, timeout=5, what="the server's record of the refused handshake")
        assert up.handler.calls == 0
    finally:
        up.stop()
    assert refused == 3
    assert ep["breaker"] == "open"
    assert "oneway call(s) written on it never reached the service" in caplog.text
    assert "tlsv13 alert certificate required" in caplog.text


@pytest.mark.parametrize("case,why", [
    ("wrong-ca", "certificate verify failed: unable to get local issuer certificate"),
    ("wrong-name", "certificate verify failed: Hostname mismatch"),
])
def test_wrong_ca_or_server_name_is_not_sent_and_logged(pki, caplog, case, why):
    up = TlsThriftServer(server_ctx(pki, require_client_cert=False), name="tls-up")
    kw = {"ca": pki / ("other-ca.pem" if case == "wrong-ca" else "ca.pem"),
          "server_name": "users.internal" if case == "wrong-ca" else "billing.internal"}
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.pool"):
            with Proxy(config_text([up.address], extra_cluster=tls_yaml(**kw))) as p, client(p.port()) as c:
                for _ in range(2):   # the connection stays usable after the proxy's error
                    with pytest.raises(TApplicationException) as e:
                        c.lookup("x")
                    assert e.value.type == TApplicationException.INTERNAL_ERROR
                    assert e.value.message.startswith(f"thrift-sidecar: not sent: connect to {up.address} failed")
                    assert why in e.value.message
        assert up.handler.calls == 0
        lines = [r.getMessage() for r in caplog.records if r.name == "proxy.pool"]
        # one line for the two failures (the second came within the pool's WARN_EVERY), and the
        # count held back said when the pool closed
        said = [m for m in lines if f"connect to {up.address} failed" in m and why in m]
        assert len(said) == 2 and said[1].endswith(": 1 more time since the last such line, "
                                                   "before its pool closed"), lines
    finally:
        up.stop()


def cluster_cfg(pki: Path, **tls) -> cfgmod.Cluster:
    items = ", ".join(f"{k}: {v}" for k, v in tls.items())
    text = f"""
listeners: [{{listen: 127.0.0.1:0, routes: [{{cluster: c}}]}}]
clusters: [{{name: c, endpoints: [127.0.0.1:1], tls: {{{items}}}}}]
"""
    return cfgmod.loads(text, str(pki / "sidecar.yaml")).clusters[0]


def test_unusable_files_are_refused_when_the_config_is_built(pki, tmp_path):
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    with pytest.raises(TlsError, match=r"cluster c: tls.ca .*missing.pem: No such file"):
        client_context(cluster_cfg(pki, ca=tmp_path / "missing.pem").tls, "c")
    with pytest.raises(TlsError, match=r"cluster c: tls.ca .*garbage.pem"):
        client_context(cluster_cfg(pki, ca=tmp_path / "garbage.pem").tls, "c")
    with pytest.raises(TlsError, match=r"tls.cert .*client.pem / tls.key .*server.key: KEY_VALUES_MISMATCH"):
        client_context(cluster_cfg(pki, cert="client.pem", key="server.key").tls, "c")


def test_an_unusable_cert_or_key_file_is_named_at_its_own_key(pki, tmp_path):
    """A missing, empty or non-PEM key is said at `tls.key`, a bad certificate at `tls.cert`,
    each with its own file only. Before: every case was said at `tls.cert` with both files, a
    garbage or empty file of either kind as OpenSSL's "PEM lib"."""
    (tmp_path / "garbage").write_text("hello\n")
    (tmp_path / "empty").write_text("")
    cases = [
        (dict(cert=pki / "client.pem", key=tmp_path / "nokey"), "key", "nokey: No such file or directory"),
        (dict(cert=tmp_path / "nocert", key=pki / "client.key"), "cert", "nocert: No such file or directory"),
        (dict(cert=pki / "client.pem", key=tmp_path / "garbage"), "key", "garbage: not a PEM private key (no PRIVATE KEY block)"),
        (dict(cert=pki / "client.pem", key=tmp_path / "empty"), "key", "empty: not a PEM private key (empty)"),
        (dict(cert=tmp_path / "garbage", key=pki / "client.key"), "cert", "garbage: not a PEM certificate (no BEGIN CERTIFICATE block)"),
        (dict(cert=pki / "client.key", key=pki / "client.pem"), "cert", "client.key: not a PEM certificate (no BEGIN CERTIFICATE block)"),
    ]
    for tls, field, detail in cases:
        with pytest.raises(TlsError) as e:
            client_context(cluster_cfg(pki, **tls).tls, "c")
        assert e.value.field == field and e.value.detail.endswith(detail), (tls, e.value)
        other = tls["key" if field == "cert" else "cert"]
        assert str(other) not in e.value.detail, e.value  # (only the file at fault is named)


def test_an_encrypted_key_is_refused_not_prompted_for(pki, tmp_path):
    """OpenSSL would ask for the passphrase on the terminal (blocking start, or the event loop
    in a reload); the proxy refuses such a key, naming it."""
    _openssl("pkey", "-in", str(pki / "client.key"), "-aes256", "-passout", "pass:secret",
             "-out", str(tmp_path / "locked.key"), cwd=tmp_path)
    with pytest.raises(TlsError) as e:
        client_context(cluster_cfg(pki, cert=pki / "client.pem", key=tmp_path / "locked.key").tls, "c")
    assert (e.value.field, e.value.detail) == (
        "key", f"{tmp_path / 'locked.key'}: encrypted (it needs a passphrase); give an unencrypted key file")


def test_each_config_load_reads_the_files_again(pki, tmp_path):
    """What a reload does: build the cluster from the config again, TLS context included."""
    shutil.copy(pki / "ca.pem", tmp_path / "trust.pem")
    cfg = cluster_cfg(pki, ca=tmp_path / "trust.pem", server_name="users.internal")
    first = build_cluster(cfg, None, random.Random(1))
    assert first.ssl.verify_mode == ssl.CERT_REQUIRED and first.ssl.check_hostname
    assert first.server_name == "users.internal"
    assert [c["subject"] for c in first.ssl.get_ca_certs()] == [((("commonName", "ca"),),)]
    shutil.copy(pki / "other-ca.pem", tmp_path / "trust.pem")   # the CA file is rotated
    second = build_cluster(cfg, None, random.Random(1))
    assert [c["subject"] for c in second.ssl.get_ca_certs()] == [((("commonName", "other-ca"),),)]
    assert [c["subject"] for c in first.ssl.get_ca_certs()] == [((("commonName", "ca"),),)]


class HelloThenClose(RawUpstream):
    """Reads the proxy's ClientHello and closes without a byte: the proxy's handshake ends in
    ConnectionResetError('') (no errno, no text)."""

    def _one(self, c) -> None:
        with contextlib.suppress(OSError):
            c.recv(4096)
            c.close()


def test_upstream_closing_during_the_handshake_is_named_not_blank(pki, caplog):
    up = HelloThenClose()
    hint = "ConnectionResetError during the TLS handshake (closed by the endpoint; does it speak TLS?)"
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.pool"):
            yaml = tls_yaml(ca=pki / "ca.pem", server_name="users.internal")
            with Proxy(config_text([up.address], extra_cluster=yaml)) as p, client(p.port()) as c:
                with pytest.raises(TApplicationException) as e:
                    c.lookup("x")
        assert e.value.message == f"thrift-sidecar: not sent: connect to {up.address} failed: {hint}"
        lines = [r.getMessage() for r in caplog.records if r.name == "proxy.pool"]
        assert f"connect to {up.address} failed: {hint}" in lines, lines
        # an active health check says the same
        why = asyncio.run(check_once("127.0.0.1", up.port, "ping", Framing.FRAMED, Protocol.BINARY, 5.0,
                                     ssl=client_context(cluster_cfg(pki, ca=pki / "ca.pem").tls, "c"),
                                     server_hostname="users.internal"))
        assert why == f"connect failed: {hint}"
    finally:
        up.close()


def test_a_reload_reads_an_unchanged_clusters_tls_files_again(pki, tmp_path, caplog):
    """The same config text, reloaded after its CA file was rotated: new connections trust the
    new CA (a cluster whose config did not change is kept, its pools and breakers too, but its TLS
    files are read again). A CA file that is gone then rejects the reload; the old one serves."""
    up = TlsThriftServer(server_ctx(pki, require_client_cert=False), name="tls-up")
    trust = tmp_path / "trust.pem"
    shutil.copy(pki / "other-ca.pem", trust)  # the wrong CA first: handshakes fail
    text = config_text([up.address], extra_cluster=tls_yaml(ca=trust, server_name="users.internal")
                       + "\n    pool: {idle_timeout: 0s}")

    def reload() -> bool:
        return asyncio.run_coroutine_threadsafe(p.server.apply(cfgmod.loads(text, "test.yaml")),
                                                p.loop).result(20)

    try:
        with Proxy(text) as p, client(p.port()) as c:
            cluster = p.server.clusters["up"]
            with pytest.raises(TApplicationException) as e:
                c.lookup("x")
            assert e.value.message.startswith("thrift-sidecar: not sent: "), e.value.message
            shutil.copy(pki / "ca.pem", trust)   # rotated
            assert reload()
            assert p.server.clusters["up"] is cluster  # kept: the config text is the same
            assert c.lookup("x") == "tls-up:x"
            trust.unlink()
            with caplog.at_level(logging.ERROR, logger="proxy.server"):
                assert not reload()
            assert any("tls.ca" in r.getMessage() and "reload rejected" in r.getMessage()
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
            assert c.lookup("y") == "tls-up:y"
    finally:
        up.stop()


def test_the_file_watch_reloads_when_a_tls_file_the_config_names_is_rotated(pki, tmp_path, caplog):
    """reload: {watch: true} watches the files the config names as well as the config itself: a
    CA file rotated in place (as cert-manager rotates a mounted Secret) is picked up without a
    signal. Before: only the config file was watched; the proxy kept the old CA until a SIGHUP."""
    up = TlsThriftServer(server_ctx(pki, require_client_cert=False), name="tls-up")
    trust = tmp_path / "trust.pem"
    shutil.copy(pki / "other-ca.pem", trust)  # the wrong CA first: handshakes fail
    text = config_text([up.address], extra_top="reload: {watch: true}",
                       extra_cluster=tls_yaml(ca=trust, server_name="users.internal"))
    path = tmp_path / "sidecar.yaml"
    path.write_text(text)

    def answered() -> bool:
        try:
            return c.lookup("x") == "tls-up:x"
        except TApplicationException as e:
            assert e.message.startswith("thrift-sidecar: not sent: "), e.message
            return False

    try:
        with caplog.at_level(logging.INFO, logger="proxy"):
            with Proxy(text, path=str(path)) as p, client(p.port()) as c:
                assert not answered()
                shutil.copy(pki / "ca.pem", trust)   # rotated; the config file is untouched
                wait_for(answered, timeout=15, what="the rotated CA file to be picked up")
                assert p.server.reloads["ok"] == 1
        assert any(r.getMessage() == f"{trust} changed: reloading" for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        up.stop()


def test_dns_discovered_endpoints_are_checked_against_the_dns_name(pki, tmp_path):
    """endpoints: {dns: {name: users.internal:PORT}}, no server_name, a certificate naming only
    users.internal: the name looked up is the one checked (and sent as SNI). Before: each
    resolved IP was, so every connect failed ("IP address mismatch") and the breaker opened."""
    ext = EXT_SERVER.replace("subjectAltName=DNS:users.internal,IP:127.0.0.1", "subjectAltName=DNS:users.internal")
    make_leaf(pki, "name-only", "ca", ext)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "name-only.pem", pki / "name-only.key")
    names: list[str | None] = []
    ctx.sni_callback = lambda sock, name, _ctx: names.append(name)
    up = TlsThriftServer(ctx, name="tls-up")

    async def resolver(host: str) -> list[str]:
        assert host == "users.internal"
        return ["127.0.0.1"]

    text = config_text(["127.0.0.1:1"], extra_cluster=tls_yaml(ca=pki / "ca.pem")).replace(
        "endpoints: [127.0.0.1:1]", f"endpoints: {{dns: {{name: 'users.internal:{up.port}'}}}}")
    try:
        with Proxy(text, resolver=resolver) as p:
            wait_for(lambda: len(p.server.clusters["up"].endpoints) == 1, what="the DNS answer")
            with client(p.port()) as c:
                assert [c.lookup(f"k{i}") for i in range(3)] == [f"tls-up:k{i}" for i in range(3)]
        assert not up.handshake_errors and names and set(names) == {"users.internal"}, (up.handshake_errors, names)
    finally:
        up.stop()


class OneCallTls(RawUpstream):
    """Answers one call per TLS connection, then (when `close` is set) closes it as a TLS server
    does: a close_notify record, then the FIN."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.close_now = threading.Event()
        super().__init__()

    def _one(self, c: socket.socket) -> None:
        from harness import reply_bytes

        s = self.ctx.wrap_socket(c, server_side=True)
        for name, seqid in self.requests(s):
            s.sendall(reply_bytes(name, seqid, b"served"))
            self.close_now.wait(10)
            self.close_now.clear()
            s.settimeout(0.3)
            with contextlib.suppress(OSError, ValueError):
                s.unwrap()  # close_notify
            with contextlib.suppress(OSError):
                socket.socket.shutdown(s, socket.SHUT_RDWR)
            s.close()
            return


def test_an_idle_tls_connection_closing_is_not_lent_to_a_call(pki):
    """The upstream closes an idle TLS connection while the proxy's loop is busy: its
    close_notify waits unread, and the next call must not go out on it. Before: the peek saw
    bytes, not the FIN, lent it, and the non-idempotent incr was answered "may have run"."""
    up = OneCallTls(server_ctx(pki, require_client_cert=False))
    text = config_text([up.address], extra_cluster=tls_yaml(ca=pki / "ca.pem"))
    try:
        with Proxy(text) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                s.sendall(request_bytes("framed", "binary", "incr", "k", seqid=1))
                (m,) = read_messages(s, 1)
                assert m.type == 2
                time.sleep(0.1)  # idle in the pool
                p.loop.call_soon_threadsafe(time.sleep, 1.0)  # the loop busy (a GC pause, a slow callback)
                time.sleep(0.1)
                s.sendall(request_bytes("framed", "binary", "incr", "k", seqid=2))
                time.sleep(0.1)
                up.close_now.set()  # the close arrives while the call waits for the loop
                (m,) = read_messages(s, 1, timeout=5)
        assert m.seqid == 2 and m.type == 2, app_exception(m).message if m.type == 3 else m
        assert up.connections == 2  # served on a new connection
    finally:
        up.close()


def test_tls_to_a_plaintext_endpoint_says_tls(pki):
    """A common mistake, `tls` on a cluster whose server speaks plaintext: the client's error
    names the TLS handshake, not a bare "Connection reset by peer" that reads as the network."""
    up = ThriftServer()
    try:
        with Proxy(config_text([up.address], extra_cluster=tls_yaml(ca=pki / "ca.pem"))) as p, client(p.port()) as c:
            with pytest.raises(TApplicationException) as e:
                c.lookup("x")
    finally:
        up.stop()
    msg = e.value.message
    assert msg.startswith(f"thrift-sidecar: not sent: connect to {up.address} failed: "), msg
    assert "TLS handshake" in msg or "SSL" in msg, msg


def _tls_pools(p):
    (ep,) = p.call(p.server.snapshot)["clusters"]["up"]["endpoints"]
    return ep["pools"]


def test_tls13_session_tickets_unread_after_oneways_do_not_churn_connections(pki):
    """A burst of 300 oneways over TLS 1.3 to a server that sends the default two session
    tickets after each handshake: a connection that only wrote oneways has them unread when it
    is lent next, and is set aside until the loop reads them, then lent again. Before: each such
    connection was aborted as if closed, 87-144 handshakes for the burst (4-17 over TLS 1.2)."""
    up = TlsThriftServer(server_ctx(pki, require_client_cert=False), name="t")
    try:
        with Proxy(config_text([up.address], extra_cluster=tls_yaml(ca=pki / "ca.pem",
                                                                    server_name="users.internal"))) as p:
            with socket.create_connection(("127.0.0.1", p.port())) as s:
                for i in range(300):
                    s.sendall(request_bytes("framed", "binary", "log_event", f"e{i}", seqid=i))
                    if i % 3 == 0:
                        time.sleep(0.0005)
                s.sendall(request_bytes("framed", "binary", "incr", "k", seqid=999))
                (r,) = read_messages(s, 1, timeout=10)
                assert r.seqid == 999
            wait_for(lambda: len(up.handler.events) == 300, what="every oneway delivered")
            connects = sum(x["connects"] for x in _tls_pools(p))
        assert connects < 30, f"{connects} TLS handshakes for 300 oneways"
    finally:
        up.stop()

