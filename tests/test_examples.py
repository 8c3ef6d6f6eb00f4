"""Every example runs end to end, as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_quickstart_runs_against_its_own_private_redis() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "AlreadyClaimed by worker-a" in out
    assert "TookOver from worker-a" in out
    assert "refused (Stale claim token)" in out
    assert "AlreadyDone by instance 2" in out
    assert "takeovers=1" in out


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()))
def test_every_example_has_a_readme(example: str) -> None:
    assert (EXAMPLES / example / "README.md").is_file()


def test_the_testing_example_passes_under_the_projects_pytest_configuration() -> None:
    # Given the example's tests, run as a user runs them (its conftest loads the plugin)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/testing"],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Then both pass, under filterwarnings = error and --strict-markers
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
