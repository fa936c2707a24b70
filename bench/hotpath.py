"""The proxy's own CPU per call, without the kernel: the hot path driven by hand.

Builds the real objects from a config (Server, listener, pipeline, cluster, pool) and feeds
one client connection and one pooled upstream connection whole frames, with transports that
only count what is written. What it measures is exactly the Python work per call that the
socket benchmarks (`bench/run.sh`) cannot separate from syscalls and scheduling: request
framed, routed, balanced, pooled, written; reply framed, checked, classified, written back;
the call recorded (metrics, sampling). Not a test: nothing here decides pass or fail.

    .venv/bin/python bench/hotpath.py                 # ping, tracing off
    .venv/bin/python bench/hotpath.py --calls 200000 --profile   # + cProfile, top 25

It also splits each leg at its write (medians): the work before the request is written
upstream and before the reply is written to the client is what a lone client waits for (ping1's
added latency); the work after each write overlaps the upstream's and the client's own time.

A connected loopback TCP socket stands in for the client's, so the write_response ioctl
(SIOCOUTQNSD) is the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import socket
import struct
import sys
import statistics
import time
from pathlib import Path
from time import perf_counter_ns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop  # noqa: E402

from proxy import config as cfgmod  # noqa: E402
from proxy.listener import ClientConnection  # noqa: E402
from proxy.server import Server  # noqa: E402
from proxy.upstream import UpstreamConnection  # noqa: E402

CONFIG = """
listeners:
  - name: main
    service: BenchService
    listen: 127.0.0.1:0
    transport: framed
    protocol: binary
    routes:
      - cluster: up
clusters:
  - name: up
    endpoints: ["127.0.0.1:9"]
tracing: {exporter: none}
"""


class CountingTransport(asyncio.Transport):
    """Accepts writes and counts them; enough of a transport for the proxy's protocols."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        super().__init__()
        self.sock = sock
        self.written = 0
        self.writes = 0
        self.t_write = 0  # perf_counter_ns() of the last write

    def write(self, data) -> None:
        self.t_write = perf_counter_ns()
        self.writes += 1
        self.written += len(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        if name == "socket":
            return self.sock
        if name == "peername":
            return ("127.0.0.1", 1)
        return default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def frame(mtype: int, name: bytes, seqid: int, body: bytes = b"\x00") -> bytes:
    head = struct.pack("!Ii", 0x80010000 | mtype, len(name)) + name + struct.pack("!i", seqid)
    return struct.pack("!i", len(head) + len(body)) + head + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--config", help="a config file (its first listener and a pooled connection to "
                                     "the first endpoint of the cluster it routes to)")
    ap.add_argument("--profile", action="store_true", help="also run under cProfile, print the top 25")
    args = ap.parse_args()

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    config = cfgmod.load(args.config) if args.config else cfgmod.loads(CONFIG)
    server = Server(config, loop)
    lc = config.listeners[0]
    state = server.build_listener(lc)

    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    conn = ClientConnection(state)
    conn.connection_made(CountingTransport(a))

    cluster = server.clusters[lc.routes[0].cluster]
    ep = cluster.endpoints[0]
    pool = cluster.pool(ep, state.settings.framing, state.settings.protocol)
    up = UpstreamConnection(pool, pool.framing, pool.protocol, pool.settings.max_reply_size,
                            pool.settings.stream_threshold)
    up.connection_made(CountingTransport())
    pool.open += 1
    pool.idle.append(up)

    requests = [frame(1, b"ping", i) for i in range(256)]
    replies = [frame(2, b"ping", i) for i in range(256)]

    async def calls(n: int) -> float:
        client_in = conn.data_received
        up_in = up.data_received
        t0 = time.perf_counter()
        for i in range(n):
            j = i & 255
            client_in(requests[j])
            up_in(replies[j])
            if j == 255:  # the loop turns, as between a socket's reads: closed timer handles are freed
                await asyncio.sleep(0)
        return time.perf_counter() - t0

    def run(n: int) -> float:
        return loop.run_until_complete(calls(n))

    def split(n: int) -> list[float]:
        """Median ns per call: request leg before/after its upstream write, reply leg before/after
        its client write."""
        client_in = conn.data_received
        up_in = up.data_received
        up_t, client_t = up.transport, conn.transport
        parts = ([], [], [], [])
        for i in range(n):
            j = i & 255
            t0 = perf_counter_ns()
            client_in(requests[j])
            t1 = perf_counter_ns()
            up_in(replies[j])
            t2 = perf_counter_ns()
            parts[0].append(up_t.t_write - t0)
            parts[1].append(t1 - up_t.t_write)
            parts[2].append(client_t.t_write - t1)
            parts[3].append(t2 - client_t.t_write)
        return [statistics.median(p) for p in parts]

    run(2000)  # warm: specialisation, the method's metric labels
    gc.collect()
    best = min(run(args.calls) for _ in range(3))
    print(f"hot path: {best / args.calls * 1e6:.2f} µs per call (best of 3 x {args.calls:,} calls)")
    req_pre, req_post, rep_pre, rep_post = (x / 1000 for x in split(min(args.calls, 50_000)))
    print(f"  request: {req_pre:.2f} µs until written upstream, {req_post:.2f} after; "
          f"reply: {rep_pre:.2f} µs until written to the client, {rep_post:.2f} after (medians)")
    print(f"  before the writes: {req_pre + rep_pre:.2f} µs (what a lone client waits for)")
    served = state.pipeline.stats["calls"]
    print(f"  {served:,} calls served, {conn.transport.writes:,} replies written")
    if conn.transport.writes != served:
        print("error: not every call was answered", file=sys.stderr)
        return 1
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(args.calls)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    a.close()
    b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
