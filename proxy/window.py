"""A sliding window of counts in time slices: O(1) per add, what the retry budget and breaker share."""

from __future__ import annotations

import math
from typing import Callable


class SlidingCounts:
    """Two counters summed over the last `window` seconds, kept in `buckets` time slices.

    O(1) per update (at most `buckets` slices are cleared when time jumps).
    A count expires when its slice leaves the window: between
    window × (1 − 1/buckets) and window seconds after it was added.
    """

    __slots__ = ("clock", "width", "n", "_a", "_b", "_slot", "_i", "_edge", "a", "b")

    def __init__(self, window: float, clock: Callable[[], float], buckets: int = 10) -> None:
        self.clock = clock
        self.width = window / buckets
        self.n = buckets
        self._a = [0] * buckets
        self._b = [0] * buckets
        self.a = 0
        self.b = 0
        self._set_slot(math.floor(clock() / self.width))

    def _set_slot(self, slot: int) -> None:
        self._slot = slot                      # absolute number of the newest slice
        self._i = slot % self.n                # its index
        self._edge = (slot + 1) * self.width   # clock time it ends

    def _roll(self) -> int:
        now = self.clock()
        if now < self._edge:  # the newest slice still (the common case: one compare)
            return self._i
        slot = math.floor(now / self.width)
        last = self._slot
        if slot > last:
            if slot - last >= self.n:
                self._zero()
            else:
                a, b, n = self._a, self._b, self.n
                for s in range(last + 1, slot + 1):
                    i = s % n
                    self.a -= a[i]
                    self.b -= b[i]
                    a[i] = b[i] = 0
            self._set_slot(slot)
        return self._i  # a clock that steps back keeps writing the newest slice

    def _zero(self) -> None:
        self._a = [0] * self.n
        self._b = [0] * self.n
        self.a = self.b = 0

    def add(self, a: int = 0, b: int = 0) -> None:
        i = self._i if self.clock() < self._edge else self._roll()  # (_roll's common case, inline)
        self._a[i] += a
        self._b[i] += b
        self.a += a
        self.b += b

    def totals(self) -> tuple[int, int]:
        self._roll()
        return self.a, self.b

    def reset(self) -> None:
        self._zero()
        self._set_slot(math.floor(self.clock() / self.width))
