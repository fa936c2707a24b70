"""Issue 10's performance targets, checked against one `make bench` run's results.

Reads the JSON that `bench/run.sh` leaves for one run (the harness's summaries of the framed,
buffered and large invocations, and bench/memory.py's RSS figures) and prints one row per
target: the bound, what was measured, the ratio, and whether it is met. A target whose figures
are not in the run (Envoy not installed, `--only framed`, a target that failed its start) says
so instead of passing. Nothing here decides pass or fail in `make test`; `bench/run.sh` prints
this table at the end of every run.

Each row also says what the floor makes of the same bound (`floor`): the plain uvloop relay
(`pyrelay`, no Thrift parsing or pooling: the floor for any Python proxy) in its place, and for
the 10 MB reply also `splicerelay` (bench/splicerelay.py: every byte moved by splice(2), none
read: the floor for a large message on this machine). A target the floor misses too in a run
was beyond what the machine or the language gave in that run, whatever the proxy does; one the
floor meets and the sidecar misses is the sidecar's own cost (bench/README says where it goes).

    .venv/bin/python bench/targets.py ~/.cache/thrift-sidecar/bench/results/bench-20261122-213512
    .venv/bin/python bench/targets.py --json PREFIX        # the rows as JSON

PREFIX is the run's results path without its suffix: `PREFIX-framed.json`,
`PREFIX-buffered.json`, `PREFIX-large.json`, `PREFIX-memory.json` (each optional).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# (section, workload, target) -> the harness's summary row for it
Summaries = dict[tuple[str, str, str], dict]

SECTIONS = ("framed", "buffered", "large")


@dataclass(frozen=True)
class Verdict:
    target: str            # what the issue asks, in words
    bound: str             # the limit, in words
    measured: str          # the figures it was decided on
    ratio: float | None    # measured / limit's reference (None: an absolute bound, or no data)
    met: bool | None       # None: the run has no figures for it
    floor: str = ""        # the floor relay's figure on the same bound ("": none in this run, or n/a)


def load(prefix: str | Path) -> tuple[Summaries, dict | None]:
    """The summaries of one run (every section whose JSON exists) and its memory figures."""
    prefix = str(prefix)
    rows: Summaries = {}
    for section in SECTIONS:
        path = Path(f"{prefix}-{section}.json")
        if not path.exists():
            continue
        for s in json.loads(path.read_text())["summary"]:
            rows[(section, s["workload"], s["target"])] = s
    mem_path = Path(f"{prefix}-memory.json")
    memory = json.loads(mem_path.read_text()) if mem_path.exists() else None
    return rows, memory


def _get(rows: Summaries, section: str, workload: str, target: str, key: str) -> float | None:
    row = rows.get((section, workload, target))
    if row is None or not row.get("rounds_ok", 1):
        return None
    value = row.get(key)
    return float(value) if value is not None else None


def _at_most(target: str, bound: str, value: float | None, ref: float | None, factor: float,
             what: str, ref_what: str, unit: str = "µs", floor: str = "") -> Verdict:
    """value <= factor × ref (lower is better)."""
    if value is None or ref is None or ref <= 0:
        missing = what if value is None else ref_what
        return Verdict(target, bound, f"no {missing} in this run", None, None, floor)
    ratio = value / ref
    return Verdict(target, bound, f"{what} {value:.1f} {unit}, {ref_what} {ref:.1f} {unit}",
                   round(ratio, 3), ratio <= factor, floor)


def _floor(who: str, value: float | None, ref: float | None, factor: float, higher_is_better: bool = False) -> str:
    """The floor relay's ratio on a relative bound, and whether it would meet it ("" without figures)."""
    if value is None or ref is None or ref <= 0:
        return ""
    ratio = value / ref
    met = ratio >= factor if higher_is_better else ratio <= factor
    return f"{who} {ratio:.3f} ({'meets it' if met else 'misses it too'})"


def _floor_ms(who: str, value: float | None, limit_us: float) -> str:
    """The floor relay's figure on an absolute bound in ms ("" without figures)."""
    if value is None:
        return ""
    return f"{who} +{value / 1000:.2f} ms ({'meets it' if value <= limit_us else 'misses it too'})"


def check(rows: Summaries, memory: dict | None) -> list[Verdict]:
    """Every target of issue 10, in its order."""
    g = lambda workload, target, key, section="framed": _get(rows, section, workload, target, key)  # noqa: E731
    envoy_pt = {w: g(w, "envoy-pt", "added_p50_us") for w in ("ping1", "users1", "echo64k8")}
    out = [
        _at_most("ping1, default tracing: added p50", "<= 0.8 x Envoy passthrough's",
                 g("ping1", "sidecar-default", "added_p50_us"), envoy_pt["ping1"], 0.8,
                 "sidecar-default", "envoy-pt",
                 floor=_floor("pyrelay", g("ping1", "pyrelay", "added_p50_us"), envoy_pt["ping1"], 0.8)),
        _at_most("ping1, tracing off: added p50", "<= 2 x the plain uvloop relay's",
                 g("ping1", "sidecar-off", "added_p50_us"), g("ping1", "pyrelay", "added_p50_us"), 2.0,
                 "sidecar-off", "pyrelay"),
    ]
    envoys = [x for x in (g("ping32", "envoy", "rps"), g("ping32", "envoy-pt", "rps")) if x is not None]
    best = max(envoys) if envoys else None
    ours = g("ping32", "sidecar-off", "rps")
    floor = _floor("pyrelay", g("ping32", "pyrelay", "rps"), best, 1.25, higher_is_better=True)
    if ours is None or best is None:
        out.append(Verdict("ping32: calls/s", ">= 1.25 x the better Envoy's",
                           f"no {'sidecar-off' if ours is None else 'Envoy'} in this run", None, None, floor))
    else:
        out.append(Verdict("ping32: calls/s", ">= 1.25 x the better Envoy's",
                           f"sidecar-off {ours:,.0f}/s, better Envoy {best:,.0f}/s",
                           round(ours / best, 3), ours >= 1.25 * best, floor))
    envoy_cpu = g("ping32", "envoy", "proxy_cpu_us_per_call")
    framed_users1 = g("users1", "sidecar-off", "added_p50_us")
    out += [
        _at_most("ping32: proxy CPU per call", "<= 0.7 x Envoy's",
                 g("ping32", "sidecar-off", "proxy_cpu_us_per_call"), envoy_cpu, 0.7, "sidecar-off", "envoy",
                 floor=_floor("pyrelay", g("ping32", "pyrelay", "proxy_cpu_us_per_call"), envoy_cpu, 0.7)),
        _at_most("users1 (945 KB reply): added p50", "<= 0.8 x Envoy passthrough's",
                 framed_users1, envoy_pt["users1"], 0.8, "sidecar-off", "envoy-pt",
                 floor=_floor("pyrelay", g("users1", "pyrelay", "added_p50_us"), envoy_pt["users1"], 0.8)),
        _at_most("echo64k8: added p50", "<= Envoy passthrough's",
                 g("echo64k8", "sidecar-off", "added_p50_us"), envoy_pt["echo64k8"], 1.0, "sidecar-off", "envoy-pt",
                 floor=_floor("pyrelay", g("echo64k8", "pyrelay", "added_p50_us"), envoy_pt["echo64k8"], 1.0)),
        _at_most("buffered users1: added p50", "<= 2 x the framed users1 figure",
                 g("users1", "sidecar-off", "added_p50_us", "buffered"), framed_users1,
                 2.0, "buffered", "framed",
                 floor=_floor("pyrelay", g("users1", "pyrelay", "added_p50_us", "buffered"),
                              g("users1", "pyrelay", "added_p50_us"), 2.0)),
    ]
    big = g("users10m", "sidecar-off", "added_p50_us", "large")
    floors = [f for f in (_floor_ms("splicerelay", g("users10m", "splicerelay", "added_p50_us", "large"), 2000.0),
                          _floor_ms("pyrelay", g("users10m", "pyrelay", "added_p50_us", "large"), 2000.0)) if f]
    out.append(Verdict("10 MB reply (users10m): added p50", "<= 2 ms",
                       "no users10m in this run" if big is None else f"sidecar-off +{big / 1000:.2f} ms",
                       None, None if big is None else big <= 2000.0, "; ".join(floors)))
    for key, what, limit in (("idle_mib", "RSS idle, demo config", 80.0),
                             ("with_connections_mib", "RSS with 1,000 idle client connections", 200.0)):
        value = memory.get(key) if memory else None
        out.append(Verdict(f"memory: {what}", f"<= {limit:.0f} MiB",
                           "no memory figures in this run" if value is None else f"{value:.1f} MiB",
                           None, None if value is None else float(value) <= limit))
    return out


def table(verdicts: list[Verdict]) -> str:
    lines = ["| target | bound | measured | ratio | met | the floor on this bound |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        met = "n/a" if v.met is None else ("yes" if v.met else "NO")
        ratio = "" if v.ratio is None else f"{v.ratio:.3f}"
        lines.append(f"| {v.target} | {v.bound} | {v.measured} | {ratio} | {met} | {v.floor} |")
    counted = [v for v in verdicts if v.met is not None]
    lines.append("")
    lines.append(f"{sum(v.met for v in counted)} of {len(counted)} targets met"
                 + (f" ({len(verdicts) - len(counted)} without figures in this run)"
                    if len(counted) != len(verdicts) else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix", help="the run's results path without its -framed.json etc. suffix")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows, memory = load(args.prefix)
    if not rows and memory is None:
        print(f"targets.py: no results at {args.prefix}-{{framed,buffered,large,memory}}.json", file=sys.stderr)
        return 2
    verdicts = check(rows, memory)
    print(json.dumps([asdict(v) for v in verdicts], indent=1) if args.json else table(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
