"""Held copies: kept unacked outside the pool and re-checked on the consumer's timer."""

from __future__ import annotations

import contextlib

from celery.utils.log import get_logger

from celery_claims.worker import signals
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import State
from celery_claims.worker.delivery.wiring import Wiring

__all__ = ["Holds"]

logger = get_logger("celery_claims.worker")


class Holds:
    """Holds copies (``HELD``) and times their re-checks."""

    def __init__(self, w: Wiring, reg: Registry) -> None:
        self.w = w
        self.reg = reg

    def hold(
        self, copy: Copy, reason: str, *, holder: str | None, error: BaseException | None
    ) -> None:
        """Keep the copy unacked and re-check it later (``HELD``).

        A copy held by another copy's live lease gives its prefetch slot back (within the
        window), so the queue keeps flowing; a copy held because the store is unreachable
        keeps it: nothing can run while the store is down, and taking more messages would
        only hoard them away from other workers.
        """
        settings = self.w.settings
        first = copy.state is not State.HELD
        changed = copy.hold_reason != reason
        self.reg.move(copy, State.HELD)
        copy.hold_reason = reason
        if reason == "held":
            self.w.slots.give_back(copy)
            copy.delay_ms = settings.held_recheck_ms
        else:
            copy.delay_ms = (
                settings.unavailable_retry_ms
                if first or changed or copy.delay_ms == 0
                else min(copy.delay_ms * 2, settings.unavailable_retry_max_ms)
            )
        recheck_s = copy.delay_ms / 1000
        request = copy.request
        if first or changed:
            self.w.counters.incr("held_unavailable" if reason == "unavailable" else "held")
            if reason == "unavailable":
                logger.warning(
                    "Held %s[%s]: claim store unavailable (%s); not run, retrying in %.1f s",
                    request.name,
                    request.id,
                    error,
                    recheck_s,
                )
            else:
                logger.info(
                    "Held %s[%s]: claim %s is held by %s; kept unacked, re-checking every %.1f s",
                    request.name,
                    request.id,
                    copy.claim_id,
                    holder,
                    recheck_s,
                )
            signals.task_held.send(
                sender=request.task,
                request=request,
                reason=reason,
                claim_id=copy.claim_id,
                holder=holder,
                recheck_s=recheck_s,
                key=copy.key.field if copy.key is not None else "",
            )
        else:
            self.w.counters.incr("rechecks")
        copy.timer_entry = self.w.consumer.timer.call_after(
            recheck_s, self._on_recheck, (copy,), priority=6
        )

    def _on_recheck(self, copy: Copy) -> None:
        copy.timer_entry = None
        if copy.state is State.HELD and self.w.recheck is not None:
            self.w.recheck(copy)

    def cancel_timer(self, copy: Copy) -> None:
        """Cancel the pending re-check of a held copy, if any."""
        entry, copy.timer_entry = copy.timer_entry, None
        if entry is not None:
            with contextlib.suppress(Exception):
                self.w.consumer.timer.cancel(entry)
