"""An existing Celery app made claim-aware: the settings you likely have, plus one line.

Configured from ``PROJ_BROKER`` so the example runner can point it at a private Redis.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_claims.worker import install

BROKER = os.environ.get("PROJ_BROKER", "redis://localhost:6379/0")

app = Celery("proj", broker=BROKER)
app.conf.update(
    task_acks_late=True,  # claims take over a crashed worker's task only if it was not acked
    worker_prefetch_multiplier=1,
    task_time_limit=300,
    task_ignore_result=True,
    broker_transport_options={"visibility_timeout": 180},  # ~3x the 60 s default lease
)
install(app)  # the one line: every task is claimed before it runs


@app.task(name="proj.send_invoice")
def send_invoice(invoice: str) -> None:
    """Pretend to email an invoice; count the emails in Redis so the runner can see them."""
    time.sleep(0.5)
    with redis.Redis.from_url(BROKER) as client:
        client.incr(f"sent:{invoice}")
