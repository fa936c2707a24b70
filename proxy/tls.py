"""Upstream TLS: the client `ssl.SSLContext` a cluster's pools dial with.

    tls: {ca: ca.pem, cert: client.pem, key: client.key, server_name: users.internal}

- `ca` is the only CA the upstream's certificate may chain to (without it: the
  system's trust store); verification and the hostname check are always on.
- `server_name` is sent as SNI and is the name the certificate must carry; without
  it the endpoint's host (a name or an IP address) is used.
- `cert` + `key` present a client certificate (mutual TLS).

Certificate files are read here, once per context. The composition root builds
a new context each time the config is loaded, so a reload (SIGHUP, or a
watched file) picks up rotated certificates; running connections keep the
context they were opened with until they close.

A wrong CA or server name fails the TLS handshake inside the pool's connect,
which the pool reports as "not sent" and logs with the handshake's reason.
"""

from __future__ import annotations

import ssl

from proxy import config as cfgmod


class TlsError(Exception):
    """A TLS setting cannot be used (unreadable or mismatched files); `field` is the key
    (`ca`, or `cert` for the cert/key pair), `detail` what is wrong with it."""

    def __init__(self, cluster: str, field: str, detail: str) -> None:
        super().__init__(f"cluster {cluster}: tls.{field} {detail}")
        self.cluster = cluster
        self.field = field
        self.detail = detail


def client_context(tls: cfgmod.Tls, cluster: str = "?") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        if tls.ca is not None:
            ctx.load_verify_locations(cafile=str(tls.ca))  # only this CA: not the system's too
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(cluster, "ca", f"{tls.ca}: {_reason(e)}") from None
    if tls.cert is not None:
        try:
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
        except (OSError, ssl.SSLError) as e:
            raise TlsError(cluster, "cert", f"{tls.cert} / tls.key {tls.key}: {_reason(e)}") from None
    return ctx


def _reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError):
        return e.reason or str(e)
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e)
