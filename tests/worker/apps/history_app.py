"""The app of the task history's real ``celery worker`` test, configured from the environment.

``CLAIMS_TEST_BROKER`` (broker URL), ``CLAIMS_TEST_BACKEND`` (Redis result backend),
``CLAIMS_TEST_QUEUE`` (the test's queue). Claim settings come from ``--claims-*`` worker
options. ``history.claimed`` goes through the claim gate.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_claims.worker import install

app = Celery("history", broker=os.environ["CLAIMS_TEST_BROKER"],
             backend=os.environ["CLAIMS_TEST_BACKEND"])  # fmt: skip
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ["CLAIMS_TEST_QUEUE"],
    task_acks_late=True,
    # room for the copies held while the claim store is down (each keeps its prefetch slot)
    worker_prefetch_multiplier=8,
    result_expires=None,
)
install(app)


@app.task(name="history.claimed")
def claimed(value: int) -> int:
    """A claimed task: returns ``value``."""
    return value
