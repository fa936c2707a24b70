"""Build settings for the compiled parts, each the twin of a pure-Python reference:

    proxy.codec._scan      the unframed-message scanner (proxy.codec.scan; SCANNER_IMPL)
    proxy.codec._message   Message's fields and the one-read framed shortcut (proxy.codec.message; TAKE_IMPL)
    proxy._hops            a finished call's hop histograms (proxy.metrics; HOPS_IMPL)
    proxy._sockq           a TCP socket's queue sizes, GIL held (proxy.sockets; SOCKQ_IMPL)
    proxy._otlp            a call's spans as OTLP protobuf (proxy.otlp; SPANS_IMPL)

Everything else about the package is in pyproject.toml. The extensions are optional:
if one cannot be compiled (no C compiler or Python headers) the build warns and goes
on, and its module falls back to the pure-Python twin (the *_IMPL name says which one
runs; tests/test_scanner_compiled.py and tests/test_codec_take.py fail `make test`
without the compiled ones).
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(name, sources=[source], optional=True,
                  extra_compile_args=["-O3"] if os.name == "posix" else [])
        for name, source in [
            ("proxy.codec._scan", "proxy/codec/_scan.c"),
            ("proxy.codec._message", "proxy/codec/_message.c"),
            ("proxy._hops", "proxy/_hops.c"),
            ("proxy._sockq", "proxy/_sockq.c"),
            ("proxy._otlp", "proxy/_otlp.c"),
        ]
    ],
)
