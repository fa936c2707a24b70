"""Command line: `thrift-sidecar run|check-config|demo` (argparse, the standard library's).

Parsing only; each command calls into the module that owns the work.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thrift-sidecar",
                                description="A localhost Thrift proxy sidecar with per-hop traces.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve until SIGTERM/SIGINT, then drain; SIGHUP reloads")
    run.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML config file")

    check = sub.add_parser("check-config", help="validate a config file and print a summary")
    check.add_argument("file", metavar="FILE")

    sub.add_parser("demo", help="run the demo: upstreams, sidecar, clients, hop table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "run":
        from proxy.server import run_from_file
        return run_from_file(args.config)
    if args.command == "demo":
        from proxy.demo import main as demo_main
        return demo_main()
    raise AssertionError(args.command)


def _check_config(path: str) -> int:
    from proxy.config import ConfigError, load, summary
    try:
        cfg = load(path)
    except ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{path}:0: (file): {e.strerror}", file=sys.stderr)
        return 2
    print(summary(cfg))
    return 0
