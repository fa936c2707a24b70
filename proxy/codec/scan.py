"""Find where an unframed message ends by walking its struct, resumably.

An unframed (buffered) message has no length prefix: its end is the STOP of
its top-level struct. `StructScanner` walks field headers and container
headers without building objects, and when the bytes run out it keeps its
place (a small stack, a pending value type, a count of bytes still to skip) so
the next call resumes there. A 15 MB message fed in 64 KiB reads is examined
about once in total, not once per read: a re-scan from the start on every read
is quadratic, which is how one team's proxy lost seconds.

Fixed-size values and string bodies are "skipped" by count, so only headers
and varints (a few bytes) are ever re-read after a short read. `examined`
counts every byte looked at, re-reads included (tests bound it).

Two implementations of one interface: `cls(compact, pos=0, max_depth=64)`,
`advance(buf, end) -> bool`, `pass_over(n)`, `pos`, `reach` and `examined`.

    PureStructScanner      this module's pure-Python scanner (the reference, always there)
    CompiledStructScanner  proxy/codec/_scan.c (built by `pip install`), or None if it
                           was not built; it agrees with the pure one step for step
                           (tests/test_scanner_compiled.py, `make fuzz`)
    StructScanner          the one to use: compiled if importable, else pure; the
                           decoder's default. THRIFT_SIDECAR_PURE_SCANNER=1 (or _PURE_PYTHON=1) forces pure.
    SCANNER_IMPL           "c" or "python": which one StructScanner is.
    struct_end             `(buf, pos, end, compact) -> int | None`: one whole scan with no
                           object made (the listener's check of every framed request's body):
                           the compiled `_scan.struct_end` with StructScanner's, else
                           `pure_struct_end`.

Nothing is logged at import.
"""

from __future__ import annotations

from proxy.codec.errors import ProtocolError
from proxy.codec.twins import load, pure_forced

# Frame kinds on the scanner's stack.
_STRUCT = 0
_LIST = 1
_MAP = 2

# Binary protocol: value sizes of fixed-size types, and which types are valid.
_BIN_FIXED = {2: 1, 3: 1, 4: 8, 6: 2, 8: 4, 10: 8, 16: 16}
_BIN_VALID = frozenset((2, 3, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16))
# Compact protocol: fixed-size value types (byte, double, uuid, bools in containers).
_CMP_FIXED = {1: 1, 2: 1, 3: 1, 7: 8, 13: 16}
_CMP_VARINT = frozenset((4, 5, 6))
_CMP_VALID = frozenset(range(1, 14))

DEFAULT_MAX_DEPTH = 64


class PureStructScanner:
    """Walks one struct starting at `pos`; `advance` returns True once its end is found.

    After True, `pos` is the offset just past the struct's STOP byte (and further
    calls return True again, changing nothing).
    """

    __slots__ = ("pos", "examined", "_compact", "_stack", "_pending", "_skip", "_max_depth")

    def __init__(self, compact: bool, pos: int = 0, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        self.pos = pos
        self.examined = 0
        self._compact = compact
        self._stack: list[list[int]] = [[_STRUCT, 0, 0, 0]]
        self._pending = -1   # type of the next value to read, -1 = none
        self._skip = 0       # bytes of the current value still to pass over
        self._max_depth = max_depth

    @property
    def reach(self) -> int:
        """The offset the scan is sure to pass (further than `pos` while a string is skipped).

        The decoder refuses a message as too long as soon as this passes its limit.
        """
        return self.pos + self._skip

    def pass_over(self, n: int) -> None:
        """Count `n` bytes of the value being skipped as passed, unseen (they went on another
        way: a splice moved them); `n` <= reach - pos, else ValueError. `pos` stays."""
        if n < 0 or n > self._skip:
            raise ValueError(f"pass_over({n}): only {self._skip} byte(s) of a value are left to skip")
        self._skip -= n

    def advance(self, buf, end: int) -> bool:
        """Scan buf[pos:end]. True when the struct is complete; False = need more bytes."""
        if not self._stack:
            return True
        if self._compact:
            return self._advance_compact(buf, end)
        return self._advance_binary(buf, end)

    # -- binary ---------------------------------------------------------------

    def _advance_binary(self, buf, end: int) -> bool:
        pos = self.pos
        stack = self._stack
        pending = self._pending
        skip = self._skip
        fixed = _BIN_FIXED
        valid = _BIN_VALID
        start = pos
        try:
            while True:
                if skip:
                    avail = end - pos
                    if avail < skip:
                        pos = end
                        skip -= avail
                        return False
                    pos += skip
                    skip = 0
                if pending >= 0:
                    t = pending
                    size = fixed.get(t)
                    if size is not None:
                        skip = size
                        pending = -1
                        continue
                    if t == 11:  # string / binary
                        if end - pos < 4:
                            return False
                        n = int.from_bytes(buf[pos:pos + 4], "big", signed=True)
                        if n < 0:
                            raise ProtocolError(f"bad request: negative string length {n}")
                        pos += 4
                        skip = n
                    elif t == 12:
                        self._push(stack, [_STRUCT, 0, 0, 0])
                    elif t == 15 or t == 14:
                        if end - pos < 5:
                            return False
                        et = buf[pos]
                        n = int.from_bytes(buf[pos + 1:pos + 5], "big", signed=True)
                        if et not in valid:
                            raise ProtocolError(f"bad request: invalid element type {et}")
                        if n < 0:
                            raise ProtocolError(f"bad request: negative container size {n}")
                        pos += 5
                        self._push(stack, [_LIST, et, 0, n])
                    else:  # 13 map
                        if end - pos < 6:
                            return False
                        kt = buf[pos]
                        vt = buf[pos + 1]
                        n = int.from_bytes(buf[pos + 2:pos + 6], "big", signed=True)
                        if n < 0:
                            raise ProtocolError(f"bad request: negative container size {n}")
                        if n and (kt not in valid or vt not in valid):
                            raise ProtocolError(f"bad request: invalid map types {kt}/{vt}")
                        pos += 6
                        self._push(stack, [_MAP, kt, vt, 2 * n])
                    pending = -1
                    continue
                top = stack[-1]
                kind = top[0]
                if kind == _STRUCT:
                    if pos >= end:
                        return False
                    t = buf[pos]
                    if t == 0:
                        pos += 1
                        stack.pop()
                        if not stack:
                            return True
                        continue
                    if end - pos < 3:
                        return False
                    if t not in valid:
                        raise ProtocolError(f"bad request: invalid field type {t}")
                    pos += 3
                    pending = t
                elif kind == _LIST:
                    if top[3] == 0:
                        stack.pop()
                        continue
                    top[3] -= 1
                    pending = top[1]
                else:
                    rem = top[3]
                    if rem == 0:
                        stack.pop()
                        continue
                    top[3] = rem - 1
                    pending = top[1] if rem & 1 == 0 else top[2]
        finally:
            # Bytes passed over plus a partial token's bytes, re-read next time.
            self.examined += (pos - start) + (end - pos if pos < end and stack else 0)
            self.pos = pos
            self._pending = pending
            self._skip = skip

    # -- compact --------------------------------------------------------------

    def _advance_compact(self, buf, end: int) -> bool:
        pos = self.pos
        stack = self._stack
        pending = self._pending
        skip = self._skip
        fixed = _CMP_FIXED
        valid = _CMP_VALID
        start = pos
        try:
            while True:
                if skip:
                    avail = end - pos
                    if avail < skip:
                        pos = end
                        skip -= avail
                        return False
                    pos += skip
                    skip = 0
                if pending >= 0:
                    t = pending
                    size = fixed.get(t)
                    if size is not None:
                        skip = size
                    elif t in _CMP_VARINT:
                        p = _varint_end(buf, pos, end)
                        if p < 0:
                            return False
                        pos = p
                    elif t == 8:
                        r = _read_uvarint(buf, pos, end)
                        if r is None:
                            return False
                        skip, pos = r
                    elif t == 12:
                        self._push(stack, [_STRUCT, 0, 0, 0])
                    elif t == 9 or t == 10:
                        if pos >= end:
                            return False
                        b = buf[pos]
                        et = b & 0x0F
                        n = b >> 4
                        p = pos + 1
                        if n == 15:
                            r = _read_uvarint(buf, p, end)
                            if r is None:
                                return False
                            n, p = r
                        if et not in valid:
                            raise ProtocolError(f"bad request: invalid element type {et}")
                        pos = p
                        self._push(stack, [_LIST, et, 0, n])
                    else:  # 11 map
                        r = _read_uvarint(buf, pos, end)
                        if r is None:
                            return False
                        n, p = r
                        kt = vt = 0
                        if n:
                            if p >= end:
                                return False
                            kt = buf[p] >> 4
                            vt = buf[p] & 0x0F
                            if kt not in valid or vt not in valid:
                                raise ProtocolError(f"bad request: invalid map types {kt}/{vt}")
                            p += 1
                        pos = p
                        self._push(stack, [_MAP, kt, vt, 2 * n])
                    pending = -1
                    continue
                top = stack[-1]
                kind = top[0]
                if kind == _STRUCT:
                    if pos >= end:
                        return False
                    b = buf[pos]
                    if b == 0:
                        pos += 1
                        stack.pop()
                        if not stack:
                            return True
                        continue
                    t = b & 0x0F
                    if t not in valid:
                        raise ProtocolError(f"bad request: invalid field type {t}")
                    p = pos + 1
                    if not b & 0xF0:  # long form: zigzag varint field id follows
                        p = _varint_end(buf, p, end)
                        if p < 0:
                            return False
                    pos = p
                    if t != 1 and t != 2:  # bool fields carry their value in the type
                        pending = t
                elif kind == _LIST:
                    if top[3] == 0:
                        stack.pop()
                        continue
                    top[3] -= 1
                    pending = top[1]
                else:
                    rem = top[3]
                    if rem == 0:
                        stack.pop()
                        continue
                    top[3] = rem - 1
                    pending = top[1] if rem & 1 == 0 else top[2]
        finally:
            self.examined += (pos - start) + (end - pos if pos < end and stack else 0)
            self.pos = pos
            self._pending = pending
            self._skip = skip

    def _state(self) -> tuple:
        """(pending, skip, frames): the resumable state, as the compiled scanner's `_state()`."""
        return self._pending, self._skip, tuple(tuple(f) for f in self._stack)

    def _push(self, stack: list, frame: list) -> None:
        if len(stack) >= self._max_depth:
            raise ProtocolError(f"bad request: nesting deeper than {self._max_depth}")
        stack.append(frame)


def _varint_end(buf, pos: int, end: int) -> int:
    """Offset just past a varint at pos, or -1 when incomplete."""
    start = pos
    while pos < end:
        if not buf[pos] & 0x80:
            return pos + 1
        pos += 1
        if pos - start >= 10:
            raise ProtocolError("bad request: varint longer than 10 bytes")
    return -1


def _read_uvarint(buf, pos: int, end: int):
    result = 0
    shift = 0
    start = pos
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result > 0x7FFFFFFF:
                raise ProtocolError(f"bad request: length {result} out of range")
            return result, pos
        shift += 7
        if pos - start >= 5:
            raise ProtocolError("bad request: length varint longer than 5 bytes")
    return None


def pure_struct_end(buf, pos: int, end: int, compact: bool) -> int | None:
    """Where the struct at buf[pos] ends, if by `end` (None if not); ProtocolError if it is
    malformed. The reference for the compiled `struct_end`."""
    s = PureStructScanner(compact, pos)
    return s.pos if s.advance(buf, end) else None


_compiled = load("proxy.codec._scan")
CompiledStructScanner = _compiled.StructScanner if _compiled is not None else None

if CompiledStructScanner is not None and not pure_forced("THRIFT_SIDECAR_PURE_SCANNER"):
    StructScanner = CompiledStructScanner
    SCANNER_IMPL = "c"
else:
    StructScanner = PureStructScanner
    SCANNER_IMPL = "python"

struct_end = _compiled.struct_end if StructScanner is CompiledStructScanner else pure_struct_end
