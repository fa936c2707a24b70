"""The config file: its typed, frozen model, every default, and every rule checked at load.

Owns: the YAML shape of DESIGN.md ("Config (YAML)") as pydantic models, the defaults (here and
nowhere else), the cross-checks that need the whole file (route → cluster, unique names and
addresses), and turning every broken rule into one `FILE:LINE: key.path: message` line.
Leaves to others: what the values *do* (listener, router, pool, breaker, ...), reading the
IDL and endpoint files it names (paths are only resolved here), and the units' grammar
(`proxy.units`).

    cfg = load("sidecar.yaml")            # raises ConfigError(.errors = ["FILE:LINE: path: msg", ...])
    cfg.listeners[0].listen.port          # durations are float seconds, sizes int bytes
    print(summary(cfg))                   # what `check-config` prints
    cfg.effective()                       # JSON-able dict for the admin /config page

How errors get their lines: the YAML is composed into a node tree first, so every key path
(`("listeners", 0, "routes", 2, "retry", "attempts")`) has the line where it starts; pydantic's
error locations are mapped onto those paths (a missing key gets its closest parent's line).
Rules that concern a model's own keys are model validators that raise `_At(key, message)`, so
the error names the key rather than the whole model.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import stat
import types
from pathlib import Path
from urllib.parse import urlsplit
from functools import cached_property
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
    ValidationInfo,
    model_serializer,
    model_validator,
)

from proxy.router import compile_regex
from proxy.units import (
    Address,
    format_duration,
    format_size,
    parse_address,
    parse_duration,
    parse_size,
)

__all__ = [
    "Address", "Admin", "Backoff", "CircuitBreaker", "Cluster", "Config", "ConfigError",
    "DnsEndpoints", "Endpoint", "Endpoints", "HeaderMatch", "HealthCheck", "Limits", "Listener",
    "Logging", "Match", "Pool", "Reload", "Retry", "RetryBudget", "Route", "Tls", "Tracing",
    "WeightedCluster", "load", "loads", "read_regular", "special_file", "summary",
]

Loc = tuple[str | int, ...]

MAX_FRAME = 2**31 - 1  # a frame length is a signed 32-bit integer on the wire
THRIFT_DEFAULT_FRAME = 16_384_000  # Apache Thrift's own default max frame size
MiB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# Errors


class ConfigError(Exception):
    """The config is invalid; `.errors` has one `FILE:LINE: key.path: message` per broken rule."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


class _At(ValueError):
    """A rule broken at `key` below the model that raised it (pydantic would blame the model)."""

    def __init__(self, key: str | Loc, message: str):
        super().__init__(message)
        self.key: Loc = key if isinstance(key, tuple) else (key,)


class _Problems(ValueError):
    """Several (loc, message) problems at once: field errors plus the cross-checks."""

    def __init__(self, problems: list[tuple[Loc, str]]):
        super().__init__("; ".join(f"{_path(loc)}: {msg}" for loc, msg in problems))
        self.problems = problems


# --------------------------------------------------------------------------------------------
# Value types: each parses what a human typed and prints back what parses again.


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("must be more than 0s")
    return seconds


def _frame_size(value: object) -> int:
    size = parse_size(value)
    if not 1 <= size <= MAX_FRAME:
        raise ValueError(f"must be 1-{MAX_FRAME} bytes")
    return size


def _listen_address(value: object) -> Address:
    return value if isinstance(value, Address) else parse_address(value, allow_port_zero=True)


def _endpoint_address(value: object) -> Address:
    return value if isinstance(value, Address) else parse_address(value)


def _ratio(value: float) -> float:
    if not 0 <= value <= 1:
        raise ValueError("must be between 0 and 1")
    return value


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError("must be letters, digits, '_', '.' or '-' (starting with a letter or digit)")
    return value


def _not_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _input_path(value: Path, info: ValidationInfo) -> Path:
    """Relative paths of files we read resolve against the config file's folder.

    `absolute()`, not `resolve()`: a Kubernetes ConfigMap mounts files through symlinks that are
    swapped on update, and resolving would pin the old target.
    """
    base = (info.context or {}).get("base_dir")
    return base / value if base is not None and not value.is_absolute() else value


_SPECIAL_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                  (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def special_file(mode: int) -> str | None:
    """What a file of this `st_mode` is ("a FIFO", ...) when it is not a regular file; None
    when it is. The files we read must be regular: opening a FIFO waits for a writer."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _SPECIAL_FILES if test(mode)), "a special file")


def read_regular(path: str | Path, limit: int = -1) -> tuple[bytes, str | None]:
    """(bytes, None): up to `limit` bytes of the regular file at `path`; (b"", what it is)
    when it is not one. Opened with O_NONBLOCK, so that a FIFO is refused instead of holding
    the caller (the loop's thread) in `open()` until some writer comes. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        kind = special_file(os.fstat(fd).st_mode)  # (before fdopen, which refuses a directory)
        if kind is not None:
            return b"", kind
        with os.fdopen(fd, "rb") as f:
            fd = -1  # (f closes it)
            return f.read(limit), None
    finally:
        if fd >= 0:
            os.close(fd)


def _regular_if_present(value: Path) -> Path:
    """A file the proxy reads (IDL, TLS, endpoints) that is there must be a regular file: the
    loop's thread would wait in `open()` on a FIFO. (Missing: an endpoints file may come later;
    the others are refused when read.)"""
    try:
        kind = special_file(os.stat(value).st_mode)
    except OSError:
        return value
    if kind is not None:
        raise ValueError(f"must be a regular file; {value} is {kind}")
    return value


def _not_empty_list(value: object) -> object:
    # before the items are validated: pydantic's min_length also counts the invalid items out
    if isinstance(value, list) and not value:
        raise ValueError("needs at least one item")
    return value


def _no_auto(value: object) -> object:
    if value == "auto":
        raise ValueError("auto is for listeners only; leave it out to speak what the client spoke")
    return value


Duration = Annotated[float, PlainValidator(parse_duration), PlainSerializer(format_duration, when_used="json")]
PositiveDuration = Annotated[
    float, PlainValidator(_positive_duration), PlainSerializer(format_duration, when_used="json")]
Size = Annotated[int, PlainValidator(parse_size), PlainSerializer(format_size, when_used="json")]
FrameSize = Annotated[int, PlainValidator(_frame_size), PlainSerializer(format_size, when_used="json")]
ListenAddress = Annotated[Address, PlainValidator(_listen_address), PlainSerializer(str, when_used="json")]
EndpointAddress = Annotated[Address, PlainValidator(_endpoint_address), PlainSerializer(str, when_used="json")]
Name = Annotated[StrictStr, AfterValidator(_name)]
Text = Annotated[StrictStr, AfterValidator(_not_empty)]
def _path_text(value: object) -> object:
    if isinstance(value, str):
        _not_empty(value)
        if "\0" in value:
            raise ValueError("must not contain a NUL character")
    return value


def _url(value: str) -> str:
    if not value.lower().startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:4317")
    try:
        parts = urlsplit(value)
        parts.port  # (an unparsable host or a port out of range raises here)
    except ValueError as e:
        raise ValueError(f"not a usable URL: {e}") from None
    if not parts.hostname:
        raise ValueError("must name a host, e.g. http://127.0.0.1:4317")
    return value


def _section_not_null(value: object) -> object:
    """A section written with nothing under it (`tls:` and only comments) is YAML null: an
    error, not "absent" (`tls:` with its keys commented out silently meant plaintext)."""
    if value is None:
        raise ValueError("must be a mapping ({} for the defaults, or leave the key out)")
    return value


InputPath = Annotated[Path, BeforeValidator(_path_text), AfterValidator(_input_path),
                      AfterValidator(_regular_if_present)]
OutputPath = Annotated[Path, BeforeValidator(_path_text)]
Ratio = Annotated[float, Strict(), AfterValidator(_ratio)]
Count = Annotated[int, Strict(), Field(ge=0)]
PositiveCount = Annotated[int, Strict(), Field(ge=1)]
MAX_WEIGHT = 1_000_000  # (a 400-digit weight overflowed the float pick: every call dropped)
Weight = Annotated[int, Strict(), Field(ge=0, le=MAX_WEIGHT)]
PositiveWeight = Annotated[int, Strict(), Field(ge=1, le=MAX_WEIGHT)]

# Thrift transports are "framing" in code (asyncio has its own Transport and Protocol).
ListenerFraming = Literal["framed", "buffered", "header", "auto"]
Framing = Literal["framed", "buffered", "header"]
ListenerProtocolName = Literal["binary", "binary_nonstrict", "compact", "auto"]
ProtocolName = Literal["binary", "binary_nonstrict", "compact"]
LoadBalancer = Literal["round_robin", "random", "least_request", "peak_ewma"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------
# Top-level sections


class Admin(_Model):
    """`/ready /live /metrics /stats /config`; only exists when the file has an admin section."""

    listen: ListenAddress = Address("127.0.0.1", 9901)
    allow_remote: StrictBool = False
    health_listen: ListenAddress | None = None  # /ready and /live only, for probes on the pod IP

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> Admin:
        if not self.listen.is_loopback and not self.allow_remote:
            raise _At("listen", "must be a loopback address unless allow_remote is true")
        return self


class Logging(_Model):
    format: Literal["json", "text"] = "json"
    level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: StrictBool = False


class Reload(_Model):
    watch: StrictBool = False  # also reload when the file changes (SIGHUP always reloads)


def _file_cap(value: object) -> int:
    size = parse_size(value)
    if 0 < size < 1024 * 1024:
        raise ValueError("must be 0 (no cap) or at least 1MiB")
    return size


class Tracing(_Model):
    """Without a tracing section the exporter is `none`; with one, it defaults to `otlp`."""

    # None: OTEL_SERVICE_NAME, else service.name in OTEL_RESOURCE_ATTRIBUTES, else thrift-sidecar
    service_name: Text | None = None
    exporter: Literal["otlp", "jsonl", "console", "none"] = "otlp"
    otlp_protocol: Literal["grpc", "http"] = "grpc"
    # None = the OTLP exporter's own default, which honours OTEL_EXPORTER_OTLP_ENDPOINT
    # (else http://localhost:4317 for grpc, http://localhost:4318/v1/traces for http)
    endpoint: Annotated[Text, AfterValidator(_url)] | None = None
    path: OutputPath | None = None  # for jsonl; relative to the working directory (output file)
    # for jsonl: past this the file is renamed to <path>.1 and a new one begun; 0 = no cap
    max_file_size: Annotated[int, PlainValidator(_file_cap), PlainSerializer(format_size, when_used="json")] \
        = 256 * 1024 * 1024
    sample_ratio: Ratio = 0.01

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> Tracing:
        if self.exporter == "jsonl" and self.path is None:
            raise _At("path", "required when exporter is jsonl")
        # settings another exporter would use, never read by this one: said, not ignored
        for key, exporter in (("path", "jsonl"), ("max_file_size", "jsonl"), ("endpoint", "otlp"),
                              ("otlp_protocol", "otlp")):
            if (key in self.model_fields_set and self.exporter != exporter
                    and getattr(self, key) != type(self).model_fields[key].default):
                raise _At(key, f"only used when exporter is {exporter} (it is {self.exporter})")
        return self


# --------------------------------------------------------------------------------------------
# Listeners and routes


class Backoff(_Model):
    base: Duration = 0.025
    max: Duration = 0.25

    @model_validator(mode="after")
    def _max_not_below_base(self) -> Backoff:
        if self.max < self.base:
            raise _At("max", f"must be at least base ({format_duration(self.base)})")
        return self


def _idempotent(value: object) -> object:
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        for i, v in enumerate(value):
            if ":" in v:
                raise _At(i, _with_service("a method glob", v, f"'{v.rpartition(':')[2]}'"))
        return tuple(value)
    raise ValueError("must be true, false or a list of method globs")


def _with_service(what: str, value: str, fix: str) -> str:
    """A method glob written with its multiplexed `Svc:` prefix: what to write instead."""
    return (f"{what} without the service: '{value}' never matches (methods are matched without their "
            f"multiplexed 'Svc:' prefix); write {fix}")


def _method_glob(value: str) -> str:
    if ":" in value:
        svc, _, method = value.rpartition(":")
        raise ValueError(_with_service("a method name or glob", value, f"service: {svc} and method: {method}"))
    return value


def _oneway_name(value: str) -> str:
    if any(c in value for c in "*?["):
        raise ValueError(f"exact method names only, not globs ('{value}'): a glob that caught a method "
                         "with a reply would leave its clients waiting; list each, or give the listener "
                         "its idl (which says which methods are oneway)")
    return value


def _exception_ref(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 32767:
        return value
    if isinstance(value, str) and value.isidentifier():
        return value
    raise ValueError("must be a result field id (1-32767) or an exception name")


MAX_ATTEMPTS = 10  # (gRPC caps maxAttempts at 5; a call's spans and its time grow with each)


def _attempts(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_ATTEMPTS:
        raise ValueError(f"must be at most {MAX_ATTEMPTS} (each try of a call is another upstream "
                         "call and span; the retry budget bounds retries across calls)")
    return value


class Retry(_Model):
    # total tries, the first included
    attempts: Annotated[PositiveCount, AfterValidator(_attempts)] = 1
    # true: every method may run twice; a list: methods matching these globs; false: only
    # requests that were never written are retried
    idempotent: Annotated[bool | tuple[str, ...], BeforeValidator(_idempotent)] = False
    per_try_timeout: Duration = 0.0  # 0 = only the route timeout bounds an attempt
    # declared exceptions (result field ids, or names from the listener's IDL) worth a retry
    on_exceptions: tuple[Annotated[int | str, BeforeValidator(_exception_ref)], ...] = ()
    backoff: Backoff = Backoff()

    @model_validator(mode="after")
    def _exceptions_need_idempotent(self) -> Retry:
        if self.on_exceptions and not self.idempotent:  # (false, or an empty list of globs)
            # (a declared exception means the call ran: it is only retried for idempotent methods)
            raise _At("on_exceptions", "only retried for idempotent methods: set idempotent "
                                       "(true, or globs of the methods it may retry)")
        if self.on_exceptions and self.attempts == 1:
            raise _At("on_exceptions", "never retried with attempts 1 (the first try only): "
                                       "set attempts to 2 or more")
        return self


def _header_match(value: object) -> object:
    if isinstance(value, str):
        return {"exact": value}
    if isinstance(value, dict):
        return value
    raise ValueError("must be a string, or {exact: ...}, {regex: ...} or {present: true}")


def _regex(value: str | None) -> str | None:
    if value is not None:
        compile_regex(value)  # (ValueError: said at the key, with its line)
    return value


class HeaderMatch(_Model):
    """One THeader header test; a plain string in the file means `exact`."""

    exact: StrictStr | None = None
    regex: Annotated[StrictStr | None, AfterValidator(_regex)] = None
    present: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> HeaderMatch:
        if sum(v is not None for v in (self.exact, self.regex, self.present)) != 1:
            raise _At((), "needs exactly one of exact, regex or present")
        return self


class Match(_Model):
    method: Annotated[Text, AfterValidator(_method_glob)] | None = None  # name or glob (`get_*`), no `Svc:`
    service: Name | None = None  # the TMultiplexedProtocol service name
    header: dict[StrictStr, Annotated[HeaderMatch, BeforeValidator(_header_match)]] | None = None
    invert: StrictBool = False

    @model_validator(mode="after")
    def _tests_something(self) -> Match:
        if self.method is None and self.service is None and not self.header:
            raise _At((), "needs method, service or header (leave match out for the default route)")
        return self


class WeightedCluster(_Model):
    cluster: Name
    weight: Weight = 1


def _match_not_null(value: object) -> object:
    """`match:` with its tests commented out is YAML null: an error, not the default route (it
    silently took every call)."""
    if value is None:
        raise ValueError("is empty: give method, service or header (leave match out for the default "
                         "route, which takes every call)")
    return value


class Route(_Model):
    # left out = the default route, matches every call
    match: Annotated[Match | None, BeforeValidator(_match_not_null)] = None
    cluster: Name | None = None
    weighted: Annotated[tuple[WeightedCluster, ...] | None, BeforeValidator(_not_empty_list)] = None
    strip_service: StrictBool = False
    timeout: Duration = 0.0  # 0 = no route timeout
    slow_call: Duration = 1.0  # slower calls are always traced
    retry: Retry = Retry()
    retry_buffer: Size = MiB  # larger requests are not retried: they stream (pipeline.upload_threshold)

    @model_validator(mode="after")
    def _one_target(self) -> Route:
        if self.cluster is not None and self.weighted is not None:
            raise _At("weighted", "use cluster or weighted, not both")
        if self.cluster is None and self.weighted is None:
            raise _At("cluster", "a route needs cluster or weighted")
        if self.weighted is not None and sum(w.weight for w in self.weighted) == 0:
            raise _At("weighted", "weights must add up to more than 0")
        per_try = self.retry.per_try_timeout
        if self.timeout and per_try >= self.timeout:
            raise _At(("retry", "per_try_timeout"), f"must be less than the route timeout "
                      f"({format_duration(self.timeout)}): it would never end an attempt to retry it")
        return self

    @property
    def targets(self) -> tuple[tuple[str, int], ...]:
        """(cluster, weight) pairs, whichever form the route used."""
        if self.weighted is not None:
            return tuple((w.cluster, w.weight) for w in self.weighted)
        assert self.cluster is not None
        return ((self.cluster, 1),)


class Listener(_Model):
    name: Name  # default `listener{index}` (filled in by Config)
    service: Name  # names spans and metrics; default: the listener name
    idl: InputPath | None = None
    listen: ListenAddress
    transport: ListenerFraming = "framed"
    protocol: ListenerProtocolName = "binary"
    max_frame_size: FrameSize = THRIFT_DEFAULT_FRAME
    max_connections: PositiveCount = 10000
    backlog: Annotated[int, Strict(), Field(ge=1, le=65535)] = 1024  # (the kernel caps it at somaxconn)
    request_read_timeout: Duration = 30.0  # a started request must arrive within this; 0 = none
    idle_timeout: Duration = 0.0  # no call in flight, no byte either way for this long: closed; 0 = keep idle client connections
    # calls one client connection may have open (pipelined) before the proxy stops reading it, and
    # the bytes their requests may hold (kept for retries until each is answered); one call
    # always may be open, however large
    max_inflight: Annotated[int, Strict(), Field(ge=1, le=100_000)] = 128
    max_inflight_bytes: Annotated[Size, Field(ge=1)] = 16 * 1024 * 1024
    oneway_methods: tuple[Annotated[Text, AfterValidator(_oneway_name)], ...] = ()
    routes: Annotated[tuple[Route, ...], BeforeValidator(_not_empty_list)]  # first match wins

    @model_validator(mode="before")
    @classmethod
    def _service_defaults_to_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "service" not in data:
            name = data.get("name")
            # a bad or missing name is reported on `name`; don't report it again on `service`
            usable = isinstance(name, str) and _NAME.fullmatch(name)
            return {**data, "service": name if usable else "unnamed"}
        return data

    @model_validator(mode="after")
    def _nonstrict_needs_a_framing(self) -> Listener:
        if self.transport == "auto" and self.protocol == "binary_nonstrict":
            # A frame and an unversioned binary message both begin with an i32 length (the
            # frame's, the name's): which one it is cannot be told from the bytes.
            raise _At("transport", "auto cannot tell framed from buffered for protocol binary_nonstrict "
                                   "(both begin with a length): set framed or buffered")
        return self

    @model_validator(mode="after")
    def _routes_reachable(self) -> Listener:
        for i, route in enumerate(self.routes[:-1]):
            if route.match is None:
                raise _At(("routes", i + 1), f"unreachable: routes[{i}] has no match and takes every call")
        return self

    @model_validator(mode="after")
    def _headers_need_theader(self) -> Listener:
        if self.transport in ("framed", "buffered"):
            for i, route in enumerate(self.routes):
                if route.match is not None and route.match.header:
                    raise _At(("routes", i, "match", "header"),
                              f"a {self.transport} listener's calls carry no headers (THeader's do): this "
                              f"test could never match{' (inverted: it would take every call)' if route.match.invert else ''}; "
                              "set the listener's transport to header or auto")
        return self

    @property
    def framing(self) -> str:
        return self.transport

    @cached_property
    def parsed_idl(self) -> Any:
        """The `idl` file parsed (a `proxy.idl.Idl`), or None without one; IdlError if it cannot
        be. Read once per loaded config: by its checks (`config_problems`, in the thread that
        loads a reload's config), then used as is by the server that builds the listener."""
        from proxy.idl import load as load_idl
        return load_idl(self.idl) if self.idl is not None else None


# --------------------------------------------------------------------------------------------
# Clusters


def _endpoint(value: object) -> object:
    if isinstance(value, str):
        return {"address": value}
    if isinstance(value, (dict, Endpoint)):
        return value
    raise ValueError("endpoint must be host:port or {address: host:port, weight: N}")


class Endpoint(_Model):
    address: EndpointAddress
    weight: PositiveWeight = 1


def _at_least(floor: float, why: str):
    """A duration of at least `floor` seconds (smaller ones would only burn CPU: `why`)."""
    def check(value: object) -> float:
        seconds = _positive_duration(value)
        if seconds < floor:
            raise ValueError(f"must be at least {format_duration(floor)} ({why})")
        return seconds
    return Annotated[float, PlainValidator(check), PlainSerializer(format_duration, when_used="json")]


DnsRefresh = _at_least(0.1, "a lookup per endpoint source that often is load, not freshness")
CheckInterval = _at_least(0.01, "each check is a connection and a call per endpoint")
CheckTimeout = _at_least(0.001, "no connect and call can be done sooner")


class DnsEndpoints(_Model):
    name: EndpointAddress  # host:port; every A/AAAA record becomes an endpoint on that port
    refresh: DnsRefresh = 5.0


class Endpoints(_Model):
    """Exactly one source: a list in the file (`static`), `dns: {...}` or `file: path`."""

    static: tuple[Annotated[Endpoint, BeforeValidator(_endpoint)], ...] | None = None
    dns: DnsEndpoints | None = None
    file: InputPath | None = None

    @model_validator(mode="before")
    @classmethod
    def _list_is_static(cls, data: Any) -> Any:
        if isinstance(data, list):
            return {"static": data}
        if not isinstance(data, (dict, Endpoints)):
            raise ValueError("must be a list of host:port, or {dns: {name: host:port}} or {file: path}")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> Endpoints:
        given = sum(v is not None for v in (self.static, self.dns, self.file))
        if given == 0:
            raise _At((), "needs a list of host:port, dns or file")
        if given > 1:
            raise _At((), "use only one of a list, dns or file")
        if self.static is not None:
            if not self.static:
                raise _At((), "needs at least one endpoint")
            seen: set[Address] = set()
            for i, endpoint in enumerate(self.static):
                if endpoint.address in seen:
                    raise _At(("static", i), f"duplicate endpoint {endpoint.address}")
                seen.add(endpoint.address)
        return self

    @model_serializer(mode="wrap")
    def _as_written(self, handler: Any) -> Any:
        dumped = handler(self)
        if self.static is not None:
            return dumped["static"]
        return {k: v for k, v in dumped.items() if v is not None}

    @property
    def kind(self) -> Literal["static", "dns", "file"]:
        return "static" if self.static is not None else "dns" if self.dns is not None else "file"


class Pool(_Model):
    max_connections: PositiveCount = 64  # per endpoint
    idle_timeout: Duration = 30.0  # 0 = keep idle connections
    acquire_timeout: PositiveDuration = 1.0
    # a connection this old (less up to 10%, so a pool's connections do not all go at once) closes
    # when its call ends, and the next call gets a new one: calls spread again over what is behind
    # one address (a Kubernetes Service's pods, an L4 balancer's backends); 0 = no limit
    max_age: Duration = 0.0


class Limits(_Model):
    max_pending: Count = 256  # calls waiting for a connection
    max_requests: PositiveCount = 1024  # calls in flight
    max_retries: Count = 16  # retries in flight

    @model_validator(mode="after")
    def _some_may_wait(self) -> Limits:
        if self.max_pending == 0:  # (as in Envoy; here a config error rather than a dead cluster)
            raise _At("max_pending", "must be at least 1: a call waits while its connection is "
                                     "opened, so 0 would refuse every call that needs a new one")
        return self


def _some_may_be_out(value: int) -> int:
    if value == 0:  # (Envoy's healthy_panic_threshold 0 turns panic off: the opposite)
        raise ValueError("must be 1-100: 0 would panic, ignoring health, as soon as one endpoint "
                         "is out (100 never panics)")
    return value


class CircuitBreaker(_Model):
    """Per endpoint; also the outlier ejection (open time grows per opening up to max_open_for)."""

    consecutive_failures: Count = 5  # 0 = off
    failure_rate: Ratio = 0.5  # over `window`, once `min_calls` were seen
    window: PositiveDuration = 10.0
    min_calls: PositiveCount = 20
    open_for: PositiveDuration = 5.0
    max_open_for: PositiveDuration = 300.0
    half_open_probes: PositiveCount = 1
    # above: panic, ignore health
    max_open_percent: Annotated[int, Strict(), Field(ge=0, le=100), AfterValidator(_some_may_be_out)] = 50

    @model_validator(mode="after")
    def _max_not_below_open_for(self) -> CircuitBreaker:
        if self.max_open_for < self.open_for:
            raise _At("max_open_for", f"must be at least open_for ({format_duration(self.open_for)})")
        return self


Threshold = Annotated[int, Strict(), Field(ge=1, le=100)]


class HealthCheck(_Model):
    interval: CheckInterval = 5.0
    timeout: CheckTimeout = 1.0
    method: Text = "ping"
    # checks in a row that take an endpoint out / bring it back (Envoy's; an endpoint's first
    # check decides alone, as Envoy's first check of a new host does)
    unhealthy_threshold: Threshold = 1
    healthy_threshold: Threshold = 1

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> HealthCheck:
        if self.timeout > self.interval:
            raise _At("timeout", f"must not exceed interval ({format_duration(self.interval)})")
        return self


class RetryBudget(_Model):
    ratio: Ratio = 0.2  # retries may add this share of the calls in `window`
    # (bounded: an infinite reserve made /stats answer 500)
    min_per_second: Annotated[float, Strict(), Field(ge=0, le=1_000_000, allow_inf_nan=False)] = 10.0
    window: PositiveDuration = 10.0


class Tls(_Model):
    ca: InputPath | None = None
    cert: InputPath | None = None
    key: InputPath | None = None
    server_name: Text | None = None

    @model_validator(mode="after")
    def _cert_with_key(self) -> Tls:
        if (self.cert is None) != (self.key is None):
            raise _At("key" if self.key is None else "cert", "cert and key go together")
        return self


class Cluster(_Model):
    name: Name
    endpoints: Endpoints
    # None (the default) = speak what the client spoke
    transport: Annotated[Framing | None, BeforeValidator(_no_auto)] = None
    protocol: Annotated[ProtocolName | None, BeforeValidator(_no_auto)] = None
    load_balancer: LoadBalancer = "least_request"
    connect_timeout: PositiveDuration = 0.25
    max_reply_size: FrameSize = THRIFT_DEFAULT_FRAME
    # Larger replies stream instead of being read whole. DESIGN.md says 1 MiB; 64 KiB measured
    # better (a 945 KB reply: +370 µs p50 and 427 µs CPU per call streamed, vs +900 µs and
    # 1,050 µs read whole), and a reply that arrives in one read is never streamed anyway.
    stream_threshold: Size = 64 * 1024
    pool: Pool = Pool()
    limits: Limits = Limits()
    circuit_breaker: CircuitBreaker = CircuitBreaker()
    health_check: Annotated[HealthCheck | None, BeforeValidator(_section_not_null)] = None
    retry_budget: RetryBudget = RetryBudget()
    tls: Annotated[Tls | None, BeforeValidator(_section_not_null)] = None

    @model_validator(mode="after")
    def _health_check_needs_wire(self) -> Cluster:
        if self.health_check is not None and (self.transport is None or self.protocol is None):
            raise _At("health_check", "needs transport and protocol set on the cluster")
        return self

    @property
    def framing(self) -> str | None:
        return self.transport


# --------------------------------------------------------------------------------------------
# The whole file


class Config(_Model):
    admin: Annotated[Admin | None, BeforeValidator(_section_not_null)] = None  # none: no admin listener
    metrics_listen: ListenAddress | None = None  # /metrics alone, without an admin section
    logging: Logging = Logging()
    reload: Reload = Reload()
    drain_timeout: Duration = 20.0
    tracing: Tracing = Tracing(exporter="none")
    listeners: Annotated[tuple[Listener, ...], BeforeValidator(_not_empty_list)]
    clusters: tuple[Cluster, ...] = ()

    @model_validator(mode="wrap")
    @classmethod
    def _check_across(cls, data: Any, handler: Any) -> Config:
        """Cross-checks run on the raw data too, so their errors come with the field errors."""
        if not isinstance(data, dict):
            return handler(data)
        data = _name_listeners(data)
        problems = _cross_problems(data)
        if not problems:
            return handler(data)
        try:
            handler(data)
        except ValidationError as e:
            problems = _problems_from(e, cls) + problems
        raise _Problems(problems)

    def cluster(self, name: str) -> Cluster:
        """The cluster called `name` (every route's cluster exists: checked at load)."""
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        raise KeyError(name)

    def effective(self) -> dict[str, Any]:
        """Every key with its effective value, JSON-able (admin `/config`); loads back as is.
        Sections left out (admin, a cluster's tls and health_check, a default route's match) stay
        out: written null, they would be a config error (`_section_not_null`, `_match_not_null`)."""
        data = self.model_dump(mode="json")
        if data.get("admin") is None:
            data.pop("admin", None)
        for cluster in data["clusters"]:
            for key in ("tls", "health_check"):
                if cluster.get(key) is None:
                    cluster.pop(key, None)
        for listener in data["listeners"]:
            for route in listener["routes"]:
                if route.get("match") is None:  # (the default route: no match)
                    route.pop("match", None)
        return data


def _valid_listeners(data: Any, context: dict) -> list[tuple[int, Listener]]:
    """(index, Listener) for each listener in the raw data that is valid on its own."""
    data = _name_listeners(data) if isinstance(data, dict) else {}
    out = []
    for i, item in enumerate(data.get("listeners") if isinstance(data.get("listeners"), list) else []):
        try:
            out.append((i, Listener.model_validate(item, context=context)))
        except ValidationError:
            pass  # (its problems are reported on it already)
    return out


def _name_listeners(data: dict[str, Any]) -> dict[str, Any]:
    listeners = data.get("listeners")
    if not isinstance(listeners, list):
        return data
    named = [{"name": f"listener{i}", **item} if isinstance(item, dict) and "name" not in item
             else item for i, item in enumerate(listeners)]
    return {**data, "listeners": named}


_KNOWN_PROTOCOLS = frozenset(get_args(ProtocolName))


def _overlap(a: Address, b: Address) -> str | None:
    """Why two sockets cannot both bind, or None: the same port, and one of them the wildcard of
    a family the other belongs to (0.0.0.0: any IPv4 address or host name; `::`: any IPv6
    address), or two names for one address (`localhost` binds 127.0.0.1 and ::1: RFC 6761's
    loopback name, the one name looked at here; others are not resolved)."""
    if a.port != b.port:
        return None
    same = _bound_hosts(a.host) & _bound_hosts(b.host)
    if same:
        return f"both bind {', '.join(sorted(same))}"
    for wild, other in ((a, b), (b, a)):
        hosts = _bound_hosts(other.host)
        if (wild.host == "0.0.0.0" and any(":" not in h for h in hosts)) or (
                wild.host == "::" and any(":" in h for h in hosts)):
            return "a wildcard address takes its port on every address of its family"
    return None


def _bound_hosts(host: str) -> set[str]:
    """The addresses a listen host binds, as far as known without a lookup."""
    if host.lower().rstrip(".") == "localhost":
        return {"127.0.0.1", "::1"}
    try:
        return {str(ipaddress.ip_address(host))}  # (one spelling: ::0001 is ::1)
    except ValueError:
        return {host.lower()}


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _cross_problems(data: dict[str, Any]) -> list[tuple[Loc, str]]:
    """Rules across sections, on the raw data so they run even when some fields are invalid."""
    problems: list[tuple[Loc, str]] = []

    def unique(kind: str, items: Any, section: str) -> list[str]:
        names: dict[str, None] = {}
        for i, item in enumerate(items if isinstance(items, list) else []):
            name = item.get("name") if isinstance(item, dict) else None
            if isinstance(name, str):
                if name in names:
                    problems.append(((section, i, "name"), f"duplicate {kind} name '{name}'"))
                names[name] = None
        return list(names)

    clusters = data.get("clusters")
    cluster_names = unique("cluster", clusters, "clusters")
    cluster_set = frozenset(cluster_names)
    listeners = data.get("listeners")
    unique("listener", listeners, "listeners")

    # Every route's cluster exists (unless `clusters` itself is broken: its own errors say so),
    # and speaks the listener's protocol if it names one (binary and binary_nonstrict are one
    # wire format; protocols are never transcoded, so a mismatch would fail every call). A
    # header or auto listener's clients say their protocol per message: checked per call.
    if clusters is None or isinstance(clusters, list):
        # (only text: a list or mapping where a name or protocol belongs is reported by its field)
        speaks = {c["name"]: _text_or_none(c.get("protocol")) for c in clusters or []
                  if isinstance(c, dict) and isinstance(c.get("name"), str)}
        for i, listener in enumerate(listeners if isinstance(listeners, list) else []):
            routes = listener.get("routes") if isinstance(listener, dict) else None
            client = None  # the protocol the listener's clients speak, when it says one
            if isinstance(listener, dict) and listener.get(
                    "transport", Listener.model_fields["transport"].default) in ("framed", "buffered"):
                client = _text_or_none(listener.get("protocol", Listener.model_fields["protocol"].default))
            for j, route in enumerate(routes if isinstance(routes, list) else []):
                if not isinstance(route, dict):
                    continue
                refs: list[tuple[Loc, Any]] = [(("cluster",), route.get("cluster"))]
                weighted = route.get("weighted")
                for k, w in enumerate(weighted if isinstance(weighted, list) else []):
                    if isinstance(w, dict):
                        refs.append((("weighted", k, "cluster"), w.get("cluster")))
                for sub, ref in refs:
                    if not isinstance(ref, str):
                        continue  # (missing, or not text: the field's own error says so)
                    if ref not in cluster_set:
                        hint = difflib.get_close_matches(ref, cluster_names, n=1)
                        problems.append((("listeners", i, "routes", j, *sub),
                                         f"cluster '{ref}' is not defined"
                                         + (f" (did you mean '{hint[0]}'?)" if hint else "")))
                    elif _KNOWN_PROTOCOLS.issuperset((client, speaks.get(ref))) and (
                            (client == "compact") != (speaks.get(ref) == "compact")):
                        problems.append((("listeners", i, "routes", j, *sub),
                                         f"cluster '{ref}' speaks {speaks[ref]} but the listener "
                                         f"speaks {client} (protocols are never transcoded)"))

    # No two sockets on one address (port 0 = any free port, never a clash).
    spots: list[tuple[Loc, Any]] = [(("metrics_listen",), data.get("metrics_listen"))]
    admin = data.get("admin")
    if isinstance(admin, dict):
        spots.append((("admin", "listen"), admin.get("listen", str(Admin.model_fields["listen"].default))))
        spots.append((("admin", "health_listen"), admin.get("health_listen")))
    for i, listener in enumerate(listeners if isinstance(listeners, list) else []):
        if isinstance(listener, dict):
            spots.append((("listeners", i, "listen"), listener.get("listen")))
    taken: dict[Address, Loc] = {}
    for loc, value in spots:
        try:
            address = parse_address(value, allow_port_zero=True)
        except ValueError:
            continue  # reported by the field itself, or not given
        if address.port == 0:
            continue
        if address in taken:
            problems.append((loc, f"{address} is already used by {_path(taken[address])}"))
            continue
        clash = next(((other, why) for other in taken if (why := _overlap(address, other))), None)
        if clash is not None:
            other, why = clash
            problems.append((loc, f"{address} overlaps {other} of {_path(taken[other])} ({why})"))
            continue
        taken[address] = loc
    return problems


# --------------------------------------------------------------------------------------------
# Loading: YAML → (data, line of every key path) → Config, or every error with its line


def load(path: str | Path, again: bool = False) -> Config:
    """Read and validate the config file at `path`; raise ConfigError listing every problem.

    `again`: a reload's read, while serving: the file must be a regular one (`_read_again`)."""
    filename = str(path)
    try:
        text = _read_again(path) if again else _read_first(path)
    except OSError as e:
        raise ConfigError([f"{filename}:0: (file): {e.strerror or e}"]) from None
    except UnicodeDecodeError as e:
        line = e.object.count(b"\n", 0, e.start) + 1
        raise ConfigError([f"{filename}:{line}: (file): not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    except ValueError as e:
        raise ConfigError([f"{filename}:0: (file): {e}"]) from None
    return loads(text, filename)


def _parse(text: str, filename: str) -> tuple[Any, dict[Loc, int], list[tuple[Loc, str]]]:
    """`_read_yaml`, with YAML's own errors raised as ConfigError lines (`FILE:LINE: (root): ...`)."""
    try:
        return _read_yaml(text)
    except yaml.reader.ReaderError as e:  # (a character YAML does not allow; no mark, a position)
        line = text.count("\n", 0, e.position) + 1
        char = e.character if isinstance(e.character, int) else ord(e.character)
        raise ConfigError([f"{filename}:{line}: (root): invalid YAML: unacceptable character "
                           f"#x{char:04x}: {e.reason}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(e, "problem", None) or str(e)
        context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and start is not None and start.line + 1 != line:
            problem += f" ({context} started on line {start.line + 1})"
        raise ConfigError([f"{filename}:{line}: (root): invalid YAML: {problem}"]) from None
    except RecursionError:  # (the YAML parser recurses per level of nesting)
        raise ConfigError([f"{filename}:1: (root): invalid YAML: nested too deeply"]) from None


def loads(text: str, filename: str = "<string>") -> Config:
    """Validate config text; relative file paths in it resolve against `filename`'s folder."""
    data, lines, problems = _parse(text, filename)
    if data is None:
        raise ConfigError([f"{filename}:1: (root): the file has no config in it"])
    config = None
    context = {"base_dir": Path(filename).parent.absolute()}
    try:
        config = Config.model_validate(data, context=context)
    except ValidationError as e:
        problems += _problems_from(e, Config)
    from proxy.idl import config_problems, listener_problems  # (they read each listener's IDL)
    if config is not None:
        problems += config_problems(config)
    else:  # the IDLs of the listeners that are valid on their own, reported with the rest
        for i, listener in _valid_listeners(data, context):
            problems += listener_problems(i, listener)
    if problems:
        raise ConfigError(_error_lines(filename, data, lines, problems))
    assert config is not None
    return config


def load_endpoints_text(text: str, filename: str) -> tuple[Endpoint, ...]:
    """An endpoints file (`endpoints: {file: ...}`): a YAML list of host:port or {address:
    host:port, weight: N}, by the rules of a config's endpoint list. ConfigError with every
    problem said as config errors are: `FILE:LINE: [i].key: rule`."""
    data, lines, problems = _parse(text, filename)
    if data is None:
        raise ConfigError([f"{filename}:1: (root): no endpoints (the file is empty)"])
    if not isinstance(data, list):
        raise ConfigError([f"{filename}:1: (root): must be a YAML list of host:port or "
                           "{address: host:port, weight: N}"])
    endpoints = None
    try:
        endpoints = Endpoints.model_validate(data)
    except ValidationError as e:
        problems += _problems_from(e, Endpoints)
    if problems:
        raise ConfigError(_error_lines(filename, data, lines, problems))
    assert endpoints is not None and endpoints.static is not None
    return endpoints.static


def line_of_key(path: str | Path, loc: Loc) -> int:
    """The line where key path `loc` starts in the config file at `path` (for errors found
    after loading, e.g. a port in use); 1 if the file cannot be read again (or is no regular
    file: a pipe given at start-up is not read twice)."""
    try:
        _, lines, _ = _read_yaml(_read_again(path))
    except (OSError, ValueError, yaml.YAMLError, RecursionError):  # (UnicodeDecodeError: a ValueError)
        return 1
    return _line_of(loc, lines)


MAX_CONFIG_FILE = 16 * 1024 * 1024  # bytes: a config is kilobytes; /dev/zero is endless


def _read_first(path: str | Path) -> str:
    """The config file's text at start-up: a regular file or a pipe (`run -c <(...)`), at most
    MAX_CONFIG_FILE bytes (a device, or a file that size, is refused: ValueError)."""
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ValueError(f"must be a regular file or a pipe; it is {special_file(mode)}")
        raw = f.read(MAX_CONFIG_FILE + 1)
    return _config_text(raw)


def _config_text(raw: bytes) -> str:
    """Config bytes read with a limit of MAX_CONFIG_FILE + 1, as text (ValueError: too large)."""
    if len(raw) > MAX_CONFIG_FILE:
        raise ValueError(f"larger than {MAX_CONFIG_FILE // (1024 * 1024)} MiB")
    return raw.decode("utf-8")


def _read_again(path: str | Path) -> str:
    """The text of the config file at `path`, read again while serving (reload, an error's
    line): it must be a regular file, and it is opened with O_NONBLOCK, so that a FIFO put in
    its place is refused (ValueError) instead of holding the loop's thread in `open()` until
    some writer comes. At start-up a pipe does too (`run -c <(...)`: `_read_first`)."""
    raw, kind = read_regular(path, MAX_CONFIG_FILE + 1)
    if kind is not None:
        raise ValueError(f"must be a regular file to be read again; it is {kind} now")
    return _config_text(raw)


_CORE = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float", "null", "timestamp")}


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core schema for plain scalars, as other YAML tools
    (and Kubernetes' newer ones) read them. PyYAML follows YAML 1.1, where `timeout: 010` is 8
    (octal), `1:30` is 90 (base 60), `0b11` and `1_000` are numbers and `yes`, `no`, `on`, `off`
    are booleans, `2001-12-14` a date: a config that says one thing and is read as another.
    Here `010` is 10, `0o10` is 8, `0x10` is 16, only `true`/`false` are booleans, and the rest
    are strings (which the schema then refuses, at their key, where a number or a boolean is due)."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in _CORE]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign = -1 if text[0] == "-" else 1
        digits = text.lstrip("+-")
        if digits.startswith("0o"):
            return sign * int(digits[2:], 8)
        if digits.startswith("0x"):
            return sign * int(digits[2:], 16)
        return sign * int(digits, 10)


def _core_resolver(tag: str, pattern: str, first) -> None:
    """`first`: the characters a plain scalar of the tag may begin with ("" for the empty one)."""
    Yaml12Loader.add_implicit_resolver(tag, re.compile(pattern), list(first))


_core_resolver("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF")
_core_resolver("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""])
_core_resolver("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789")
_core_resolver("tag:yaml.org,2002:float",
               r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
               "-+0123456789.")
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", Yaml12Loader.construct_yaml_int)


def _read_yaml(text: str) -> tuple[Any, dict[Loc, int], list[tuple[Loc, str]]]:
    """The data, the 1-based line where each key path starts, and duplicate-key problems."""
    loader = Yaml12Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, {}, []
        _keys_as_text(root)
        _bounded_expansion(root)
        problems = _duplicate_keys(loader, root)
        data = loader.construct_document(root)  # also applies `<<` merges to the node tree
        lines: dict[Loc, int] = {}
        _record_lines(loader, root, (), lines, set())
        return data, lines, problems
    finally:
        loader.dispose()


MAX_EXPANDED_NODES = 200_000  # values a config may hold once its aliases are expanded


def _bounded_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand past MAX_EXPANDED_NODES values (raises a
    MarkedYAMLError at the first node that crosses it). Reading a config walks it expanded
    (key-path lines, validation): ten nested aliases of ten items each are a ~500-byte file and
    ten billion values, which would hold a reload's loop for minutes."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # (an alias that contains itself counts once)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_EXPANDED_NODES:  # (the first, so the smallest, node past it)
                raise yaml.MarkedYAMLError(
                    problem=f"its aliases expand to more than {MAX_EXPANDED_NODES:,} values",
                    problem_mark=node.start_mark)
        sizes[id(node)] = total
        return total

    size(root)


def _key(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return loader.construct_object(node) if isinstance(node, yaml.ScalarNode) else None


def _record_lines(loader: yaml.SafeLoader, node: yaml.Node, loc: Loc,
                  lines: dict[Loc, int], walking: set[int]) -> None:
    lines.setdefault(loc, node.start_mark.line + 1)
    if id(node) in walking:  # an alias that contains itself
        return
    walking.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = _key(loader, key_node)
            if key is not None:
                lines[loc + (key,)] = key_node.start_mark.line + 1
                _record_lines(loader, value_node, loc + (key,), lines, walking)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_lines(loader, item, loc + (i,), lines, walking)
    walking.discard(id(node))


_TEXT = "tag:yaml.org,2002:str"


def _keys_as_text(root: yaml.Node) -> None:
    """Every plain mapping key is text, as written: YAML 1.1 reads `on`, `no` or `~` as a boolean
    or null, which no config key is (and a header may be named so); `on: 1` is then an unknown
    key `on`, with suggestions, not "Keys should be strings" at a key path it cannot name."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if (isinstance(key_node, yaml.ScalarNode) and key_node.style is None
                        and key_node.tag != "tag:yaml.org,2002:merge"):
                    key_node.tag = _TEXT
                stack.append(value_node)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def _duplicate_keys(loader: yaml.SafeLoader, root: yaml.Node) -> list[tuple[Loc, str]]:
    """PyYAML silently keeps the last of two equal keys; a config must not."""
    problems: list[tuple[Loc, str]] = []
    visited: set[int] = set()

    def walk(node: yaml.Node, loc: Loc) -> None:
        if id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = _key(loader, key_node)
                if key is not None:
                    line = key_node.start_mark.line + 1
                    if key in first:
                        problems.append((loc + (key,), f"duplicate key (first on line {first[key]})"))
                    first.setdefault(key, line)
                walk(value_node, loc + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, loc + (i,))

    walk(root, ())
    return problems


def _problems_from(error: ValidationError, root: type[BaseModel]) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    for err in error.errors():
        loc = tuple(err["loc"])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _Problems):
            problems.extend((loc + sub, msg) for sub, msg in cause.problems)
            continue
        if isinstance(cause, _At):
            loc += cause.key
        message = _message(err)
        if err["type"] == "extra_forbidden":
            model = _model_at(root, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1) if model else []
            if hint:
                message += f" (did you mean '{hint[0]}'?)"
        problems.append((loc, message))
    return problems


def _message(err: Any) -> str:
    """Pydantic's wording, cut to the rule."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    fixed = {
        "missing": "required key is missing",
        "extra_forbidden": "unknown key",
        "int_type": "must be a whole number", "int_parsing": "must be a whole number",
        "int_from_float": "must be a whole number",
        "bool_type": "must be true or false", "bool_parsing": "must be true or false",
        "string_type": "must be a string",
        "float_type": "must be a number", "float_parsing": "must be a number",
        "finite_number": "must be a finite number",
        "model_type": "must be a mapping", "model_attributes_type": "must be a mapping",
        "dict_type": "must be a mapping",
        "tuple_type": "must be a list", "list_type": "must be a list",
        "path_type": "must be a file path",
    }
    if kind in fixed:
        return fixed[kind]
    if kind == "literal_error":
        return "must be one of " + ", ".join(re.findall(r"'([^']*)'", ctx.get("expected", "")))
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']}"
    if kind == "greater_than":
        return f"must be more than {ctx['gt']}"
    if kind == "less_than_equal":
        return f"must be at most {ctx['le']}"
    if kind == "less_than":
        return f"must be less than {ctx['lt']}"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"needs at least {n} item{'s' if n != 1 else ''}"
    return re.sub(r"^Value error, ", "", str(err["msg"]))


def _model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The model class that validates the value at pydantic location `loc`."""
    kind: Any = root
    for part in loc:
        kind = _unwrap(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel) and isinstance(part, str):
            field = kind.model_fields.get(part)
            if field is None:
                return None
            kind = field.annotation
        elif get_origin(kind) is tuple and isinstance(part, int):
            kind = get_args(kind)[0]
        elif get_origin(kind) is dict:
            kind = get_args(kind)[1]
        else:
            return None
    kind = _unwrap(kind)
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _unwrap(kind: Any) -> Any:
    while True:
        origin = get_origin(kind)
        if origin is Annotated:
            kind = get_args(kind)[0]
        elif origin in (Union, types.UnionType):
            options = [a for a in get_args(kind) if a is not type(None)]
            models = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
            kind = models[0] if models else options[0]
        else:
            return kind


MAX_ERRORS_SHOWN = 200  # a config's error lines (each is also a log line when a reload fails)


def _error_lines(filename: str, data: Any, lines: dict[Loc, int],
                 problems: list[tuple[Loc, str]]) -> list[str]:
    """`FILE:LINE: key.path: message` for each distinct problem, by line; past
    MAX_ERRORS_SHOWN, one last line says how many more there are."""
    unique: dict[tuple[int, str], None] = {}
    for loc, message in problems:
        loc = _file_loc(loc, data)
        unique[(_line_of(loc, lines), f"{_path(loc)}: {message}")] = None
    rows = sorted(unique, key=lambda row: row[0])  # stable: same line keeps pydantic's order
    shown = [f"{filename}:{line}: {text}" for line, text in rows[:MAX_ERRORS_SHOWN]]
    if len(rows) > MAX_ERRORS_SHOWN:
        shown.append(f"{filename}:{rows[MAX_ERRORS_SHOWN][0]}: (root): {len(rows) - MAX_ERRORS_SHOWN} "
                     f"more error(s) from this line on, not shown (fix the first {MAX_ERRORS_SHOWN} and check again)")
    return shown


def _file_loc(loc: Loc, data: Any) -> Loc:
    """Pydantic's location as a path in the file: drop the steps the file doesn't have.

    Those are the models' own wrapping (an endpoint list is `static`, an endpoint string is
    `{address: ...}`); a last step that names a key the file lacks is a missing key and stays.
    """
    path: list[str | int] = []
    here = data
    for i, part in enumerate(loc):
        if isinstance(here, dict) and part in here:
            path.append(part)
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here):
            path.append(part)
            here = here[part]
        elif isinstance(here, dict) and i == len(loc) - 1 and isinstance(part, str):
            path.append(part)
    return tuple(path)


def _line_of(loc: Loc, lines: dict[Loc, int]) -> int:
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return 1


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _path(loc: Loc) -> str:
    """`("listeners", 0, "routes", 2, "retry")` → `listeners[0].routes[2].retry`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{part!r}]"
    return text or "(root)"


# --------------------------------------------------------------------------------------------
# Summary for `check-config`


def summary(config: Config) -> str:
    """Listeners → routes → clusters in a few lines, then the effective config with every default."""
    out: list[str] = []
    for listener in config.listeners:
        out.append(f"listener {listener.name} on {listener.listen} "
                   f"({listener.transport}/{listener.protocol}, service {listener.service})")
        for i, route in enumerate(listener.routes):
            out.append(f"  route {i}: {_describe_match(route.match)} -> {_describe_targets(route)}"
                       f"{_describe_policy(route)}")
    for cluster in config.clusters:
        wire = (f"{cluster.transport or 'client framing'}/{cluster.protocol or 'client protocol'}")
        out.append(f"cluster {cluster.name}: {_describe_endpoints(cluster.endpoints)} "
                   f"({cluster.load_balancer}, {wire})")
    if config.admin is not None:
        out.append(f"admin on {config.admin.listen}"
                   + (f", health on {config.admin.health_listen}" if config.admin.health_listen else ""))
    if config.metrics_listen is not None:
        out.append(f"metrics on {config.metrics_listen}")
    out.append(f"tracing: {config.tracing.exporter}, sample_ratio {config.tracing.sample_ratio}")
    effective = yaml.safe_dump(config.effective(), sort_keys=False, default_flow_style=False)
    return "\n".join(out) + "\n\n# effective config (every default filled in)\n" + effective


def _describe_match(match: Match | None) -> str:
    if match is None:
        return "every call"
    tests = []
    if match.service is not None:
        tests.append(f"service {match.service}")
    if match.method is not None:
        tests.append(f"method {match.method}")
    for name, header in (match.header or {}).items():
        if header.exact is not None:
            tests.append(f"header {name}={header.exact!r}")
        elif header.regex is not None:
            tests.append(f"header {name}~{header.regex!r}")
        else:
            tests.append(f"header {name} {'present' if header.present else 'absent'}")
    return ("not " if match.invert else "") + " and ".join(tests)


def _describe_targets(route: Route) -> str:
    if route.weighted is None:
        return str(route.cluster)
    return ", ".join(f"{cluster} ({weight})" for cluster, weight in route.targets)


def _describe_policy(route: Route) -> str:
    parts = [f"timeout {format_duration(route.timeout)}" if route.timeout else "no timeout"]
    if route.retry.attempts > 1:
        idempotent = route.retry.idempotent
        which = ("any method" if idempotent is True else "unwritten only" if idempotent is False
                 else " ".join(idempotent))
        parts.append(f"{route.retry.attempts} attempts ({which})")
    return " [" + ", ".join(parts) + "]"


def _describe_endpoints(endpoints: Endpoints) -> str:
    if endpoints.static is not None:
        return ", ".join(str(e.address) + (f" (weight {e.weight})" if e.weight != 1 else "")
                         for e in endpoints.static)
    if endpoints.dns is not None:
        return f"dns {endpoints.dns.name} every {format_duration(endpoints.dns.refresh)}"
    return f"file {endpoints.file}"
