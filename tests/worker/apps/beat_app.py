"""The app of the ``celery beat`` subprocess: the user assigns ``beat_schedule`` after install."""

from __future__ import annotations

import os
from datetime import timedelta

from celery import Celery

from celery_claims.worker import install

app = Celery("beat_app", broker=os.environ["CLAIMS_TEST_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ["CLAIMS_TEST_QUEUE"],
    claims_cleanup_interval_s=1.0,
)
install(app)

# what users do: assign the whole schedule after setting up the app
app.conf.beat_schedule = {
    "user-entry": {"task": "user.report", "schedule": timedelta(seconds=1)},
}
