"""The compiled per-call core: whether it runs, and the pure-Python fallback.

The modules every call runs through (MODULES: calls, window, pipeline, listener, upstream) are
plain, type-annotated Python. When `pip install` finds mypy (a build requirement, see setup.py),
mypyc compiles them to C; each then imports as an extension module beside its .py source.
Same source, same behaviour, about a quarter less CPU per call.

A compiled module that no longer matches its source would run code nobody can read (an
editable install whose .py was edited after the build), so the build records each source's
SHA-256 (BUILD_RECORD, written by setup.py) and `choose()` compares them at import. Any
difference, a missing record, THRIFT_SIDECAR_PURE_PYTHON=1 or THRIFT_SIDECAR_PURE_CORE=1 puts a finder first on sys.meta_path
that loads those modules from their .py files, and IMPL says why:

    IMPL    "mypyc" or "python"
    WHY     why "python" ("" when compiled): "not built", "forced (THRIFT_SIDECAR_PURE_PYTHON)",
            "stale: pipeline.py changed since the build (run `make deps`)"

`proxy/__init__.py` calls choose() before any of them is imported; the server logs IMPL and WHY
once at start. This module imports nothing of the project (setup.py reads MODULES from it).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

MODULES = ("proxy.calls", "proxy.window", "proxy.pipeline", "proxy.listener", "proxy.upstream")
BUILD_RECORD = "_compiled.json"   # beside the sources: {"pipeline.py": sha256 hex, ...}
PURE_PYTHON = "THRIFT_SIDECAR_PURE_PYTHON"   # every compiled part off (proxy.codec.twins)
PURE_CORE = "THRIFT_SIDECAR_PURE_CORE"       # this one only (to compare the two)

IMPL = "python"
WHY = "not chosen yet"

_HERE = os.path.dirname(os.path.abspath(__file__))


def source(module: str) -> str:
    """A core module's .py file."""
    return os.path.join(_HERE, module.rpartition(".")[2] + ".py")


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _built() -> bool:
    """Whether any core module has an extension beside its source."""
    names = set(os.listdir(_HERE))
    return any(m.rpartition(".")[2] + suffix in names
               for m in MODULES for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _stale() -> str:
    """"" when every source is the one compiled, else which is not."""
    try:
        with open(os.path.join(_HERE, BUILD_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return f"stale: {BUILD_RECORD} is missing or unreadable (run `make deps`)"
    for m in MODULES:
        name = m.rpartition(".")[2] + ".py"
        if record.get(name) != digest(source(m)):
            return f"stale: {name} changed since the build (run `make deps`)"
    return ""


class _PureFinder(importlib.abc.MetaPathFinder):
    """Loads the core modules from their .py sources, ahead of the extensions beside them."""

    def find_spec(self, name, path=None, target=None):
        if name in MODULES:
            return importlib.util.spec_from_file_location(name, source(name))
        return None


def choose() -> None:
    """Decide once, before the core is imported, whether it runs compiled (sets IMPL and WHY)."""
    global IMPL, WHY
    if IMPL == "mypyc" or any(isinstance(f, _PureFinder) for f in sys.meta_path):
        return
    forced = [v for v in (PURE_PYTHON, PURE_CORE) if os.environ.get(v, "") not in ("", "0")]
    if forced:
        WHY = f"forced ({forced[0]})"
    elif not _built():
        WHY = "not built"
    else:
        WHY = _stale()
        if not WHY:
            IMPL = "mypyc"
            return
    IMPL = "python"
    sys.meta_path.insert(0, _PureFinder())
