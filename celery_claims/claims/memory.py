"""``MemoryClaimManager``: the executable specification of the claim protocol.

It is the reference every other backend is checked against (the contract suite and a
hypothesis model test run the Redis backend side by side with it), and it is public so users
can test their own code without a Redis server.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from celery_claims.claims.status import token_error
from celery_claims.clock import Clock, system_clock_ms
from celery_claims.errors import ClaimTokenError
from celery_claims.model import (
    DEFAULT_GIVEN_UP_TTL_MS,
    AlreadyClaimed,
    AlreadyDone,
    ClaimResult,
    ClaimStats,
    ClaimStatus,
    ClaimToken,
    GateResult,
    GivenUp,
    Success,
    TookOver,
)
from celery_claims.runs import earlier_run, require_run
from celery_claims.validation import (
    require_id,
    require_limit,
    require_max_takeovers,
    require_ms,
    require_token,
    require_tokens,
)

__all__ = ["MemoryClaimManager"]


@dataclass
class _Queue:
    """One queue's state; guarded by its own lock, as in the Rust ``AtomicClaimManager``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    claims: dict[str, ClaimToken] = field(default_factory=dict)
    done: dict[str, tuple[AlreadyDone | GivenUp, int]] = field(default_factory=dict)
    #: takeovers granted per task, counted only under a takeover limit; never outlives its claim
    takeovers: dict[str, int] = field(default_factory=dict)
    #: tasks whose claim a takeover granted, under a takeover limit, and whose holder has not
    #: marked its start (``mark_started``): its death does not count
    unstarted: set[str] = field(default_factory=set)
    last_instance: int = 0
    stats: ClaimStats = field(default_factory=ClaimStats)

    def forget(self, task_id: str) -> None:
        """The task's claim is gone: its takeover count and start mark go with it."""
        self.takeovers.pop(task_id, None)
        self.unstarted.discard(task_id)


class MemoryClaimManager:
    """Thread-safe in-process claim manager with an injectable clock.

    Args:
        clock: returns epoch ms; the default reads ``time.time()`` (freezegun moves it).
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or system_clock_ms
        self._queues: dict[str, _Queue] = {}
        self._registry_lock = threading.Lock()

    def _queue(self, queue_id: str) -> _Queue:
        """The queue's state, created on first claim."""
        queue = self._queues.get(queue_id)
        if queue is None:
            with self._registry_lock:
                queue = self._queues.setdefault(queue_id, _Queue())
        return queue

    def _existing(self, queue_id: str) -> _Queue:
        """The queue's state for a lookup: an unknown queue reads as empty and is not created."""
        return self._queues.get(queue_id) or _EMPTY

    def _count(self, queue: _Queue, **increments: int) -> None:
        stats = queue.stats
        queue.stats = replace(
            stats, **{name: getattr(stats, name) + n for name, n in increments.items()}
        )

    # --- the Rust AtomicClaimManager's API ---------------------------------------------------

    def claim(self, queue_id: str, task_id: str, owner: str, lease_ms: int) -> ClaimResult:
        """See :meth:`celery_claims.ClaimManager.claim`."""
        result = self._claim(queue_id, task_id, owner, lease_ms, honour_done=False)
        # without records or a takeover limit, only the Rust ``AtomicClaimManager``'s results are
        # possible
        assert isinstance(result, (Success, AlreadyClaimed, TookOver))
        return result

    def _claim(
        self,
        queue_id: str,
        task_id: str,
        owner: str,
        lease_ms: int,
        *,
        honour_done: bool,
        max_takeovers: int | None = None,
        given_up_ttl_ms: int = DEFAULT_GIVEN_UP_TTL_MS,
        run: int | None = None,
    ) -> GateResult:
        require_id("queue_id", queue_id)
        require_id("task_id", task_id)
        require_id("owner", owner)
        require_ms("lease_ms", lease_ms)
        require_max_takeovers(max_takeovers)
        require_ms("given_up_ttl_ms", given_up_ttl_ms)
        if run is not None:
            require_run(run)
        queue = self._queue(queue_id)
        with queue.lock:
            now = self._clock()
            self._count(queue, attempts=1)
            if honour_done:
                record = self._live_done(queue, task_id, now)
                # a record of an earlier run stays until this run's completion replaces it
                new_run = isinstance(record, AlreadyDone) and earlier_run(record.owner, run)
                if record is not None and not new_run:
                    return record
            current = queue.claims.get(task_id)
            previous_owner = None
            if current is not None and current.owner != owner:
                if now < current.expires_at:
                    self._count(queue, contentions=1)
                    return AlreadyClaimed(owner=current.owner, expires_at=current.expires_at)
                previous_owner = current.owner
                if max_takeovers is not None and task_id not in queue.unstarted:
                    # its holder may have died of it (see ClaimManager.claim_unless_done)
                    taken = queue.takeovers.get(task_id, 0)
                    if taken >= max_takeovers:
                        return self._give_up(queue, task_id, current, taken, now, given_up_ttl_ms)
                    queue.takeovers[task_id] = taken + 1
                if max_takeovers is None:
                    queue.unstarted.discard(task_id)
                else:
                    queue.unstarted.add(task_id)
            elif current is None:
                queue.unstarted.discard(task_id)
            queue.last_instance += 1
            token = ClaimToken(queue_id, task_id, owner, queue.last_instance, now, now + lease_ms)
            queue.claims[task_id] = token
            if previous_owner is not None:
                self._count(queue, takeovers=1)
                return TookOver(previous_owner=previous_owner, token=token)
            self._count(queue, successes=1)
            return Success(token=token)

    def _give_up(
        self, queue: _Queue, task_id: str, expired: ClaimToken, taken: int, now: int, ttl_ms: int
    ) -> GivenUp:
        """One takeover too many: drop the expired claim and its count, keep a given-up record."""
        del queue.claims[task_id]
        queue.forget(task_id)
        record = GivenUp(previous_owner=expired.owner, takeovers=taken, given_up_at=now)
        if ttl_ms > 0:
            queue.done[task_id] = (record, now + ttl_ms)
        return record

    def _check(self, queue: _Queue, task_id: str, token: ClaimToken) -> ClaimToken:
        """The stored claim ``token`` refers to; errors in the Rust ``AtomicClaimManager``'s
        order."""
        current = queue.claims.get(task_id)
        if current is None:
            raise token_error(ClaimStatus.NOT_FOUND, token)
        if current.instance != token.instance:
            raise token_error(ClaimStatus.STALE, token)
        if current.owner != token.owner:
            raise token_error(ClaimStatus.NOT_OWNER, token)
        return current

    def release(self, token: ClaimToken) -> None:
        """See :meth:`celery_claims.ClaimManager.release`."""
        self._release(token, done_ttl_ms=None)

    def _release(self, token: ClaimToken, done_ttl_ms: int | None) -> None:
        require_token(token)
        queue = self._existing(token.queue_id)
        with queue.lock:
            current = self._check(queue, token.task_id, token)
            del queue.claims[token.task_id]
            queue.forget(token.task_id)
            self._count(queue, acks=1)
            if done_ttl_ms is not None:
                now = self._clock()
                record = AlreadyDone(owner=current.owner, instance=current.instance, done_at=now)
                queue.done[token.task_id] = (record, now + done_ttl_ms)

    def extend(self, queue_id: str, token: ClaimToken, additional_ms: int) -> ClaimToken:
        """See :meth:`celery_claims.ClaimManager.extend`."""
        require_id("queue_id", queue_id)
        require_token(token)
        require_ms("additional_ms", additional_ms)
        queue = self._existing(queue_id)
        with queue.lock:
            current = self._check(queue, token.task_id, token)
            extended = replace(current, expires_at=current.expires_at + additional_ms)
            queue.claims[token.task_id] = extended
            return extended

    def is_claimed(self, queue_id: str, task_id: str) -> tuple[str, int] | None:
        """See :meth:`celery_claims.ClaimManager.is_claimed`."""
        token = self._live(queue_id, task_id)
        return None if token is None else (token.owner, token.expires_at)

    def get_token(self, queue_id: str, task_id: str, owner: str) -> ClaimToken | None:
        """See :meth:`celery_claims.ClaimManager.get_token`."""
        require_id("owner", owner)
        token = self._live(queue_id, task_id)
        return token if token is not None and token.owner == owner else None

    def _live(self, queue_id: str, task_id: str) -> ClaimToken | None:
        require_id("queue_id", queue_id)
        require_id("task_id", task_id)
        queue = self._existing(queue_id)
        with queue.lock:
            token = queue.claims.get(task_id)
            return token if token is not None and self._clock() < token.expires_at else None

    def cleanup_expired(self, *, limit: int | None = None) -> int:
        """See :meth:`celery_claims.ClaimManager.cleanup_expired`."""
        budget = require_limit(limit) or 2**62
        removed = 0
        # soonest expiry first, queues in sorted order (the Redis backend, which keeps no expiry
        # index, removes a limited run's share in its sweep's order: which ones go first is
        # not part of the contract)
        for _, queue in sorted(self._queues.items()):
            with queue.lock:
                now = self._clock()
                expired = sorted(
                    (tok.expires_at, task_id)
                    for task_id, tok in queue.claims.items()
                    if now >= tok.expires_at
                )[: max(budget - removed, 0)]
                for _, task_id in expired:
                    del queue.claims[task_id]
                    queue.forget(task_id)
                self._count(queue, expirations=len(expired))
                removed += len(expired)
                for task_id in [t for t, (_, until) in queue.done.items() if now >= until]:
                    del queue.done[task_id]
        return removed

    def stats(self) -> ClaimStats:
        """See :meth:`celery_claims.ClaimManager.stats`."""
        total = ClaimStats()
        for queue in list(self._queues.values()):
            with queue.lock:
                total += queue.stats
        return total

    def active_claims(self, queue_id: str) -> int:
        """See :meth:`celery_claims.ClaimManager.active_claims`."""
        return len(self.list_claims(queue_id))

    def list_claims(self, queue_id: str) -> list[ClaimToken]:
        """See :meth:`celery_claims.ClaimManager.list_claims`."""
        require_id("queue_id", queue_id)
        queue = self._existing(queue_id)
        with queue.lock:
            now = self._clock()
            live = [t for t in queue.claims.values() if now < t.expires_at]
        return sorted(live, key=lambda t: (t.expires_at, t.task_id))

    # --- additions for the Celery integration ---------------------------------------------

    def claim_unless_done(
        self,
        queue_id: str,
        task_id: str,
        owner: str,
        lease_ms: int,
        *,
        max_takeovers: int | None = None,
        given_up_ttl_ms: int = DEFAULT_GIVEN_UP_TTL_MS,
        run: int | None = None,
    ) -> GateResult:
        """See :meth:`celery_claims.ClaimManager.claim_unless_done`."""
        return self._claim(
            queue_id,
            task_id,
            owner,
            lease_ms,
            honour_done=True,
            max_takeovers=max_takeovers,
            given_up_ttl_ms=given_up_ttl_ms,
            run=run,
        )

    def mark_started(self, token: ClaimToken) -> None:
        """See :meth:`celery_claims.ClaimManager.mark_started`."""
        require_token(token)
        queue = self._existing(token.queue_id)
        with queue.lock:
            self._check(queue, token.task_id, token)
            queue.unstarted.discard(token.task_id)

    def complete(self, token: ClaimToken, done_ttl_ms: int) -> None:
        """See :meth:`celery_claims.ClaimManager.complete`."""
        require_ms("done_ttl_ms", done_ttl_ms)
        self._release(token, done_ttl_ms=done_ttl_ms)

    def done_record(self, queue_id: str, task_id: str) -> AlreadyDone | GivenUp | None:
        """See :meth:`celery_claims.ClaimManager.done_record`."""
        require_id("queue_id", queue_id)
        require_id("task_id", task_id)
        queue = self._existing(queue_id)
        with queue.lock:
            return self._live_done(queue, task_id, self._clock())

    def _live_done(self, queue: _Queue, task_id: str, now: int) -> AlreadyDone | GivenUp | None:
        entry = queue.done.get(task_id)
        return entry[0] if entry is not None and now < entry[1] else None

    def renew(
        self, queue_id: str, tokens: Sequence[ClaimToken], lease_ms: int
    ) -> list[ClaimToken | ClaimTokenError]:
        """See :meth:`celery_claims.ClaimManager.renew`."""
        require_id("queue_id", queue_id)
        checked = require_tokens(tokens)
        require_ms("lease_ms", lease_ms)
        queue = self._existing(queue_id)
        results: list[ClaimToken | ClaimTokenError] = []
        with queue.lock:
            now = self._clock()
            for token in checked:
                try:
                    current = self._check(queue, token.task_id, token)
                except ClaimTokenError as refused:
                    results.append(refused)
                    continue
                renewed = replace(current, expires_at=max(current.expires_at, now + lease_ms))
                queue.claims[token.task_id] = renewed
                results.append(renewed)
        return results


#: The state every unknown queue reads as; never written, since writes need an existing claim.
_EMPTY = _Queue()
