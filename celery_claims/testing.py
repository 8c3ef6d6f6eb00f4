"""Helpers for testing code that uses celery-claims (and for the package's own tests)."""

from __future__ import annotations

import threading

from celery_claims.errors import InvalidArgument

__all__ = ["ManualClock"]


class ManualClock:
    """A clock (``Callable[[], int]`` of epoch ms) that moves only when told to.

    Pass it as ``clock=`` to a claim manager to make expiry deterministic in tests.

    Args:
        start_ms: the initial time in epoch ms.
    """

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self._now

    def advance(self, ms: int) -> int:
        """Move the clock forward by ``ms`` (never backwards) and return the new time."""
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            raise InvalidArgument("ms", f"must be a non-negative int, got {ms!r}")
        with self._lock:
            self._now += ms
            return self._now
