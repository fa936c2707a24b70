"""Command line: `thrift-sidecar run|check-config|demo|hops|demo-upstream|demo-client` (argparse, the standard library's).

Parsing only; each command calls into the module that owns the work.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("thrift-sidecar")
    except PackageNotFoundError:  # (run from a source tree that was never installed)
        return "unknown (not installed)"


def _count(low: int, high: int | None = None):
    """An argparse type: a whole number from `low` (to `high`), else a usage error that says so."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(
                f"must be {low}-{high}" if high is not None else f"must be at least {low}")
        return n
    return parse


def _nonempty(what: str):
    """An argparse type: any text but an empty one."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"empty: give {what}")
        return text
    return parse


_path = _nonempty("a file's path")  # ('' would pass for no file given)


def _seconds(low: float, high: float):
    """An argparse type: a number of seconds from `low` to `high`, else a usage error."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not low <= x <= high:  # (also NaN)
            raise argparse.ArgumentTypeError(f"must be {low:g}-{high:g} seconds")
        return x
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse's, except that a help or version text that cannot be written to stdout is an
    error (`main` says so, exit 1): argparse drops the OSError and exits 0 (and a buffered
    stdout only fails at exit, exit 120). Usage errors on stderr are argparse's (exit 2)."""

    def _print_message(self, message: str, file=None) -> None:
        if message and file is sys.stdout and file is not None:
            file.write(message)
            file.flush()
        else:
            super()._print_message(message, file)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="thrift-sidecar",
                                description="A localhost Thrift proxy sidecar with per-hop traces.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve until SIGTERM/SIGINT, then drain; SIGHUP reloads")
    given_run = run.add_mutually_exclusive_group(required=True)
    given_run.add_argument("file", metavar="FILE", nargs="?", type=_path, help="YAML config file")
    given_run.add_argument("-c", "--config", dest="config_file", metavar="FILE", type=_path, help="the same")

    check = sub.add_parser("check-config", help="validate a config file and print a summary")
    given = check.add_mutually_exclusive_group(required=True)
    given.add_argument("file", metavar="FILE", nargs="?", type=_path)
    given.add_argument("-c", "--config", dest="config_file", metavar="FILE", type=_path,
                       help="the same, as `run` takes it")
    check.add_argument("--strict", action="store_true",
                       help="exit 2, too, when `run` could not start with it on this machine (TLS or span "
                            "files it names cannot be used); without it they are warnings")

    demo = sub.add_parser("demo", help="run the demo: upstreams, sidecar, clients, hop table")
    demo.add_argument("--out", default="out/demo", metavar="DIR",
                      help="where the span file and the waterfall go (default out/demo)")
    demo.add_argument("--calls", type=_count(1), default=120, metavar="N", help="calls in the client's mix (120)")
    demo.add_argument("--otlp", metavar="ENDPOINT",
                      help="also export the spans there, e.g. http://127.0.0.1:4317 (or set "
                           "THRIFT_SIDECAR_DEMO_OTLP)")
    demo.add_argument("--otlp-protocol", choices=("grpc", "http"), default="grpc")
    demo.add_argument("--png", action=argparse.BooleanOptionalAction, default=None,
                      help="also screenshot the waterfall as PNG (default: when chromium is installed)")

    up = sub.add_parser("demo-upstream", help="serve the demo's UserService until SIGTERM")
    up.add_argument("--host", default="0.0.0.0", help="address to listen on (0.0.0.0: every interface)")
    up.add_argument("--port", type=_count(0, 65535), default=9191, help="port (0: any free port; printed)")
    up.add_argument("--framing", choices=("framed", "buffered", "header"), default="framed")
    up.add_argument("--protocol", choices=("binary", "compact"), default="binary")
    up.add_argument("--fail-every", type=_count(0), default=0, metavar="N",
                    help="answer 1 get_users in N with the declared Unavailable exception")

    client = sub.add_parser("demo-client", help="make a mix of UserService calls (with --forever until SIGTERM)")
    client.add_argument("--target", required=True, metavar="HOST:PORT", help="the sidecar's listener")
    client.add_argument("--count", type=_count(1), default=120, metavar="N", help="calls per round (120)")
    client.add_argument("--forever", action="store_true", help="repeat rounds until SIGTERM/SIGINT")
    client.add_argument("--interval", type=_seconds(0, 86400), default=1.0, metavar="SECONDS",
                        help="with --forever: pause between rounds (1)")
    client.add_argument("--connections", type=_count(1), default=4, metavar="N", help="concurrent connections (4)")
    client.add_argument("--large", type=_count(0), default=2, metavar="N",
                        help="5,499-user get_users calls per round, read normally (2)")
    client.add_argument("--no-slow-reader", dest="slow_reader", action="store_false",
                        help="leave out the slow-reading client")
    client.add_argument("--framing", choices=("framed", "buffered", "header"), default="framed")
    client.add_argument("--protocol", choices=("binary", "compact"), default="binary")
    client.add_argument("--seed", type=int, default=1, help="the mix's random seed")

    hops = sub.add_parser("hops", help="which hop is slow: hop table, worst calls and a verdict from spans",
                          description="Per group: count, p50/p99 of the total and of each hop, each hop's "
                                      "share; the worst calls; last line: the verdict.")
    source = hops.add_mutually_exclusive_group(required=True)
    source.add_argument("--spans", metavar="FILE.jsonl", type=_path, help="span file of `tracing.exporter: jsonl`")
    source.add_argument("--jaeger", metavar="URL", type=_nonempty("a URL"), help="Jaeger query API, e.g. http://127.0.0.1:16686")
    hops.add_argument("--service", metavar="NAME", help="with --jaeger: the sidecar's tracing.service_name")
    hops.add_argument("--method", metavar="M", help="only this method (`get_users`, `Svc/get_*`; globs)")
    hops.add_argument("--by", choices=("method", "endpoint", "client"), default="method",
                      help="group calls by method (default), upstream endpoint or client connection")
    hops.add_argument("--worst", type=_count(0), default=5, metavar="N", help="list (and draw) the N slowest calls")
    hops.add_argument("--html", metavar="FILE", help="also write a waterfall of the worst calls as HTML")
    hops.add_argument("--limit", type=_count(1), metavar="N", help="with --jaeger: at most N traces (1000)")
    hops.add_argument("--lookback", metavar="DURATION", help="with --jaeger: how far back (1h)")
    return p


def _hold_standard_fds() -> None:
    """Open /dev/null on any of fds 0-2 the process was started without (`run >&-`). Else the
    first socket takes that number, and libuv aborts the process when it closes it (its
    assertion `fd > STDERR_FILENO`), as would a log line written to a client's socket."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            except OSError:  # (no /dev/null here: carry on as before, best effort)
                continue
            if null != fd:  # (lower fds are open, so it is fd; this is belt and braces)
                os.dup2(null, fd)
                os.close(null)


def main(argv: list[str] | None = None) -> int:
    _hold_standard_fds()
    try:
        code = _main(argv)
        if sys.stdout is not None:  # (None: started with stdout closed)
            sys.stdout.flush()  # (a full disk is said here; at exit it would be exit 120 and a traceback)
        return code
    except BrokenPipeError:  # `check-config F | head -1`: the reader left; nothing to say to it
        # (stdout's buffer still holds what could not be written: point it at /dev/null, so
        # that flushing it at exit does not fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # `check-config F > /dev/full`: said, not a traceback
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
            raise
        print(f"thrift-sidecar: cannot write the output: {e.strerror}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.config_file if args.file is None else args.file, args.strict)
    if args.command == "run":
        # SIGHUP's default action ends the process: until the server handles it (once it is
        # up), a reload asked for is noted here (before the server's heavy imports) and done then.
        import signal
        early_hups: list[int] = []
        signal.signal(signal.SIGHUP, lambda signum, frame: early_hups.append(signum))
        from proxy.server import run_from_file
        return run_from_file(args.config_file if args.file is None else args.file, early_hups)
    if args.command == "demo":
        from proxy.demo import main as demo_main
        return demo_main(args)
    if args.command == "demo-upstream":
        from proxy.demo_upstream import main as upstream_main
        return upstream_main(args)
    if args.command == "demo-client":
        from proxy.demo_client import main as client_main
        return client_main(args)
    if args.command == "hops":
        from proxy.hops import run as hops_run
        return hops_run(args)
    raise AssertionError(args.command)


def _check_config(path: str, strict: bool = False) -> int:
    """Exit 0 and the summary for a valid file, 2 and its errors for one that is not. What `run`
    could not start with *here* (a TLS or span file) is said as a warning, an error with
    `--strict`: a config is often checked away from the machine whose files it names."""
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
    from proxy.server import StartError, start_problems
    problems = [p.line(path) for p in start_problems(cfg)]
    if problems and strict:
        for line in problems:
            print(line, file=sys.stderr)
        return 2
    print(summary(cfg))
    for line in problems:
        print(f"warning: {line} (`run` would refuse it on this machine; --strict makes this an error)",
              file=sys.stderr)
    for i, c in enumerate(cfg.clusters):  # allowed (file discovery waits for it), but maybe a mistake
        f = c.endpoints.file
        if f is None:
            continue
        loc = ("clusters", i, "endpoints", "file")
        if not Path(f).exists():
            said = StartError(loc, f"{f} does not exist (yet): cluster '{c.name}' has no endpoints until it does")
            print(f"warning: {said.line(path)}", file=sys.stderr)
            continue
        from proxy.config import load_endpoints_text
        from proxy.discovery import read_endpoints_file
        try:
            load_endpoints_text(read_endpoints_file(Path(f)).decode("utf-8"), str(f))
        except ConfigError as e:  # (`run` starts, and keeps the file's last good set: none yet)
            said = StartError(loc, f"cluster '{c.name}' has no endpoints until {f} is fixed:")
            for line in [said.line(path), *e.errors]:
                print(f"warning: {line}", file=sys.stderr)
        except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
            said = StartError(loc, f"cannot read {f}: {getattr(e, 'strerror', None) or e}: cluster "
                                   f"'{c.name}' has no endpoints until it can be")
            print(f"warning: {said.line(path)}", file=sys.stderr)
    return 0
