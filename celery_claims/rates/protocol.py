"""The ``RateLimiter`` interface: fleet-wide limits on how often tasks start."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from celery_claims.rates.model import Limit, RateResult

__all__ = ["RateLimiter"]


@runtime_checkable
class RateLimiter(Protocol):
    """Counts starts against named rates, atomically, by one clock for the whole fleet."""

    def acquire(self, scope: str, limits: Sequence[Limit]) -> RateResult:
        """Count one start against every limit of ``limits``, or against none.

        Each limit's state is kept under ``scope`` and its name: in Redis, one key carrying
        ``scope``'s hash tag (a claim queue's: the claim script of that queue could count the
        start in the same call). The start is allowed when every limit allows it: then each
        counts it and the result is :class:`RateAllowed`; otherwise nothing is counted and
        the result is :class:`RateLimited`, with the ms until every limit allows a start. A
        refusal costs no limit anything, however often it is asked.

        For each limit, in any window of its period (half-open, whole ms of the store's
        clock) at most ``count`` starts are allowed, one every ``period / count`` ms; asked
        again when a refusal says, a busy limit allows exactly ``count`` starts per period
        over time. A limit nothing started under for one interval keeps no state.

        Raises:
            InvalidArgument: a bad scope, or ``limits`` not 1..16 limits with distinct,
                usable names; nothing was counted.
            BackendUnavailable: the store could not be reached.
        """
        ...
