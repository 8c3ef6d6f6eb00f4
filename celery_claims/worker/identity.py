"""Which claim a delivered Celery message maps to, and who is claiming it.

A claim is named by queue + task id + attempt. The attempt is the pair ``(retries,
replaced_task_nesting)``: ``Task.retry()`` and ``Task.replace()`` reuse the task id and publish
the next attempt before the current one ends, so the next attempt must get a claim of its own,
while a duplicate delivery of an earlier attempt maps to that attempt's (done) claim. Along
one task id's history every retry raises ``retries`` and every replacement raises the nesting,
so no two attempts share a pair (a sum of the two would collide: retry-then-replace).

The owner names one execution attempt in one process (``hostname/pid/nonce``), never a host:
the claim store lets the same owner re-claim freely, so two copies of a task in one worker
must never share an owner.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from celery_claims.worker.compat import task_queues

__all__ = [
    "Attempt",
    "QueueResolver",
    "attempt_of",
    "attempt_task_id",
    "claim_task_id",
    "new_owner",
]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One execution attempt of a task id.

    Attributes:
        retries: the request's ``retries`` (raised by every ``Task.retry``).
        nesting: the request's ``replaced_task_nesting`` (raised by every ``Task.replace``).
    """

    retries: int = 0
    nesting: int = 0

    def __str__(self) -> str:
        return f"{self.retries}.{self.nesting}"


def _count(value: Any) -> int:
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError):
        return 0


def attempt_of(request_dict: Mapping[str, Any]) -> Attempt:
    """The attempt a request is, from its ``retries`` and ``replaced_task_nesting`` headers."""
    return Attempt(
        _count(request_dict.get("retries")), _count(request_dict.get("replaced_task_nesting"))
    )


def claim_task_id(task_id: str, attempt: Attempt) -> str:
    """The claim store's task id of one attempt: ``<task id>:<retries>:<nesting>``.

    The claim store escapes ``:`` inside keys, so the separator cannot collide with task ids.
    """
    return f"{task_id}:{attempt.retries}:{attempt.nesting}"


def attempt_task_id(task_id: str, fields: Mapping[str, Any]) -> str:
    """``claim_task_id(task_id, attempt_of(fields))`` (``fields``: a message's headers or a
    request dict), without building an :class:`Attempt` for the counts Celery itself sends (a
    first attempt's absent or 0, or two non-negative ints): every message asks it."""
    retries, nesting = fields.get("retries"), fields.get("replaced_task_nesting")
    if not retries and not nesting:
        return f"{task_id}:0:0"  # attempt_of() reads absent, None or 0 so too
    if type(retries) is int and type(nesting) is int and retries >= 0 and nesting >= 0:
        return f"{task_id}:{retries}:{nesting}"
    return claim_task_id(task_id, attempt_of(fields))


def new_owner(hostname: str) -> str:
    """A fresh owner string for one delivery in this process: ``hostname/pid/nonce``.

    The nonce is random per process (drawn again in a forked child), a ``.``, and a counter,
    so no two deliveries share an owner, even across restarts that reuse a pid. The claim
    store writes an owner's part up to its last ``.`` once per queue and keeps only the
    counter in each claim and completion record (see ``claims/keys.py``).
    """
    prefix, counter = _nonce
    return f"{hostname}/{prefix}{next(counter):x}"


def _fresh_nonce() -> tuple[str, Iterator[int]]:
    """``<pid>/<nonce>.`` of this process, and its counter."""
    return f"{os.getpid()}/{uuid.uuid4().hex[:8]}.", itertools.count()


_nonce = _fresh_nonce()


def _reset_nonce() -> None:
    global _nonce
    _nonce = _fresh_nonce()


os.register_at_fork(after_in_child=_reset_nonce)


class QueueResolver:
    """Maps a delivery to the name of the queue it came from.

    Redis deliveries carry no queue name, only the exchange and routing key they were
    published with, so the name is found through ``app.amqp.queues`` (the queues this app
    knows, including those added at run time with ``add_consumer``).

    Args:
        app: the Celery app.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._by_route: dict[tuple[str, str], str] = {}
        self._by_key: dict[str, str] = {}
        self._size = -1

    def _rebuild(self) -> None:
        queues = task_queues(self.app)
        by_route: dict[tuple[str, str], str] = {}
        by_key: dict[str, str] = {}
        for name, queue in sorted(queues.items()):
            exchange = getattr(getattr(queue, "exchange", None), "name", "") or ""
            key = queue.routing_key or name
            by_route.setdefault((exchange, key), name)
            by_key.setdefault(key, name)
        self._by_route, self._by_key, self._size = by_route, by_key, len(queues)

    def queue_of(self, delivery_info: Mapping[str, Any] | None) -> str:
        """The queue name of a delivery.

        An exact (exchange, routing key) match wins, then a routing key match; a routing key
        that no known queue binds (a topic pattern, say) is itself used as the queue id, and a
        delivery without one falls back to the app's default queue.
        """
        info = delivery_info or {}
        exchange = str(info.get("exchange") or "")
        key = str(info.get("routing_key") or "")
        if len(task_queues(self.app)) != self._size:
            self._rebuild()
        name = self._by_route.get((exchange, key)) or self._by_key.get(key)
        if name is not None:
            return name
        return key or str(self.app.conf.task_default_queue)
