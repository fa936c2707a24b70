"""Active health checks against real upstreams that answer wrong. A check that fails is that
endpoint's failed check with a reason worth logging.
"""

from __future__ import annotations

import asyncio

from harness import ThriftServer
from proxy.codec import Framing, Protocol
from proxy.health import check_once


def check(port: int, method: str = "ping") -> str | None:
    return asyncio.run(check_once("127.0.0.1", port, method, Framing.FRAMED, Protocol.BINARY, 5.0))


def test_an_unknown_method_is_logged_with_the_exception_type_and_message():
    up = ThriftServer()
    try:
        assert check(up.port, "no_such_method") == (
            "TApplicationException UNKNOWN_METHOD: Unknown function no_such_method")
        up.handler.throw = {"ping"}
        assert check(up.port).startswith("TApplicationException INTERNAL_ERROR")
    finally:
        up.stop()
