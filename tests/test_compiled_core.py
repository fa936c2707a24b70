"""The per-call core compiled by mypyc (proxy.compiled): built, never stale, and its fallback works.

`pip install -e .` (make deps) compiles proxy.compiled.MODULES from their own sources; every
other test runs them compiled. Here: `make test` fails if the build silently fell back to pure
Python; a source edited after the build runs as Python, never as the old compiled code; and the
pure-core pass: the data-path tests pass with the pure-Python core too (THRIFT_SIDECAR_PURE_CORE=1),
so the fallback a machine without a C compiler gets is a working proxy, and so do the tests the
compiled core skips (marked pure_core: they replace one of its methods).
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import compiled

ROOT = Path(__file__).resolve().parent.parent
FORCED = [v for v in (compiled.PURE_PYTHON, compiled.PURE_CORE) if os.environ.get(v, "") not in ("", "0")]
EXTENSION = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def test_the_per_call_core_is_compiled_and_runs_so():
    """A build that fell back to pure Python (mypy missing, a type error, no compiler) fails here."""
    modules = [sys.modules.get(m) or __import__(m, fromlist=["_"]) for m in compiled.MODULES]
    if FORCED:
        assert compiled.IMPL == "python" and compiled.WHY == f"forced ({FORCED[0]})"
        assert all(m.__file__.endswith(".py") for m in modules)
        return
    assert compiled.IMPL == "mypyc", (
        f"the per-call core runs as pure Python ({compiled.WHY}): `make deps` compiles it with mypyc; "
        "look for a 'warning: mypyc' or 'per-call core' line in the pip install output")
    assert compiled.WHY == ""
    for m in modules:
        assert m.__file__.endswith(EXTENSION), m.__file__


def _copy_package(tmp_path: Path) -> Path:
    """The installed package (built extensions and build record too) copied under tmp_path."""
    shutil.copytree(ROOT / "proxy", tmp_path / "proxy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    return tmp_path


def _which(path: Path, **env) -> list[str]:
    """IMPL, WHY and pipeline's file, as a fresh interpreter importing the copy says them."""
    code = ("import proxy.compiled as c, proxy.pipeline as p, proxy.listener as l\n"
            "print(c.IMPL); print(c.WHY); print(p.__file__); print(l.__file__)")
    env = {k: v for k, v in os.environ.items() if k not in (compiled.PURE_PYTHON, compiled.PURE_CORE)} | env
    r = subprocess.run([sys.executable, "-c", code], cwd=path, env=dict(env, PYTHONPATH=str(path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.skipif(compiled.IMPL != "mypyc", reason="needs the compiled core (see the test above)")
def test_a_source_edited_after_the_build_runs_as_python_never_as_the_old_build(tmp_path):
    """An editable install whose pipeline.py was edited: the edit runs (every core module from its
    source, so none calls into the other's old build), and WHY says which file and what to do."""
    pkg = _copy_package(tmp_path)
    impl, why, pipeline, listener = _which(pkg)
    assert (impl, why) == ("mypyc", "") and pipeline.endswith(EXTENSION) and listener.endswith(EXTENSION)

    with open(pkg / "proxy" / "pipeline.py", "a") as f:
        f.write("\n# an edit after the build\n")
    impl, why, pipeline, listener = _which(pkg)
    assert impl == "python"
    assert why == "stale: pipeline.py changed since the build (run `make deps`)"
    assert pipeline == str(pkg / "proxy" / "pipeline.py") and listener == str(pkg / "proxy" / "listener.py")

    (pkg / "proxy" / compiled.BUILD_RECORD).unlink()  # an older build, or one that did not finish
    impl, why, *_ = _which(pkg)
    assert (impl, why) == ("python", f"stale: {compiled.BUILD_RECORD} is missing or unreadable (run `make deps`)")


@pytest.mark.skipif(compiled.IMPL != "mypyc", reason="needs the compiled core")
def test_the_core_can_be_forced_to_python_and_a_copy_without_extensions_is_python(tmp_path):
    pkg = _copy_package(tmp_path)
    impl, why, pipeline, _ = _which(pkg, THRIFT_SIDECAR_PURE_CORE="1")
    assert (impl, why) == ("python", "forced (THRIFT_SIDECAR_PURE_CORE)") and pipeline.endswith(".py")
    for f in (pkg / "proxy").iterdir():
        if f.name.endswith(EXTENSION) and (f.name.startswith("_core__mypyc") or
                                           any(f.name.startswith(m.rpartition(".")[2] + ".")
                                               for m in compiled.MODULES)):
            f.unlink()
    impl, why, pipeline, _ = _which(pkg)
    assert (impl, why) == ("python", "not built") and pipeline.endswith(".py")


PURE_CORE_PASS = {
    # the data path, again, as the fallback runs it
    "data path": ["tests/test_compiled_core.py::test_the_per_call_core_is_compiled_and_runs_so",
                  "tests/test_datapath.py", "tests/test_upstream_faults.py", "tests/test_pool.py"],
    # the tests the compiled core skips: they replace one of its methods (conftest.py)
    "marked pure_core": ["-m", "pure_core", "tests"],
}


@pytest.mark.slow
@pytest.mark.skipif(compiled.IMPL != "mypyc", reason="the core already runs as pure Python here")
@pytest.mark.parametrize("which", PURE_CORE_PASS)
def test_the_pure_core_pass(which):
    """The fallback is the same source, run by CPython: these tests, again, in a fresh pytest."""
    env = dict(os.environ, THRIFT_SIDECAR_PURE_CORE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PURE_CORE_PASS[which]]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1] and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
