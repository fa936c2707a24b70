"""A listener's Thrift IDL: which methods exist, which are oneway, which exceptions each declares.

Owns: reading an IDL file and the files it includes (with `thriftpy2`'s parser, not one of our
own) into a small frozen `Idl`, the names the rest of the proxy takes from it, and the check of a
config's IDL references (`config_problems`). Leaves to others: what those names do — the pipeline
treats `oneway_methods()` as oneway even when sent as CALL, metrics give every `known_methods()`
name its own label, `RetryPolicy` resolves `on_exceptions` names through `exception_ids()`.

    idl = load("user_service.thrift")            # raises IdlError("FILE:LINE: message")
    idl.services["UserService"].methods["get"]   # Method(name, oneway, exceptions={"NotFound": 1})
    idl.method_names()                           # frozenset of bare method names
    idl.oneway_methods()                         # bare names, and `Svc:method` for multiplexed calls
    idl.exception_ids()                          # {method: {exception type name: result field id}}

Only the file's own services count (an `extends` brings the parent's methods in); services that
sit in included files alone are not this listener's. Includes resolve against the including
file's folder, then the top file's folder — never the working directory. A parse reads the
files every time (a reload sees an edited include): thriftpy2's module cache is left as found.
Every file the parser opens goes through `_Opener`: a regular file of at most MAX_IDL_FILE bytes
(a FIFO would hold the reading thread in `open()`), MAX_IDL_FILES and MAX_IDL_BYTES in all.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fnmatch
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["Idl", "IdlError", "Method", "Service", "config_problems", "load"]


class IdlError(Exception):
    """The IDL cannot be used; the message starts with `FILE:LINE:` when the parser knows them."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = path
        self.line = line
        self.message = message
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


@dataclass(frozen=True)
class Method:
    name: str
    oneway: bool
    # exception type name → its field id in the method's result struct (the id a reply carries)
    exceptions: Mapping[str, int]


@dataclass(frozen=True)
class Service:
    name: str
    methods: Mapping[str, Method]  # in IDL order, inherited (`extends`) methods last


@dataclass(frozen=True)
class Idl:
    path: Path
    services: Mapping[str, Service]

    def methods(self) -> list[tuple[str, Method]]:
        """(service name, method) for every method of every service."""
        return [(s.name, m) for s in self.services.values() for m in s.methods.values()]

    def method_names(self) -> frozenset[str]:
        """Bare method names, as a non-multiplexed client sends them."""
        return frozenset(m.name for _, m in self.methods())

    def known_methods(self) -> frozenset[str]:
        """Every name a client may send: bare, and `Svc:method` (TMultiplexedProtocol)."""
        return self.method_names() | {f"{s}:{m.name}" for s, m in self.methods()}

    def oneway_methods(self) -> frozenset[str]:
        """Names to treat as oneway even when they arrive as CALL.

        `Svc:method` for each oneway method; the bare name only when no service of the file
        declares that name as a normal (replying) method, so a clash never leaves a client
        waiting for a reply the proxy would not send.
        """
        replying = {m.name for _, m in self.methods() if not m.oneway}
        names = set()
        for service, m in self.methods():
            if m.oneway:
                names.add(f"{service}:{m.name}")
                if m.name not in replying:
                    names.add(m.name)
        return frozenset(names)

    def exception_ids(self) -> dict[str, dict[str, int]]:
        """Bare method → {exception type name: result field id}, for `RetryPolicy`.

        A method name declared by several services keeps only the exceptions whose id agrees
        in all of them (the pipeline matches replies on the bare name).
        """
        out: dict[str, dict[str, int]] = {}
        clash: set[tuple[str, str]] = set()
        for _, m in self.methods():
            ids = out.setdefault(m.name, {})
            for name, fid in m.exceptions.items():
                if ids.setdefault(name, fid) != fid:
                    clash.add((m.name, name))
        for method, name in clash:
            del out[method][name]
        return out


# --------------------------------------------------------------------------------------------
# Reading


_AT_LINE = re.compile(r",? at line (\d+)")
_OF_FILE = re.compile(r" of the file '(.*)'$")
_NO_INCLUDE = re.compile(r"Couldn't include thrift (.*) in any directories provided")


def load(path: str | os.PathLike) -> Idl:
    """Parse the IDL at `path` and its includes; IdlError for anything unusable."""
    shown = os.fspath(path)
    try:  # imported here: only configs with `idl:` need it
        from thriftpy2.parser import parser as tp
        from thriftpy2.parser.exc import ThriftParserError
    except ImportError as e:
        raise IdlError(shown, None, f"reading an IDL needs the thriftpy2 package ({e})") from None

    top = os.path.abspath(shown)
    if not os.path.exists(top):
        raise IdlError(shown, None, "no such file")
    if not top.endswith(".thrift"):
        raise IdlError(shown, None, "an IDL file name must end with .thrift")
    lock = getattr(tp, "_parse_lock", None) or contextlib.nullcontext()
    cache = getattr(tp, "_thrift_cache", None)
    try:
        with lock:  # (the parser's own lock: what it shares, and `open`, are ours meanwhile)
            saved = dict(cache) if isinstance(cache, dict) else None  # includes are cached by
            had = tp.__dict__.get("open")                             # name: keep none of ours
            tp.open = _Opener(shown, top)
            try:
                module = tp.parse(top, include_dirs=[os.path.dirname(top)], enable_cache=False)
            finally:
                if had is None:
                    del tp.open
                else:
                    tp.open = had
                if saved is not None:
                    cache.clear()
                    cache.update(saved)
    except ThriftParserError as e:
        raise _parse_error(shown, top, str(e)) from None
    except OSError as e:
        raise IdlError(e.filename or shown, None, e.strerror or str(e)) from None
    except UnicodeDecodeError as e:
        raise IdlError(shown, None, f"not UTF-8 text ({e.reason})") from None
    except RecursionError:
        raise IdlError(shown, None, "includes or types nest too deeply") from None
    except Exception as e:  # the parser choked on something it has no message for
        raise IdlError(shown, None, f"cannot be parsed ({type(e).__name__}: {e})") from None

    # (a file with no declarations at all has no __thrift_meta__)
    meta = getattr(module, "__thrift_meta__", None) or {}
    services = {cls.__name__: _service(cls) for cls in meta.get("services", [])}
    if not services:
        raise IdlError(shown, None, "declares no service")
    return Idl(Path(shown), MappingProxyType(services))


MAX_IDL_FILE = 4 * 1024 * 1024  # bytes in one IDL file (a large service's IDL is ~100 KB)
MAX_IDL_BYTES = 16 * 1024 * 1024  # bytes of all the files one parse opens
MAX_IDL_FILES = 256  # files one parse may open, the top one counted (each time it is reached)


class _Opener:
    """thriftpy2's `open` while it parses one IDL (it opens the top file and every include
    through that name). Each file must be a regular file (a FIFO would hold the parsing thread
    in `open()` until some writer came; a device is endless) of at most MAX_IDL_FILE bytes; one
    parse opens at most MAX_IDL_FILES files and MAX_IDL_BYTES (includes reached by many paths
    are parsed once per path). It is read here, whole, and handed over as text."""

    def __init__(self, shown: str, top: str) -> None:
        self.shown, self.top = shown, top
        self.files = self.bytes = 0

    def __call__(self, file: str, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                 **_: Any) -> io.StringIO:
        from proxy.config import read_regular  # (the O_NONBLOCK read the config's own files get)

        name = self.shown if file == self.top else file
        via = "" if file == self.top else f" (included by way of {self.shown})"
        self.files += 1
        if self.files > MAX_IDL_FILES:
            raise OSError(errno.EMLINK, f"its includes open more than {MAX_IDL_FILES} files", self.shown)
        raw, kind = read_regular(file, MAX_IDL_FILE + 1)
        if kind is not None:
            raise OSError(errno.EINVAL, f"must be a regular file; it is {kind}{via}", name)
        if len(raw) > MAX_IDL_FILE:
            raise OSError(errno.EFBIG, f"larger than {MAX_IDL_FILE // (1024 * 1024)} MiB{via}", name)
        self.bytes += len(raw)
        if self.bytes > MAX_IDL_BYTES:
            raise OSError(errno.EFBIG, f"its includes come to more than {MAX_IDL_BYTES // (1024 * 1024)} MiB "
                                       "(an include reached by many paths is read once per path)", self.shown)
        return io.StringIO(raw.decode(encoding or "utf-8"))


def _parse_error(shown: str, top: str, text: str) -> IdlError:
    """thriftpy2's message as `FILE:LINE: message`.

    Only syntax errors name their file (maybe an include); the others (an illegal character,
    an unknown type) give a line in whichever file was being read, shown with the top file.
    """
    where = shown
    m = _OF_FILE.search(text)
    if m:
        where = shown if os.path.abspath(m.group(1)) == top else m.group(1)
        text = text[:m.start()]
    line = None
    m = _AT_LINE.search(text)
    if m:
        line = int(m.group(1))
        text = text[:m.start()] + text[m.end():]
    m = _NO_INCLUDE.match(text)
    if m:
        text = (f"include \"{m.group(1)}\" not found (looked in the including file's folder "
                "and the top IDL file's folder)")
    elif text.startswith("Grammar error at EOF"):
        text = "syntax error: unexpected end of file"
    elif text.startswith("Grammar error "):
        text = "syntax error at " + text[len("Grammar error "):]
    return IdlError(where, line, text)


def _service(cls: Any) -> Service:
    methods = {}
    for name in cls.thrift_services:
        result = getattr(cls, f"{name}_result")
        exceptions: dict[str, int] = {}
        for fid, spec in sorted(result.thrift_spec.items()):
            if fid != 0 and len(spec) > 2 and isinstance(spec[2], type):
                exceptions.setdefault(spec[2].__name__, fid)  # the same type twice: its first id
        methods[name] = Method(name, bool(getattr(result, "oneway", False)), MappingProxyType(exceptions))
    return Service(cls.__name__, MappingProxyType(methods))


# --------------------------------------------------------------------------------------------
# Checking a config


def config_problems(config: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """(key path, message) for each listener IDL that cannot be read and each `on_exceptions`
    name that cannot be resolved: without an `idl`, or declared by no method of it."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for i, listener in enumerate(config.listeners):
        problems += listener_problems(i, listener)
    return problems


def listener_problems(i: int, listener: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """`config_problems` for one valid listener, the `i`th (also when other parts of the
    config are invalid: every problem is reported in one go)."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    try:
        idl = listener.parsed_idl
    except IdlError as e:
        return [(("listeners", i, "idl"), str(e))]
    declared = (sorted({n for ids in idl.exception_ids().values() for n in ids})
                if idl is not None else [])
    if idl is not None:
        problems += _method_problems(i, listener, idl)
    for j, route in enumerate(listener.routes):
        for k, ref in enumerate(route.retry.on_exceptions):
            if not isinstance(ref, str):
                continue
            loc = ("listeners", i, "routes", j, "retry", "on_exceptions", k)
            if idl is None:
                problems.append((loc, f"exception name '{ref}' needs the listener's idl "
                                      "(or give the result field id)"))
            elif ref not in declared:
                hint = difflib.get_close_matches(ref, declared, n=1)
                problems.append((loc, f"no method in {idl.path.name} declares exception '{ref}'"
                                      + (f" (did you mean '{hint[0]}'?)" if hint else "")))
    return problems


def _method_problems(i: int, listener: Any, idl: Idl) -> list[tuple[tuple[str | int, ...], str]]:
    """Method names a listener with an IDL names that its IDL does not declare (a typo: the
    route or retry rule would never apply), and `oneway_methods` the IDL declares with a reply
    (their replies would be dropped, their clients left waiting)."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    names = sorted(idl.method_names())
    replying = {m.name for _, m in idl.methods() if not m.oneway} | {
        f"{s}:{m.name}" for s, m in idl.methods() if not m.oneway}

    def unknown(loc: tuple[str | int, ...], pattern: str) -> None:
        rx = re.compile(fnmatch.translate(pattern))  # (as the router and the retry policy match)
        if not any(rx.match(n) for n in names):
            hint = difflib.get_close_matches(pattern, names, n=1)
            problems.append((loc, f"method '{pattern}' matches no method of {idl.path.name}"
                                  + (f" (did you mean '{hint[0]}'?)" if hint else "")))

    for k, name in enumerate(listener.oneway_methods):
        loc = ("listeners", i, "oneway_methods", k)
        if name in replying:
            problems.append((loc, f"'{name}' is not oneway in {idl.path.name}: its replies would be dropped "
                                  "and its clients left waiting (the idl's oneway methods need no listing)"))
        elif name not in idl.known_methods():
            unknown(loc, name)
    for j, route in enumerate(listener.routes):
        if route.match is not None and route.match.method is not None:
            unknown(("listeners", i, "routes", j, "match", "method"), route.match.method)
        if not isinstance(route.retry.idempotent, bool):
            for k, glob in enumerate(route.retry.idempotent):
                unknown(("listeners", i, "routes", j, "retry", "idempotent", k), glob)
    return problems
