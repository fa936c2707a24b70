"""Test-wide setup: `tests/` (for `harness`) and `tests/gen` (code generated from tests/idl) on sys.path."""

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (_TESTS, os.path.join(_TESTS, "gen")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
