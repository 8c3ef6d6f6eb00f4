"""An app with two lanes for ``celery claims stats``: ``video`` (limit 1: the ``lanes.job``
tasks of the worker's queue), and ``idle`` (limit 3) on a queue nobody sends to. Configured
from the environment of ``tests.worker.processes.Fleet`` (``CLAIMS_TEST_BROKER``,
``CLAIMS_TEST_QUEUE``)."""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_claims.worker import install

BROKER = os.environ["CLAIMS_TEST_BROKER"]
QUEUE = os.environ["CLAIMS_TEST_QUEUE"]

app = Celery("cli-lanes", broker=BROKER, backend=BROKER, set_as_current=False)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 30},
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_time_limit=60,
    worker_prefetch_multiplier=1,
    result_expires=None,
    claims_lanes={
        "video": {"queues": [QUEUE], "kinds": ["lanes.job"], "limit": 1},
        "idle": {"queues": [f"{QUEUE}-idle"], "limit": 3},
    },
)
install(app)


@app.task(name="lanes.job")  # type: ignore[untyped-decorator]
def job(seconds: float) -> float:
    """Sleep ``seconds``: one lane job."""
    time.sleep(seconds)
    return seconds


@app.task(name="lanes.fail")  # type: ignore[untyped-decorator]
def fail() -> None:
    """Fail (outside the lanes): its claim is released."""
    raise ValueError("no such video")
