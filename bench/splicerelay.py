#!/usr/bin/env python3
"""A byte relay that moves every byte with splice(2): the floor for a large message.

`../shared/bench/adapters/pyrelay.py` is the floor for any Python proxy that reads what it
passes on; this one reads nothing at all. Each direction of each connection is source socket ->
pipe -> sink socket in the kernel, no byte copied to user space and back, no Thrift parsing, no
pooling (one upstream connection per client connection, round robin). Whatever a proxy adds to
a 10 MB reply beyond what this adds on the same machine is the proxy's; what this adds is the
machine's (loopback copies, wakeups, three busy processes on two cores). `bench/run.sh` runs it
as the `splicerelay` target of the large section; `bench/targets.py` reports its figure beside
the 10 MB target's.

    splicerelay.py --listen 127.0.0.1:9091 --upstream 127.0.0.1:9090[,host:port...]

Either side closing or failing closes both. Linux only (os.splice). Not a test; not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import itertools
import os
import signal
import socket
import sys

CHUNK = 1 << 20      # bytes asked of one splice from a socket (and the pipe's capacity asked for)
FLAGS = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE if hasattr(os, "splice") else 0


class Direction:
    """src socket -> pipe -> dst socket, driven by the loop's readiness callbacks."""

    def __init__(self, loop, src: int, dst: int, on_end) -> None:
        self.loop, self.src, self.dst, self.on_end = loop, src, dst, on_end
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, CHUNK)
        except OSError:
            pass  # the default capacity, then
        self.in_pipe = 0
        self.waiting_dst = False
        self.closed = False
        loop.add_reader(src, self._readable)

    def _readable(self) -> None:
        try:
            n = os.splice(self.src, self.w, CHUNK, flags=FLAGS)
        except BlockingIOError:
            return
        except OSError:
            self.on_end()
            return
        if n == 0:
            self.on_end()
            return
        self.in_pipe += n
        if not self._drain() and not self.closed:  # the sink is full: read again once it takes more
            self.loop.remove_reader(self.src)
            self.waiting_dst = True
            self.loop.add_writer(self.dst, self._writable)

    def _drain(self) -> bool:
        """Write what the pipe holds; False when the sink socket is full (or failed)."""
        while self.in_pipe:
            try:
                self.in_pipe -= os.splice(self.r, self.dst, self.in_pipe, flags=FLAGS)
            except BlockingIOError:
                return False
            except OSError:
                self.on_end()
                return False
        return True

    def _writable(self) -> None:
        if self._drain():  # (False too when writing failed: closed then)
            self.loop.remove_writer(self.dst)
            self.waiting_dst = False
            self.loop.add_reader(self.src, self._readable)

    def close(self) -> None:
        self.closed = True
        self.loop.remove_reader(self.src)
        if self.waiting_dst:
            self.loop.remove_writer(self.dst)
        os.close(self.r)
        os.close(self.w)


class Connection:
    def __init__(self, loop, down: socket.socket, up: socket.socket) -> None:
        self.down, self.up, self.closed = down, up, False
        self.ways = (Direction(loop, down.fileno(), up.fileno(), self.close),
                     Direction(loop, up.fileno(), down.fileno(), self.close))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for way in self.ways:
            way.close()
        self.down.close()
        self.up.close()


def hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(listen: str, upstreams: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    ups = itertools.cycle(upstreams)
    lsock = socket.create_server(hostport(listen), backlog=1024, reuse_port=False)
    lsock.setblocking(False)

    async def connect(down: socket.socket) -> None:
        host, port = next(ups)
        up = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await loop.sock_connect(up, (host, port))
        except OSError as e:
            print(f"splicerelay: upstream {host}:{port}: {e}", file=sys.stderr)
            up.close()
            down.close()
            return
        Connection(loop, down, up)

    def accept() -> None:
        while True:
            try:
                down, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # (out of fds): the next accept may do
                print(f"splicerelay: accept: {e}", file=sys.stderr)
                return
            down.setblocking(False)
            down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop.create_task(connect(down))

    loop.add_reader(lsock.fileno(), accept)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"splicerelay: listening {listen} -> {','.join(f'{h}:{p}' for h, p in upstreams)} "
          f"loop={type(loop).__module__}", flush=True)
    await stop.wait()
    loop.remove_reader(lsock.fileno())
    lsock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="host:port")
    ap.add_argument("--upstream", required=True, help="host:port[,host:port...]")
    ap.add_argument("--no-uvloop", action="store_true")
    args = ap.parse_args(argv)
    if not hasattr(os, "splice"):
        print("splicerelay: os.splice is not available here (Linux, Python 3.10+)", file=sys.stderr)
        return 2
    run = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop
            run = uvloop.run
        except ImportError:
            pass
    run(serve(args.listen, [hostport(u) for u in args.upstream.split(",") if u]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
