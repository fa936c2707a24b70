"""The compiled twins: which run.

Five modules have a compiled twin (C, built by `pip install`; see setup.py) of a pure-Python
reference: proxy.codec.scan (`_scan`), proxy.codec.message (`_message`), proxy.metrics
(`proxy._hops`), proxy.sockets (`proxy._sockq`) and proxy.otlp (`proxy._otlp`). Each picks its
twin with these two helpers, so "not built" and "forced pure" mean the same everywhere.

    load("proxy.codec._message")   the compiled module, or None when it was not built
    pure_forced()                  THRIFT_SIDECAR_PURE_PYTHON=1 (or one of `also`) asks for the
                                   pure-Python twins (tests run the codec and metrics so)
"""

from __future__ import annotations

import importlib
import os

PURE_PYTHON = "THRIFT_SIDECAR_PURE_PYTHON"


def load(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def pure_forced(*also: str) -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in (PURE_PYTHON, *also))
