"""A pytest plugin that runs Celery's own integration suite as a new user of the package would.

Load it into a run of Celery's ``t/integration`` (its sdist; see ``runner.py``) with
``-p tests.celery_suite.plugin``. ``CLAIMS_SUITE_MODE`` says what it applies:

- ``claims`` (the default): the guide's recommended settings (docs/guide.md, *Adopt it*) and
  ``celery_claims.install(app)`` on every app the suite makes: the session worker's
  (``celery_session_app``) and each test's producer (``celery_app``, the suite's ``app``).
- ``settings``: the guide's settings alone, to tell what they change from what claims change.

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


def pytest_report_header(config: pytest.Config) -> str:
    """Say in the run's header what the plugin applies."""
    return f"celery-claims suite plugin: mode {_mode()}, settings {GUIDE_SETTINGS}"


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: Any) -> Generator[None]:
    """Apply the guide's settings to ``celery_config`` and ``install`` the suite's apps."""
    value = yield
    if fixturedef.argname == "celery_config" and isinstance(value, dict):
        value.update(GUIDE_SETTINGS)
    elif fixturedef.argname in _APP_FIXTURES and _mode() == "claims":
        install(value)
    return value
