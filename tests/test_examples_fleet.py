"""The lanes, fencing and drop-in examples run end to end, as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES.joinpath(*path))],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_the_lanes_example_never_runs_more_jobs_than_the_limit() -> None:
    result = run("lanes", "lanes.py")

    assert result.returncode == 0, result.stderr
    assert "10 jobs rendered" in result.stdout
    assert "lane limit 2, peak running 2" in result.stdout


@pytest.mark.postgres
def test_the_fencing_example_refuses_the_stale_workers_late_write() -> None:
    result = run("fencing", "fencing.py")

    if result.returncode != 0 and "connection" in result.stderr.lower():
        from tests.servers import missing_service

        missing_service("PostgreSQL on 127.0.0.1:5432")
    assert result.returncode == 0, result.stderr
    assert "worker-b writes with fence 2: landed" in result.stdout
    assert "worker-a wakes, writes with fence 1: refused" in result.stdout
    assert "row: status='charged by b' fence=2" in result.stdout


@pytest.mark.slow
def test_the_dropin_example_sends_a_twice_published_invoice_once() -> None:
    result = run("dropin", "run.py")

    assert result.returncode == 0, result.stderr
    assert "published 2 times and sent 1 time(s)" in result.stdout
    assert "DONE by celery@" in result.stdout
    assert "claims check: no unsafe settings found" in result.stdout
