"""The claim in task code, and the guard that keeps a stale copy's result out of the backend.

The gate puts a :class:`~celery_claims.fencing.TaskClaim` under ``"claim"`` in the request
dict it hands to the pool. That dict is what crosses to a prefork child (pickled with the
body), and Celery's tracer builds ``self.request`` (a ``Context``) from it in every pool, so
``self.request.claim`` works the same in prefork children, threads and solo.

A copy whose lease was lost must not store its result: the tracer writes the result (and
sends chain callbacks) from the process that ran the task, before the worker's main process
hears of it. So every claimed task's ``run`` is wrapped once, at worker start: before the body
starts and after it ends, if the lease handed to the pool may have run out (the time is past
its ``expires_at`` minus a safety margin), the wrapper renews the claim itself, one round
trip; a refused renewal means another copy owns the task now, and the wrapper raises
``Ignore``, so nothing is stored, no callback is sent, and the worker acks the message. A task
that ends well within its lease, the usual case, pays no round trip.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import redis
from celery import current_task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import get_logger

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import BackendUnavailable, ClaimError, ClaimTokenError
from celery_claims.fencing import TaskClaim
from celery_claims.worker.settings import ClaimsSettings

__all__ = ["REQUEST_KEY", "StaleCopy", "current_claim", "declare_request_key", "guard_tasks"]

logger = get_logger("celery_claims.worker")

#: Key of the claim in the request dict handed to the pool (``self.request.claim``).
REQUEST_KEY = "claim"

#: Attribute marking a task whose ``run`` is already wrapped.
_GUARDED = "_celery_claims_guarded"


class StaleCopy(Ignore):  # type: ignore[misc]  # celery is untyped
    """Raised in place of a stale copy's outcome: its claim was taken over by another copy.

    An ``Ignore``: Celery stores no result, sends no callback, and acks the message.
    """


def declare_request_key() -> None:
    """Make ``claim`` a known field of Celery's task ``Context`` (idempotent).

    ``Context`` treats every request field it does not define as a custom message header and
    copies it into the messages a task sends with ``retry()`` or ``replace()``: the claim of
    one attempt would leak into the next (and fail to serialize). Declaring the field (default
    ``None``) keeps it out of the headers, and makes ``self.request.claim`` read ``None`` in
    a task that is not claimed instead of raising ``AttributeError``.
    """
    from celery.app.task import Context

    if REQUEST_KEY not in Context.__dict__:
        setattr(Context, REQUEST_KEY, None)


def current_claim() -> TaskClaim | None:
    """The claim of the task running in this thread, or None (not claimed, not in a task).

    Works in every pool, prefork children included; same as ``self.request.claim`` in a
    bound task.
    """
    task = current_task
    if task is None:
        return None
    claim = getattr(task.request, REQUEST_KEY, None)
    return claim if isinstance(claim, TaskClaim) else None


class _Verifier:
    """Checks, from the process running the task, that its claim is still its own."""

    def __init__(self, settings: ClaimsSettings, manager: RedisClaimManager) -> None:
        self.settings = settings
        self._parent_pid = os.getpid()
        self._parent_manager = manager
        self._manager: RedisClaimManager | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def manager(self) -> RedisClaimManager:
        pid = os.getpid()
        if pid == self._parent_pid:
            return self._parent_manager
        with self._lock:
            if self._manager is None or self._pid != pid:
                # a prefork child: never share the parent's sockets across fork
                timeout_s = self.settings.socket_timeout_ms / 1000
                client = redis.Redis.from_url(
                    self.settings.redis_url,
                    socket_timeout=timeout_s,
                    socket_connect_timeout=timeout_s,
                )
                self._manager = RedisClaimManager(client=client, prefix=self.settings.prefix)
                self._pid = pid
            return self._manager

    def still_mine(self, claim: TaskClaim) -> bool:
        """False only if the claim store says another copy owns the task now."""
        # Nobody can take a claim over before its lease ends, and the lease handed to the
        # pool ended no earlier than claim.expires_at (renewals only extend it). The margin
        # covers clock skew between this host and the claim store's clock.
        margin_ms = claim.lease_ms // 4
        if time.time() * 1000 < claim.expires_at - margin_ms:
            return True
        try:
            result = self.manager().renew(claim.queue_id, [claim.token()], claim.lease_ms)
        except BackendUnavailable as exc:
            # no other copy can take the claim over while the store is unreachable either
            logger.warning("Claim %s: could not verify the lease (%s)", claim.task_id, exc)
            return True
        except ClaimError:
            logger.exception("Claim %s: could not verify the lease", claim.task_id)
            return True
        return not (result and isinstance(result[0], ClaimTokenError))


def _guarded_run(run: Any, task: Any, verifier: _Verifier) -> Any:
    @functools.wraps(run)
    def claims_guarded_run(*args: Any, **kwargs: Any) -> Any:
        claim = getattr(task.request, REQUEST_KEY, None)
        if not isinstance(claim, TaskClaim):
            return run(*args, **kwargs)
        if not verifier.still_mine(claim):
            raise _stale(task, claim, "before it started")
        try:
            retval = run(*args, **kwargs)
        except (Ignore, Reject, Retry):
            raise
        except Exception as exc:
            if not verifier.still_mine(claim):
                raise _stale(task, claim, f"failed ({type(exc).__name__})") from exc
            raise
        if not verifier.still_mine(claim):
            raise _stale(task, claim, "finished")
        return retval

    setattr(claims_guarded_run, _GUARDED, True)
    return claims_guarded_run


def _stale(task: Any, claim: TaskClaim, what: str) -> StaleCopy:
    logger.warning(
        "%s[%s] %s after its claim %s/%s (instance %d) was taken over: result discarded",
        task.name,
        task.request.id,
        what,
        claim.queue_id,
        claim.task_id,
        claim.instance,
    )
    return StaleCopy(f"claim instance {claim.instance} was taken over")


def guard_tasks(app: Any, settings: ClaimsSettings, manager: RedisClaimManager) -> int:
    """Wrap the ``run`` of every claimed task of ``app`` (idempotent); returns how many.

    Called when the worker starts, before the pool forks and before the consumer builds the
    tracers (which capture ``task.run``).
    """
    from celery_claims.worker.gate import is_exempt

    verifier = _Verifier(settings, manager)
    wrapped = 0
    for name, task in list(app.tasks.items()):
        if is_exempt(task, name) or getattr(task.run, _GUARDED, False):
            continue
        # an instance attribute: the tracer and Task.__call__ both look run up on the task
        task.run = _guarded_run(task.run, task, verifier)
        wrapped += 1
    return wrapped
