"""Celery's own integration tests pass under ``install(app)`` and the guide's settings.

Each of Celery's integration modules (:data:`~tests.celery_suite.runner.MODULES`, from the
sdist of the installed Celery) runs twice on a private Redis (broker, results, claim store):
as Celery ships it, and with the guide's settings and ``install(app)`` (``plugin.py``). Every
test that passes on plain Celery must pass under claims, except the differences listed in
:data:`KNOWN`, each with its reason; a listed test that passes again must leave the list.

Slow (Celery's canvas module alone runs for minutes, twice) and deselected unless asked for:
``python -m pytest -m celery_suite tests/celery_suite`` or ``tox -e celerysuite``. The suite
is fetched with pip into a temporary directory unless ``CLAIMS_CELERY_SUITE`` names a
directory ``python -m tests.celery_suite.runner fetch`` filled.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.celery_suite.runner import MODULES, SUITE_ENV, fetch, regressions, run_module

pytestmark = [pytest.mark.celery_suite, pytest.mark.timeout(3600)]

#: Tests of Celery's suite that pass on plain Celery and not under claims, and why.
KNOWN: dict[str, str] = {
    "test_tasks.py::test_tasks::test_request_time_limits_none_when_not_configured": (
        "the guide's task_time_limit = 600: the task's request.time_limit is 600, not None"
    ),
    "test_inspect.py::test_Inspect::test_active": (
        "the guide's task_acks_late: inspect reports the running task as not acknowledged"
    ),
    "test_inspect.py::test_Inspect::test_query_task": (
        "the guide's task_acks_late: inspect reports the running task as not acknowledged"
    ),
}


@pytest.fixture(scope="session")
def celery_suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Celery's integration suite of the installed version (fetched with pip if need be)."""
    root = os.environ.get(SUITE_ENV)
    return fetch(Path(root) if root else tmp_path_factory.mktemp("celery-suite"))


@pytest.mark.parametrize("module", MODULES)
def test_every_celery_integration_test_that_passes_plain_passes_under_claims(
    module: str, celery_suite: Path, tmp_path: Path
) -> None:
    # Given Celery's integration module, run as shipped and then under the guide's settings
    # and install(app), each on a Redis of its own
    plain = run_module(
        celery_suite, module, "plain", junit=tmp_path / "plain.xml", log=tmp_path / "plain.log"
    )
    claims = run_module(
        celery_suite, module, "claims", junit=tmp_path / "claims.xml", log=tmp_path / "claims.log"
    )
    assert plain.outcomes, f"plain Celery ran no test of {module}: see {tmp_path / 'plain.log'}"

    # When their outcomes are compared
    lost = regressions(plain.outcomes, claims.outcomes)

    # Then every test that passed plain passed under claims, but the known differences
    unexpected = {test: seen for test, seen in lost.items() if test not in KNOWN}
    assert not unexpected, f"{module}: passes plain, not under claims ({tmp_path}): {unexpected}"
    fixed = sorted(
        test
        for test in KNOWN
        if test.startswith(f"{module}.py::") and claims.outcomes.get(test) == "passed"
    )
    assert not fixed, f"{module}: these pass under claims now, take them off KNOWN: {fixed}"
