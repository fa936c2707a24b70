"""OTLP trace protobuf, written directly: the bytes of an `ExportTraceServiceRequest`.

Owns: the protobuf wire encoding (varints, length-delimited fields, fixed64) of the few OTLP
messages a span export needs — `ExportTraceServiceRequest → ResourceSpans → ScopeSpans → Span`
(with `Status`, `KeyValue`, `AnyValue`, `Resource`, `InstrumentationScope`). Sans-IO: bytes in
memory, no clock, no sockets. Leaves to others: which spans a call has (`proxy.telemetry`),
sending the bytes (`proxy.otlp_transport`).

Why by hand: the SDK's OTLP path (ReadableSpans, then `encode_spans` building upb protobuf
objects one field at a time) costs ~215 µs per typical 8-span call here (~15 µs of spans, ~200
of encoding), in the export thread, which holds the GIL and so takes that time from the event
loop: at 100% sampling the proxy kept ~22% of its tracing-off throughput. Written straight from
the call, the same request costs ~25 µs per call (~2.3 µs per span, the rest is deciding the
spans). The generated pb2 classes, used directly, are no way out: one 13-attribute SERVER span
costs ~32 µs built as `Span(attributes=[KeyValue(...)])` + `SerializeToString` (every KeyValue
and AnyValue is a Python-built upb object), ~4.6 µs written here. Only what our spans need is
written (no events, no links; dropped counts are always 0), and `tests/test_telemetry_otlp.py`
checks that the bytes parse into the very message the SDK builds.

    encoder = Encoder(resource_attrs, resource_schema_url, scope_name, scope_version, scope_schema_url)
    trace = trace_prefix(trace_id, trace_state)
    chunk = encoder.span(trace, span_id, parent_id, remote, name, KIND_SERVER, t0, t1, attrs, None)
    data = encoder.request([chunk, ...])   # one ResourceSpans, one ScopeSpans, the spans in order
    chunk = encoder.spans(trace, plan)     # a call's whole plan (proxy.telemetry) at once

`Encoder.spans` runs the compiled twin `proxy._otlp.encode_spans` when it was built (SPANS_IMPL;
THRIFT_SIDECAR_PURE_PYTHON=1 forces Python): the same bytes (tests/test_otlp_compiled.py), ~1 µs
per span instead of ~3. What it does not handle (attribute values other than str, bool, int and
float, and anything malformed) it leaves to `span`, for the whole call.

A span is written as its `ScopeSpans.spans` field (tag, length, body), so the spans of many
calls are joined as they are. Field numbers are from opentelemetry-proto `trace/v1/trace.proto`,
`common/v1/common.proto` and `resource/v1/resource.proto`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence

from proxy.codec.twins import load, pure_forced

log = logging.getLogger(__name__)

__all__ = ["Encoder", "trace_prefix", "varint", "KIND_INTERNAL", "KIND_SERVER", "KIND_CLIENT", "STATUS_ERROR",
           "SPANS_IMPL"]

_otlp = None if pure_forced() else load("proxy._otlp")
SPANS_IMPL = "c" if _otlp is not None else "python"  # which twin Encoder.spans runs
_encode_spans = _otlp.encode_spans if _otlp is not None else None

# Span.kind (OTLP counts SPAN_KIND_UNSPECIFIED as 0)
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_ERROR = 2  # Status.code STATUS_CODE_ERROR (UNSET is 0, OK is 1)

_HAS_IS_REMOTE = 0x100  # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200      # SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK

_U64 = 0xFFFF_FFFF_FFFF_FFFF
_ONE_BYTE = [bytes((i,)) for i in range(128)]
_ID = struct.Struct(">BBQ")             # Span.span_id (2), 8 bytes
_IDS = struct.Struct(">BBQBBQ")         # span_id (2) and parent_span_id (4)
_KIND_TIMES = struct.Struct("<BBBQBQ")  # kind (6), start_time_unix_nano (7), end_time_unix_nano (8)
_DOUBLE = struct.Struct("<Bd")          # AnyValue.double_value (4)
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE)  # Span.flags (16), fixed32
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE)
_STATUS_UNSET = b"\x7a\x00"  # Span.status (15) present and empty, as the SDK always sets it
_TAIL = {False: _STATUS_UNSET + _FLAGS_LOCAL, True: _STATUS_UNSET + _FLAGS_REMOTE}


def varint(n: int) -> bytes:
    """An unsigned varint; a negative int64 as its 64-bit two's complement (10 bytes)."""
    if 0 <= n < 0x4000:
        return _ONE_BYTE[n] if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7))
    n &= _U64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (tag < 128: field number < 16)."""
    n = len(payload)
    return (bytes((tag, n)) if n < 128 else bytes((tag,)) + varint(n)) + payload


def _any_value(value) -> bytes | None:
    """An AnyValue message body; None for a type the SDK's encoder rejects (it skips those)."""
    if value is None:
        return b""
    if value is True:
        return b"\x10\x01"
    if value is False:
        return b"\x10\x00"
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return _DOUBLE.pack(0x21, value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        items = []
        for v in value:
            body = _any_value(v)
            if body is None:
                return None
            items.append(_field(0x0A, body))
        return _field(0x2A, b"".join(items))   # array_value: ArrayValue.values (1)
    if isinstance(value, Mapping):
        kvs = []
        for k, v in value.items():
            kv = _key_value(str(k), v)
            if kv is None:
                return None
            kvs.append(_field(0x0A, kv))
        return _field(0x32, b"".join(kvs))     # kvlist_value: KeyValueList.values (1)
    return None


def _key_value(key: str, value) -> bytes | None:
    body = _any_value(value)
    if body is None:
        return None
    return _field(0x0A, key.encode()) + _field(0x12, body)


def attributes(attrs: Mapping | None, tag: int) -> bytes:
    """Repeated KeyValue fields with `tag` (Span 9: 0x4A, Resource 1: 0x0A, Scope 3: 0x1A)."""
    if not attrs:
        return b""
    out = []
    for k, v in attrs.items():
        kv = _key_value(k, v)
        if kv is None:
            log.warning("span attribute %s: unsupported value type %s, skipped", k, type(v).__name__)
            continue
        out.append(_field(tag, kv))
    return b"".join(out)


def trace_prefix(trace_id: int, trace_state: str | None = None) -> bytes:
    """The fields every span of one trace starts with: trace_id (1), and trace_state (3) when set.

    (trace_state belongs after span_id (2) in field order; parsers take fields in any order, so
    it is written once here with the trace id. All other fields go in field-number order.)
    """
    prefix = b"\x0a\x10" + trace_id.to_bytes(16, "big")
    if trace_state:
        prefix += _field(0x1A, trace_state.encode())
    return prefix


class Encoder:
    """Spans of one resource and instrumentation scope, and the request around them.

    The resource and scope are encoded once. The hot part is span attributes and names: a
    string-valued pair ("rpc.system": "apache_thrift", "sidecar.outcome": "success", ...) and a
    span name recur in every call, so their encoded fields are kept (bounded: values such as
    error texts vary); for other values the field's head (tag, length, key, value tag) is kept
    per key and value size, and only the value is written. One thread uses it (the export worker).
    """

    CACHE_MAX = 4096  # entries per cache

    def __init__(self, resource_attrs: Mapping | None, resource_schema_url: str | None,
                 scope_name: str | None, scope_version: str | None, scope_schema_url: str | None,
                 scope_attrs: Mapping | None = None) -> None:
        # ScopeSpans.scope (1): InstrumentationScope name (1), version (2), attributes (3)
        scope = b""
        if scope_name:
            scope += _field(0x0A, scope_name.encode())
        if scope_version:
            scope += _field(0x12, scope_version.encode())
        scope += attributes(scope_attrs, 0x1A)
        self._scope = _field(0x0A, scope)
        # ScopeSpans.schema_url (3), ResourceSpans.schema_url (3)
        self._scope_schema = _field(0x1A, scope_schema_url.encode()) if scope_schema_url else b""
        # ResourceSpans.resource (1): Resource.attributes (1)
        self._resource = _field(0x0A, attributes(resource_attrs, 0x0A))
        self._resource_schema = _field(0x1A, resource_schema_url.encode()) if resource_schema_url else b""
        self._str_attrs: dict[tuple[str, str], bytes] = {}
        self._names: dict[str, bytes] = {}
        self._heads: dict[str, tuple] = {}

    def request(self, spans: Sequence[bytes]) -> bytes:
        """ExportTraceServiceRequest{resource_spans: [{resource, scope_spans: [{scope, spans}]}]}.

        `spans` from `span` (any number of calls, joined as they are). One copy of the spans (a
        batch is ~300 KB): the lengths are summed, not measured on intermediate joins.
        """
        scope_spans = len(self._scope) + sum(map(len, spans)) + len(self._scope_schema)
        ss_head = b"\x12" + varint(scope_spans)
        resource_spans = len(self._resource) + len(ss_head) + scope_spans + len(self._resource_schema)
        return b"".join((b"\x0a", varint(resource_spans), self._resource, ss_head, self._scope, *spans,
                         self._scope_schema, self._resource_schema))

    def spans(self, trace: bytes, plan: list) -> bytes:
        """The spans of `plan` (`(name, span_id, parent_id, remote, kind, t0, t1, attrs, error)`
        tuples, as `span` takes them) as `ScopeSpans.spans` fields, joined."""
        if _encode_spans is not None:
            data = _encode_spans(trace, plan)
            if data is not None:
                return data
        return self.pure_spans(trace, plan)

    def pure_spans(self, trace: bytes, plan: list) -> bytes:
        """`spans` in Python: the reference for the compiled twin."""
        encode = self.span
        return b"".join([encode(trace, span_id, parent_id, remote, name, kind, t0, t1, attrs, error)
                         for name, span_id, parent_id, remote, kind, t0, t1, attrs, error in plan])

    def span(self, trace: bytes, span_id: int, parent_id: int, remote: bool, name: str, kind: int,
             t0: int, t1: int, attrs: Mapping | None, error: str | None) -> bytes:
        """One span as a `ScopeSpans.spans` field.

        `trace` from `trace_prefix`; `parent_id` 0 = a root; `remote`: the parent is in another
        process; times in epoch ns; `error` None = status UNSET, else status ERROR with that
        message.
        """
        name_field = self._names.get(name)
        if name_field is None:
            name_field = _field(0x2A, name.encode())
            if len(self._names) < self.CACHE_MAX:
                self._names[name] = name_field
        parts = [trace, _IDS.pack(0x12, 8, span_id, 0x22, 8, parent_id) if parent_id else _ID.pack(0x12, 8, span_id),
                 name_field, _KIND_TIMES.pack(0x30, kind, 0x39, t0, 0x41, t1)]
        if attrs:
            self._attributes(attrs, parts)
        if error is None:
            parts.append(_TAIL[remote])
        else:
            status = _field(0x12, error.encode()) if error else b""
            parts.append(_field(0x7A, status + b"\x18\x02"))
            parts.append(_FLAGS_REMOTE if remote else _FLAGS_LOCAL)
        body = b"".join(parts)
        n = len(body)
        return (bytes((0x12, n)) if n < 128 else b"\x12" + varint(n)) + body

    def _attributes(self, attrs: Mapping, out: list) -> None:
        """Append the `Span.attributes` (9) fields of `attrs` to `out`, in pieces."""
        append = out.append
        str_attrs, all_heads = self._str_attrs, self._heads
        for k, v in attrs.items():
            t = type(v)
            if t is str:
                field = str_attrs.get((k, v))
                if field is None:
                    field = _field(0x4A, _field(0x0A, k.encode()) + _field(0x12, _field(0x0A, v.encode())))
                    if len(str_attrs) < self.CACHE_MAX:
                        str_attrs[(k, v)] = field
                append(field)
                continue
            heads = all_heads.get(k) or self._key_heads(k)
            if t is int:
                if 0 <= v < 0x80:
                    value = _ONE_BYTE[v]
                elif 0 <= v < 0x4000:
                    value = bytes(((v & 0x7F) | 0x80, v >> 7))
                else:
                    value = varint(v)
                head = heads[0][len(value)]
                if head is not None:
                    append(head)
                    append(value)
                    continue
            elif t is bool:
                append(heads[2] if v else heads[3])
                continue
            elif t is float and heads[1] is not None:
                append(heads[1])
                append(_DOUBLE.pack(0x21, v))
                continue
            kv = _key_value(k, v)
            if kv is None:
                log.warning("span attribute %s: unsupported value type %s, skipped", k, t.__name__)
                continue
            append(_field(0x4A, kv))

    def _key_heads(self, k: str) -> tuple:
        """(heads of an int attribute by varint length, head of a double, whole bool fields)."""
        key = _field(0x0A, k.encode())
        n = len(key)
        ints = [None] * 11
        if n + 13 < 128:
            for size in range(1, 11):  # KeyValue{key, value: AnyValue{int_value: varint of `size` bytes}}
                ints[size] = bytes((0x4A, n + 3 + size)) + key + bytes((0x12, 1 + size, 0x18))
        double = bytes((0x4A, n + 11)) + key + b"\x12\x09" if n + 11 < 128 else None  # + 0x21, 8 bytes
        true = _field(0x4A, key + _field(0x12, b"\x10\x01"))
        false = _field(0x4A, key + _field(0x12, b"\x10\x00"))
        heads = (ints, double, true, false)
        if len(self._heads) < self.CACHE_MAX:
            self._heads[k] = heads
        return heads
