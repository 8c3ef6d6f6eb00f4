"""The queue valve: a worker stops taking a queue's messages while two prefetch windows of
them wait for a fleet-wide rate, and takes them again at one (:mod:`.slots` counts them)."""

from __future__ import annotations

from celery.utils.log import get_logger

from celery_claims.worker.compat import set_queue_consuming
from celery_claims.worker.delivery.wiring import Wiring

__all__ = ["QueueValve"]

logger = get_logger("celery_claims.worker")


class QueueValve:
    """Stops or starts taking messages from a queue, called by the slots (``slots.bind``)."""

    def __init__(self, w: Wiring) -> None:
        self.w = w

    def __call__(self, queue: str, open_: bool) -> None:
        """Stop or start again taking messages from ``queue``, on the consumer's loop at its
        next turn: never inside the broker read that delivered a message."""
        consumer = self.w.consumer
        if consumer is None:
            return
        if open_:
            logger.info("Taking messages from queue %s again: fewer of them wait for a rate", queue)
        else:
            logger.info(
                "Not taking messages from queue %s for now: two prefetch windows of them wait "
                "for a rate (the rest stays in the broker; other queues keep flowing)",
                queue,
            )
        self.w.on_loop(consumer.call_soon, self._set_consuming, queue, open_)

    def _set_consuming(self, queue: str, open_: bool) -> None:
        try:
            if open_ == (queue not in self.w.slots.closed()):  # else the later call decides
                set_queue_consuming(self.w.consumer, queue, open_)
        except Exception:
            # the connection is failing: a new one consumes every queue again
            logger.exception("Could not %s queue %s", "resume" if open_ else "pause", queue)
        finally:
            # the copies of the queue that wait with their slots taken give them back now:
            # a raised prefetch count reaches the broker after the cancel, never before
            self.w.slots.settle(queue)
