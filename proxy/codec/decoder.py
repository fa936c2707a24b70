"""Sans-IO message decoder: `feed(bytes)`, then `next_message()` → Message or None.

No sockets, clock, loop or logging here. One decoder per connection direction.
Framing and protocol are fixed by config or detected from the first message
and then kept for the connection.

    framed         [len:i32][message]
    header         [len:i32][0x0FFF ...header block...][payload]
    framed_header  [len:i32][len:i32][0x0FFF ...][payload]   (THeader inside a framed frame)
    buffered       [message]      end found by StructScanner, resuming across reads

`max_frame_size` counts the whole frame after its length prefix and is checked
from the prefix, before anything is buffered. An unframed message longer than
it is refused as soon as the scan passes it (or a string's length says it will);
nothing past the limit is looked at, so what is refused, and why, never depends
on how the bytes were cut into reads (tests/test_codec_fuzz.py).

`pending_head()` reads the head of a message still arriving, to answer one that
never completes (request_read_timeout, EOF) with the client's seqid.

`unframed_head()` and `detach_unframed()` let a large unframed message stream: the
first reads its head and first result field once they are here, the second hands the
message's bytes so far and its scan over to a `proxy.codec.stream.UnframedStream`,
which finds its end in the reads that follow without keeping them.

`pending_frame()` and `detach_frame()` let a large framed request stream upstream as it
arrives (a request over its route's `retry_buffer`): the first reads its head and whole size
once they are here, the second hands its bytes so far over and leaves the decoder empty; the
caller then passes on the rest of the frame itself.

`take(data)` is the hot path's shortcut: one read that is exactly one strict-binary
framed message, nothing buffered: the same Message `feed` + `next_message` would give,
with no buffering (`proxy.codec.message.take_framed`, compiled when it was built). Anything
else returns None and changes nothing (tests/test_codec_take.py checks both paths agree on
any input).
"""

from __future__ import annotations

import struct

from proxy.codec.errors import Head, ProtocolError
from proxy.codec.heads import MAX_NAME_LENGTH, SET_LISTENER_PROTOCOL, SET_LISTENER_TRANSPORT, peek_result_field, read_head
from proxy.codec.message import Message, take_framed
from proxy.codec.scan import StructScanner, struct_end
from proxy.codec.stream import PAST_FRAME_END, FrameBody, UnframedStream, bytes_after_struct
from proxy.codec.theader import INFLATE_PREFIX, inflate, inflate_all, parse_header_block
from proxy.codec.wire import (
    COMPACT_PROTOCOL_ID,
    COMPACT_VERSION,
    COMPACT_VERSION_MASK,
    DEFAULT_MAX_FRAME_SIZE,
    THEADER_FIXED_SIZE,
    THEADER_MAGIC,
    F_FRAMED,
    Framing,
    MessageType,
    Protocol,
)

_I32 = struct.Struct("!i")
_U16 = struct.Struct("!H")

# Compact the buffer once this many consumed bytes sit in front of it.
_COMPACT_AT = 64 * 1024
# A frame at least this long that a read leaves incomplete is gathered as a list of the reads'
# bytes objects and joined once complete: one copy, where appending to the bytearray and then
# copying the frame out costs two or more (and the bytearray's regrowth).
_PARTS_MIN = 16 * 1024
_HEAD_BYTES = 64  # ... when its first read holds this much (pending_head reads the head from it)
# Bytes that always hold a result struct's first field header (compact: 1 + a 10-byte varint).
_FIELD_HEAD_MAX = 11
# A frame's length and the longest message head read_head takes (strict binary: version, name
# length, name, seqid; compact's is shorter).
_HEAD_MAX = 4 + 4 + 4 + MAX_NAME_LENGTH + 4


def _head_of_bad(buf, start: int, end: int, protocol: Protocol, framing: Framing) -> Head | None:
    """The head of a message refused (best effort), to address the answer: read with any
    message type (an invalid one is answered as a CALL), None if no head can be read. Where
    strict binary belongs, an unversioned head is read too (its client hears why, with its seqid)."""
    try:
        r = read_head(buf, start, end, protocol, any_type=True)
    except ProtocolError:
        r = None
        if protocol is Protocol.BINARY:  # an unversioned head where a strict one belongs
            r = _unversioned_head(buf, start, end)
    if r is None:
        return None
    mtype = r[1] if MessageType.CALL <= r[1] <= MessageType.ONEWAY else MessageType.CALL
    return Head(r[0], mtype, r[2], framing, protocol)


class Decoder:
    """Turns a byte stream into Messages.

    framing/protocol None = detect from the first message. Framing HEADER also
    accepts THeader nested in a framed frame (config says just "header"): the
    first message decides, and `framing` becomes FRAMED_HEADER if so.
    `scanner_factory` builds the unframed-message scanner: by default `proxy.codec.scan.StructScanner`,
    the compiled one when it was built (else pure Python; see proxy.codec.scan.SCANNER_IMPL).

    `whole_body` (the listener's requests): a framed or THeader message's struct must end
    exactly where its frame (payload) ends. An upstream's transport reads what is left of a
    frame as the next call: a second message hidden in one frame would run unasked, and its
    reply, on a pooled connection, would reach another client as the answer to its call. The
    scan skips values without decoding them (~0.1 µs for a small request, compiled); a zlib
    THeader payload is inflated whole for it (up to `max_frame_size`, as its upstream would),
    and a frame that streams is checked as it passes (`frame_body`).
    """

    def __init__(self, framing: Framing | None = None, protocol: Protocol | None = None,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, scanner_factory=None,
                 whole_body: bool = False) -> None:
        self.framing = framing
        self.protocol = protocol
        self.max_frame_size = max_frame_size
        self.whole_body = whole_body
        self._scanner_factory = scanner_factory or StructScanner
        # a whole scan in one call (no scanner object) unless a factory was chosen (tests)
        self._struct_end = struct_end if scanner_factory is None else self._struct_end_by_factory
        self._whole: bytes | None = None  # a fed bytes object not yet copied into _buf
        self._parts: list | None = None   # the reads of a large frame still arriving (_PARTS_MIN)
        self._parts_have = 0               # their bytes
        self._parts_need = 0               # the whole frame's bytes, length prefix included
        self._head_retry = 0               # pending_frame: its bytes when a cut head is read again
        self._buf = bytearray()
        self._off = 0
        self._scanner = None               # StructScanner of the unframed message in progress
        self._head = None                  # its head (name, type, seqid, body)
        self.examined = 0                  # bytes looked at by unframed scans (tests bound it)
        self._nesting_open = framing is Framing.HEADER  # HEADER or FRAMED_HEADER: not yet known

    # -- input ----------------------------------------------------------------

    def feed(self, data) -> None:
        if not data:
            return
        parts = self._parts
        if parts is not None:  # a large frame is arriving: keep the read as it is
            missing = self._parts_need - self._parts_have
            if not missing:
                self._buf += data
                return
            if len(data) <= missing:
                parts.append(bytes(data))
                self._parts_have += len(data)
                return
            parts.append(bytes(data[:missing]))
            self._parts_have += missing
            data = data[missing:]  # the next messages: buffered behind the frame as usual
            self._buf += data
            return
        if self._whole is None and self._off == len(self._buf):
            if self._buf:
                self._buf.clear()
                self._off = 0
            if isinstance(data, bytes):
                self._whole = data
                return
        if self._whole is not None:
            self._buf += self._whole
            self._whole = None
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as messages (a started message)."""
        n = self._parts_have if self._parts is not None else 0
        if self._whole is not None:
            return n + len(self._whole)
        return n + len(self._buf) - self._off

    def eof(self) -> None:
        """The peer closed its side: raise if a message was left half-sent."""
        n = self.buffered
        if n:
            raise ProtocolError(f"bad request: connection closed inside a message ({n} bytes unframed)",
                                head=self.pending_head())

    def pending_head(self) -> Head | None:
        """The head of the message still arriving, if its bytes are here (None otherwise).

        For answering a message that never completes (a read timeout, EOF) with the
        client's seqid. Changes nothing: the message is still read as usual.
        """
        if self._parts is not None:
            buf, off = self._parts[0], 0  # the frame's first read: its head, if any head is here
        elif self._whole is not None:
            buf, off = self._whole, 0
        else:
            buf, off = self._buf, self._off
        end = len(buf)
        if end - off < 2:
            return None
        framing = self.framing
        if framing is Framing.BUFFERED and self._head is not None:
            name, mtype, seqid, _ = self._head
            return Head(name, mtype, seqid, framing, self.protocol)
        b0, b1 = buf[off], buf[off + 1]
        unframed = (b0 == 0x80 and b1 == 0x01) or (
            b0 == COMPACT_PROTOCOL_ID and (b1 & COMPACT_VERSION_MASK) == COMPACT_VERSION)
        if framing is Framing.BUFFERED or (framing is None and unframed):
            protocol = self.protocol or (_sniff_protocol(buf, off) if unframed else None)
            if protocol is None:
                return None
            try:
                r = read_head(buf, off, end, protocol)
            except ProtocolError:
                return None
            return None if r is None else Head(r[0], r[1], r[2], Framing.BUFFERED, protocol)
        if end - off < 6:
            return None
        if framing is None or (framing is Framing.HEADER and self._nesting_open):
            if _U16.unpack_from(buf, off + 4)[0] == THEADER_MAGIC:
                framing = Framing.HEADER
            elif end - off >= 10 and _U16.unpack_from(buf, off + 8)[0] == THEADER_MAGIC:
                framing = Framing.FRAMED_HEADER
            elif framing is None:
                framing = Framing.FRAMED
        return self._peek_head(buf, off + 4, end, framing)

    def unframed_head(self) -> tuple[str, int, int, int | None] | None:
        """(name, type, seqid, first result field) of the unframed message being scanned.

        None until its head and its body's first field header are here. The field is a
        REPLY's first result field id (`heads.peek_result_field`: None = STOP), else None.
        For deciding whether a large reply streams. Changes nothing.
        """
        head = self._head
        if head is None:
            return None
        name, mtype, seqid, body = head
        if self._whole is not None:  # (the read it began in, scanned where it is: _buf is empty)
            buf = self._whole
        else:
            buf = self._buf
            body += self._off
        if len(buf) - body < _FIELD_HEAD_MAX:
            return None
        field = peek_result_field(buf, body, len(buf), self.protocol) if mtype == MessageType.REPLY else None
        return name, mtype, seqid, field

    def detach_unframed(self) -> tuple[bytes | bytearray, UnframedStream]:
        """Hand the unframed message being scanned over, to pass it on as it arrives.

        Returns its bytes so far (the caller's now: nothing here touches them again; the
        read itself, uncopied, when the message began in the one read held) and an
        `UnframedStream` that goes on with the scan in the reads that follow, under the same
        max_frame_size. The decoder is left empty, as if the message had been returned.
        Only after `unframed_head()` gave a head (the scan has begun).
        """
        scanner = self._scanner
        if scanner is None:
            raise RuntimeError("detach_unframed: no unframed message is being scanned")
        whole = self._whole
        if whole is not None:
            self._whole = None
            self._head = None
            self._scanner = None
            return whole, UnframedStream(scanner, whole, self.max_frame_size)
        buf, off = self._buf, self._off
        if off:
            del buf[:off]
            scanner.pos -= off
        self._buf = bytearray()
        self._off = 0
        self._head = None
        self._scanner = None
        return buf, UnframedStream(scanner, buf, self.max_frame_size)

    def frame_body(self, head: Message, total: int) -> FrameBody | None:
        """For a frame `detach_frame` handed over (`head`, `total` from `pending_frame`): the check
        of its struct as the rest passes, what a whole frame gets here (`whole_body`), else None."""
        if not self.whole_body:
            return None
        return FrameBody(self._scanner_factory, head.protocol is Protocol.COMPACT, head.body, total)

    def pending_size(self) -> int | None:
        """The whole size of a plain framed message still arriving, from its length prefix
        (None: not framed, nothing held, or the prefix not here yet). Cheap; changes nothing."""
        if self.framing is not F_FRAMED:
            return None
        if self._parts is not None:
            return self._parts_need
        buf, off = (self._whole, 0) if self._whole is not None else (self._buf, self._off)
        if len(buf) - off < 4:
            return None
        return 4 + _I32.unpack_from(buf, off)[0]

    def pending_frame(self) -> tuple[Message, int] | None:
        """(head, whole size) of a plain framed message still arriving, once its head is here.

        The Message carries the head only: its `data` is empty (the bytes stay here until
        `detach_frame`) and its `body` is the struct's offset in the frame. None when no
        incomplete plain framed message is held or its head is not here yet (or is unreadable:
        then it is read whole and refused as usual).
        Changes nothing.
        """
        total = self.pending_size()
        if total is None:
            return None
        joined = False
        if self._parts is not None:
            parts = self._parts  # its head may be cut by a read: then over the first reads, as
            buf, off = parts[0], 0  # many as a head can need (asked at every read: not all of them)
            if len(parts) > 1 and len(buf) < _HEAD_MAX:
                # Read again only once its bytes doubled (at most 4 KiB apart): a long name
                # trickled in byte by byte must not cost a join of all the reads at each one.
                if self._parts_have < self._head_retry:
                    return None
                n = k = 0
                while k < len(parts) and n < _HEAD_MAX:
                    n += len(parts[k])
                    k += 1
                buf = b"".join(parts[:k])
                joined = True
        else:
            buf, off = (self._whole, 0) if self._whole is not None else (self._buf, self._off)
            if total <= len(buf) - off or total - 4 > self.max_frame_size:
                return None  # complete (next_message returns it) or refused by next_message
        end = len(buf)
        start = off + 4
        protocol = self.protocol
        try:
            if protocol is None:
                if end - start < 2:
                    return None
                protocol = _sniff_protocol(buf, start)
            r = read_head(buf, start, end, protocol)
        except ProtocolError:
            r = None
        if r is None:
            if joined:
                have = self._parts_have
                self._head_retry = have + min(have, 4096)
            return None
        name, mtype, seqid, body = r
        return Message(name, mtype, seqid, F_FRAMED, protocol, b"", 0, None, b"", body - off), total

    def detach_frame(self) -> list[bytes]:
        """Hand over the incomplete framed message `pending_frame()` described: its bytes so
        far, as a list of bytes objects (the caller's now). The decoder is left empty, as if
        the message had been returned; the caller passes on the rest of the frame itself."""
        if self._parts is not None:
            parts = self._parts
            self._parts = None
            self._parts_have = self._parts_need = 0
        elif self._whole is not None:
            parts = [self._whole]
            self._whole = None
        else:
            parts = [_copy(self._buf, self._off, len(self._buf))]
        self._buf = bytearray()
        self._off = 0
        if self.protocol is None:
            self.protocol = _sniff_protocol(parts[0], 4)
        return parts

    # -- output ---------------------------------------------------------------

    def take(self, data) -> Message | None:
        """`data` as one message, when it is exactly one whole framed strict-binary message
        and nothing is buffered; else None, and nothing changed (then `feed` it)."""
        if (self._whole is not None or self._off != len(self._buf) or self._parts is not None
                or self.framing is not F_FRAMED):
            return None
        msg = take_framed(data, self.protocol, self.max_frame_size)
        if msg is not None and self.whole_body:
            try:
                if self._struct_end(data, msg.body, len(data), False) != len(data):
                    return None  # (`feed` then raises it, with its head)
            except ProtocolError:
                return None
        return msg

    def next_message(self) -> Message | None:
        """The next complete message, or None when more bytes are needed."""
        parts = self._parts
        if parts is not None:
            if self._parts_have < self._parts_need:
                return None
            self._parts = None
            self._parts_have = self._parts_need = 0
            data = b"".join(parts)
            return self._framed(data, 0, len(data), self.framing)
        whole = self._whole
        if whole is not None:
            framing = self.framing
            if framing is Framing.BUFFERED and self._head is None:
                return self._unframed_whole(whole)
            if self._nesting_open and len(whole) >= 6 and _U16.unpack_from(whole, 4)[0] == THEADER_MAGIC:
                self._nesting_open = False  # plain THeader (what _detect_nesting would decide)
            if framing is Framing.FRAMED or framing is Framing.FRAMED_HEADER or (
                    framing is Framing.HEADER and not self._nesting_open):
                n = len(whole)
                if n > 4 and framing is not Framing.FRAMED_HEADER:
                    length = _I32.unpack_from(whole, 0)[0]
                    if length == n - 4 and length <= self.max_frame_size:
                        # Fast path: the read was exactly one frame; keep the object as is.
                        self._whole = None
                        return self._framed(whole, 0, n, framing)
                if n >= _HEAD_BYTES:
                    length = _I32.unpack_from(whole, 0)[0]
                    if _PARTS_MIN <= length <= self.max_frame_size and length > n - 4:
                        # A large frame, incomplete: gather its reads, join them once.
                        self._whole = None
                        self._parts = [whole]
                        self._parts_have = n
                        self._parts_need = 4 + length
                        self._head_retry = 0
                        return None
            self._buf += whole
            self._whole = None
        buf = self._buf
        off = self._off
        end = len(buf)
        if off == end:
            return None
        if self.framing is None:
            if not self._detect(buf, off, end):
                return None
        elif self._nesting_open:
            if not self._detect_nesting(buf, off, end):
                return None
        framing = self.framing
        if framing is Framing.BUFFERED:
            msg = self._unframed(buf, off, end)
        else:
            if end - off < 4:
                return None
            length = _I32.unpack_from(buf, off)[0]
            self._check_length(length, buf, off + 4, end)
            if end - off - 4 < length:
                return None
            stop = off + 4 + length
            data = _copy(buf, off, stop)
            self._consume(stop)
            msg = self._framed(data, 0, len(data), framing)
        return msg

    def _consume(self, stop: int) -> None:
        if stop >= len(self._buf):
            self._buf.clear()
            self._off = 0
        elif stop > _COMPACT_AT:
            del self._buf[:stop]
            self._off = 0
        else:
            self._off = stop

    # -- framing detection ----------------------------------------------------

    def _detect(self, buf, off: int, end: int) -> bool:
        """Fix framing (and protocol, if auto) from the first bytes. False = need more."""
        protocol = protocol_at(buf, off, end)
        if protocol is not None:
            self._set(Framing.BUFFERED, protocol)
            return True
        if end - off < 6:
            return False
        length = _I32.unpack_from(buf, off)[0]
        if length < 0:
            raise ProtocolError(f"bad request: cannot detect framing (first word 0x{length & 0xFFFFFFFF:08x})")
        if _U16.unpack_from(buf, off + 4)[0] == THEADER_MAGIC:
            self._set(Framing.HEADER, None)
            return True
        protocol = protocol_at(buf, off + 4, end)
        if protocol is not None:
            self._set(Framing.FRAMED, protocol)
            return True
        if end - off < 10:
            return False
        if (_U16.unpack_from(buf, off + 8)[0] == THEADER_MAGIC
                and _I32.unpack_from(buf, off + 4)[0] == length - 4):
            self._set(Framing.FRAMED_HEADER, None)
            return True
        if self.protocol is Protocol.BINARY_NONSTRICT:
            self._set(Framing.FRAMED, None)
            return True
        raise _unversioned_error(buf, off, end, None) or ProtocolError(
            "bad request: cannot detect framing and protocol from the first bytes "
            f"({bytes(buf[off:off + 10]).hex()}; an unversioned binary message is detected "
            "only with the listener's protocol set to binary_nonstrict)")

    def _detect_nesting(self, buf, off: int, end: int) -> bool:
        """Configured HEADER: is the THeader frame plain or nested in a framed frame? False = need more."""
        if end - off < 4:
            return False
        length = _I32.unpack_from(buf, off)[0]
        if not 0 < length <= self.max_frame_size:
            self._nesting_open = False  # refused from the prefix alone (_check_length)
            return True
        if end - off < 6:
            return False
        if _U16.unpack_from(buf, off + 4)[0] != THEADER_MAGIC:
            if end - off < 10:
                return False
            if (_U16.unpack_from(buf, off + 8)[0] == THEADER_MAGIC
                    and _I32.unpack_from(buf, off + 4)[0] == length - 4):
                self.framing = Framing.FRAMED_HEADER
        self._nesting_open = False
        return True

    def _set(self, framing: Framing, protocol: Protocol | None) -> None:
        self.framing = framing
        if self.protocol is None and protocol is not None:
            self.protocol = protocol

    # -- framed and THeader ---------------------------------------------------

    def _check_length(self, length: int, buf, start: int, end: int) -> None:
        if 0 < length <= self.max_frame_size:
            return
        if length <= 0:
            raise (self._wrong_framing(buf, start - 4, end)
                   or ProtocolError(f"bad request: invalid frame length {length}", head=self._peek_head(buf, start, end)))
        head = self._peek_head(buf, start, end)
        raise ProtocolError(
            f"bad request: frame of {length} bytes exceeds max_frame_size {self.max_frame_size}",
            head=head, over_limit=True)

    def _peek_head(self, buf, start: int, end: int, framing: Framing | None = None) -> Head | None:
        """Best effort: the head of a message we refuse, to address the error reply.

        start: where the frame's content begins (past the length prefix if framed).
        """
        protocol = self.protocol
        framing = framing or self.framing or Framing.FRAMED
        if framing.is_header:
            return self._peek_header_head(buf, start, end, framing)
        if protocol is None:
            if end - start >= 2 and buf[start] == COMPACT_PROTOCOL_ID:
                protocol = Protocol.COMPACT
            elif end - start >= 2 and buf[start] == 0x80:
                protocol = Protocol.BINARY
            else:
                return None
        return _head_of_bad(buf, start, end, protocol, framing)

    def _wrong_framing(self, buf, off: int, end: int) -> ProtocolError | None:
        """Error paths only: the message at buf[off] plainly has another framing than the one
        configured (an unframed message on a framed connection, a framed or THeader one on an
        unframed connection). The error says which, addressed in the message's own framing and
        protocol, so its client can read the answer (DESIGN: errors go back in the client's own
        framing and protocol). None when the bytes say nothing that clear."""
        found = framing_at(buf, off, end)
        if found is None or found[0] is self.framing or (found[0].is_header and self.framing.is_header):
            return None
        framing, protocol = found
        if framing is Framing.BUFFERED:
            head = _head_of_bad(buf, off, end, protocol, framing)
        elif framing is Framing.FRAMED:
            head = _head_of_bad(buf, off + 4, end, protocol, framing)
        else:
            head = self._peek_header_head(buf, off + 4, end, framing)
        said = _FRAMING_SAID[framing] + (f" {protocol.value}" if protocol is not None else "")
        return ProtocolError(
            f"bad request: {said} message where the transport is {_FRAMING_CONFIG[self.framing]} "
            f"({SET_LISTENER_TRANSPORT} to {_FRAMING_CONFIG[framing]} or auto)", head=head)

    def _wrong_protocol(self, buf, pos: int, end: int, framing: Framing) -> ProtocolError | None:
        """Error paths only: the message at buf[pos] (its framing is right) plainly has another
        protocol than the one configured, said so and addressed in its own (as `_wrong_framing`)."""
        found = protocol_at(buf, pos, end)
        configured = self.protocol
        if found is None or configured is None or found is configured or (
                found is Protocol.BINARY and configured is Protocol.BINARY_NONSTRICT):
            return None
        return ProtocolError(
            f"bad request: a {found.value} message where the protocol is {configured.value} "
            f"({SET_LISTENER_PROTOCOL} to {found.value} or auto)", head=_head_of_bad(buf, pos, end, found, framing))

    def _answer_protocol(self) -> Protocol:
        """The protocol to answer a THeader request in whose block cannot name its own: the
        listener's (DESIGN: errors go back in the client's own framing and protocol)."""
        return Protocol.COMPACT if self.protocol is Protocol.COMPACT else Protocol.BINARY

    def _peek_header_head(self, buf, start: int, end: int, framing: Framing) -> Head | None:
        """The head inside a THeader frame we refuse; at least its seqid when the fixed part is here.

        A THeader reply names its own protocol, so a guessed one still reaches the client.
        """
        if framing is Framing.FRAMED_HEADER:
            start += 4
        if end - start < THEADER_FIXED_SIZE or _U16.unpack_from(buf, start)[0] != THEADER_MAGIC:
            return None
        seqid = _I32.unpack_from(buf, start + 4)[0]
        protocol = self.protocol or Protocol.BINARY
        fallback = Head("", MessageType.CALL, seqid, framing, protocol)
        try:
            block, payload = parse_header_block(buf, start, end, framing, self._answer_protocol())
            protocol = self._header_protocol(block.protocol)
            fallback = Head("", MessageType.CALL, seqid, framing, protocol)
            readable, pos, stop = buf, payload, end
            if block.transforms:
                readable = inflate(memoryview(buf)[payload:end], block.transforms, INFLATE_PREFIX)
                pos, stop = 0, len(readable)
            r = read_head(readable, pos, stop, protocol)
        except ProtocolError:
            return fallback
        if r is None:
            return fallback
        return Head(r[0], r[1], r[2], framing, protocol)

    def _header_protocol(self, protocol: Protocol) -> Protocol:
        """The protocol to read a THeader payload with: non-strict binary if so configured."""
        if self.protocol is Protocol.BINARY_NONSTRICT and protocol is Protocol.BINARY:
            return Protocol.BINARY_NONSTRICT
        return protocol

    def _framed(self, data, off: int, end: int, framing: Framing) -> Message:
        """A complete frame data[off:end] (length prefix included), taken: an error raised
        for it says so (`ProtocolError.whole`)."""
        try:
            return self._framed_message(data, off, end, framing)
        except ProtocolError as e:
            e.whole = True
            raise

    def _framed_message(self, data, off: int, end: int, framing: Framing) -> Message:
        start = off + 4
        if framing is Framing.FRAMED:
            protocol = self._frame_protocol(data, start, end)
            return self._message(data, start, end, framing, protocol, None, data, start)
        if framing is Framing.FRAMED_HEADER:
            if end - start < 4 or _I32.unpack_from(data, start)[0] != end - start - 4:
                raise ProtocolError("bad request: framed THeader: inner length does not match the frame")
            start += 4
        try:
            block, payload = parse_header_block(data, start, end, framing, self._answer_protocol())
        except ProtocolError as e:
            raise self._wrong_framing(data, off, end) or e
        protocol = block.protocol
        if self.protocol is None:
            self.protocol = protocol
        elif self.protocol is not protocol and not (
                self.protocol is Protocol.BINARY_NONSTRICT and protocol is Protocol.BINARY):
            raise ProtocolError(
                f"bad request: THeader protocol {protocol.value} but {self.protocol.value} is configured",
                head=Head("", 1, block.seqid, framing, protocol))
        protocol = self._header_protocol(protocol)
        try:
            if block.transforms:
                readable = inflate(memoryview(data)[payload:end], block.transforms, INFLATE_PREFIX)
                msg = self._message(readable, 0, len(readable), framing, protocol, block, data, payload,
                                    prefix_only=True)
                if self.whole_body:  # checked like any frame's: inflated whole (up to max_frame_size,
                    # as its upstream would inflate it), then dropped; the message keeps the prefix
                    try:
                        # (complete=False: what a truncated stream inflates to is what its upstream reads)
                        whole = inflate_all(memoryview(data)[payload:end], block.transforms,
                                            self.max_frame_size, complete=False)
                        self._check_body(whole, msg.body, len(whole), protocol)
                    except ProtocolError as e:
                        raise e.with_head(msg.head)
                return msg
            return self._message(data, payload, end, framing, protocol, block, data, payload)
        except ProtocolError as e:
            # The payload is unreadable, but the THeader seqid still addresses a reply, and
            # its headers (trace context) still hold.
            e.header_block = block
            raise e.with_head(Head("", MessageType.CALL, block.seqid, framing, protocol))

    def _frame_protocol(self, data, start: int, end: int) -> Protocol:
        protocol = self.protocol
        if protocol is not None:
            return protocol
        if end - start < 2:
            raise ProtocolError(f"bad request: cannot detect the protocol ({bytes(data[start:end]).hex()})")
        try:
            protocol = self.protocol = _sniff_protocol(data, start)
        except ProtocolError as e:
            raise _unversioned_error(data, start - 4, end, Framing.FRAMED) or e
        return protocol

    def _message(self, readable, start: int, end: int, framing: Framing, protocol: Protocol,
                 block, data, data_start: int, prefix_only: bool = False) -> Message:
        try:
            r = read_head(readable, start, end, protocol)
        except ProtocolError as e:  # (e.g. an invalid message type: its seqid and name still address the answer)
            raise ((block is None and self._wrong_protocol(readable, start, end, framing))
                   or e.with_head(_head_of_bad(readable, start, end, protocol, framing)))
        if r is None:
            if prefix_only:
                raise ProtocolError("bad request: message head beyond the inflated prefix")
            raise ProtocolError("bad request: message truncated inside its head "
                                "(a string length beyond the frame?)")
        name, mtype, seqid, body = r
        if body >= end and not prefix_only:
            raise ProtocolError("bad request: message has no body", head=Head(name, mtype, seqid, framing, protocol))
        if self.whole_body and not prefix_only:
            try:
                self._check_body(readable, body, end, protocol)
            except ProtocolError as e:
                raise e.with_head(Head(name, mtype, seqid, framing, protocol))
        if block is not None and block.seqid != seqid:
            # Apache Thrift keeps both equal; the payload's seqid is the one clients check.
            pass
        return Message(name, mtype, seqid, framing, protocol, data, data_start, block, readable, body)

    def _struct_end_by_factory(self, readable, body: int, end: int, compact: bool) -> int | None:
        """Where the struct at readable[body] ends; None if not by `end` (ProtocolError if it
        is malformed). Values are skipped, not decoded. (`_struct_end`, with a chosen factory.)"""
        scanner = self._scanner_factory(compact, body)
        return scanner.pos if scanner.advance(readable, end) else None

    def _check_body(self, readable, body: int, end: int, protocol: Protocol) -> None:
        """The struct at readable[body] ends exactly at `end` (`whole_body`), else ProtocolError."""
        stop = self._struct_end(readable, body, end, protocol is Protocol.COMPACT)
        if stop is None:
            raise ProtocolError(PAST_FRAME_END)
        if stop != end:
            raise ProtocolError(bytes_after_struct(end - stop))

    # -- unframed -------------------------------------------------------------

    def _unframed_whole(self, whole: bytes) -> Message | None:
        """An unframed message from its first byte at the start of the read `whole`, nothing
        else held: scanned where it is. A message that is the whole read is returned as that
        bytes object (no copy); one that goes on past it keeps the read uncopied until the
        next one comes (`feed` appends both to the buffer: the scan's offsets hold there)."""
        stop = self._scan_unframed(whole, 0, len(whole))
        if stop is None:
            return None  # (`_whole` stays: the message's bytes so far)
        self._whole = None
        if stop == len(whole):
            data = whole
        else:
            data = whole[:stop]
            self._buf += memoryview(whole)[stop:]  # the next messages' bytes
        return self._unframed_message(data)

    def _unframed(self, buf, off: int, end: int) -> Message | None:
        stop = self._scan_unframed(buf, off, end)
        if stop is None:
            return None
        data = _copy(buf, off, stop)
        self._consume(stop)
        return self._unframed_message(data)

    def _unframed_message(self, data: bytes) -> Message:
        head = self._head
        self._head = None
        self._scanner = None
        return Message(head[0], head[1], head[2], Framing.BUFFERED, self.protocol, data, 0, None, data, head[3])

    def _scan_unframed(self, buf, off: int, end: int) -> int | None:
        """Scan the unframed message starting at buf[off] up to `end`: the offset just past
        it, or None while it is incomplete (the scan keeps its place)."""
        protocol = self.protocol
        if protocol is None:  # framing configured as buffered, protocol left to detection
            if end - off < 2:
                return None
            try:
                protocol = _sniff_protocol(buf, off)
            except ProtocolError as e:
                if end - off < 6:
                    return None  # (the six bytes that tell a framed message)
                raise (self._wrong_framing(buf, off, end) or _unversioned_error(buf, off, end, Framing.BUFFERED)
                       or e)
            self.protocol = protocol
        # Nothing past `limit` is ever looked at: a message that does not end by then is
        # refused, and what lies beyond cannot change that (nor, so, depend on read sizes).
        limit = off + self.max_frame_size
        scan_end = end if end < limit else limit
        head = self._head
        if head is None:
            try:
                r = read_head(buf, off, scan_end, protocol)
            except ProtocolError as e:
                if end - off < 6:
                    return None  # (the six bytes that tell a framed message)
                raise (self._wrong_framing(buf, off, end) or self._wrong_protocol(buf, off, end, Framing.BUFFERED)
                       or e.with_head(_head_of_bad(buf, off, scan_end, protocol, Framing.BUFFERED)))
            if r is None:
                if end >= limit:
                    raise ProtocolError(
                        f"bad request: message exceeds max_frame_size {self.max_frame_size}", over_limit=True)
                return None
            name, mtype, seqid, body = r
            self._head = head = (name, mtype, seqid, body - off)
            self._scanner = self._scanner_factory(protocol is Protocol.COMPACT, body)
        scanner = self._scanner
        try:
            done = scanner.advance(buf, scan_end)
        except ProtocolError as e:
            raise e.with_head(Head(head[0], head[1], head[2], Framing.BUFFERED, protocol))
        finally:
            self.examined += scanner.examined
            scanner.examined = 0
        if not done:
            # reach: where the scan is sure to get (a string being skipped ends there).
            if end >= limit or scanner.reach > limit:
                raise ProtocolError(
                    f"bad request: message exceeds max_frame_size {self.max_frame_size}",
                    head=Head(head[0], head[1], head[2], Framing.BUFFERED, protocol), over_limit=True)
            if off and scanner.pos == end and off > _COMPACT_AT:
                # Keep the buffer from growing behind a long message: rebase positions.
                del buf[:off]
                scanner.pos -= off
                self._off = 0
            return None
        return scanner.pos


def _copy(buf: bytearray, start: int, stop: int) -> bytes:
    """buf[start:stop] as bytes in one copy (slicing the bytearray first would copy twice)."""
    with memoryview(buf) as view:
        return bytes(view[start:stop])


# An unversioned head is taken for one (to answer it) only with a name this short, all of it
# printable ASCII: a frame's length or garbage read as a name length fails that check.
_UNVERSIONED_NAME_MAX = 1024
_NOT_NAME = bytes(range(0x21, 0x7F))  # (deleted by translate: what is left is not printable)


def _unversioned_head(buf, pos: int, end: int) -> tuple[str, int, int] | None:
    """An unversioned (non-strict) binary call or oneway head at buf[pos:end], plainly one: a
    name length of 1-1024, a printable ASCII name, type CALL or ONEWAY. (name, type, seqid)."""
    if end - pos < 4:
        return None
    nlen = _I32.unpack_from(buf, pos)[0]
    if not 0 < nlen <= _UNVERSIONED_NAME_MAX or end - pos < 4 + nlen + 5:
        return None
    name = bytes(buf[pos + 4:pos + 4 + nlen])
    mtype = buf[pos + 4 + nlen]
    if name.translate(None, _NOT_NAME) or mtype not in (MessageType.CALL, MessageType.ONEWAY):
        return None
    return name.decode("ascii"), mtype, _I32.unpack_from(buf, pos + 5 + nlen)[0]


def _unversioned_at(buf, off: int, end: int, framing: Framing | None = None) -> Head | None:
    """The head of an unversioned binary message at buf[off], framed or not (`framing`: only
    that one), when the bytes plainly hold one: to answer a client that sends them where they
    are not read (a strict binary listener, or one detecting its protocol) with its seqid."""
    if framing is not Framing.BUFFERED and end - off >= 4:
        length = _I32.unpack_from(buf, off)[0]
        r = _unversioned_head(buf, off + 4, min(end, off + 4 + length)) if length > 9 else None
        if r is not None:
            return Head(r[0], r[1], r[2], Framing.FRAMED, Protocol.BINARY_NONSTRICT)
    if framing is not Framing.FRAMED:
        r = _unversioned_head(buf, off, end)
        if r is not None:
            return Head(r[0], r[1], r[2], Framing.BUFFERED, Protocol.BINARY_NONSTRICT)
    return None


def _unversioned_error(buf, off: int, end: int, framing: Framing | None) -> ProtocolError | None:
    """Error paths of a listener detecting its transport or protocol: the bytes at buf[off] are
    an unversioned binary message. Answered (strict binary, which its client reads) with what to
    set: auto cannot tell an unversioned message from a frame's length."""
    head = _unversioned_at(buf, off, end, framing)
    if head is None:
        return None
    need = "framed" if head.framing is Framing.FRAMED else "buffered"
    return ProtocolError(
        f"bad request: {_FRAMING_SAID[head.framing]} unversioned (non-strict) binary message: "
        f"{SET_LISTENER_PROTOCOL} to binary_nonstrict and its transport to {need} (auto detects "
        "strict binary, compact and THeader only: an unversioned message begins with a length, "
        "as a frame does)", head=head)


_FRAMING_SAID = {Framing.BUFFERED: "an unframed", Framing.FRAMED: "a framed", Framing.HEADER: "a THeader",
                 Framing.FRAMED_HEADER: "a THeader"}
_FRAMING_CONFIG = {Framing.BUFFERED: "buffered", Framing.FRAMED: "framed", Framing.HEADER: "header",
                   Framing.FRAMED_HEADER: "header"}


def protocol_at(buf, pos: int, end: int) -> Protocol | None:
    """The protocol a message starting at buf[pos] plainly has: strict binary or compact, from its
    first two bytes; None when they are not here or say neither (never non-strict binary)."""
    if end - pos < 2:
        return None
    b0, b1 = buf[pos], buf[pos + 1]
    if b0 == 0x80 and b1 == 0x01:
        return Protocol.BINARY
    if b0 == COMPACT_PROTOCOL_ID and (b1 & COMPACT_VERSION_MASK) == COMPACT_VERSION:
        return Protocol.COMPACT
    return None


def framing_at(buf, off: int, end: int) -> tuple[Framing, Protocol | None] | None:
    """The framing (and protocol, unless THeader) that the message at buf[off] plainly has, from
    its first six bytes: an unframed strict binary or compact message, or a frame (a positive length)
    that holds one or a THeader block. None when they say nothing that clear."""
    protocol = protocol_at(buf, off, end)
    if protocol is not None:
        return Framing.BUFFERED, protocol
    if end - off < 6 or _I32.unpack_from(buf, off)[0] <= 0:
        return None
    if _U16.unpack_from(buf, off + 4)[0] == THEADER_MAGIC:
        return Framing.HEADER, None
    protocol = protocol_at(buf, off + 4, end)
    return None if protocol is None else (Framing.FRAMED, protocol)


def _sniff_protocol(buf, pos: int) -> Protocol:
    """The protocol of a message starting at buf[pos] (two bytes needed). Never non-strict binary."""
    protocol = protocol_at(buf, pos, pos + 2)
    if protocol is None:
        raise ProtocolError(f"bad request: cannot detect the protocol ({bytes(buf[pos:pos + 2]).hex()})")
    return protocol
