"""What the parts of a worker's lifecycle share: its collaborators and the consumer's loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery_claims.claims.calls import ScriptCall
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.lanes import WorkerLanes
from celery_claims.worker.delivery.slots import SlotLedger
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.failover import RecentCompletions
from celery_claims.worker.transport.loop import LoopWaker

__all__ = ["Wiring"]


class Wiring:
    """The worker's collaborators, and the hooks the gate, the keeper and the runtime set.

    Args:
        settings: the worker's settings.
        manager: the claim manager (blocking client).
        counters: the worker's counters.
        lanes: the worker's lanes, if any.
        hostname: the worker's node name (for new owner strings).
    """

    def __init__(
        self,
        settings: ClaimsSettings,
        manager: RedisClaimManager,
        counters: Counters,
        lanes: WorkerLanes | None,
        hostname: str,
    ) -> None:
        self.settings = settings
        self.hostname = hostname
        self.manager = manager
        self.counters = counters
        self.lanes = lanes
        self.slots = SlotLedger()
        #: wakes the consumer's loop for a call from another thread (kombu before 5.7)
        self.waker = LoopWaker()
        #: the worker's pool, to terminate a stale copy's process (set when the worker starts)
        self.pool: Any = None
        self.consumer: Any = None
        #: the gate's hand-off to the pool, and its re-check of a held copy
        self.dispatch: Callable[[Copy], None] | None = None
        self.recheck: Callable[[Copy], None] | None = None
        self.loop_thread = -1
        #: the claim store is the Redis broker's own server (see ``Lifecycle``)
        self.ride_acks = False
        #: pool processes leave the completion record to this process (see ``Lifecycle``)
        self.records_left = False
        #: sends a call on the consumer's pipe, its outcome to the callback on the event loop;
        #: False if it cannot (no pipe, another thread): the caller then writes it blocking
        self.send: Callable[[ScriptCall[Any], Callable[[Any], None]], bool] = (
            lambda call, callback: False
        )
        #: wakes the lease keeper (set by it): a claim's lease is too short for its period
        self.wake_keeper: Callable[[], object] = lambda: None
        #: told ``(queue_id, task_key, done)`` when a copy's message is gone from the broker
        #: for good (its publish journal entry can go; ``done``: the attempt is recorded done
        #: or given up; set by the runtime)
        self.on_gone: Callable[[str, str, bool], object] = lambda queue_id, key, done: None
        #: writes a delivered message's publish journal entry ``(queue_id, task_key,
        #: message)``, waited for, before it is acknowledged at claim (set by the runtime when
        #: the journal is on); raises ``ClaimError`` or ``ValueError`` if it cannot
        self.keep_message: Callable[[str, str, Any], object] | None = None
        #: builds the one-script question "does another owner's live lease hold this task,
        #: and is its message journaled?" ``(queue_id, task_key, owner)``
        #: (:meth:`~celery_claims.claims.journal.RedisJournal.held_call`; set by the runtime
        #: when the journal is on)
        self.held_call: Callable[[str, str, str], ScriptCall[Any]] | None = None
        #: completions recorded lately, written again after a Sentinel failover (failover.py)
        self.recent = RecentCompletions()

    def on_loop(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a broker call on the consumer's thread."""
        if threading.get_ident() == self.loop_thread or self.consumer is None:
            fn(*args)
        else:
            self.waker.call_soon(self.consumer, fn, *args)
