"""The chaos soak's app, for real ``celery worker`` subprocesses, configured from the environment.

``CLAIMS_TEST_BROKER`` (broker URL), ``CHAOS_STORE`` (claim store URL), ``CHAOS_PG`` (SQLAlchemy URL
of the ledger), ``CHAOS_RUN`` (the run's table suffix), ``CLAIMS_TEST_QUEUE`` and
``CLAIMS_TEST_PLUGIN`` ("0": the same fleet without celery-claims, the reference).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import sqlalchemy as sa
from celery import Celery

from celery_claims.effects import apply_once, effect_key
from celery_claims.fencing import fenced_update
from celery_claims.worker import install
from tests.chaos.ledger import Ledger
from tests.chaos.soak import CHAOS_JOURNAL

QUEUE = os.environ["CLAIMS_TEST_QUEUE"]
PLUGIN = os.environ.get("CLAIMS_TEST_PLUGIN", "1") == "1"

app = Celery("chaos", broker=os.environ["CLAIMS_TEST_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    broker_transport_options={
        "visibility_timeout": 5,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    claims_redis_url=os.environ["CHAOS_STORE"],
    # the publish journal's settings, the same as the soak's producer
    **CHAOS_JOURNAL,
)
if PLUGIN:
    install(app)

_ledger: Ledger | None = None


def ledger() -> Ledger:
    """The run's ledger (one engine per process: created after the prefork fork)."""
    global _ledger
    if _ledger is None:
        _ledger = Ledger(sa.create_engine(os.environ["CHAOS_PG"]), os.environ["CHAOS_RUN"])
    return _ledger


@app.task(bind=True, name="chaos.effect")
def effect(self: Any, seconds: float) -> None:
    """Work for ``seconds``, then apply the task's side effect three ways (see ledger.py)."""
    book = ledger()
    task_id = self.request.id
    time.sleep(seconds)
    with book.engine.begin() as conn:
        conn.execute(
            sa.insert(book.executions).values(
                task=task_id, worker=f"{socket.gethostname()}/{os.getpid()}", at=time.time()
            )
        )
    claim = getattr(self.request, "claim", None)  # None on plain Celery
    rows = book.rows
    if claim is not None:
        with book.engine.begin() as conn:
            fenced_update(
                conn, rows, {"task": task_id}, {"fenced": rows.c.fenced + 1}, claim.instance
            )
        key, instance = effect_key(claim), claim.instance
    else:
        key, instance = f"{task_id}:{self.request.retries}", 0
    with book.engine.begin() as conn:
        apply_once(
            conn,
            key,
            lambda c: c.execute(
                sa.update(rows).where(rows.c.task == task_id).values(once=rows.c.once + 1)
            ),
            instance=instance,
            table=book.markers,
        )


@app.task(bind=True, name="chaos.poison")
def poison(self: Any) -> None:
    """Crash the whole worker (main process and pool) every time it runs."""
    book = ledger()
    with book.engine.begin() as conn:
        conn.execute(
            sa.insert(book.executions).values(
                task=self.request.id, worker=f"{socket.gethostname()}/{os.getpid()}", at=time.time()
            )
        )
    os.killpg(os.getpgid(0), signal.SIGKILL)
