"""pytest-celery is loaded in this suite, and a failing test is reported as a failure.

pytest-celery 1.x re-exports Celery's own fixtures (``celery_app``, ``celery_config``, the
``celery`` marker, ...), which work without Docker, and replaces Celery's ``celery_worker``
with one that starts a container: ``tests/conftest.py`` shadows it with the in-process one.
Its dependency pytest-docker-tools stays disabled (``-p no:docker_tools``, see
pyproject.toml): with it, a test that reaches a container fixture tries the Docker socket and
leaves it open, and under ``filterwarnings = error`` pytest then crashes at exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

_CONFTEST = """
from tests.conftest import celery_worker  # the suite's in-process worker  # noqa: F401
"""

_TESTS = """
import pytest
from hypothesis import given, strategies as st


def test_plain_failure():
    assert 1 == 2


@given(st.integers())
def test_hypothesis_failure(x):
    assert x < 5


def test_failure_with_a_worker_running(celery_app, celery_worker):
    @celery_app.task(name="add")
    def add(x, y):
        return x + y

    celery_worker.reload()
    assert add.delay(2, 2).get(timeout=10) == 5


@pytest.mark.celery(result_extended=True)
def test_passes_on_pytest_celerys_app(celery_app):
    assert celery_app.conf.result_extended is True


def test_docker_fixture(celery_redis_broker):
    pass
"""


def _run_suite_config(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the tests above with this project's pytest configuration (pyproject.toml)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    (tmp_path / "test_reports.py").write_text(textwrap.dedent(_TESTS))
    # the conftest imports the suite's tests.conftest
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), "-p", "no:randomly",
         "-q", "test_reports.py"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip


def test_failing_tests_are_reported_as_failures_with_pytest_celery_loaded(tmp_path: Path) -> None:
    # Given tests that fail in several ways (one on the suite's in-process worker), one that
    # passes on pytest-celery's app and marker, one that asks for a Docker fixture, all under
    # this suite's configuration
    # When pytest runs them
    result = _run_suite_config(tmp_path)
    out = result.stdout + result.stderr

    # Then each failure is a failure, the Docker fixture is a setup error, and pytest itself
    # neither reports an INTERNALERROR nor crashes at exit
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "INTERNALERROR" not in out
    assert "Traceback (most recent call last)" not in out
    assert "PytestUnraisableExceptionWarning" not in out
    assert "FAILED test_reports.py::test_plain_failure" in out
    assert "FAILED test_reports.py::test_hypothesis_failure" in out
    assert "FAILED test_reports.py::test_failure_with_a_worker_running - assert 4 == 5" in out
    assert "fixture 'docker_client' not found" in out
    assert "3 failed, 1 passed" in out, out


def test_pytest_celerys_app_runs_tasks_on_the_suites_in_process_worker(
    celery_app: Any, celery_worker: Any
) -> None:
    # Given a task on pytest-celery's app (memory broker, cache backend)
    @celery_app.task(name="plugins.echo")
    def echo(value: str) -> str:
        return value

    # When the in-process worker that shadows pytest-celery's Docker worker runs it
    celery_worker.reload()
    result = echo.delay("hello")

    # Then it ran in this process, on a worker thread
    assert result.get(timeout=10) == "hello"
    assert type(celery_worker).__module__ == "celery.contrib.testing.worker"
