"""An independent checker of how many recorded intervals overlap at any instant."""

from __future__ import annotations

from collections.abc import Iterable


def max_overlap(intervals: Iterable[tuple[float, float]]) -> tuple[int, float]:
    """The largest number of intervals open at one instant, and the first instant it happens.

    Intervals are closed at the start and open at the end: one that ends exactly when another
    starts does not overlap it (a slot freed and re-used at the same instant).
    """
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        if end < start:
            raise ValueError(f"interval ends before it starts: {(start, end)}")
        events.append((start, 1))
        events.append((end, -1))
    # At equal times, ends (-1) sort before starts (+1).
    events.sort()
    open_now = best = 0
    when = float("nan")
    for at, step in events:
        open_now += step
        if open_now > best:
            best, when = open_now, at
    return best, when
