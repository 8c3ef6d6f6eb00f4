"""A pytest plugin that runs Celery's own integration suite as a new user of the package would.

Load it into a run of Celery's ``t/integration`` (its sdist; see ``runner.py``) with
``-p tests.celery_suite.plugin``. ``CLAIMS_SUITE_MODE`` says what it applies:

- ``claims`` (the default): the guide's recommended settings (docs/guide.md, *Adopt it*) and
  ``celery_claims.install(app)`` on every app the suite makes: the session worker's
  (``celery_session_app``) and each test's producer (``celery_app``, the suite's ``app``).
- ``settings``: the guide's settings alone, to tell what they change from what claims change.

``CLAIMS_SUITE_STORE_URL``, when set, is the claim store (``claims_redis_url``): the guide's
setting for a broker that is not Redis (RabbitMQ). Without it the store is the Redis broker.
``CLAIMS_SUITE_NO_MESSAGE_TTL=1`` publishes without the AMQP ``expiration`` Celery derives from
a task's ``expires``: RabbitMQ then never drops an expired message unseen, and the worker that
reads it records it revoked, as on the Redis broker (which has no per-message TTL).

Celery's integration conftest defines ``celery_config`` itself, and a fixture a conftest
defines wins over a plugin's, so the plugin does not override fixtures: it wraps their setup
(``pytest_fixture_setup``) and changes the value they made, before any test or the worker
sees it. Nothing else of the suite is touched.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest
from celery.signals import before_task_publish

from celery_claims import install

#: The guide's recommended settings (docs/guide.md, *Adopt it: one line*), exactly.
GUIDE_SETTINGS: dict[str, Any] = {
    "task_acks_late": True,
    "worker_prefetch_multiplier": 1,
    "task_time_limit": 600,
    "broker_transport_options": {"visibility_timeout": 300},
}

#: The modes ``CLAIMS_SUITE_MODE`` takes.
MODES = ("claims", "settings")

#: Environment variable naming the claim store's URL (``claims_redis_url``), if any.
STORE_URL_ENV = "CLAIMS_SUITE_STORE_URL"

#: Environment variable: publish without the AMQP message TTL (``expiration``).
NO_TTL_ENV = "CLAIMS_SUITE_NO_MESSAGE_TTL"

#: Fixtures of ``celery.contrib.pytest`` whose app is made claim-aware.
_APP_FIXTURES = frozenset({"celery_session_app", "celery_app"})


def _mode() -> str:
    mode = os.environ.get("CLAIMS_SUITE_MODE", "claims")
    if mode not in MODES:
        raise pytest.UsageError(f"CLAIMS_SUITE_MODE must be one of {MODES}, got {mode!r}")
    return mode


def pytest_configure(config: pytest.Config) -> None:
    """Refuse an unknown mode before the session starts."""
    _mode()
    if os.environ.get(NO_TTL_ENV) == "1":
        before_task_publish.connect(_without_message_ttl, weak=False)


def _without_message_ttl(properties: dict[str, Any] | None = None, **_: Any) -> None:
    # Celery passes the dict it then publishes with (celery/app/amqp.py, send_task_message)
    if properties is not None:
        properties.pop("expiration", None)


def pytest_report_header(config: pytest.Config) -> str:
    """Say in the run's header what the plugin applies."""
    ttl = "without the AMQP message TTL" if os.environ.get(NO_TTL_ENV) == "1" else ""
    return f"celery-claims suite plugin: mode {_mode()}, settings {GUIDE_SETTINGS} {ttl}"


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: Any) -> Generator[None]:
    """Apply the guide's settings to ``celery_config`` and ``install`` the suite's apps."""
    value = yield
    if fixturedef.argname == "celery_config" and isinstance(value, dict):
        value.update(GUIDE_SETTINGS)
        if os.environ.get(STORE_URL_ENV):
            value["claims_redis_url"] = os.environ[STORE_URL_ENV]
    elif fixturedef.argname in _APP_FIXTURES and _mode() == "claims":
        install(value)
    return value
