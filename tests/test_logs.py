"""proxy.logs.Throttle: repeated warnings thinned, with a count of those held back."""

from __future__ import annotations

import logging

from proxy.clock import ManualClock
from proxy.logs import Throttle


def test_first_line_at_once_then_one_per_interval_with_the_count_held_back():
    clock = ManualClock()
    t = Throttle(5.0, clock)
    assert t.admit("connect") == 0
    for _ in range(3):
        clock.advance(1.0)
        assert t.admit("connect") is None
    clock.advance(1.9)  # 4.9 s after the line that went out
    assert t.admit("connect") is None
    clock.advance(0.1)
    assert t.admit("connect") == 4  # the four held back since
    clock.advance(60)
    assert t.admit("connect") == 0  # nothing held back in between


def test_the_count_held_back_can_be_taken_when_lines_stop_coming():
    clock = ManualClock()
    t = Throttle(5.0, clock)
    assert t.admit("full") == 0
    assert t.admit("full") is None and t.admit("full") is None
    assert t.held("full") == 2 and t.held("full") == 0  # taken once
    assert t.held("other") == 0


def test_kinds_are_thinned_apart():
    clock = ManualClock()
    t = Throttle(5.0, clock)
    assert t.admit("connect") == 0
    assert t.admit("refused") == 0
    assert t.admit("connect") is None
    assert t.admit("refused") is None


def test_warn_says_how_many_were_held_back(caplog):
    clock = ManualClock()
    t = Throttle(5.0, clock)
    log = logging.getLogger("test.throttle")
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for _ in range(3):
            t.warn(log, "connect", "connect to %s failed", "127.0.0.1:9")
            clock.advance(2.0)
        t.warn(log, "connect", "connect to %s failed", "127.0.0.1:9")
    assert [r.getMessage() for r in caplog.records] == [
        "connect to 127.0.0.1:9 failed",
        "connect to 127.0.0.1:9 failed (and 2 more like it since the last such line)",
    ]
