"""Find the end of an unframed message whose bytes are passed on as they arrive, not kept.

A large unframed reply streams to the client: each read is forwarded at once,
so nothing can be buffered but the few bytes of a field header, length or
varint cut by a read (the scanner re-reads those). `UnframedStream.feed(chunk)`
says how many bytes of the chunk belong to the message (all of them until the
chunk in which it ends); the caller forwards those.

It takes over from a `Decoder` (`Decoder.detach_unframed()`), which has read the
message's head and scanned its first bytes: the scan resumes where the decoder
stopped, nothing is scanned twice. What is refused, and why, is what the decoder
would refuse for the same bytes however they were cut into reads: the same
scanner errors, and `max_size` counts from the message's first byte with the
decoder's rule (tests/test_codec_stream.py checks both against the decoder).

    feed(chunk) -> n          n == len(chunk) until the end; then the bytes up to it
    done                      the end was found (feed it nothing more)
    size                      bytes of the message so far (its whole length once done)
    buffered                  bytes kept between reads (a cut token, at most ~16)
    opaque                    bytes just ahead that lie inside a value being skipped
    pass_over(n)              n of those went on unseen (a splice moved them)

`FrameBody` is the framed twin for a request that streams upstream: the listener checks
every framed request's struct to end exactly at its frame's end (`Decoder(whole_body=True)`,
no second message hidden in a frame), and a request passed on as it arrives is checked the
same way, each read before it goes upstream, so a frame that hides a second message never
reaches the upstream whole. Bytes a splice moves (proxy.splice) are never seen: only the
inside of one long value (`opaque`) is spliced, and the scan passes over it.
"""

from __future__ import annotations

from proxy.codec.errors import ProtocolError

# What a framed message's struct that does not fill its frame is told (the decoder's too).
PAST_FRAME_END = "bad request: the message's struct goes on past the end of its frame"


def bytes_after_struct(n: int) -> str:
    return f"bad request: {n} byte(s) after the message inside its frame (a second message in one frame?)"


# A cut token (at most ~16 bytes: a compact list header with its varint size) is finished on
# its bytes plus this many of the next chunk, so the chunk itself is never copied.
_BRIDGE = 64


class UnframedStream:
    """The rest of one unframed message: `feed` chunks, forward the bytes it says are the message's."""

    __slots__ = ("_scanner", "_carry", "_at", "max_size", "done", "size", "examined", "_too_long")

    def __init__(self, scanner, seen, max_size: int, too_long: str = "") -> None:
        """`scanner` is mid-struct at `scanner.pos` in `seen`, the message's bytes so far.
        `too_long`: the ProtocolError's text when the message would pass `max_size` (default:
        the decoder's, naming max_frame_size)."""
        pos = scanner.pos
        self._scanner = scanner
        self._carry = bytes(seen[pos:]) if pos < len(seen) else b""  # a cut token, re-read next
        self._at = pos              # message offset where the next scan buffer starts
        self.max_size = max_size
        self.done = False
        self.size = len(seen)
        self.examined = 0
        self._too_long = too_long or f"bad request: message exceeds max_frame_size {max_size}"
        scanner.pos = 0

    @property
    def buffered(self) -> int:
        """Bytes kept between reads: a cut token's, re-read with the next chunk."""
        return len(self._carry)

    def feed(self, chunk) -> int:
        """Scan the next bytes of the message: how many of them belong to it.

        Raises ProtocolError for bytes that cannot be the message's, or once it
        is sure to exceed `max_size`.
        """
        if self.done:
            return 0
        scanner = self._scanner
        carry = self._carry
        n = len(chunk)
        k = len(carry)
        if k:
            # Finish the cut token on a small buffer (its bytes + the chunk's first few).
            small = carry + bytes(chunk[:_BRIDGE])
            if self._advance(small):
                self._carry = b""
                return self._ended(scanner.pos - k)
            p = scanner.pos
            if n <= _BRIDGE:  # the whole chunk was in the bridge
                self._carry = small[p:] if p < len(small) else b""
                self._at += p
                scanner.pos = 0
                self.size += n
                return n
            # The cut token ended within the bridge (it is shorter, and the limit is past the
            # bridge or _advance raised): go on in the chunk itself.
            self._carry = b""
            self._at += k
            scanner.pos = p - k
        if self._advance(chunk):
            return self._ended(scanner.pos)
        p = scanner.pos
        self._carry = bytes(chunk[p:]) if p < n else b""
        self._at += p
        scanner.pos = 0
        self.size += n
        return n

    def _advance(self, buf) -> bool:
        """Scan `buf` (bytes received, from message offset `_at`), stopping at max_size."""
        scanner = self._scanner
        end = len(buf)
        limit = self.max_size - self._at
        try:
            done = scanner.advance(buf, end if end < limit else limit)
        finally:
            self.examined += scanner.examined
            scanner.examined = 0
        if not done and (end >= limit or scanner.reach > limit):
            # The decoder's rule: nothing past the limit is looked at, and a message that has
            # not ended by then (or whose string is sure to go past it) is refused.
            raise ProtocolError(self._too_long, over_limit=True)
        return done

    @property
    def opaque(self) -> int:
        """How many of the next bytes are inside a value being skipped (a string's): the scan
        need not see them (0 while a cut token waits for its end)."""
        return 0 if self._carry or self.done else self._scanner.reach

    def pass_over(self, n: int) -> None:
        """`n` (<= `opaque`) of the next bytes went on unseen: the scan goes on after them."""
        self._scanner.pass_over(n)
        self._at += n
        self.size += n

    def _ended(self, used: int) -> int:
        """The message ended `used` bytes into the chunk."""
        self.done = True
        self.size += used
        return used


class FrameBody:
    """The struct of a framed request passed on as it arrives: it must end exactly at its
    frame's end. `feed` each read's bytes of the frame before they go on; ProtocolError (the
    decoder's texts for a whole frame) says they must not."""

    __slots__ = ("_before", "_left", "_stream")

    def __init__(self, scanner_factory, compact: bool, body: int, total: int) -> None:
        """`body`: the struct's offset in the frame (past its length prefix and message head);
        `total`: the frame's size, its length prefix included."""
        self._before = body       # bytes before the struct still to come
        self._left = total - body  # bytes of the frame after the struct's start still to come
        self._stream = UnframedStream(scanner_factory(compact), b"", total - body, PAST_FRAME_END)

    def feed(self, chunk) -> None:
        """Check the frame's next bytes (none past its end)."""
        n = len(chunk)
        before = self._before
        if before:
            if n <= before:
                self._before = before - n
                return
            chunk = memoryview(chunk)[before:]
            n -= before
            self._before = 0
        self._left -= n
        stream = self._stream
        used = stream.feed(chunk)
        if stream.done:
            if used < n or self._left:
                raise ProtocolError(bytes_after_struct(n - used + self._left))
        elif not self._left:
            raise ProtocolError(PAST_FRAME_END)

    @property
    def opaque(self) -> int:
        """How many of the frame's next bytes may pass unseen (inside one value: a string). Never
        its last byte: the struct's end is checked on bytes seen (a string running to the frame's
        end leaves no room for its struct's STOP)."""
        return 0 if self._before else min(self._stream.opaque, self._left - 1)

    def pass_over(self, n: int) -> None:
        """`n` (<= `opaque`) of the frame's next bytes went on unseen (a splice moved them)."""
        self._stream.pass_over(n)
        self._left -= n
