"""Build settings for the compiled parts.

Five C modules, each the twin of a pure-Python reference:

    proxy.codec._scan      the unframed-message scanner (proxy.codec.scan; SCANNER_IMPL)
    proxy.codec._message   Message's fields and the one-read framed shortcut (proxy.codec.message; TAKE_IMPL)
    proxy._hops            a finished call's hop histograms (proxy.metrics; HOPS_IMPL)
    proxy._sockq           a TCP socket's queue sizes, GIL held (proxy.sockets; SOCKQ_IMPL)
    proxy._otlp            a call's spans as OTLP protobuf (proxy.otlp; SPANS_IMPL)

and the per-call core (proxy.compiled.MODULES: calls, window, pipeline, listener, upstream),
compiled from its own Python source by mypyc (mypy is a build requirement in pyproject.toml) into
one shared library, proxy._core__mypyc, and a small extension per module. The build records the
SHA-256 of each source it compiled (proxy/_compiled.json), so a compiled module never runs in
place of a source edited after the build (proxy.compiled.choose).

Everything else about the package is in pyproject.toml. Every compiled part is optional: if one
cannot be built (no C compiler, Python headers or mypy; a type error mypyc refuses) the build
warns and goes on, and the pure-Python code runs (the *_IMPL names say which does;
tests/test_scanner_compiled.py, tests/test_codec_take.py and tests/test_compiled_core.py fail
`make test` without the compiled ones). THRIFT_SIDECAR_PURE_PYTHON=1 at build time skips mypyc.
"""

import json
import os
import runpy
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CORE = runpy.run_path(os.path.join("proxy", "compiled.py"))
CORE_SOURCES = [os.path.join("proxy", m.rpartition(".")[2] + ".py") for m in CORE["MODULES"]]
CORE_LIB = "proxy._core"  # the shared library: proxy._core__mypyc


def c_twins():
    return [Extension(name, sources=[source], optional=True,
                      extra_compile_args=["-O3"] if os.name == "posix" else [])
            for name, source in [
                ("proxy.codec._scan", "proxy/codec/_scan.c"),
                ("proxy.codec._message", "proxy/codec/_message.c"),
                ("proxy._hops", "proxy/_hops.c"),
                ("proxy._sockq", "proxy/_sockq.c"),
                ("proxy._otlp", "proxy/_otlp.c"),
            ]]


def core():
    """The mypyc extensions of the per-call core ([] when mypyc is missing or refuses it)."""
    if os.environ.get(CORE["PURE_PYTHON"], "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("warning: mypyc not found: the per-call core stays pure Python", file=sys.stderr)
        return []
    try:
        return mypycify(["--follow-imports=silent", "--ignore-missing-imports", *CORE_SOURCES],
                        opt_level="3", group_name=CORE_LIB, target_dir="build/mypyc")
    except (Exception, SystemExit) as e:  # (mypyc exits on a type error, having printed it)
        print(f"warning: mypyc could not compile the per-call core ({e!r}): it stays pure Python",
              file=sys.stderr)
        return []


class BuildExt(build_ext):
    """Builds the C twins as they are; the core's extensions all or none, with their record."""

    def build_extensions(self):
        self._core_failed = False
        names = {e.name for e in self.extensions}
        has_core = CORE_LIB + "__mypyc" in names
        record = self._record_paths()[0] if not self.inplace else self._record_paths()[1]
        if os.path.exists(record):
            os.remove(record)  # (until the whole core is built again)
        super().build_extensions()
        if has_core and not self._core_failed:
            with open(record, "w", encoding="utf-8") as f:
                json.dump({os.path.basename(s): CORE["digest"](s) for s in CORE_SOURCES}, f, indent=1,
                          sort_keys=True)

    def copy_extensions_to_source(self):
        """(An editable install: the built files go beside the sources, the record too.)"""
        super().copy_extensions_to_source()
        built, inplace = self._record_paths()
        if os.path.exists(built):
            self.copy_file(built, inplace, level=self.verbose)
        elif os.path.exists(inplace):
            os.remove(inplace)

    def _record_paths(self):
        """The build record in the build directory, and beside the sources."""
        package_dir = self.get_finalized_command("build_py").get_package_dir("proxy")
        return (os.path.join(self.build_lib, "proxy", CORE["BUILD_RECORD"]),
                os.path.join(package_dir, CORE["BUILD_RECORD"]))

    def build_extension(self, ext):
        if not (ext.name.startswith(CORE_LIB) or ext.name in CORE["MODULES"]):
            return super().build_extension(ext)
        if self._core_failed:
            return
        try:
            super().build_extension(ext)
        except Exception as e:  # (a compiler's error: the rest of the core is not built either)
            self._core_failed = True
            print(f"warning: the per-call core could not be compiled ({e}): it stays pure Python",
                  file=sys.stderr)

setup(ext_modules=c_twins() + core(), cmdclass={"build_ext": BuildExt})
