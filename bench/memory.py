"""The sidecar's memory: RSS idle with the demo config, and with 1,000 idle client connections.

Starts the demo's two upstreams (`thrift-sidecar demo-upstream`), then `thrift-sidecar run` with
the demo config (config/demo.yaml: its tracing writes spans to a file here), makes a few calls
through it, and reads VmRSS from /proc: once idle, once with 1,000 more client connections open
and idle (each through a full connect and one call, so every connection's state is built).
Prints one line per measurement and a JSON line. Not a test: nothing here decides pass or fail
(issue 10's targets: <= 80 MiB idle, <= 200 MiB with 1,000 idle connections).

    .venv/bin/python bench/memory.py [--connections 1000]
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.demo import _stop_child, packaged_config_text, spawn_upstream, upstream_address  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_users_call(seqid: int) -> bytes:
    """A framed strict-binary `get_users(count=1, sleep_ms=0)` (UserService's fields 1 and 2)."""
    name = b"get_users"
    body = struct.pack("!bhibhi", 8, 1, 1, 8, 2, 0) + b"\x00"
    msg = struct.pack("!Ii", 0x80010001, len(name)) + name + struct.pack("!i", seqid) + body
    return struct.pack("!i", len(msg)) + msg


def call(sock: socket.socket, seqid: int) -> None:
    sock.sendall(get_users_call(seqid))
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    need = struct.unpack("!i", head)[0]
    while need:
        need -= len(sock.recv(need))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--out", help="also write the figures as JSON to this file (bench/targets.py reads it)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    children: list[subprocess.Popen] = []
    socks: list[socket.socket] = []
    with tempfile.TemporaryDirectory(prefix="sidecar-memory-") as tmp:
        try:
            ups = [spawn_upstream(children) for _ in range(2)]
            endpoints = [upstream_address(p, time.monotonic() + 20) for p in ups]
            data = yaml.safe_load(packaged_config_text())
            port = free_port()
            data["admin"]["listen"] = f"127.0.0.1:{free_port()}"
            data["listeners"][0]["listen"] = f"127.0.0.1:{port}"
            data["listeners"][0]["max_connections"] = args.connections + 100
            data["clusters"][0]["endpoints"] = endpoints
            data["tracing"]["path"] = str(Path(tmp) / "spans.jsonl")
            cfg = Path(tmp) / "demo.yaml"
            cfg.write_text(yaml.safe_dump(data, sort_keys=False))
            proxy = subprocess.Popen([sys.executable, "-m", "proxy", "run", "-c", str(cfg)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            children.append(proxy)
            deadline = time.monotonic() + 20
            while True:
                try:
                    first = socket.create_connection(("127.0.0.1", port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline or proxy.poll() is not None:
                        raise RuntimeError("the sidecar did not start")
                    time.sleep(0.1)
            for i in range(20):
                call(first, i)
            time.sleep(2)
            idle = rss_mib(proxy.pid)
            print(f"idle with the demo config: {idle:.1f} MiB")
            for i in range(args.connections):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                call(s, i)
                socks.append(s)
            time.sleep(2)
            many = rss_mib(proxy.pid)
            print(f"with {args.connections} idle client connections: {many:.1f} MiB")
            figures = json.dumps({"idle_mib": round(idle, 1), "connections": args.connections,
                                  "with_connections_mib": round(many, 1)})
            print(figures)
            if args.out:
                Path(args.out).write_text(figures + "\n")
        finally:
            for s in socks:
                s.close()
            for p in children:
                _stop_child(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
