"""bench/targets.py: issue 10's targets decided from a run's JSON (the verdict logic, on
hand-made summaries; no benchmark runs here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_targets", Path(__file__).resolve().parents[1] / "bench" / "targets.py")
targets = sys.modules["bench_targets"] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up)
_spec.loader.exec_module(targets)


def _row(workload, target, **figures):
    return {"workload": workload, "target": target, "rounds_ok": 3, "rounds": 3, **figures}


def _write_run(prefix: Path, framed=None, buffered=None, large=None, memory=None) -> None:
    for section, rows in (("framed", framed), ("buffered", buffered), ("large", large)):
        if rows is not None:
            Path(f"{prefix}-{section}.json").write_text(json.dumps({"meta": {}, "summary": rows, "runs": []}))
    if memory is not None:
        Path(f"{prefix}-memory.json").write_text(json.dumps(memory))


def _framed(ping1_default=60.0, ping32_rps=40_000.0, ping32_cpu=20.0, users1_off=200.0):
    return [
        _row("ping1", "envoy-pt", added_p50_us=100.0),
        _row("ping1", "pyrelay", added_p50_us=35.0),
        _row("ping1", "sidecar-off", added_p50_us=60.0),
        _row("ping1", "sidecar-default", added_p50_us=ping1_default),
        _row("ping32", "envoy", rps=26_000.0, proxy_cpu_us_per_call=35.0),
        _row("ping32", "envoy-pt", rps=30_000.0, proxy_cpu_us_per_call=37.0),
        _row("ping32", "sidecar-off", rps=ping32_rps, proxy_cpu_us_per_call=ping32_cpu),
        _row("users1", "envoy-pt", added_p50_us=500.0),
        _row("users1", "sidecar-off", added_p50_us=users1_off),
        _row("echo64k8", "envoy-pt", added_p50_us=900.0),
        _row("echo64k8", "sidecar-off", added_p50_us=800.0),
    ]


def _by_target(verdicts):
    return {v.target: v for v in verdicts}


def test_every_target_met_and_the_bounds_are_inclusive(tmp_path):
    prefix = tmp_path / "bench-1"
    # ping1 default exactly 0.8 x envoy-pt, buffered exactly 2 x framed, users10m exactly 2 ms
    _write_run(prefix, framed=_framed(ping1_default=80.0, ping32_rps=37_500.0, ping32_cpu=24.5),
               buffered=[_row("users1", "sidecar-off", added_p50_us=400.0)],
               large=[_row("users10m", "sidecar-off", added_p50_us=2000.0)],
               memory={"idle_mib": 80.0, "connections": 1000, "with_connections_mib": 200.0})
    verdicts = targets.check(*targets.load(prefix))
    assert [v.met for v in verdicts] == [True] * len(verdicts)
    by = _by_target(verdicts)
    assert by["ping32: calls/s"].ratio == 1.25  # against the better of the two Envoys (30,000/s)
    assert by["ping1, default tracing: added p50"].ratio == 0.8
    assert targets.table(verdicts).endswith(f"{len(verdicts)} of {len(verdicts)} targets met")


def test_targets_missed_say_no(tmp_path):
    prefix = tmp_path / "bench-2"
    _write_run(prefix, framed=_framed(ping1_default=80.1, ping32_rps=37_499.0, ping32_cpu=24.6, users1_off=401.0),
               buffered=[_row("users1", "sidecar-off", added_p50_us=802.1)],
               large=[_row("users10m", "sidecar-off", added_p50_us=2000.5)],
               memory={"idle_mib": 80.1, "connections": 1000, "with_connections_mib": 200.1})
    by = _by_target(targets.check(*targets.load(prefix)))
    for name in ("ping1, default tracing: added p50", "ping32: calls/s", "ping32: proxy CPU per call",
                 "users1 (945 KB reply): added p50", "buffered users1: added p50",
                 "10 MB reply (users10m): added p50", "memory: RSS idle, demo config",
                 "memory: RSS with 1,000 idle client connections"):
        assert by[name].met is False, name
    assert by["ping1, tracing off: added p50"].met is True
    assert by["echo64k8: added p50"].met is True
    assert "| NO |" in targets.table(list(by.values()))


def test_missing_figures_are_not_a_pass(tmp_path, capsys):
    prefix = tmp_path / "bench-3"
    framed = [r for r in _framed() if not r["target"].startswith("envoy")]  # Envoy not installed
    _write_run(prefix, framed=framed)  # --only framed: no buffered, large or memory figures
    verdicts = targets.check(*targets.load(prefix))
    by = _by_target(verdicts)
    assert by["ping1, tracing off: added p50"].met is True
    for name in ("ping1, default tracing: added p50", "ping32: calls/s", "ping32: proxy CPU per call",
                 "buffered users1: added p50", "10 MB reply (users10m): added p50"):
        assert by[name].met is None, name
        assert by[name].measured.startswith("no "), by[name].measured
    assert "1 of 1 targets met" in targets.table(verdicts)
    # a target whose rounds all failed counts as missing, not as measured
    bad = [dict(r, rounds_ok=0) if r["target"] == "pyrelay" else r for r in framed]
    _write_run(prefix, framed=bad)
    assert _by_target(targets.check(*targets.load(prefix)))["ping1, tracing off: added p50"].met is None


def test_cli_exits_2_without_results(tmp_path, capsys):
    assert targets.main([str(tmp_path / "nothing")]) == 2
    assert "no results" in capsys.readouterr().err


@pytest.mark.parametrize("as_json", [False, True])
def test_cli_prints_the_table_or_json(tmp_path, capsys, as_json):
    prefix = tmp_path / "bench-4"
    _write_run(prefix, framed=_framed())
    assert targets.main([str(prefix)] + (["--json"] if as_json else [])) == 0
    out = capsys.readouterr().out
    if as_json:
        rows = json.loads(out)
        assert rows[0]["target"] == "ping1, default tracing: added p50" and rows[0]["met"] is True
    else:
        assert out.startswith("| target | bound | measured | ratio | met |")


def test_each_row_says_what_the_floor_makes_of_its_bound(tmp_path):
    prefix = tmp_path / "bench-5"
    framed = _framed() + [
        _row("ping32", "pyrelay", rps=33_000.0, proxy_cpu_us_per_call=17.0),  # 1.1 x 30,000/s: short of 1.25
        _row("users1", "pyrelay", added_p50_us=150.0),
    ]
    _write_run(prefix, framed=framed, buffered=[_row("users1", "pyrelay", added_p50_us=330.0)],
               large=[_row("users10m", "sidecar-off", added_p50_us=2600.0),
                      _row("users10m", "splicerelay", added_p50_us=1900.0),
                      _row("users10m", "pyrelay", added_p50_us=4100.0)])
    by = _by_target(targets.check(*targets.load(prefix)))
    assert by["ping32: calls/s"].floor == "pyrelay 1.100 (misses it too)"
    assert by["ping32: proxy CPU per call"].floor == "pyrelay 0.486 (meets it)"   # 17 / 35
    assert by["ping1, default tracing: added p50"].floor == "pyrelay 0.350 (meets it)"
    assert by["users1 (945 KB reply): added p50"].floor == "pyrelay 0.300 (meets it)"
    assert by["buffered users1: added p50"].floor == "pyrelay 2.200 (misses it too)"  # 330 / 150
    assert by["10 MB reply (users10m): added p50"].floor == \
        "splicerelay +1.90 ms (meets it); pyrelay +4.10 ms (misses it too)"
    assert by["10 MB reply (users10m): added p50"].met is False
    # no floor figure for a target whose reference is the floor itself, or without its figures
    assert by["ping1, tracing off: added p50"].floor == ""
    assert by["echo64k8: added p50"].floor == ""
    assert "| pyrelay 1.100 (misses it too) |" in targets.table(list(by.values()))
