"""Testing your own tasks under claims with the ``celery_claims.testing`` plugin.

``claims_kit`` starts an in-process worker of an ``install(app)``-ed app against a private
redis-server (broker, results and claim store) and records what the worker decided.
"""

from __future__ import annotations

import uuid

from shop import CHARGED, charge

from celery_claims.testing import OTHER_WORKER, ClaimsKit


def test_a_duplicate_message_charges_the_order_once(claims_kit: ClaimsKit) -> None:
    # Given an order charged from two copies of one message (a redelivery, a retried publish)
    order = f"order-{uuid.uuid4().hex[:8]}"
    result = claims_kit.send(charge, order, copies=2)

    # When the worker has taken both copies
    assert result.get(timeout=10) == f"charged {order}"
    skipped = claims_kit.wait_for(lambda: claims_kit.skipped(result), what="the second copy")

    # Then the task ran once, and the other copy was acked without running, because it was done
    assert CHARGED.count(order) == 1
    assert [(s.reason, s.record is not None) for s in skipped] == [("done", True)]
    assert claims_kit.counters()["skipped_done"] == 1


def test_a_task_held_by_a_crashed_worker_runs_once_its_lease_expires(
    claims_kit: ClaimsKit,
) -> None:
    # Given a task another worker claimed and then crashed while running it
    order = f"order-{uuid.uuid4().hex[:8]}"
    task_id = str(uuid.uuid4())
    claims_kit.claim_elsewhere(task_id)

    # When its message is delivered to our worker
    result = charge.apply_async((order,), task_id=task_id)

    # Then the copy is held, not run, while the other worker's lease is live
    held = claims_kit.wait_for(lambda: claims_kit.held(task_id), what="the copy to be held")
    assert [(h.reason, h.holder) for h in held] == [("held", OTHER_WORKER)]
    assert order not in CHARGED

    # When the crashed worker's lease runs out
    claims_kit.expire_lease(task_id)

    # Then our worker takes the claim over and runs the task once
    assert result.get(timeout=10) == f"charged {order}"
    acquired = claims_kit.acquired(task_id)
    assert [(a.took_over, a.previous_owner) for a in acquired] == [(True, OTHER_WORKER)]
    assert CHARGED.count(order) == 1
