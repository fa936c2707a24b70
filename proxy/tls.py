"""Upstream TLS: the client `ssl.SSLContext` a cluster's pools dial with.

    tls: {ca: ca.pem, cert: client.pem, key: client.key, server_name: users.internal}

- `ca` is the only CA the upstream's certificate may chain to (without it: the
  system's trust store); verification and the hostname check are always on.
- `server_name` is sent as SNI and is the name the certificate must carry; without
  it the name DNS discovery looks up, or else the endpoint's host (a name or an IP
  address) is used.
- `cert` + `key` present a client certificate (mutual TLS).

Certificate files are read here, once per context. The composition root builds
a new context each time the config is loaded, so a reload (SIGHUP, or a
watched file) picks up rotated certificates; running connections keep the
context they were opened with until they close.

A wrong CA or server name fails the TLS handshake inside the pool's connect,
which the pool reports as "not sent" and logs with the handshake's reason. An
upstream that refuses the proxy's own credentials (no client certificate, or one
it does not trust) does so with a TLS alert after the proxy's side of a TLS 1.3
handshake is done, so after the request was written: `refusal` names those
alerts, and the call is still "not sent" (the service never saw it).
"""

from __future__ import annotations

import ssl

from proxy import config as cfgmod


class TlsError(Exception):
    """A TLS setting cannot be used (unreadable or mismatched files); `field` is the key
    (`ca`, `cert` or `key` for a file that cannot be read or is not PEM of its kind, or `cert`
    for a pair that does not go together), `detail` what is wrong with it."""

    def __init__(self, cluster: str, field: str, detail: str) -> None:
        super().__init__(f"cluster {cluster}: tls.{field} {detail}")
        self.cluster = cluster
        self.field = field
        self.detail = detail


def client_context(tls: cfgmod.Tls, cluster: str = "?") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # (TLS 1.2: no handshake, nor refusal, mid-connection)
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
        # Each file on its own first, so that the error names the one that is wrong (OpenSSL's
        # own says "PEM lib" for either, and a missing file as the pair's).
        _check_pem(cluster, "cert", tls.cert, _PEM_CERT, "a PEM certificate")
        _check_pem(cluster, "key", tls.key, _PEM_KEY, "a PEM private key")
        try:
            # (a passphrase asked for: refused, never OpenSSL's prompt on the terminal, which
            # would block the process, or its event loop during a reload)
            ctx.load_cert_chain(str(tls.cert), str(tls.key), password=_no_passphrase)
        except _Encrypted:
            raise TlsError(cluster, "key", f"{tls.key}: encrypted (it needs a passphrase); give an "
                                           "unencrypted key file") from None
        except (OSError, ssl.SSLError) as e:
            raise TlsError(cluster, "cert", f"{tls.cert} / tls.key {tls.key}: {_reason(e)}") from None
    return ctx


_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY = b"PRIVATE KEY-----"  # (BEGIN PRIVATE KEY, BEGIN RSA/EC/ENCRYPTED PRIVATE KEY)


def _check_pem(cluster: str, field: str, path, marker: bytes, what: str) -> None:
    """`path` can be read and holds `marker` (a PEM block of the right kind), else a TlsError
    naming `field`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TlsError(cluster, field, f"{path}: {_reason(e)}") from None
    if marker not in data:
        why = "empty" if not data.strip() else f"no {marker.decode().strip('-')} block"
        raise TlsError(cluster, field, f"{path}: not {what} ({why})")


class _Encrypted(Exception):
    """The key file asked for a passphrase."""


def _no_passphrase() -> bytes:
    raise _Encrypted


# TLS alerts with which a server refuses the client itself (its certificate, or the lack of
# one). They end the handshake on the server's side: nothing the client wrote reached the service.
_REFUSALS = frozenset({
    "TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE", "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_REVOKED", "SSLV3_ALERT_CERTIFICATE_EXPIRED", "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "TLSV1_ALERT_UNKNOWN_CA", "TLSV1_ALERT_ACCESS_DENIED", "SSLV3_ALERT_HANDSHAKE_FAILURE",
    "TLSV1_ALERT_DECRYPT_ERROR", "TLSV1_ALERT_INSUFFICIENT_SECURITY",
})


def refusal(exc: BaseException | None) -> str | None:
    """The alert, as text ("tlsv13 alert certificate required"), when `exc` is a server refusing
    the proxy's TLS credentials; None for anything else. (The caller trusts it only on a TLS 1.3
    connection before its first reply byte: with renegotiation off, nowhere else can
    such an alert mean the service never saw the request.)"""
    if isinstance(exc, ssl.SSLError) and exc.reason in _REFUSALS:
        return exc.reason.lower().replace("_", " ")
    return None


def _reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError):
        return e.reason or str(e)
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e)
