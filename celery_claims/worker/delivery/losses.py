"""A copy whose claim is no longer its own: stopped, fenced, readmitted or given up."""

from __future__ import annotations

import os
import signal

from celery.utils.log import get_logger

from celery_claims.runs import with_run
from celery_claims.worker import signals
from celery_claims.worker.compat import result_ready, set_request_field
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.endings import Endings
from celery_claims.worker.delivery.guard import REQUEST_KEY, StaleCopy
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import State
from celery_claims.worker.delivery.turns import Turns
from celery_claims.worker.delivery.wiring import Wiring
from celery_claims.worker.identity import new_owner

__all__ = ["Losses"]

logger = get_logger("celery_claims.worker")


class Losses:
    """Ends the copies whose lease is lost to another copy, or that the pool never started."""

    def __init__(self, w: Wiring, reg: Registry, turns: Turns, ends: Endings) -> None:
        self.w = w
        self.reg = reg
        self.turns = turns
        self.ends = ends

    def lose(self, copy: Copy, detail: str) -> None:
        """Another copy owns the task now: this one must not start, or is stopped."""
        state = copy.state
        if state is State.COMPLETING:
            # its body ran, but the record could not be written before another copy took
            # the task: that copy's outcome counts; this one's message is let go
            logger.warning(
                "Claim %s: completion not recorded, another copy owns the task now (%s)",
                copy.claim_id,
                detail,
            )
            self.ends.go_stale(copy, f"completion not recorded ({detail})", other_owner=True)
            self.ends.let_go(copy, "body ended before another copy took over")
            return
        if state is State.WAITING:
            # never started: it goes through the gate again as a duplicate (held until the
            # owner finishes, or taken over if it dies). It leaves WAITING here, under the
            # lock, so the keeper stops renewing it and a lane grant cannot send it to the
            # pool before the loop runs the readmission (the loss is decided once)
            if not self.reg.move(copy, State.RECEIVED, only_from=frozenset({State.WAITING})):
                return
            self.turns.out_of_turn(copy)
        elif not self.ends.go_stale(copy, f"lease lost ({detail})", other_owner=True):
            return
        request = copy.request
        self.w.counters.incr("lease_lost")
        logger.warning(
            "Claim %s: lease lost (%s); %s[%s] is fenced, its result will not be recorded",
            copy.claim_id,
            detail,
            request.name,
            request.id,
        )
        signals.lease_lost.send(
            sender=request.task,
            request=request,
            token=copy.token,
            error=StaleCopy(f"claim instance {copy.instance} was taken over ({detail})"),
        )
        if state is State.RUNNING:
            self._stop(copy)
        elif state is State.WAITING:
            self.w.on_loop(self._readmit, copy)

    def start_overdue(self, copy: Copy) -> None:
        """The pool did not start the copy in ``claims_start_timeout_ms``: give it up.

        Its claim is released and its message handed back to the broker, so another worker
        runs it; if the pool starts it later after all, its pool process finds the claim is
        no longer its own and does not run it.
        """
        if not self.ends.go_stale(copy, "not started in time", other_owner=False):
            return
        self.w.counters.incr("start_timeouts")
        request = copy.request
        logger.error(
            "Claim %s: the pool has not started %s[%s] in time (claims_start_timeout_ms, or a "
            "lease after a broker connection loss); given up: claim released, message handed "
            "back to the broker",
            copy.claim_id,
            request.name,
            request.id,
        )
        self.ends.release_claim(copy, "not started in time")
        copy.handed_back = True  # before the pool can report it: its end must not settle it
        self.w.on_loop(self.ends.requeue, copy)

    def _readmit(self, copy: Copy) -> None:
        """A waiting copy whose claim was taken over (moved to ``RECEIVED`` by :meth:`_lose`):
        out of its lane, through the gate again under a new owner."""
        if copy.state is not State.RECEIVED:
            return
        self.ends.leave_lane(copy)
        # a new owner: under its old one the copy would simply re-claim the task
        owner = new_owner(self.w.hostname)
        # a canvas part's new owner names its run, as its first did (gate.py)
        copy.owner = with_run(owner, copy.run) if copy.key is None else copy.key.owner(owner)
        copy.token = None
        set_request_field(copy.request, REQUEST_KEY, None)
        if self.w.recheck is not None:
            self.w.recheck(copy)

    def _stop(self, copy: Copy) -> None:
        """Stop a stale running copy: terminate its pool process where that is possible."""
        request = copy.request
        pid = getattr(request, "worker_pid", None)
        pool = self.w.pool
        # Only a separate process can be stopped: thread and solo pools run the task in this
        # process (worker_pid is ours), where it is fenced instead and its result discarded.
        if pool is None or not pid or pid == os.getpid():
            logger.warning(
                "Claim %s: %s[%s] keeps running fenced; its result will be discarded",
                copy.claim_id,
                request.name,
                request.id,
            )
            return
        # a task that ended meanwhile must not be stopped: its process may already run
        # another task (the same last-moment race Celery's revoke(terminate=True) has)
        if copy.state is not State.STALE or result_ready(request):
            return
        try:
            # SIGKILL: a stale copy must not run its cleanup code either (it may write)
            pool.terminate_job(pid, signal.SIGKILL)
        except Exception as exc:
            logger.warning("Claim %s: could not terminate the stale copy: %r", copy.claim_id, exc)
            return
        self.w.counters.incr("stale_terminated")
        logger.warning(
            "Claim %s: terminated %s[%s] (pool process %d): another worker owns it now",
            copy.claim_id,
            request.name,
            request.id,
            pid,
        )
