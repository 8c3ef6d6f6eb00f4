"""Apps for the start check: one good or broken configuration per ``CLAIMS_TEST_CASE``.

``CLAIMS_TEST_BROKER`` is the broker (and claim store); ``CLAIMS_TEST_CASE`` names the
configuration (a key of :data:`CASES`). Every case starts from a safe, valid app: a keyed task,
a lane on a declared queue, nothing ``celery claims check`` reports. Each broken case then
changes one thing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celery import Celery, Task

from celery_claims.worker import install

#: The queue the app declares (and its lane limits).
QUEUE = "names-video"

app = Celery("names", broker=os.environ["CLAIMS_TEST_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 180},
    task_acks_late=True,
    task_time_limit=600,
    task_soft_time_limit=540,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    claims_lanes={"video": {"queues": [QUEUE], "limit": 2}},
)
install(app)


@app.task(name="names.sync", claims_key="customer")
def sync(customer: str) -> str:
    """A keyed task: one run per customer at a time."""
    return customer


class Django:
    """A Django settings module, read with ``config_from_object(..., namespace="CELERY")``."""

    CELERY_TASK_ACKS_LATE = True
    CELERY_CLAIMS_LEASE_MS = 30_000
    DEBUG = True


def _django_typo() -> None:
    Django.CELERY_CLAIMS_RENEW_INTERVAL_MSEC = 5_000  # type: ignore[attr-defined]
    app.config_from_object(Django, namespace="CELERY")


def _task(**options: Any) -> Callable[[], None]:
    def declare() -> None:
        @app.task(name="names.other", **options)
        def other(customer: str) -> str:
            return customer

    return declare


def _subclass_typo() -> None:
    class Reports(Task):  # type: ignore[misc]  # celery is untyped
        claims_lease_msec = 120_000

    @app.task(name="names.report", base=Reports)
    def report() -> None:
        pass


def _conf(**changes: Any) -> Callable[[], None]:
    return lambda: app.conf.update(changes)


#: Each case: what it changes in the good app.
CASES: dict[str, Callable[[], None]] = {
    "good": lambda: None,
    "good_own_setting": _conf(myapp_timeout=3, MYAPP_RETRIES=2),
    "good_django": lambda: app.config_from_object(Django, namespace="CELERY"),
    "setting_typo": _conf(claims_key_done_tll=60_000),
    "setting_lease_msec": _conf(claims_lease_msec=30_000),
    "setting_max_takeover": _conf(claims_max_takeover=5),
    "setting_django_typo": _django_typo,
    "task_attribute_as_setting": _conf(claims_key_done_ttl=60),
    "task_kwarg_typo": _task(claims_kye="customer"),
    "task_option_typo": _task(claims_key="customer", claims_key_conflcit="skip"),
    "task_subclass_typo": _subclass_typo,
    "setting_as_task_attribute": _task(claims_key="customer", claims_done_ttl_ms=1000),
    "lane_key_typo": _conf(claims_lanes={"video": {"queues": [QUEUE], "limt": 2}}),
    "keyed_lane_key_typo": _conf(
        claims_lanes={
            "video": {"queues": [QUEUE], "limit": 2, "key": "customer", "limit_per_kye": 1}
        }
    ),
    "held_recheck_zero": _conf(claims_held_recheck_ms=0),
    "malformed_lane": _conf(claims_lanes={"video": {"queues": QUEUE, "limit": 2}}),
    "key_conflict_value": _conf(claims_key_conflict="skp"),
    "task_attribute_value": _task(claims_key="customer", claims_key_reschedule_max=-1),
    "http_store": _conf(claims_redis_url="http://127.0.0.1:6379/0"),
    "lane_matches_nothing_strict": _conf(
        claims_strict_settings=True,
        claims_lanes={"video": {"queues": ["names-vidoe"], "limit": 2}},
    ),
    "lane_kind_matches_nothing_strict": _conf(
        claims_strict_settings=True,
        claims_lanes={"video": {"queues": [QUEUE], "limit": 2, "kinds": ["names.snyc"]}},
    ),
    "lane_matches_nothing": _conf(claims_lanes={"video": {"queues": ["names-vidoe"], "limit": 2}}),
    "ack_on_claim_without_journal": _conf(claims_ack_on_claim=True, claims_journal=False),
    "ack_on_claim_keyed_task": _task(claims_key="customer", claims_ack_on_claim=True),
    "ack_on_claim_attribute_value": _task(claims_ack_on_claim="yes"),
    # the broker (the claim store) of these tests keeps nothing across a restart
    "ack_on_claim_store_without_persistence": _conf(claims_ack_on_claim=True),
}

CASES[os.environ.get("CLAIMS_TEST_CASE", "good")]()
