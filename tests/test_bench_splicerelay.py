"""bench/splicerelay.py, the splice(2) floor relay of `make bench`'s large section: every byte
arrives, in order, both ways, and a close on either side closes the other. Real sockets; the
relay runs as `bench/run.sh` runs it (its own process)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.harness import free_port, listening, wait_for

RELAY = Path(__file__).resolve().parents[1] / "bench" / "splicerelay.py"

pytestmark = pytest.mark.skipif(not hasattr(os, "splice"), reason="os.splice: Linux, Python 3.10+")


def _echo_server():
    """A thread that echoes each accepted connection's bytes until it closes; returns its listening
    socket (closing it stops the thread)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve_one(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept():
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock


@pytest.fixture
def relay():
    upstream = _echo_server()
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(RELAY), "--listen", f"127.0.0.1:{port}",
                             "--upstream", f"127.0.0.1:{upstream.getsockname()[1]}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: listening(port) or proc.poll() is not None, what="the relay listening")
        assert proc.poll() is None, proc.stdout.read()
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        upstream.close()


def test_every_byte_arrives_in_order_both_ways(relay):
    payload = os.urandom(3 << 20) + b"end"  # over the pipe's capacity: the sink fills, reading waits
    with socket.create_connection(("127.0.0.1", relay), timeout=30) as c:  # (a byte lost: no hang)
        sender = threading.Thread(target=c.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = c.recv(1 << 16)
            assert chunk, f"closed after {len(got)} of {len(payload)} bytes"
            got += chunk
        sender.join()
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


def test_a_close_on_one_side_closes_the_other(relay):
    with socket.create_connection(("127.0.0.1", relay)) as c:
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"
        c.shutdown(socket.SHUT_WR)  # the client's FIN: the relay closes both legs
        c.settimeout(5)
        assert c.recv(16) == b""
