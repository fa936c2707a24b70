"""Test-wide setup: `tests/` (for `harness`) and `tests/gen` (code generated from tests/idl) on sys.path."""

import os
import sys

# Imported now, not by its pytest plugin's terminal summary: there, in a run of files that never
# imported it (e.g. `pytest tests/test_reload.py`), CPython 3.11.7's ast.parse of it (pytest's
# assertion rewriting) failed with "SystemError: AST constructor recursion depth mismatch" after
# the tests had passed, and the run exited 1.
import hypothesis  # noqa: F401

_TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (_TESTS, os.path.join(_TESTS, "gen")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
