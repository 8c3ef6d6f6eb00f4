"""A Celery app with its own beat schedule, assigned after ``install(app)``.

``install(app)`` adds the ``celery_claims.cleanup_expired`` entry when the app is finalized,
with ``setdefault``, so the schedule assigned below keeps its own entry and gets the cleanup
one too. Configured from ``BEAT_CLEANUP_BROKER`` so the runner can use a private Redis.
"""

from __future__ import annotations

import os
from datetime import timedelta

import redis
from celery import Celery

from celery_claims.worker import install

BROKER = os.environ.get("BEAT_CLEANUP_BROKER", "redis://localhost:6379/0")
#: Counter the user's own periodic task increments.
DIGESTS_KEY = "beat-cleanup:digests"

app = Celery("beat_cleanup", broker=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_time_limit=60,
    task_ignore_result=True,
    claims_cleanup_interval_s=2,  # default 300 s; short so the example sees it run
)
install(app)

# what many apps do: assign the whole schedule, after the app is set up
app.conf.beat_schedule = {
    "send-digest": {"task": "beat_cleanup.send_digest", "schedule": timedelta(seconds=2)},
}


@app.task(name="beat_cleanup.send_digest")  # type: ignore[untyped-decorator]
def send_digest() -> None:
    """The user's periodic task: count the digests sent."""
    with redis.Redis.from_url(BROKER) as client:
        client.incr(DIGESTS_KEY)
