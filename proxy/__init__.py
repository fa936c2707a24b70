"""thrift-sidecar: a localhost Thrift proxy with balancing, retries, timeouts,
circuit breaking and per-hop traces.

The package layout is the architecture (see README "Layout"): `codec/` is the
sans-IO wire code, `pipeline` shows one call's path top-down, `server` is the
one composition root.
"""

__version__ = "0.1.0"
