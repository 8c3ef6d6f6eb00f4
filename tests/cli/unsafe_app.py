"""An app with settings that weaken claims, for ``celery claims check``."""

from celery import Celery

app = Celery("unsafe", broker="redis://127.0.0.1:1/0", set_as_current=False)
# acks early (the default), kombu's default 1 h visibility timeout, no hard time limit
app.conf.update(task_acks_late=False, claims_lease_ms=30_000)
