"""Following a Sentinel failover: what the old master took after the switch is written again.

Sentinel promotes a replica first and tells its clients afterwards, and a redis-py connection
to the old master stays there as long as that server answers as a master. After
``SENTINEL FAILOVER`` the old master goes on taking writes for about 11 s (measured: until
the Sentinels demote it), then discards them as it resynchronises from the new master: every
claim, renewal and completion record written there meanwhile vanishes without an error. A
vanished completion record lets a later copy of a finished task run again.

The lease keeper follows the master with a :class:`MasterWatch` (one Sentinel round trip per
beat, Sentinel-managed stores only):

1. Before the beat's renewals it asks the Sentinels for the master
   (:func:`~celery_claims.connection.sentinel_master`). When the master has moved, the claim
   manager's pool drops its connections to the old one, so the renewals go to the new master
   at once; a claim the new master never saw is refused there and claimed again under the
   same owner by the lifecycle's recovery (:mod:`celery_claims.worker.delivery.verdict`), so the
   task keeps running: a claim that vanished in a failover never stops it.
2. After the renewals it writes again on the new master the completion records of this
   worker's recent completions (:class:`RecentCompletions`, fed by the lifecycle whenever a
   copy ends recorded done): every completion learned of within the failover window before
   the switch was seen (twice the Sentinels' ``down-after-milliseconds``, two beats and a
   margin: the promotion comes before the Sentinels report it), and every one learned of
   after it, until the old master answers as a replica (or not at all) for a grace period.
   Pool processes have clients of their own, which leave the old master only once it refuses
   their writes (``READONLY``): until then their records go there, and the main process,
   which learns of each completion from the pool, writes it again. Writing a record again is
   idempotent and costs two pipelined round trips per batch (:func:`restore_records`).
3. A record another copy's claim stands in the way of is not written (that copy owns the task
   now): it is logged.

Not covered: a worker that dies before it has written its records again (its completions of
the window may run again), and a master that fails without a replica having its last writes
(asynchronous replication); ``WAIT`` narrows that (docs/operations.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from celery.utils.log import get_logger

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import role_at, sentinel_down_after_ms, sentinel_master
from celery_claims.errors import BackendError
from celery_claims.model import ClaimToken
from celery_claims.worker.delivery.verdict import Verdict, restore_records
from celery_claims.worker.signals import Counters

__all__ = [
    "FAILOVER_MARGIN_S",
    "RECENT_MAX",
    "RESTORE_BATCH",
    "MasterWatch",
    "RecentCompletions",
]

logger = get_logger("celery_claims.worker")

#: Most completions a worker remembers for writing again after a failover.
RECENT_MAX = 50_000
#: Seconds added to the failover window: the Sentinels' election, the promotion, the report.
FAILOVER_MARGIN_S = 5.0
#: Records written again in one pipelined round trip.
RESTORE_BATCH = 500
#: Most records written again in one keeper beat (the rest on the next ones).
_RESTORE_PER_BEAT = 10 * RESTORE_BATCH
#: ``down-after-milliseconds`` assumed when no Sentinel says (Sentinel's own default).
_DOWN_AFTER_DEFAULT_MS = 30_000


class RecentCompletions:
    """The completions this worker learned of lately, numbered, bounded (thread-safe).

    Off (``keep_s == 0``, :meth:`add` keeps nothing) until a :class:`MasterWatch` on a
    Sentinel-managed store turns it on: other stores have no failover to write them again on.
    """

    def __init__(self, maxlen: int = RECENT_MAX) -> None:
        #: seconds an entry is kept (0: off)
        self.keep_s = 0.0
        self._entries: deque[tuple[int, float, ClaimToken]] = deque(maxlen=maxlen)
        self._seq = 0
        self._lock = threading.Lock()

    def add(self, token: ClaimToken | None) -> None:
        """Remember that ``token``'s attempt was recorded done (now)."""
        if token is None or not self.keep_s:
            return
        now = time.monotonic()
        with self._lock:
            self._seq += 1
            self._entries.append((self._seq, now, token))
            while self._entries and self._entries[0][1] < now - self.keep_s:
                self._entries.popleft()

    def since(self, at: float) -> tuple[int, list[ClaimToken]]:
        """The last number handed out, and the tokens learned of at ``at`` or later."""
        with self._lock:
            return self._seq, [token for _, when, token in self._entries if when >= at]

    def after(self, seq: int) -> tuple[int, list[ClaimToken]]:
        """The last number handed out, and the tokens numbered after ``seq``."""
        with self._lock:
            return self._seq, [token for number, _, token in self._entries if number > seq]

    def truncated(self, at: float) -> bool:
        """True if entries learned of at ``at`` or later were dropped (the bound was hit)."""
        with self._lock:
            entries = self._entries
            return len(entries) == entries.maxlen and bool(entries) and entries[0][1] > at


class MasterWatch:
    """Follows a Sentinel-managed claim store's master from the lease keeper (module doc).

    Args:
        manager: the worker's claim manager (its client is the one that follows the master).
        recent: the lifecycle's recent completions.
        counters: the worker's counters (``master_switches``, ``records_restored``,
            ``records_restore_lost``).
        renew_interval_ms: the keeper's period.
        lease_ms: the lease of a claim taken again to write its record.
        done_ttl_ms: the retention of the records written again.
    """

    def __init__(
        self,
        manager: RedisClaimManager,
        recent: RecentCompletions,
        counters: Counters,
        *,
        renew_interval_ms: int,
        lease_ms: int,
        done_ttl_ms: int,
    ) -> None:
        self.manager = manager
        self.recent = recent
        self.counters = counters
        self.interval_s = renew_interval_ms / 1000
        self.lease_ms = lease_ms
        self.done_ttl_ms = done_ttl_ms
        #: the failover window: how far back completions are written again
        self.window_s = 0.0
        self._enabled = True
        self._master: tuple[str, int] | None = None
        self._unreachable = False
        # while a switch is being followed: the former masters, the pending records, the last
        # completion number taken, and since when no former master takes writes
        self._former: set[tuple[str, int]] = set()
        self._pending: list[ClaimToken] = []
        self._cursor = 0
        self._settled_at: float | None = None
        self._restored = 0

    def check(self) -> None:
        """Ask the Sentinels for the master, and follow it if it moved (before renewals)."""
        if not self._enabled:
            return
        try:
            address = sentinel_master(self.manager.client)
        except BackendError as exc:
            if not self._unreachable:
                self._unreachable = True
                logger.warning("Claim store: cannot ask the Sentinels for the master: %s", exc)
            return
        if address is None:
            self._enabled = False  # not Sentinel-managed: nothing to follow
            return
        if self._unreachable:
            self._unreachable = False
            logger.warning("Claim store: the Sentinels answer again (master %s:%d)", *address)
        if self._master is None:
            self._master = address
            self._set_window()
            return
        if address == self._master:
            return
        old, self._master = self._master, address
        self.counters.incr("master_switches")
        self._set_window()
        since = time.monotonic() - self.window_s
        self._cursor, tokens = self.recent.since(since)
        if not self._former:
            self._restored = 0
        # a second switch while following the first: everything of the window again
        self._pending = tokens
        self._former.add(old)
        self._former.discard(address)
        self._settled_at = None
        logger.warning(
            "Claim store: the Sentinels moved the master from %s:%d to %s:%d; following it, "
            "claims are renewed (and claimed again) there and %d completion record(s) of the "
            "last %.0f s written again",
            *old,
            *address,
            len(tokens),
            self.window_s,
        )
        if self.recent.truncated(since):
            logger.warning(
                "Claim store: more completions in the failover window than the %d kept; the "
                "oldest of them are not written again",
                RECENT_MAX,
            )

    def restore(self) -> None:
        """Write again the records the old master may have taken (after renewals)."""
        if not self._former:
            return
        self._cursor, tokens = self.recent.after(self._cursor)
        self._pending.extend(tokens)
        done = 0
        while self._pending and done < _RESTORE_PER_BEAT:
            batch = self._pending[:RESTORE_BATCH]
            try:
                found = restore_records(
                    self.manager, batch, lease_ms=self.lease_ms, done_ttl_ms=self.done_ttl_ms
                )
            except BackendError as exc:
                logger.warning("Claim store: completion records not written again yet: %s", exc)
                return
            del self._pending[: len(batch)]
            done += len(batch)
            for token, recovery in zip(batch, found, strict=True):
                if recovery.verdict is Verdict.LOST:
                    self.counters.incr("records_restore_lost")
                    logger.warning(
                        "Claim %s/%s: completion record not written again on the new master: %s",
                        token.queue_id,
                        token.task_id,
                        recovery.detail,
                    )
                else:
                    self.counters.incr("records_restored")
                    self._restored += 1
        self._settle()

    def _settle(self) -> None:
        """End the switch once no former master has taken writes for a grace period."""
        now = time.monotonic()
        if any(role_at(self.manager.client, old) == "master" for old in self._former):
            # the pool processes' connections may still write there
            self._settled_at = None
            return
        if self._settled_at is None:
            self._settled_at = now
        # a pool process's completion reaches this process a moment after its record
        if now - self._settled_at < max(2.0, 2 * self.interval_s) or self._pending:
            return
        logger.warning(
            "Claim store: the old master (%s) takes no more writes; %d completion record(s) "
            "written again on the new master",
            ", ".join(f"{host}:{port}" for host, port in sorted(self._former)),
            self._restored,
        )
        self._former.clear()
        self._settled_at = None

    def _set_window(self) -> None:
        down_after_ms = sentinel_down_after_ms(self.manager.client)
        if down_after_ms is None:
            down_after_ms = _DOWN_AFTER_DEFAULT_MS
        self.window_s = 2 * down_after_ms / 1000 + 2 * self.interval_s + FAILOVER_MARGIN_S
        self.recent.keep_s = self.window_s
