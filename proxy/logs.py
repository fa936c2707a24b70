"""Structured logs: one JSON object per line (or plain text), nothing formatted unless emitted;
repeated warnings thinned (`Throttle`).

A log line's message may carry what a client chose (a method name, up to 64 KiB on the wire):
either format keeps it to one line of at most `MAX_MESSAGE` characters, and the text format
shows control characters escaped (`\x0a`), so a name cannot forge a line or send a terminal
escape sequence (a traceback, after the message, keeps its lines)."""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Hashable


class Throttle:
    """Repeated log lines, thinned: per key, the first line goes out at once, then at most one
    per `every` seconds, and the line let through says how many were held back since the last
    one (the count of a burst shows with the next line of its kind, if one comes; `held` takes it,
    or `say_held` says it in that line's words, when no line will come). A pure policy
    object: `clock()` gives seconds (proxy.clock). Its keys are the caller's kinds of line (a
    pool's failure reasons: a few; it forgets none)."""

    __slots__ = ("every", "clock", "_last", "_held", "_words")

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}
        self._words: dict[Hashable, tuple[str, tuple]] = {}  # each key's last line (warn)

    def admit(self, key: Hashable) -> int | None:
        """None: hold this line back; else let it out, with the count held back before it."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)

    def held(self, key: Hashable) -> int:
        """How many of `key`'s lines are held back since the last one let out (and forget them):
        for a last word when the lines stop coming, e.g. at shutdown."""
        return self._held.pop(key, 0)

    def say_held(self, logger: logging.Logger, when: str,
                 which: Callable[[Hashable], bool] = lambda key: True) -> None:
        """For each key `which` accepts with lines held back (by `warn`): say their count now, in
        the words of its last line, `when` telling why no next line of its kind will carry it."""
        for key in [k for k in self._held if which(k) and k in self._words]:
            n = self._held.pop(key)
            msg, args = self._words[key]
            logger.warning(msg + ": %d more time%s since the last such line, %s", *args, n,
                           "" if n == 1 else "s", when)

    def warn(self, logger: logging.Logger, key: Hashable, msg: str, *args) -> None:
        """`logger.warning(msg, *args)`, if `key`'s line may go out now (`admit`)."""
        self.log(logger, logging.WARNING, key, msg, *args)

    def log(self, logger: logging.Logger, level: int, key: Hashable, msg: str, *args) -> None:
        """`logger.log(level, msg, *args)`, if `key`'s line may go out now (`admit`)."""
        if not logger.isEnabledFor(level):
            return
        self._words[key] = (msg, args)
        held = self.admit(key)
        if held is None:
            return
        if held:
            logger.log(level, msg + " (and %d more like it since the last such line)", *args, held)
        else:
            logger.log(level, msg, *args)


MAX_MESSAGE = 4096  # characters of a log line's message; the rest is cut, and counted
# Names and texts a client chooses are cut to these lengths in spans, logs and metric labels (a
# method name may be up to 64 KiB on the wire): one client's 60 KB names made a span batch of
# 256 calls a 15 MB request, which a collector (gRPC's 4 MiB default) refuses whole.
MAX_NAME = 128
MAX_ERROR = 1024
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f)}


def escape_controls(text: str) -> str:
    """`text` with control characters escaped (`\\x0a`): a client-chosen name printed to a
    terminal (a log line, `thrift-sidecar hops`) can neither forge lines nor send escapes."""
    return text.translate(_ESCAPES)


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the last an ellipsis (a client's name in a span, a log)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def bounded(message: str) -> str:
    """`message` cut to MAX_MESSAGE characters (saying how many more there were)."""
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}... ({len(message) - MAX_MESSAGE} more characters)"


class TextFormatter(logging.Formatter):
    """`%(asctime)s %(levelname)s %(name)s: %(message)s`, the message on one line (bounded,
    control characters escaped). A record's structured `fields` (an access-log line's hop
    timings, what the JSON format puts in the object) follow it as `key=value` pairs (logfmt),
    those that are None left out; a value with a space, `"` or `=` is quoted."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = bounded(record.message)
        fields = getattr(record, "fields", None)
        if fields:
            message = f"{message} {logfmt(fields)}"
        record.message = escape_controls(message)
        return super().formatMessage(record)


def logfmt(fields: dict) -> str:
    """`fields` as `key=value` pairs, None values left out: `total_ms=1.25 error="not sent: …"`."""
    out = []
    for key, value in fields.items():
        if value is None:
            continue
        if not isinstance(value, str):
            value = json.dumps(value, default=str) if isinstance(value, (list, dict)) else str(value)
        if not value or any(c in value for c in ' "='):
            value = json.dumps(value, ensure_ascii=False)
        out.append(f"{key}={value}")
    return " ".join(out)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": bounded(record.getMessage()),
        }
        extra = getattr(record, "fields", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
