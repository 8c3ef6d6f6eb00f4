"""Clocks: every clock in celery-claims is a ``Callable[[], int]`` returning epoch milliseconds."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Clock", "system_clock_ms"]

#: A clock returns the current time as integer milliseconds since the Unix epoch.
Clock = Callable[[], int]


def system_clock_ms() -> int:
    """The local wall clock in epoch ms.

    Reads ``time.time()`` on every call (not a captured function), so freezegun moves it.
    """
    return int(time.time() * 1000)
