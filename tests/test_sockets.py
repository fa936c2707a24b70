"""proxy.sockets' queue sizes: the compiled twins (proxy._sockq) are built, and agree with the
pure ones (fcntl.ioctl) on real loopback sockets: empty, with bytes waiting to be read, with
bytes the kernel could not send yet (the peer's window full), and on fds that are not TCP."""

from __future__ import annotations

import os
import socket
import time

import pytest

from proxy import sockets
from proxy.codec.twins import load

_sockq = load("proxy._sockq")


def test_compiled_socket_queues_are_built():
    """`make test` runs the compiled ioctls: a build that silently fell back to fcntl fails here."""
    if os.environ.get("THRIFT_SIDECAR_PURE_PYTHON", "") not in ("", "0"):
        assert sockets.SOCKQ_IMPL == "python" and sockets.unsent_bytes is sockets.pure_unsent_bytes
        return
    assert _sockq is not None, (
        "proxy._sockq is not built: `pip install -e .` (make deps) compiles proxy/_sockq.c")
    assert sockets.SOCKQ_IMPL == "c"
    assert sockets.unsent_bytes is _sockq.unsent_bytes and sockets.unread_bytes is _sockq.unread_bytes
    assert sockets.peer_closed is _sockq.peer_closed


def _pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback pair (client side, server side)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    return a, b


def _fill(a: socket.socket) -> int:
    """Write to `a` until its peer's window and its own send buffer are full; the bytes written."""
    a.setblocking(False)
    sent = 0
    try:
        while True:
            sent += a.send(b"y" * 65536)
    except BlockingIOError:
        return sent


def _both(fd: int) -> tuple[tuple[int, int], tuple[int, int]]:
    pure = (sockets.pure_unsent_bytes(fd), sockets.pure_unread_bytes(fd))
    compiled = (_sockq.unsent_bytes(fd), _sockq.unread_bytes(fd))
    return pure, compiled


@pytest.mark.skipif(_sockq is None, reason="proxy._sockq not built (test_compiled_socket_queues_are_built says so)")
def test_twins_agree_on_loopback_queues():
    a, b = _pair()
    try:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: bytes stay unsent
        pure, compiled = _both(a.fileno())
        assert pure == compiled == (0, 0)

        a.sendall(b"x" * 1000)
        for _ in range(100):  # (loopback delivers at once; this only bounds a slow kernel)
            if sockets.pure_unread_bytes(b.fileno()) >= 1000:
                break
            time.sleep(0.01)
        pure, compiled = _both(b.fileno())
        assert pure == compiled == (0, 1000)

        sent = _fill(a)
        pure, compiled = _both(a.fileno())
        assert pure == compiled
        assert compiled[0] > 0, "the sender's queue holds bytes the full peer could not take"
        assert compiled[0] <= sent
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(_sockq is None, reason="proxy._sockq not built")
def test_twins_agree_on_fds_that_are_not_tcp_sockets():
    r, w = os.pipe()
    os.write(w, b"abc")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed = socket.socket()
    dead = closed.fileno()
    closed.close()
    try:
        for fd in (r, w, udp.fileno(), dead, 1 << 20, -1):
            pure, compiled = _both(fd)
            assert pure == compiled, fd
        assert _sockq.unread_bytes(r) == 3  # FIONREAD works on a pipe too, as fcntl's does
        assert _sockq.unsent_bytes(dead) == 0
        with pytest.raises(TypeError):
            _sockq.unsent_bytes("3")
    finally:
        os.close(r)
        os.close(w)
        udp.close()


def _closed_both(fd: int) -> bool:
    pure, compiled = sockets.pure_peer_closed(fd), _sockq.peer_closed(fd)
    assert pure == compiled, fd
    return compiled


@pytest.mark.skipif(_sockq is None, reason="proxy._sockq not built")
def test_twins_agree_on_a_peers_close_waiting_unread():
    """peer_closed: the FIN (or reset) waiting behind bytes not read yet is seen; bytes alone
    are not a close; nothing is consumed by looking."""
    a, b = _pair()
    c, d = _pair()
    r, w = os.pipe()
    try:
        assert not _closed_both(a.fileno())  # nothing yet
        b.sendall(b"reply")
        time.sleep(0.02)
        assert not _closed_both(a.fileno())  # bytes waiting are not a close
        b.shutdown(socket.SHUT_WR)
        time.sleep(0.02)
        assert a.recv(100) == b"reply"  # the look consumed nothing
        assert _closed_both(a.fileno())  # the FIN, unread
        d.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        d.close()  # a reset
        time.sleep(0.02)
        assert _sockq.peer_closed(c.fileno()) is True
        for fd in (r, w, -1, 1 << 20):  # not a TCP socket: nothing to tell
            assert _closed_both(fd) is False, fd
    finally:
        for s in (a, b, c):
            s.close()
        os.close(r)
        os.close(w)


def test_sent_bytes_counts_what_left_the_send_queue_and_survives_a_reset():
    a, b = _pair()
    try:
        if sockets.sent_bytes(a.fileno()) is None:
            pytest.skip("TCP_INFO tcpi_bytes_sent not available (Linux >= 4.19)")
        assert sockets.sent_bytes(a.fileno()) == 0
        a.sendall(b"x" * 12345)
        time.sleep(0.05)
        assert sockets.sent_bytes(a.fileno()) == 12345
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        written = 12345 + _fill(a)
        time.sleep(0.05)
        left = sockets.sent_bytes(a.fileno())
        assert left + sockets.unsent_bytes(a.fileno()) == written  # the two views agree
        b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        b.close()
        time.sleep(0.05)
        with pytest.raises(OSError):
            a.send(b"z")
        assert sockets.sent_bytes(a.fileno()) == left  # the count of what left stays after a reset
    finally:
        a.close()
        b.close()
    assert sockets.sent_bytes(-1) is None
