"""Calling through the sidecar from a Python app: a fast generated client that joins the trace.

Owns: building a generated Thrift client that really uses Thrift's C accelerator, the app-side
socket (TCP_NODELAY, timeouts, redial after a broken exchange), the app's CLIENT span per call
with its `encode` / `send` / `wait` / `decode` children, and the W3C trace context sent in
THeader headers so the sidecar's SERVER span (and every hop under it) becomes a child of the
app's call. Leaves to others: what the sidecar does with the headers (`proxy.tracecontext`),
the sidecar's own spans (`proxy.telemetry`), exporting spans (the app's OpenTelemetry SDK).

    from proxy.client import connect
    users = connect(UserService.Client, port=9090, framing="header")
    rows = users.get_users(5499, 0)      # CLIENT "UserService/get_users" + encode/send/wait/decode

Why it is built this way:

* Thrift's C accelerator (`fastbinary`) engages only when the protocol is
  TBinaryProtocolAccelerated / TCompactProtocolAccelerated *and* the read transport is a
  `CReadableTransport`; otherwise the generated code silently falls back to per-field Python
  (here: 10-16x slower decoding a 5,499-user reply; an accelerated protocol over a transport
  that is not C-readable is slower than the pure protocol). `check_accelerated` says why, once.
* Thrift encodes into memory and decodes from memory; this module does the socket I/O. That
  is what lets the phases be timed apart: `decode` starts once the whole reply frame is in
  memory, so the sidecar's and the service's time show as `wait`, never as decoding.
  Unframed (`buffered`) replies carry no length, so their decode pulls the rest of the reply
  from the socket as it needs it; the time it spent blocked there is `sidecar.decode_blocked_ms`.
* One exchange at a time per connection and generated clients never check seqids, so a
  connection whose exchange broke (timeout, EOF, garbage) is closed; the next call dials again.

Span tree of one call (children tile the CLIENT span; built after the fact from timestamps,
only when the CLIENT span is recording):

    CLIENT "{service}/{method}"   the app's call
     ├─ encode                    send_<method>: request (and its framing) serialized into memory
     ├─ send                      request bytes handed to the kernel
     ├─ wait                      request sent → whole reply in memory (first reply bytes if buffered)
     └─ decode                    recv_<method>: the reply deserialized (also for declared exceptions)

Not thread-safe: one client per thread (like a generated Thrift client over one socket).
"""

from __future__ import annotations

import importlib
import io
import select
import socket
import struct
import time
import warnings

from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from thrift.protocol.TBinaryProtocol import TBinaryProtocolAccelerated
from thrift.protocol.TCompactProtocol import TCompactProtocolAccelerated
from thrift.protocol.THeaderProtocol import THeaderProtocol
from thrift.protocol.TMultiplexedProtocol import TMultiplexedProtocol
from thrift.protocol.TProtocol import TProtocolException
from thrift.Thrift import TException
from thrift.transport.THeaderTransport import (HARD_MAX_FRAME_SIZE, THeaderClientType, THeaderSubprotocolID,
                                               THeaderTransport)
from thrift.transport.TTransport import (
    CReadableTransport,
    TBufferedTransport,
    TFramedTransport,
    TTransportBase,
    TTransportException,
)

from proxy import __version__, spans
from proxy.codec.wire import DEFAULT_MAX_FRAME_SIZE
from proxy.sockets import set_nodelay

__all__ = ["AcceleratorWarning", "TracedClient", "check_accelerated", "connect",
           "ENCODE", "SEND", "WAIT", "DECODE", "FRAMINGS", "PROTOCOLS"]

FRAMINGS = ("framed", "buffered", "header")
PROTOCOLS = ("binary", "compact")

# The app-side phase spans (children of the app's CLIENT span). TODO(lead): move these three
# names and two keys into proxy.spans with the hop names.
ENCODE = "encode"
SEND = "send"
WAIT = "wait"
DECODE = "decode"
_PHASES = (ENCODE, SEND, WAIT, DECODE)
ACCELERATED = "sidecar.accelerated"              # on the app's CLIENT span: fastbinary in use
DECODE_BLOCKED_MS = "sidecar.decode_blocked_ms"  # decode: time blocked on the socket (buffered)

_I32 = struct.Struct("!i")
_CHUNK = 256 * 1024       # reads of the rest of an unframed reply
_FIRST_CHUNK = 64 * 1024  # its first read (below malloc's mmap threshold: cheap for small replies)
# THeader replies come back as THeader; framed ones are accepted too (they are length-prefixed).
_HEADER_READ_TYPES = (THeaderClientType.HEADERS, THeaderClientType.FRAMED_BINARY,
                      THeaderClientType.FRAMED_COMPACT)
_RESERVED = frozenset({"client", "close", "call", "accelerated", "framing", "protocol", "service_name",
                       "address", "timeout", "max_frame_size"})  # TracedClient's own attributes


class AcceleratorWarning(RuntimeWarning):
    """Thrift's C accelerator is not in use: (de)serialization runs in pure Python."""


_warned = False  # once per process: the cause is the install or the code, not the call


class _HeaderProtocol(THeaderProtocol):
    """THeaderProtocol whose inner (per-frame) protocol reads strings up to a limit of ours,
    not the library's default: it makes that protocol anew when a frame's protocol id changes."""

    _string_length_limit = None

    def limit_strings(self, limit: int) -> None:
        self._string_length_limit = limit
        self._protocol.string_length_limit = limit

    def _set_protocol(self) -> None:
        super()._set_protocol()
        if self._string_length_limit is not None:
            self._protocol.string_length_limit = self._string_length_limit


def _warn_once(reason: str, stacklevel: int) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"Thrift's C accelerator is not in use: {reason}; (de)serialization runs in "
                  "pure Python (10x slower or worse on large replies)", AcceleratorWarning,
                  stacklevel=stacklevel + 1)


def _fastbinary_missing() -> bool:
    try:
        importlib.import_module("thrift.protocol.fastbinary")
    except ImportError:
        return True
    return False


def _why_not_accelerated(iprot, oprot) -> str | None:
    """Why decoding from iprot / encoding to oprot would not use fastbinary; None when both do."""
    if _fastbinary_missing():
        return ("thrift.protocol.fastbinary cannot be imported (thrift was installed without its "
                "C extension: it needs a compiler and Python headers at install time)")
    if getattr(oprot, "_fast_encode", None) is None:
        return (f"{type(oprot).__name__} does not encode with fastbinary "
                "(use TBinaryProtocolAccelerated or TCompactProtocolAccelerated)")
    if getattr(iprot, "_fast_decode", None) is None:
        return (f"{type(iprot).__name__} does not decode with fastbinary "
                "(use TBinaryProtocolAccelerated or TCompactProtocolAccelerated)")
    if not isinstance(iprot.trans, CReadableTransport):
        return (f"{type(iprot.trans).__name__} is not a CReadableTransport, so generated code "
                "reads field by field in Python (wrap it in TBufferedTransport or TFramedTransport)")
    return None


def check_accelerated(obj) -> bool:
    """True when a generated client (or a protocol) uses Thrift's C accelerator both ways.

    Otherwise warns once per process (AcceleratorWarning, naming the cause) and returns False.
    For apps that build their own Thrift clients; `connect` checks its own (given one of its
    clients, this says what that check found, without a second warning).
    """
    if isinstance(obj, TracedClient):
        return obj.accelerated
    iprot = getattr(obj, "_iprot", obj)
    oprot = getattr(obj, "_oprot", obj)
    reason = _why_not_accelerated(iprot, oprot)
    if reason is not None:
        _warn_once(reason, stacklevel=2)  # the caller of check_accelerated (_warn_once adds its own frame)
    return reason is None


class _Outbox(TTransportBase):
    """Where the framing writes: memory, so encoding is timed apart from sending."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def isOpen(self) -> bool:
        return True

    def write(self, buf) -> None:
        self._parts.append(buf)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class _Inbox(TTransportBase, CReadableTransport):
    """The reply in memory, C-readable. Unframed replies may pull the rest from the socket."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._sock: socket.socket | None = None   # set only while decoding an unframed reply
        self.blocked_ns = 0                       # time spent in recv while decoding
        self.received = 0                         # reply bytes loaded and pulled

    def load(self, data, sock: socket.socket | None = None) -> None:
        self._buf = io.BytesIO(data)
        self._sock = sock
        self.blocked_ns = 0
        self.received = len(data)

    def release(self) -> int:
        """Stop reading from the socket; returns the bytes left unread (a stream out of step)."""
        self._sock = None
        left = len(self._buf.getbuffer()) - self._buf.tell()
        self._buf = io.BytesIO()
        return left

    def isOpen(self) -> bool:
        return True

    def read(self, sz: int) -> bytes:
        ret = self._buf.read(sz)
        if len(ret) < sz and self._sock is not None:
            more = self._pull(sz - len(ret))
            need = sz - len(ret)
            ret += more[:need]
            self._buf = io.BytesIO(more[need:])
        return ret  # short only at the end of an in-memory frame: readAll raises EOFError

    @property
    def cstringio_buf(self):
        return self._buf

    def cstringio_refill(self, partialread, reqlen: int):
        if self._sock is None:
            raise EOFError()  # the frame ended inside a value: fastbinary raises a protocol error
        self._buf = io.BytesIO(bytes(partialread) + self._pull(reqlen - len(partialread)))
        return self._buf

    def _pull(self, n: int) -> bytes:
        """At least n more bytes from the socket (what is there, in large reads)."""
        chunks = []
        got = 0
        t0 = time.perf_counter_ns()
        try:
            while got < n:
                data = self._sock.recv(max(n - got, _CHUNK))
                if not data:
                    raise TTransportException(TTransportException.END_OF_FILE,
                                              "connection closed inside the reply")
                chunks.append(data)
                got += len(data)
        finally:
            self.blocked_ns += time.perf_counter_ns() - t0
            self.received += got
        return b"".join(chunks)


def _still_open(sock: socket.socket) -> bool:
    """An idle connection the peer has not closed (nor sent anything on, unasked): one
    non-blocking peek. A sidecar closes a client connection idle past its `idle_timeout`: the
    next call dials again rather than fail on the closed one."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    if not p.poll(0):
        return True  # nothing to read, no FIN, no reset: open
    try:  # (readable: a peek cannot block; a socket timeout would make a plain recv wait first)
        sock.recv(1, socket.MSG_PEEK)
    except OSError:
        pass
    return False  # closed (b"", or reset), or bytes nobody asked for: out of step


def _is_reply(e: BaseException) -> bool:
    """A declared exception or a TApplicationException: the reply itself, decoded."""
    return isinstance(e, TException) and not isinstance(e, (TTransportException, TProtocolException))


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise TTransportException(TTransportException.END_OF_FILE,
                                      "connection closed before the whole reply arrived")
        got += k


class TracedClient:
    """A generated Thrift client's methods, each call one CLIENT span; see `connect`.

    `client` is the generated client itself (it encodes to and decodes from memory only: a call
    made on it never reaches the socket); `accelerated` says whether fastbinary is in use. A
    method whose name is one of this class's own attributes (`close`, `timeout`, `call`, ...) or
    starts with `_` is not set as an attribute: `call(name, *args)` makes it, as any other.
    """

    def __init__(self, client_class, host: str, port: int, framing: str, protocol: str,
                 service: str | None, timeout: float | None, tracer, service_name: str | None,
                 max_frame_size: int) -> None:
        if framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {', '.join(FRAMINGS)}, not {framing!r}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        if timeout is not None and not timeout > 0:  # (0 would make the socket non-blocking)
            raise ValueError(f"timeout must be a number of seconds above 0, or None to wait forever, not {timeout!r}")
        self.framing = framing
        self.protocol = protocol
        self.address = (host, port)
        self.timeout = timeout
        self.max_frame_size = max_frame_size
        self._sock: socket.socket | None = None
        self._outbox = _Outbox()
        self._inbox = _Inbox()
        self._header_out: THeaderTransport | None = None

        compact = protocol == "compact"
        # max_frame_size bounds every part the Thrift library bounds on its own too (a THeader
        # frame either way, one string or binary value): else its defaults (16,384,000 bytes)
        # refused what the caller allowed
        if framing == "header":
            sub = THeaderSubprotocolID.COMPACT if compact else THeaderSubprotocolID.BINARY
            self._header_out = THeaderTransport(self._outbox, (THeaderClientType.HEADERS,), sub)
            oprot = THeaderProtocol(self._header_out, (THeaderClientType.HEADERS,), sub)
            iprot = _HeaderProtocol(self._inbox, _HEADER_READ_TYPES, sub)
            for p in (oprot, iprot):  # (frames both ways; strings are limited only as read)
                p.trans.set_max_frame_size(min(max_frame_size, HARD_MAX_FRAME_SIZE - 1))
            iprot.limit_strings(max_frame_size)
        else:
            accelerated = TCompactProtocolAccelerated if compact else TBinaryProtocolAccelerated
            framer = TFramedTransport if framing == "framed" else TBufferedTransport
            oprot = accelerated(framer(self._outbox))
            iprot = accelerated(self._inbox, string_length_limit=max_frame_size)
        if service is not None:
            oprot = TMultiplexedProtocol(oprot, service)
        self.client = client_class(iprot, oprot)
        reason = _why_not_accelerated(iprot, oprot)
        self.accelerated = reason is None
        if reason is not None:
            _warn_once(reason, stacklevel=3)  # the caller of connect (_warn_once adds its own frame)

        self.service_name = service_name or service or client_class.__module__.rsplit(".", 1)[-1]
        self._tracer = tracer if tracer is not None else trace.get_tracer(
            spans.INSTRUMENTATION_SCOPE + ".client", __version__, schema_url=spans.SCHEMA_URL)
        self._methods = {}
        for name in sorted(n[5:] for n in dir(client_class) if n.startswith("send_")):
            call = getattr(client_class, name, None)
            if not callable(call):
                continue
            method = self._methods[name] = self._method(name, call, getattr(client_class, "send_" + name),
                                                        getattr(client_class, "recv_" + name, None))
            if name not in _RESERVED and not name.startswith("_"):
                setattr(self, name, method)
        self._connect()

    def call(self, method: str, *args, **kwargs):
        """Call the service's method named `method`, as its attribute would: the one way to
        call a method whose name this class uses itself (e.g. a service's own `close`)."""
        try:
            run = self._methods[method]
        except KeyError:
            raise AttributeError(f"{self.service_name} has no method {method!r}") from None
        return run(*args, **kwargs)

    # -- the connection ------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, self.timeout)
        except OSError as e:
            raise TTransportException(TTransportException.NOT_OPEN,
                                      f"could not connect to {self.address[0]}:{self.address[1]}: {e}") from e
        set_nodelay(sock)
        self._sock = sock
        return sock

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> "TracedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one call --------------------------------------------------------------------------------

    def _method(self, name: str, call, send, recv):
        span_name = spans.call_span_name(self.service_name, name)
        attributes = {
            spans.RPC_SYSTEM: spans.RPC_SYSTEM_VALUE, spans.RPC_SERVICE: self.service_name,
            spans.RPC_METHOD: name, spans.SERVER_ADDRESS: self.address[0],
            spans.SERVER_PORT: self.address[1], ACCELERATED: self.accelerated,
        }

        def traced(*args, **kwargs):
            start = time.time_ns()
            span = self._tracer.start_span(span_name, kind=SpanKind.CLIENT, attributes=attributes,
                                           start_time=start)
            marks = [start]
            # attach/detach, not `use_span`: contextlib sets __traceback__ on the exception it
            # re-raises, and generated Thrift exceptions are immutable (TypeError)
            token = context.attach(set_span_in_context(span))
            try:
                return self._exchange(span, send, recv, args, kwargs, marks)
            except Exception as e:
                if span.is_recording():
                    span.set_attribute(spans.ERROR_TYPE, type(e).__qualname__)
                    span.record_exception(e)
                    span.set_status(Status(StatusCode.ERROR, f"{type(e).__qualname__}: {e}"))
                raise
            finally:
                context.detach(token)
                span.end(end_time=marks[-1] if len(marks) > 1 else None)

        traced.__name__ = traced.__qualname__ = name
        traced.__doc__ = call.__doc__
        return traced

    def _exchange(self, span, send, recv, args, kwargs, marks: list[int]):
        """encode → send → wait → decode; `marks` gets each phase's end time."""
        failed = None  # the failed phase's error (a declared exception is a decoded reply, not one)
        request = reply_size = None
        try:
            if self._header_out is not None:
                self._inject(span)
            send(self.client, *args, **kwargs)
            request = self._outbox.take()
            marks.append(time.time_ns())                                        # encode
            sock = self._sock
            if sock is None or not _still_open(sock):  # (the sidecar may have closed it idle)
                self.close()
                sock = self._connect()
            sock.sendall(request)
            marks.append(time.time_ns())                                        # send
            if recv is None:  # oneway: nothing comes back
                return None
            reply_size = self._receive(sock)
            marks.append(time.time_ns())                                        # wait
            try:
                return recv(self.client)
            finally:
                marks.append(time.time_ns())                                    # decode
                if self._inbox.release():
                    self.close()  # bytes after the reply: the stream is out of step
        except Exception as e:
            if len(marks) <= len(_PHASES) or not _is_reply(e):
                failed = e
            if len(marks) <= len(_PHASES):
                marks.append(time.time_ns())  # the failed phase ends now
            err = self._after_failure(e, len(marks) - 2)
            if err is e:
                raise
            raise err from e
        except BaseException:
            # Interrupted (KeyboardInterrupt, a gevent or eventlet Timeout) in any phase: the
            # framing may hold half a request, the socket a reply still coming: start afresh,
            # or the next call would read this one's reply.
            self._after_failure(RuntimeError("interrupted"), 0)
            self.close()
            raise
        finally:
            if span.is_recording():
                self._record(span, marks, failed, request, reply_size)

    def _after_failure(self, e: Exception, phase: int) -> Exception:
        """Leave the client usable after a failed phase; the exception to raise."""
        if phase == 0:  # encoding failed half-way: drop what the framing holds
            try:
                self.client._oprot.trans.flush()
            except Exception:  # noqa: BLE001 - best effort; the original error is what matters
                pass
            self._outbox.take()
            return e
        if _is_reply(e):
            return e
        self.close()  # the exchange broke: the next call dials again
        if _PHASES[phase] == DECODE and not isinstance(e, TException):
            # the reply's bytes are not what the method's reply should be: fastbinary and the
            # generated code say so with bare EOFError, ValueError, OverflowError ...
            return TProtocolException(TProtocolException.INVALID_DATA,
                                      f"{DECODE}: malformed reply: {type(e).__name__}" + (f": {e}" if str(e) else ""))
        if isinstance(e, OSError):
            kind = (TTransportException.TIMED_OUT if isinstance(e, TimeoutError) else
                    TTransportException.END_OF_FILE if isinstance(e, ConnectionError) else
                    TTransportException.UNKNOWN)
            return TTransportException(kind, f"{_PHASES[phase]}: {e}")
        return e

    def _inject(self, span) -> None:
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return  # no SDK configured: nothing to join
        out = self._header_out
        out.set_header(b"traceparent",
                       f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}".encode())
        if ctx.trace_state:
            out.set_header(b"tracestate", ctx.trace_state.to_header().encode())

    def _receive(self, sock: socket.socket) -> int:
        """Block until the reply is in memory (its first bytes if unframed); returns its size so far."""
        if self.framing == "buffered":
            data = sock.recv(_FIRST_CHUNK)
            if not data:
                raise TTransportException(TTransportException.END_OF_FILE,
                                          "connection closed before the reply")
            self._inbox.load(data, sock)
            return len(data)
        head = bytearray(4)
        _recv_into(sock, memoryview(head))
        (n,) = _I32.unpack(head)
        if n < 0 or n > self.max_frame_size:
            raise TTransportException(TTransportException.SIZE_LIMIT,
                                      f"reply frame of {n} bytes (max_frame_size {self.max_frame_size})")
        if self.framing == "header":  # THeaderTransport reads the length prefix itself
            frame = bytearray(4 + n)
            frame[:4] = head
            _recv_into(sock, memoryview(frame)[4:])
        else:
            frame = bytearray(n)
            _recv_into(sock, memoryview(frame))
        self._inbox.load(frame)
        return 4 + n

    def _record(self, span, marks: list[int], failed, request, reply_size) -> None:
        """The phase spans, from the timestamps taken during the call."""
        if request is not None:
            span.set_attribute(spans.REQUEST_SIZE, len(request))
        if reply_size is not None:  # unframed: what the decode pulled counts too
            span.set_attribute(spans.REPLY_SIZE,
                               self._inbox.received if self.framing == "buffered" else reply_size)
        blocked_ms = self._inbox.blocked_ns / 1e6
        ctx = set_span_in_context(span)
        last = len(marks) - 2
        for i in range(len(marks) - 1):
            child = self._tracer.start_span(_PHASES[i], context=ctx, start_time=marks[i])
            if _PHASES[i] == DECODE and self.framing == "buffered":
                child.set_attribute(DECODE_BLOCKED_MS, blocked_ms)
            if i == last and failed is not None:
                child.set_status(Status(StatusCode.ERROR, f"{type(failed).__qualname__}: {failed}"))
            child.end(end_time=marks[i + 1])


def connect(client_class, host: str = "127.0.0.1", port: int = 9090, *, framing: str = "framed",
            protocol: str = "binary", service: str | None = None, timeout: float | None = 30.0,
            tracer=None, service_name: str | None = None,
            max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> TracedClient:
    """A traced, accelerated client for `client_class` (a generated `Svc.Client`) via the sidecar.

    framing: framed | buffered | header (header also sends the call's W3C trace context, so
    the sidecar's spans join the app's trace; the others carry no headers). protocol: binary |
    compact. service: the multiplexed service name (`Svc:method` on the wire), if any.
    timeout: seconds for connecting and for each blocking socket operation (None = wait
    forever). tracer: an OpenTelemetry tracer (default: the global provider's).
    service_name: the `{service}` of span names (default: `service`, else the generated
    module's name, e.g. `UserService`); match the sidecar listener's `service`.
    Connects at once (raises TTransportException NOT_OPEN); after a broken exchange the next
    call dials again. Warns once per process (AcceleratorWarning) if fastbinary is not in use.
    """
    return TracedClient(client_class, host, port, framing, protocol, service, timeout, tracer,
                        service_name, max_frame_size)
