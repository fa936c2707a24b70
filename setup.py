"""Build settings for the one compiled part: the unframed-message scanner `proxy.codec._scan`.

Everything else about the package is in pyproject.toml. The extension is optional:
if it cannot be compiled (no C compiler or Python headers) the build warns and goes
on, and `proxy.codec.scan` falls back to its pure-Python scanner (SCANNER_IMPL says
which one runs; tests/test_scanner_compiled.py fails `make test` without the compiled one).
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.codec._scan",
            sources=["proxy/codec/_scan.c"],
            optional=True,
            extra_compile_args=["-O3"] if os.name == "posix" else [],
        ),
    ],
)
