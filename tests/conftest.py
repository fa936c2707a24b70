"""Test-wide setup: `tests/` (for `harness`) and `tests/gen` (code generated from tests/idl) on sys.path."""

import os
import sys

# Imported now, not by its pytest plugin's terminal summary: there, in a run of files that never
# imported it (e.g. `pytest tests/test_reload.py`), CPython 3.11.7's ast.parse of it (pytest's
# assertion rewriting) failed with "SystemError: AST constructor recursion depth mismatch" after
# the tests had passed, and the run exited 1.
import hypothesis  # noqa: F401
import pytest


_TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (_TESTS, os.path.join(_TESTS, "gen")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_collection_modifyitems(config, items):
    """Tests marked pure_core replace a method of the per-call core, as Python lets them only when
    it runs from its sources: with the compiled core they are skipped here and run in
    tests/test_compiled_core.py's pure-core pass (a fresh pytest with THRIFT_SIDECAR_PURE_CORE=1)."""
    from proxy import compiled

    if compiled.IMPL != "mypyc":
        return
    skip = pytest.mark.skip(reason="replaces a per-call core method: run by test_compiled_core.py's pure-core pass")
    for item in items:
        if item.get_closest_marker("pure_core"):
            item.add_marker(skip)
