#!/usr/bin/env python3
"""The shared harness (`../shared/bench/driver.py`) with two more workloads: ~10 MB messages.

Issue 10's large-reply target ("10 MB adds <= 2 ms") is not among the harness's own workloads,
so this registers `users10m` (get_users of 58,000 users: a 10.0 MB binary reply, one
connection) and `echo10m` (a 10 MB request echoed back: the request streams upstream as it
arrives, then the reply streams back) in the harness's workload table and runs its `main`
unchanged: the same
interleaved rounds, targets (direct, Envoy passthrough, the Python relay, the sidecar) and
table as every other row of `make bench`.

    bench/large.py --bin-dir DIR [driver options]   # as ../shared/bench/run.sh would run driver.py

`bench/run.sh` runs it after the framed and buffered sections. Not a test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

USERS = 58_000   # x ~172 bytes per user in the harness's reply = 10.0 MB

shared = Path(os.environ.get("THRIFT_BENCH_DIR") or Path(__file__).resolve().parent.parent.parent / "shared" / "bench")
sys.path.insert(0, str(shared))

import driver  # noqa: E402  (the shared harness)

driver.WORKLOADS.setdefault(
    "users10m", (f"get_users {USERS} (~10 MB binary reply), 1 connection",
                 ["-mode", "get_users", "-users", str(USERS), "-conns", "1"]))
driver.WORKLOADS.setdefault(
    "echo10m", ("echo 10 MB (10 MB request and reply), 1 connection",
                ["-mode", "echo", "-payload", "10000000", "-conns", "1"]))

if __name__ == "__main__":
    sys.argv[0] = str(shared / "driver.py")
    driver.main()
