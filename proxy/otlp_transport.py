"""Sending encoded OTLP trace requests to a collector: gRPC or HTTP, with retries, never raising.

Owns: `OtlpExporter`, the `tracing.exporter: otlp` exporter. Its fast path, `export_request`,
takes a whole encoded `ExportTraceServiceRequest` (`proxy.otlp`, written by `proxy.telemetry`
straight from the calls) and sends those bytes: gRPC `TraceService/Export` with an identity
serializer, or OTLP/HTTP `POST /v1/traces` as `application/x-protobuf`. It is also an SDK
`SpanExporter` (`export(spans)` encodes with the SDK, slowly) for code that holds ReadableSpans.
Leaves to others: what is exported and when (`proxy.exporter.ExportQueue`, in its worker thread).

Why not the SDK's OTLP exporters: they take ReadableSpans and encode them with the SDK's
encoder (~25 µs per span, most of the proxy's CPU at 100% sampling), and they cannot be handed
bytes. What they do on the wire is kept (`Settings.resolve` follows them):

- no `endpoint` in the config: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
  `OTEL_EXPORTER_OTLP_ENDPOINT` (HTTP: + `/v1/traces`), else `http://localhost:4317` (gRPC) /
  `http://localhost:4318/v1/traces` (HTTP); a configured HTTP endpoint without a path gets
  `/v1/traces`. gRPC: `http://` means plaintext, `https://` TLS, anything else TLS unless
  `OTEL_EXPORTER_OTLP[_TRACES]_INSECURE=true`.
- `OTEL_EXPORTER_OTLP[_TRACES]_HEADERS`, `_TIMEOUT` (seconds, default 10: the whole export,
  retries included), `_COMPRESSION` (`gzip`; HTTP also `deflate`), `_CERTIFICATE`,
  `_CLIENT_KEY`, `_CLIENT_CERTIFICATE`.
- retries: gRPC codes CANCELLED, DEADLINE_EXCEEDED, ABORTED, OUT_OF_RANGE, UNAVAILABLE,
  DATA_LOSS, and RESOURCE_EXHAUSTED with a RetryInfo (the OTLP spec; the SDK retries it
  always, also a request over the collector's size limit, which fails again); HTTP 429, 502, 503, 504 and connection errors. At most 6 tries,
  backoff 1, 2, 4, ... s ±20% (or the server's RetryInfo / Retry-After), never past the
  deadline; shutdown cuts a backoff short. After a first UNAVAILABLE the gRPC channel is made
  anew (a restarted collector is otherwise only retried after grpc's own reconnect backoff).

A server's delay (RetryInfo / Retry-After) longer than what is left of an export's timeout
also holds the exports after it back (failed at once, counted), up to 60 s: a collector that
asked for 30 s of quiet is not sent a batch every 0.2 s. Spans the collector rejected in an
accepted export (`partial_success`) are counted (`rejected_spans`) and logged.

Failures are returned (`SpanExportResult.FAILURE`) and logged at most every 10 s, never raised.
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import socket
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy import __version__

log = logging.getLogger(__name__)

__all__ = ["OtlpExporter", "Settings", "GRPC_METHOD"]

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
HTTP_PATH = "/v1/traces"
USER_AGENT = f"thrift-sidecar/{__version__}"
DEFAULT_TIMEOUT = 10.0   # seconds, the SDK's
MAX_TRIES = 6            # the SDK's
LOG_EVERY = 10.0         # seconds between warnings about failed exports
MAX_QUIET = 60.0         # seconds at most that a collector's Retry-After / RetryInfo holds later exports back

_GRPC_RETRYABLE = frozenset(("CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "OUT_OF_RANGE",
                             "UNAVAILABLE", "DATA_LOSS"))
_HTTP_RETRYABLE = frozenset((429, 502, 503, 504))


def _env(environ: Mapping[str, str], name: str) -> str | None:
    """OTEL_EXPORTER_OTLP_TRACES_{name}, else OTEL_EXPORTER_OTLP_{name} (empty = unset)."""
    return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(f"OTEL_EXPORTER_OTLP_{name}") or None


@dataclass(frozen=True)
class Settings:
    """Where and how to send: the config's endpoint, else the OTEL_EXPORTER_OTLP_* variables."""

    protocol: str                 # grpc | http
    target: str                   # gRPC: host:port; HTTP: the full URL
    insecure: bool                # gRPC: plaintext (HTTP: the URL's scheme decides)
    headers: tuple[tuple[str, str], ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    compression: str | None = None   # gzip | deflate (HTTP only) | None
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None

    @classmethod
    def resolve(cls, protocol: str, endpoint: str | None, environ: Mapping[str, str] = os.environ) -> Settings:
        from opentelemetry.util.re import parse_env_headers

        headers = tuple(parse_env_headers(_env(environ, "HEADERS") or "", liberal=True).items())
        raw_timeout = _env(environ, "TIMEOUT")
        try:
            timeout = float(raw_timeout) if raw_timeout else DEFAULT_TIMEOUT
        except ValueError:
            log.warning("OTEL_EXPORTER_OTLP timeout %r is not a number; using %s s", raw_timeout, DEFAULT_TIMEOUT)
            timeout = DEFAULT_TIMEOUT
        compression = (_env(environ, "COMPRESSION") or "none").strip().lower()
        if compression not in ("gzip", "none") and not (protocol == "http" and compression == "deflate"):
            log.warning("OTEL_EXPORTER_OTLP compression %r is not supported for %s; not compressing",
                        compression, protocol)
            compression = "none"
        tls = dict(certificate=_env(environ, "CERTIFICATE"), client_key=_env(environ, "CLIENT_KEY"),
                   client_certificate=_env(environ, "CLIENT_CERTIFICATE"))
        common = dict(headers=headers, timeout=timeout, compression=None if compression == "none" else compression,
                      **tls)
        if protocol == "http":
            if endpoint:
                url = endpoint.rstrip("/") + HTTP_PATH if urlsplit(endpoint).path in ("", "/") else endpoint
            elif environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
                url = environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
            else:
                url = (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318").rstrip("/") + HTTP_PATH
            return cls("http", url, urlsplit(url).scheme == "http", **common)
        if protocol != "grpc":
            raise ValueError(f"unknown OTLP protocol {protocol!r}")
        endpoint = (endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4317")
        parts = urlsplit(endpoint)
        insecure_env = _env(environ, "INSECURE")
        if parts.scheme == "https":
            insecure = False
        elif insecure_env is not None:
            insecure = insecure_env.strip().lower() == "true"
        else:
            insecure = parts.scheme == "http"
            if parts.scheme != "http":  # as the SDK: no scheme means TLS, easy to trip over
                log.warning("OTLP/gRPC endpoint %r has no http:// or https:// scheme: using TLS "
                            "(write http://%s for plaintext, e.g. a local Jaeger)", endpoint,
                            parts.netloc or endpoint)
        return cls("grpc", parts.netloc or endpoint, insecure, **common)


@dataclass(frozen=True)
class _Failure:
    reason: str
    retryable: bool
    delay: float | None = None  # what the server asked us to wait


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


class _GrpcSender:
    """One unary call per export on a long-lived channel; the request is already bytes."""

    def __init__(self, settings: Settings) -> None:
        import grpc

        self._grpc = grpc
        self.settings = settings
        self._metadata = settings.headers or None
        self._compression = grpc.Compression.Gzip if settings.compression == "gzip" else grpc.Compression.NoCompression
        self._credentials = None
        if not settings.insecure:
            self._credentials = grpc.ssl_channel_credentials(
                _read(settings.certificate), _read(settings.client_key), _read(settings.client_certificate))
        self._lock = threading.Lock()
        self._channel = None
        self._call = None
        self._connect()

    def _connect(self) -> None:
        grpc = self._grpc
        options = [("grpc.primary_user_agent", USER_AGENT)]
        with self._lock:
            old = self._channel
            if self._credentials is None:
                channel = grpc.insecure_channel(self.settings.target, options=options, compression=self._compression)
            else:
                channel = grpc.secure_channel(self.settings.target, self._credentials, options=options,
                                              compression=self._compression)
            # request_serializer None: the request goes out as the bytes it is
            self._call = channel.unary_unary(GRPC_METHOD, request_serializer=None, response_deserializer=None)
            self._channel = channel
        if old is not None:
            old.close()

    def prepare(self, data: bytes) -> bytes:
        return data  # grpc compresses on the channel

    def send(self, data: bytes, timeout: float, first: bool) -> _Failure | bytes:
        """The response's bytes (an ExportTraceServiceResponse), or what failed."""
        try:
            return self._call(data, timeout=timeout, metadata=self._metadata) or b""
        except self._grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            name = getattr(code, "name", str(code))
            delay = _retry_info(e)
            if name == "UNAVAILABLE" and first:
                self._connect()
            # RESOURCE_EXHAUSTED is retried only when the server says when (RetryInfo), as the
            # OTLP spec says: without it, it is usually a request over the server's size limit
            retryable = name in _GRPC_RETRYABLE and (name != "RESOURCE_EXHAUSTED" or delay is not None)
            return _Failure(f"gRPC {name}: {e.details() if hasattr(e, 'details') else e}", retryable, delay)

    def close(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


def _retry_info(error) -> float | None:
    """The delay of a `google.rpc.RetryInfo` in the error's trailing metadata, if any."""
    try:
        raw = dict(error.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
        if raw is None:
            return None
        from google.rpc.error_details_pb2 import RetryInfo

        info = RetryInfo.FromString(raw)
        return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    except Exception:  # noqa: BLE001 - a malformed hint is no reason to fail differently
        return None


_watching = threading.local()  # the connections this thread's export is using (_HttpSender.send)


def _watched(base: type) -> type:
    """A urllib3 connection class that tells the export watching it (on its thread) which
    connection carries the request, so that the deadline can cut it (`_HttpSender._cut`)."""

    class Watched(base):
        def request(self, *args, **kwargs):
            watch = getattr(_watching, "conns", None)
            if watch is not None:
                watch.append(self)
            return super().request(*args, **kwargs)

    Watched.__name__ = Watched.__qualname__ = f"Watched{base.__name__}"
    return Watched


class _HttpSender:
    """POST application/x-protobuf on a keep-alive session (requests, as the SDK's exporter).

    The timeout is the whole export's, as gRPC's deadline is: requests' own is per socket read,
    so a collector that answers a byte at a time held an export (and the export thread) for
    ever. A timer shuts the request's socket down at the deadline. (Through an HTTP(S) proxy
    from the environment only requests' per-read timeout applies.)
    """

    def __init__(self, settings: Settings) -> None:
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3 import connection, connectionpool

        self._requests = requests
        self.settings = settings
        self._session = requests.Session()
        self._cut_lock = threading.Lock()
        adapter = HTTPAdapter()
        pools = adapter.poolmanager.pool_classes_by_scheme = dict(adapter.poolmanager.pool_classes_by_scheme)
        pools["http"] = type("WatchedHTTPConnectionPool", (connectionpool.HTTPConnectionPool,),
                             {"ConnectionCls": _watched(connection.HTTPConnection)})
        pools["https"] = type("WatchedHTTPSConnectionPool", (connectionpool.HTTPSConnectionPool,),
                              {"ConnectionCls": _watched(connection.HTTPSConnection)})
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._headers = {"Content-Type": "application/x-protobuf", "User-Agent": USER_AGENT}
        self._headers.update(settings.headers)
        if settings.compression:
            self._headers["Content-Encoding"] = settings.compression
        self._verify = settings.certificate or True
        cert = settings.client_certificate
        self._cert = (cert, settings.client_key) if cert and settings.client_key else cert

    def prepare(self, data: bytes) -> bytes:
        compression = self.settings.compression
        if compression == "gzip":
            return gzip.compress(data, mtime=0)
        if compression == "deflate":
            return zlib.compress(data)
        return data

    def send(self, data: bytes, timeout: float, first: bool) -> _Failure | bytes:
        """The response's body (an ExportTraceServiceResponse), or what failed."""
        requests = self._requests
        deadline = time.monotonic() + timeout
        conns: list = []  # (the Timer's _cut and this thread share it under _cut_lock)
        cut = threading.Timer(timeout, self._cut, (conns,))
        cut.daemon = True
        _watching.conns = conns
        cut.start()
        try:
            try:
                r = self._post(data, timeout)
            except requests.ConnectionError:
                # at once, once: usually a pooled connection the collector had closed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                r = self._post(data, remaining)
        except requests.RequestException as e:
            if time.monotonic() >= deadline:
                return _Failure(f"HTTP: no answer within {timeout:.3g} s ({type(e).__name__})", True)
            if isinstance(e, requests.ConnectionError):
                return _Failure(f"HTTP connection error: {e}", True)
            return _Failure(f"HTTP error: {e}", False)
        finally:
            cut.cancel()
            with self._cut_lock:  # a _cut already running must not reach a later export's connection
                conns.clear()
            _watching.conns = None
        if 200 <= r.status_code < 300:
            return r.content if "protobuf" in r.headers.get("Content-Type", "") else b""
        if 300 <= r.status_code < 400:  # (not followed: a redirected POST turns into a GET that "succeeds")
            return _Failure(f"HTTP {r.status_code} {r.reason} to {r.headers.get('Location')!r}: redirects "
                            "are not followed; set the endpoint to the collector's own URL", False)
        retryable = r.status_code in _HTTP_RETRYABLE
        return _Failure(f"HTTP {r.status_code} {r.reason}: {r.text[:200]}", retryable,
                        _retry_after(r.headers.get("Retry-After")) if retryable else None)

    def _cut(self, conns: list) -> None:
        """The deadline passed with the request still out: shut its socket down (the blocked
        read returns; requests raises, and the connection is not reused). Once `send` is done
        `conns` is empty: a connection back in the pool, maybe already carrying the next
        export, is never cut."""
        with self._cut_lock:
            for conn in conns:
                sock = getattr(conn, "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _post(self, data: bytes, timeout: float):
        return self._session.post(self.settings.target, data=data, headers=self._headers, timeout=timeout,
                                  verify=self._verify, cert=self._cert, allow_redirects=False)

    def close(self) -> None:
        self._session.close()


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (delay-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class OtlpExporter(SpanExporter):
    """OTLP over gRPC or HTTP: `export_request(bytes)` for encoded requests, `export(spans)` too.

    Thread-safe enough for its one caller (the export worker) plus `shutdown` from another
    thread: shutdown wakes a retry backoff at once and closes the channel/session.
    """

    def __init__(self, protocol: str = "grpc", endpoint: str | None = None, *, settings: Settings | None = None,
                 backoff_base: float = 1.0, rng: random.Random | None = None) -> None:
        self.settings = settings or Settings.resolve(protocol, endpoint)
        self.backoff_base = backoff_base  # seconds before the first retry (the SDK's: 1)
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._last_warning = -LOG_EVERY
        self._last_rejected_warning = -LOG_EVERY
        self._quiet_until = 0.0   # (monotonic) the collector asked for no export before then
        self.rejected_spans = 0   # spans the collector said it rejected (partial_success); export thread
        self.sender = _GrpcSender(self.settings) if self.settings.protocol == "grpc" else _HttpSender(self.settings)

    def export_request(self, data: bytes) -> SpanExportResult:
        """Send one encoded ExportTraceServiceRequest, retrying within the timeout; never raises."""
        if self._stop.is_set():
            return SpanExportResult.FAILURE
        clock = time.monotonic
        quiet = self._quiet_until - clock()
        if quiet > 0:  # (not sent: a collector that said "not before" is not asked again sooner)
            return self._failed(f"the collector asked for no exports for {quiet:.1f} s more "
                                "(Retry-After or RetryInfo)", 0)
        deadline = clock() + self.settings.timeout
        try:
            body = self.sender.prepare(data)
            for n in range(MAX_TRIES):
                remaining = deadline - clock()
                if remaining <= 0:
                    return self._failed("deadline passed", n)
                answer = self.sender.send(body, remaining, n == 0)
                if not isinstance(answer, _Failure):  # accepted: the response's bytes
                    if answer:
                        self._partial(answer)
                    return SpanExportResult.SUCCESS
                failure = answer
                delay = failure.delay
                if delay is not None and delay > deadline - clock():
                    # the collector's own "not before" outlasts this export: later ones wait too
                    self._quiet_until = clock() + min(delay, MAX_QUIET)
                if delay is None:
                    delay = self.backoff_base * 2 ** n * self._rng.uniform(0.8, 1.2)
                if not failure.retryable or n + 1 == MAX_TRIES or delay > deadline - clock():
                    return self._failed(failure.reason, n + 1)
                log.debug("OTLP export: %s; retrying in %.2f s", failure.reason, delay)
                if self._stop.wait(delay):
                    return self._failed(f"{failure.reason} (no more tries: shutting down)", n + 1)
        except Exception as e:  # noqa: BLE001 - the export worker must never see an exception from here
            return self._failed(f"{type(e).__name__}: {e}", 0)
        return SpanExportResult.FAILURE  # not reached

    def _partial(self, response: bytes) -> None:
        """An accepted export's response: the spans the collector says it rejected
        (`partial_success`) are counted and logged (at most every 10 s), not taken as exported."""
        try:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

            partial = ExportTraceServiceResponse.FromString(response).partial_success
        except Exception:  # noqa: BLE001 - an answer we cannot read says nothing more than "accepted"
            return
        if not partial.rejected_spans and not partial.error_message:
            return
        self.rejected_spans += partial.rejected_spans
        now = time.monotonic()
        if now - self._last_rejected_warning >= LOG_EVERY:
            self._last_rejected_warning = now
            log.warning("OTLP/%s collector %s rejected %d span(s) of an export (%d in all): %s",
                        self.settings.protocol, self.settings.target, partial.rejected_spans,
                        self.rejected_spans, partial.error_message or "no reason given")

    def _failed(self, reason: str, tries: int) -> SpanExportResult:
        now = time.monotonic()
        if now - self._last_warning >= LOG_EVERY:
            self._last_warning = now
            log.warning("OTLP/%s export to %s failed after %d tries: %s", self.settings.protocol,
                        self.settings.target, tries, reason)
        return SpanExportResult.FAILURE

    def export(self, spans: Sequence) -> SpanExportResult:
        """The SDK's interface: ReadableSpans, encoded by the SDK's (slow) encoder."""
        if not spans:
            return SpanExportResult.SUCCESS
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        return self.export_request(encode_spans(spans).SerializeToString())

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered here

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.sender.close()
        except Exception:  # noqa: BLE001
            log.debug("closing the OTLP sender failed", exc_info=True)
