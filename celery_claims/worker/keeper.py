"""The lease keeper: one thread per worker renewing every live claim, batched per queue.

The keeper lives in the worker's main process. It is a thread rather than a timer entry
because the solo pool runs tasks inside the event loop, which would stop a timer from firing
exactly while a long task needs its lease renewed. Each beat it:

1. renews every live claim with one ``renew`` round trip per (queue, lease), and fences the
   requests whose renewal was refused (their lease was lost: another worker took over);
2. retries completions that could not be recorded because the claim store was unreachable;
3. with the Redis broker, refreshes the score of every claimed or held delivery in kombu's
   ``unacked_index``, so kombu does not restore a message whose holder is alive (a dead
   holder stops refreshing, and its message is restored after ``visibility_timeout``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import bootsteps
from celery.utils.log import get_logger
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import BackendUnavailable, ClaimError, ClaimTokenError, InvalidArgument
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.model import ClaimToken
from celery_claims.safety import check_settings
from celery_claims.worker import signals
from celery_claims.worker.guard import guard_tasks
from celery_claims.worker.lanes import WorkerLanes
from celery_claims.worker.pipe import StorePipe
from celery_claims.worker.settings import WORKER_OPTION_NAMES, ClaimsSettings, load_settings
from celery_claims.worker.signals import Counters

__all__ = ["ActiveClaim", "ClaimsRuntime", "Delivery", "HeldCopy", "LeaseKeeper", "new_manager"]

logger = get_logger("celery_claims.worker")

#: Seconds a stopping keeper goes on renewing claims of tasks that are still finishing
#: (a warm shutdown stops this step before the pool has drained).
STOP_GRACE_S = 600.0


def new_manager(settings: ClaimsSettings) -> RedisClaimManager:
    """A claim manager for ``settings``, with timeouts fit for the worker's event loop.

    redis-py's default retry policy sleeps between attempts; the gate runs in the event loop
    and has its own backoff, so a call fails fast instead (one immediate retry, for a
    connection dropped by an idle timeout).
    """
    timeout_s = settings.socket_timeout_ms / 1000
    client = redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        health_check_interval=30,
    )
    return RedisClaimManager(client=client, prefix=settings.prefix)


@dataclass(eq=False)
class Delivery:
    """A Redis broker delivery whose ``unacked_index`` score the keeper refreshes.

    Attributes:
        channel: the kombu Redis channel the message was delivered on.
        tag: the delivery tag (the member of ``unacked_index``).
    """

    channel: Any
    tag: str

    @classmethod
    def of(cls, message: Any) -> Delivery | None:
        """The delivery of ``message`` if it came from kombu's Redis transport, else None."""
        channel = getattr(message, "channel", None)
        tag = getattr(message, "delivery_tag", None)
        # duck-typed: kombu's Redis channel is the one with an unacked index and a client
        # factory; AMQP channels have neither and need no refresh (they redeliver on close)
        if tag is None or not hasattr(channel, "unacked_index_key"):
            return None
        if not callable(getattr(channel, "conn_or_acquire", None)):
            return None
        return cls(channel, str(tag))


@dataclass(eq=False)
class ActiveClaim:
    """A claim this worker holds for one request, from the gate until completion or release.

    Attributes:
        token: the latest token (``expires_at`` is updated by each renewal).
        claim_id: ``queue/task:attempt`` for logs.
        lease_ms: the lease renewals extend to.
        request: the worker's ``Request``.
        delivery: its Redis delivery, if the broker is Redis.
        fenced: the lease was lost; success must not be recorded as done.
        finished: completion or release has run (exactly once).
        dispatched: handed to the pool (``execute_using_pool`` was called).
        completing: success seen but ``complete`` is pending (the store was unreachable).
        stopped: the lease was lost while the task ran and its pool process was terminated.
        lane_waiter: while the message waits for a lane slot, its place in the lane.
        lane_slot: the lane slot the running task holds, if its message is in a lane.
    """

    token: ClaimToken
    claim_id: str
    lease_ms: int
    request: Any
    delivery: Delivery | None = None
    fenced: bool = False
    finished: bool = False
    dispatched: bool = False
    completing: bool = False
    stopped: bool = False
    lane_waiter: Any = None
    lane_slot: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def instance(self) -> int:
        """The fencing number of the claim."""
        return self.token.instance


@dataclass(eq=False)
class HeldCopy:
    """A delivery the gate keeps unacked (another lease is live, or the store is down).

    Attributes:
        request: the worker's ``Request``.
        owner: the owner string used for every claim attempt of this copy.
        reason: ``"held"`` or ``"unavailable"``.
        qos: the consumer's QoS whose prefetch was raised for this copy.
        delivery: its Redis delivery, if the broker is Redis.
        timer_entry: the pending re-check.
        delay_ms: the current back-off delay (``unavailable`` only).
    """

    request: Any
    owner: str
    reason: str
    qos: Any
    delivery: Delivery | None = None
    timer_entry: Any = None
    delay_ms: int = 0


class ClaimsRuntime:
    """The claim state of one worker: settings, manager, counters, live claims, held copies.

    Reachable as ``worker.claims`` (the ``WorkController``) and from the consumer as
    ``consumer.controller.claims``.

    Args:
        app: the Celery app.
        settings: the validated settings.
        hostname: the worker's node name (the first part of every owner string).
        manager: a claim manager (default: a ``RedisClaimManager`` for ``settings``).
    """

    def __init__(
        self,
        app: Any,
        settings: ClaimsSettings,
        hostname: str,
        manager: RedisClaimManager | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.hostname = hostname
        self.manager = manager if manager is not None else new_manager(settings)
        self.counters = Counters()
        #: the worker's lanes, when ``claims_lanes`` is configured
        self.lanes: WorkerLanes | None = None
        if settings.lanes:
            store = RedisTaskClaimStore(
                client=self.manager.client,
                lanes=WorkerLanes.store_lanes(settings),
                prefix=settings.prefix,
            )
            self.lanes = WorkerLanes(settings, store, self.counters)
        #: the worker's pool (set at start), to terminate a stale copy whose lease was lost
        self.pool: Any = None
        #: hands a request whose claim was lost while it waited back to the gate (event loop)
        self.on_waiting_lost: Any = None
        self._lock = threading.Lock()
        self._claims: dict[int, ActiveClaim] = {}
        self._held: dict[int, HeldCopy] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_at: float | None = None
        self._unavailable_since: float | None = None

    # --- registry ---------------------------------------------------------------------------

    def track(self, claim: ActiveClaim) -> None:
        """Start renewing ``claim``."""
        with self._lock:
            self._claims[id(claim)] = claim

    def untrack(self, claim: ActiveClaim) -> None:
        """Stop renewing ``claim``."""
        with self._lock:
            self._claims.pop(id(claim), None)

    def hold(self, held: HeldCopy) -> None:
        """Start refreshing a held copy's delivery."""
        with self._lock:
            self._held[id(held)] = held

    def unhold(self, held: HeldCopy) -> bool:
        """Stop tracking a held copy; False if it was not tracked (already resolved)."""
        with self._lock:
            return self._held.pop(id(held), None) is not None

    def live_claims(self) -> list[ActiveClaim]:
        """The claims being renewed right now."""
        with self._lock:
            return list(self._claims.values())

    def held_copies(self) -> list[HeldCopy]:
        """The copies held right now."""
        with self._lock:
            return list(self._held.values())

    # --- completion -------------------------------------------------------------------------

    def finish(self, claim: ActiveClaim, *, done: bool, why: str) -> None:
        """Record ``claim`` done (``done=True``) or release it, exactly once.

        Safe to call from any thread and any number of times: a hard time limit reaches the
        failure path twice, and a failure can follow a success callback.

        Args:
            claim: the claim.
            done: record completion (success, retry, replace) rather than release.
            why: what ended the attempt, for the log.
        """
        if not self._ending(claim, done=done, why=why):
            return
        if done:
            self._complete(claim, why)
        else:
            self._release(claim, why)

    def finish_async(
        self, claim: ActiveClaim, pipe: StorePipe, *, why: str, then: Callable[[], object]
    ) -> None:
        """Record ``claim`` done through the consumer's ``pipe``, then call ``then``.

        :meth:`finish` with ``done=True``, without waiting for the reply: the call is on the
        store's socket before ``then`` (Celery's own success handler, which acks) runs, and
        its reply is accounted for when it is read. A completion the store could not take is
        retried from the keeper, as after a failed blocking call. Consumer thread only.
        """
        if self._ending(claim, done=True, why=why):
            call = self.manager.complete_call(claim.token, self.settings.done_ttl_ms)
            try:
                pipe.submit(call, functools.partial(self._completed, claim, why))
            except BackendUnavailable as exc:
                self._completed(claim, why, exc)
        then()

    def _ending(self, claim: ActiveClaim, *, done: bool, why: str) -> bool:
        """Mark ``claim`` finished; True if its completion or release is to be written."""
        with claim.lock:
            if claim.finished:
                return False
            claim.finished = True
        slot = claim.lane_slot
        if slot is not None and self.lanes is not None:
            # the slot goes back first: the next task of the lane need not wait for the store
            # write of this one's completion
            self.lanes.release(slot)
        if claim.fenced:
            # another worker holds the task now: writing anything would overwrite its claim
            self.untrack(claim)
            if done:
                self.counters.incr("fenced_success")
                logger.warning(
                    "Claim %s: %s after the lease was lost; not recorded as done",
                    claim.claim_id,
                    why,
                )
            return False
        return True

    def _complete(self, claim: ActiveClaim, why: str) -> None:
        outcome: ClaimError | None = None
        try:
            self.manager.complete(claim.token, self.settings.done_ttl_ms)
        except ClaimError as exc:
            outcome = exc
        self._completed(claim, why, outcome)

    def _completed(self, claim: ActiveClaim, why: str, outcome: object) -> None:
        """Account for a ``complete`` call's outcome (``None`` or its error)."""
        if isinstance(outcome, BackendUnavailable):
            # keep renewing it and retry from the keeper: the attempt is done, and a duplicate
            # copy must not take the claim over while the record cannot be written
            claim.completing = True
            self.counters.incr("completion_deferred")
            logger.warning("Claim %s: %s, completion deferred: %s", claim.claim_id, why, outcome)
            return
        self.untrack(claim)
        if isinstance(outcome, ClaimTokenError):
            self._lost(claim, outcome)
        elif isinstance(outcome, ClaimError):
            logger.error("Claim %s: could not record completion: %s", claim.claim_id, outcome)
        else:
            self.counters.incr("completed")
            logger.debug("Claim %s: %s, recorded done", claim.claim_id, why)

    def _release(self, claim: ActiveClaim, why: str) -> None:
        self.untrack(claim)
        try:
            self.manager.release(claim.token)
        except ClaimTokenError as exc:
            logger.debug("Claim %s: already gone at release (%s)", claim.claim_id, exc)
            return
        except BackendUnavailable as exc:
            # nothing to retry: the lease is no longer renewed and expires by itself
            logger.warning("Claim %s: %s, release failed: %s", claim.claim_id, why, exc)
            return
        except ClaimError:
            logger.exception("Claim %s: could not release", claim.claim_id)
            return
        self.counters.incr("released")
        logger.debug("Claim %s: %s, released", claim.claim_id, why)

    def _lost(self, claim: ActiveClaim, error: ClaimTokenError) -> None:
        claim.fenced = True
        self.counters.incr("lease_lost")
        request = claim.request
        logger.warning(
            "Claim %s: lease lost (%s); %s[%s] is fenced, its result will not be recorded",
            claim.claim_id,
            type(error).__name__,
            getattr(request, "name", "?"),
            getattr(request, "id", "?"),
        )
        signals.lease_lost.send(
            sender=getattr(request, "task", None), request=request, token=claim.token, error=error
        )
        if not claim.finished:
            self._stop_stale(claim)

    def _stop_stale(self, claim: ActiveClaim) -> None:
        """Stop the copy whose lease was lost: terminate its pool process where possible."""
        request = claim.request
        if claim.lane_waiter is not None:
            # still waiting for its lane, never started: the gate deals with it as a new copy
            if self.on_waiting_lost is not None:
                self.on_waiting_lost(claim)
            return
        pid = getattr(request, "worker_pid", None)
        pool = self.pool
        # Only a separate process can be stopped: thread and solo pools run the task in this
        # process (worker_pid is ours), where it is fenced instead and its result discarded.
        if not claim.dispatched or pool is None or not pid or pid == os.getpid():
            logger.warning(
                "Claim %s: %s[%s] keeps running fenced; its result will be discarded",
                claim.claim_id,
                getattr(request, "name", "?"),
                getattr(request, "id", "?"),
            )
            return
        with claim.lock:
            # a task that ended meanwhile must not be stopped: its process may already run
            # another task (the same last-moment race Celery's revoke(terminate=True) has)
            if claim.finished or _result_ready(request):
                return
            try:
                # SIGKILL: a stale copy must not run its cleanup code either (it may write)
                pool.terminate_job(pid, signal.SIGKILL)
            except Exception as exc:
                logger.warning(
                    "Claim %s: could not terminate the stale copy: %r", claim.claim_id, exc
                )
                return
            claim.stopped = True
        self.counters.incr("stale_terminated")
        logger.warning(
            "Claim %s: terminated %s[%s] (pool process %d): another worker owns it now",
            claim.claim_id,
            getattr(request, "name", "?"),
            getattr(request, "id", "?"),
            pid,
        )

    # --- the keeper thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start the keeper thread (once)."""
        if self._thread is not None and self._thread.is_alive():
            self._stop_at = None
            return
        self._stop_at = None
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name="celery-claims-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the keeper to stop once no claim is left (reentrant, no logging, no blocking).

        A warm shutdown stops worker bootsteps before the pool has finished its tasks, so the
        keeper goes on renewing live claims for up to ``STOP_GRACE_S`` and then exits.
        """
        if self._stop_at is None:
            self._stop_at = time.monotonic() + STOP_GRACE_S
        self._wake.set()

    def close(self) -> None:
        """Close the claim store connections (a later call would simply reconnect)."""
        with contextlib.suppress(Exception):
            self.manager.client.close()

    def _run(self) -> None:
        interval_s = self.settings.renew_interval_ms / 1000
        while True:
            stop_at = self._stop_at
            if stop_at is not None and (not self.live_claims() or time.monotonic() > stop_at):
                self.close()
                return
            try:
                self.beat()
            except Exception:
                logger.exception("Lease keeper beat failed")
            if self._wake.wait(interval_s):
                self._wake.clear()

    def beat(self) -> None:
        """One keeper beat: renew, retry deferred completions, refresh deliveries."""
        claims = [c for c in self.live_claims() if not c.fenced]
        self._renew(claims)
        if self.lanes is not None:
            slots = [c.lane_slot for c in claims if c.lane_slot is not None and not c.fenced]
            self.lanes.heartbeat(slots)
        for claim in claims:
            if claim.completing and not claim.fenced:
                claim.completing = False
                self._complete(claim, "deferred completion")
        if self.settings.refresh_unacked:
            self.refresh_deliveries()

    def _renew(self, claims: list[ActiveClaim]) -> None:
        groups: dict[tuple[str, int], list[ActiveClaim]] = defaultdict(list)
        for claim in claims:
            groups[(claim.token.queue_id, claim.lease_ms)].append(claim)
        for (queue_id, lease_ms), group in groups.items():
            try:
                results = self.manager.renew(queue_id, [c.token for c in group], lease_ms)
            except BackendUnavailable as exc:
                self.counters.incr("renew_unavailable")
                if self._unavailable_since is None:
                    self._unavailable_since = time.monotonic()
                    logger.warning("Lease keeper: claim store unavailable: %s", exc)
                continue
            if self._unavailable_since is not None:
                logger.warning(
                    "Lease keeper: claim store reachable again after %.1f s",
                    time.monotonic() - self._unavailable_since,
                )
                self._unavailable_since = None
            for claim, result in zip(group, results, strict=True):
                if isinstance(result, ClaimToken):
                    claim.token = result
                    self.counters.incr("renewals")
                    continue
                with claim.lock:
                    # a claim completed between the snapshot and the renewal is simply gone
                    if claim.finished and not claim.completing:
                        continue
                self.untrack(claim)
                self._lost(claim, result)

    def refresh_deliveries(self) -> None:
        """Set the ``unacked_index`` score of claimed and held Redis deliveries to now."""
        by_channel: dict[int, tuple[Any, list[str]]] = {}
        deliveries = [c.delivery for c in self.live_claims() if not c.fenced]
        deliveries += [h.delivery for h in self.held_copies()]
        for delivery in deliveries:
            if delivery is None:
                continue
            by_channel.setdefault(id(delivery.channel), (delivery.channel, []))[1].append(
                delivery.tag
            )
        now = time.time()
        for channel, tags in by_channel.values():
            try:
                with channel.conn_or_acquire() as client:
                    pipe = client.pipeline(transaction=False)
                    for tag in tags:
                        # XX: never re-add a delivery that was acked or restored meanwhile
                        pipe.zadd(channel.unacked_index_key, {tag: now}, xx=True)
                    pipe.execute()
                self.counters.incr("unacked_refreshed", len(tags))
            except Exception as exc:
                logger.warning("Lease keeper: could not refresh unacked deliveries: %r", exc)


class _Overridden:
    """``app.conf`` as the worker sees it: command-line ``--claims-*`` values win."""

    def __init__(self, conf: Any, overrides: Mapping[str, Any]) -> None:
        self._conf = conf
        self._given = {k: v for k, v in overrides.items() if v is not None}

    def get(self, key: str, default: Any = None) -> Any:
        return self._given[key] if key in self._given else self._conf.get(key, default)


def check_unsafe_settings(conf: Any, overrides: Mapping[str, Any], *, strict: bool) -> None:
    """Log each unsafe Celery setting with its fix; refuse to start in strict mode.

    Raises:
        InvalidArgument: ``strict`` and at least one finding; ``name`` is
            ``claims_strict_settings`` and the message lists every finding.
    """
    findings = check_settings(_Overridden(conf, overrides))
    for finding in findings:
        logger.warning(
            "Unsafe setting %s (%s): %s", finding.key, finding.severity.value, finding.message
        )
    if strict and findings:
        listed = "; ".join(f"{f.key}: {f.message}" for f in findings)
        raise InvalidArgument(
            "claims_strict_settings",
            f"the worker refuses to start with {len(findings)} unsafe setting(s): {listed}",
        )


def _result_ready(request: Any) -> bool:
    # the pool already has the task's outcome (prefork: ApplyResult, held by weak reference)
    ref = getattr(request, "_apply_result", None)
    result = ref() if callable(ref) else None
    ready = getattr(result, "ready", None)
    return bool(ready()) if callable(ready) else False


class LeaseKeeper(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Worker bootstep: reads the settings, creates ``worker.claims``, runs the keeper.

    Settings are validated here, while the worker starts, so a bad ``claims_*`` value stops
    the worker with an error naming the key instead of failing on the first task.
    """

    label = "Claims"
    requires = ("celery.worker.components:Timer",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        w.claims = None
        overrides = {name: kwargs.get(name) for name in WORKER_OPTION_NAMES}
        settings = load_settings(w.app, overrides)
        from celery_claims.worker.gate import check_task_policies

        check_task_policies(w.app, settings)
        check_unsafe_settings(w.app.conf, overrides, strict=settings.strict_settings)
        self.runtime = ClaimsRuntime(w.app, settings, w.hostname)
        # before the pool forks and the consumer builds its tracers, which capture task.run
        guard_tasks(w.app, settings, self.runtime.manager)
        w.claims = self.runtime
        super().__init__(w, **kwargs)

    def start(self, w: Any) -> None:
        self.runtime.pool = getattr(w, "pool", None)
        self.runtime.start()

    def stop(self, w: Any) -> None:
        self.runtime.stop()

    terminate = stop
    shutdown = stop
