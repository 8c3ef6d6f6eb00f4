"""An app configured the way many users configure theirs: the broker comes from outside.

``CLAIMS_TEST_CODE_BROKER``: a broker URL written in the code (unset: none, the app relies on
``CELERY_BROKER_URL`` or ``celery -b``). ``CLAIMS_TEST_QUEUE``: the test's queue. No claim
setting is given: the claim store is whatever celery-claims takes by default.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_claims.worker import install

QUEUE = os.environ["CLAIMS_TEST_QUEUE"]

app = Celery("env-broker", broker=os.environ.get("CLAIMS_TEST_CODE_BROKER") or None)
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
)
install(app)


@app.task(name="env.add")
def add(x: int, y: int) -> int:
    """A task whose completion record shows which claim store the worker used."""
    return x + y
