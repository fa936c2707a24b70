"""Socket options, set in one place for both legs (accepted and dialed).

TCP_NODELAY is set by our own code on every socket: Nagle's algorithm with
delayed ACKs turns a split write into a 40 ms stall (one team's 14 s job took
210 s). asyncio and uvloop happen to set it too; we do not rely on that.
"""

from __future__ import annotations

import fcntl
from array import array
import logging
import resource
import socket
import struct
import termios

from proxy.codec.twins import load, pure_forced

log = logging.getLogger(__name__)


def set_nodelay(sock) -> bool:
    """Set TCP_NODELAY on a TCP socket; warn (once per call site) and go on if it fails."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True
    except OSError as e:
        log.warning("could not set TCP_NODELAY: %s", e)
        return False


def nodelay_of(sock) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the open-file soft limit to the hard limit (a sidecar holds many sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit to %d: %s", hard, e)
    return soft, hard


_OUT = array("i", [0])  # the ioctl result (the loop thread is its only user)
SIOCOUTQNSD = 0x894B  # Linux: bytes in a TCP socket's send queue not yet sent to the peer


def pure_unsent_bytes(fd: int) -> int:
    """Bytes written to a TCP socket that the kernel has not yet sent (SIOCOUTQNSD); 0 on error.

    0 means every byte left for the peer: on loopback, the client's kernel has them. We do not
    wait for ACKs (SIOCOUTQ): clients delay their ACK (Linux delayed ACKs, up to ~40 ms),
    which would pass for a slow reader, while a slow reader's full window keeps bytes unsent.
    The reference for the compiled `proxy._sockq.unsent_bytes`, which keeps the GIL (this one
    releases it: ~1.5 µs per call more while the span export thread lives).
    """
    try:
        fcntl.ioctl(fd, SIOCOUTQNSD, _OUT, True)  # fills _OUT in place: no bytes object per call
    except (OSError, ValueError):  # (ValueError: a negative fd, a connection not made yet)
        return 0
    return _OUT[0]


_IN = array("i", [0])


def pure_unread_bytes(fd: int) -> int:
    """Bytes that arrived on a TCP socket and are not read yet (FIONREAD); 0 on error."""
    try:
        fcntl.ioctl(fd, termios.FIONREAD, _IN, True)
    except (OSError, ValueError):
        return 0
    return _IN[0]


def pure_peer_closed(fd: int) -> bool:
    """Whether the peer's FIN or reset waits unread on a TCP socket: a non-blocking MSG_PEEK
    recv of one byte gives 0 bytes (or a reset). Bytes waiting are not a close (a TLS record).
    The reference for the compiled `proxy._sockq.peer_closed` (this one builds a socket object
    around the fd, not owned: detached again)."""
    if fd < 0:
        return False
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (ConnectionResetError, BrokenPipeError, TimeoutError, ConnectionAbortedError):
        return True
    except OSError:
        return False
    finally:
        s.detach()


_TCPI_BYTES_SENT = struct.Struct("=QQ")  # struct tcp_info's tcpi_bytes_sent, tcpi_bytes_retrans (Linux >= 4.19)
_TCPI_BYTES_SENT_AT = 200


def sent_bytes(fd: int) -> int | None:
    """Bytes written to a TCP socket that left its send queue for the peer, counted from the
    connection's start (TCP_INFO: tcpi_bytes_sent less tcpi_bytes_retrans): the same "nothing
    unsent" as `unsent_bytes`, as an offset in the stream, still valid after a reset (the
    socket's counters stay until it is closed). Not tcpi_bytes_acked: a client that read
    everything may reset before its delayed ACK goes out. None when it cannot be read (not
    Linux, an older kernel, a closed fd). Not per call: it builds a socket object around the fd
    (not owned: detached again)."""
    if fd < 0 or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    finally:
        s.detach()
    if len(info) < _TCPI_BYTES_SENT_AT + _TCPI_BYTES_SENT.size:
        return None
    sent, retransmitted = _TCPI_BYTES_SENT.unpack_from(info, _TCPI_BYTES_SENT_AT)
    return max(sent - retransmitted, 0)


_sockq = None if pure_forced() else load("proxy._sockq")
SOCKQ_IMPL = "c" if _sockq is not None else "python"  # which twin runs (tests/test_sockets.py)
unsent_bytes = _sockq.unsent_bytes if _sockq is not None else pure_unsent_bytes
unread_bytes = _sockq.unread_bytes if _sockq is not None else pure_unread_bytes
peer_closed = _sockq.peer_closed if _sockq is not None else pure_peer_closed
