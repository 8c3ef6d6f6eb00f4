"""Acknowledging once claimed (``claims_ack_on_claim``): the message goes as its copy starts.

For tasks longer than the broker lets a delivery stay unacked (RabbitMQ's ``consumer_timeout``,
SQS's visibility timeout). A claimed copy's message is acknowledged when the pool starts it, or
when it starts waiting outside the pool (rates, lane, turn); queued in the pool it stays
unacked, so Celery's prefetch still bounds what a worker takes. The message's publish journal
entry is written first, and waited for (an entry the producer wrote keeps its message): from
the ack on, the claim and that entry are the task's durable copy. A holder that dies lets its
lease run out, and journal recovery publishes the entry again, to be taken over with the next
fencing number; a copy published again for a task already done is skipped.
docs/semantics.md, *Acknowledging at claim*.
"""

from __future__ import annotations

from celery.utils.log import get_logger

from celery_claims.errors import ClaimError
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.wiring import Wiring
from celery_claims.worker.policy import acks_on_claim

__all__ = ["AckOnClaim"]

logger = get_logger("celery_claims.worker")


class AckOnClaim:
    """Acknowledges the messages of claimed copies whose task asks for it."""

    def __init__(self, w: Wiring) -> None:
        self.w = w
        #: task name -> whether its messages are acked at claim (read once: every claimed
        #: message asks, most tasks never do)
        self._asks: dict[str, bool] = {}

    def take(self, copy: Copy) -> bool:
        """Acknowledge ``copy``'s message now, its claim taken, once its journal entry is in
        the store; False (nothing done: it is acked when it ends, as usual) where its task
        does not ask for it or the entry could not be written."""
        request = copy.request
        keep = self.w.keep_message
        if keep is None or copy.key is not None:
            return False
        asks = self._asks.get(request.name)
        if asks is None:
            asks = self._asks[request.name] = acks_on_claim(request.task, self.w.settings)
        if not asks or request.acknowledged:
            return False
        try:
            keep(copy.queue_id, copy.task_key, request.message)
        except (ClaimError, ValueError) as exc:
            # never acked without its durable copy: this one keeps its message unacked
            self.w.counters.incr("ack_on_claim_refused")
            logger.warning(
                "Claim %s: %s[%s] not acknowledged at claim, its journal entry could not be "
                "written (%s); acknowledged when it ends",
                copy.claim_id,
                request.name,
                request.id,
                exc,
            )
            return False
        copy.acked_at_claim = True
        # nothing of it is left in the broker: no unacked_index score to refresh
        copy.delivery = None
        self.w.counters.incr("acked_on_claim")
        self.w.on_loop(_acknowledge, copy)
        logger.debug("Claim %s: acknowledged at claim", copy.claim_id)
        return True


def _acknowledge(copy: Copy) -> None:
    """Celery's own ack of the request (once: ``Request.acknowledge`` is idempotent); a
    failure leaves the message with the broker, which redelivers it: the copy it delivers is
    held while this one's lease lives, then skipped once it is recorded done."""
    try:
        copy.request.acknowledge()
    except Exception as exc:
        logger.warning("Claim %s: acknowledgement at claim failed: %r", copy.claim_id, exc)
