"""One start check (issue 30, items 1-3): what stops ``celery worker`` stops ``celery claims
check``, with the same words, and nothing else does.

Each case of :mod:`tests.cli.broken_app` is run twice, as a real ``celery -A app worker``
process and as ``celery -A app claims check``: a broken app is refused by both, naming the
same thing (for a typo, the known name it resembles too); a good app passes both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import RedisServer, redis_server

pytestmark = pytest.mark.slow

APP = "tests.cli.broken_app"
#: Longest a worker gets to refuse or to be ready.
START_TIMEOUT_S = 60.0

#: Each broken case, and the words both refusals must hold: what is at fault (and, for a
#: typo, the known name it resembles).
REFUSED: dict[str, tuple[str, ...]] = {
    "setting_typo": ("claims_key_done_tll: unknown setting; did you mean claims_key_done_ttl?",),
    "setting_lease_msec": ("claims_lease_msec", "did you mean claims_lease_ms?"),
    "setting_max_takeover": ("claims_max_takeover", "did you mean claims_max_takeovers?"),
    "setting_django_typo": (
        "CELERY_CLAIMS_RENEW_INTERVAL_MSEC",
        "CELERY_CLAIMS_RENEW_INTERVAL_MS",
        "claims_renew_interval_ms",
    ),
    "task_attribute_as_setting": (
        "claims_key_done_ttl: unknown setting",
        "claims_key_done_ttl is a task attribute, not a setting",
    ),
    "task_kwarg_typo": ("names.other.claims_kye", "did you mean claims_key?"),
    "task_option_typo": ("names.other.claims_key_conflcit", "did you mean claims_key_conflict?"),
    "task_subclass_typo": ("names.report.claims_lease_msec", "did you mean claims_lease_ms?"),
    "setting_as_task_attribute": (
        "names.other.claims_done_ttl_ms",
        "claims_done_ttl_ms is a setting, not a task attribute",
    ),
    "lane_key_typo": ("claims_lanes", "lane 'video'", "'limt'", "did you mean limit?"),
    "keyed_lane_key_typo": (
        "claims_lanes",
        "lane 'video'",
        "'limit_per_kye'",
        "did you mean limit_per_key?",
    ),
    "held_recheck_zero": ("claims_held_recheck_ms",),
    "malformed_lane": ("claims_lanes", "lane 'video' queues must be a list"),
    "key_conflict_value": ("claims_key_conflict", "'skp'"),
    "task_attribute_value": ("names.other.claims_key_reschedule_max",),
    "http_store": ("claims_redis_url", "http://"),
    "lane_matches_nothing_strict": (
        "claims_strict_settings",
        "claims_lanes",
        "lane 'video'",
        "'names-vidoe'",
        "did you mean 'names-video'?",
    ),
    "ack_on_claim_without_journal": ("claims_ack_on_claim", "needs claims_journal = True"),
    "ack_on_claim_keyed_task": (
        "names.other.claims_ack_on_claim",
        "a keyed task (claims_key) cannot be acknowledged at claim",
    ),
    "ack_on_claim_attribute_value": ("names.other.claims_ack_on_claim", "'yes'"),
    "ack_on_claim_store_without_persistence": (
        "claims_ack_on_claim",
        "keeps nothing across a restart",
    ),
    "lane_kind_matches_nothing_strict": (
        "claims_strict_settings",
        "claims_lanes",
        "lane 'video'",
        "'names.snyc'",
        "did you mean 'names.sync'?",
    ),
}

#: Apps both must accept: a valid one, one with settings of its own outside ``claims_``, one
#: configured Django-style (``CELERY_CLAIMS_*``), one whose lane matches nothing (a warning).
ACCEPTED = ("good", "good_own_setting", "good_django", "lane_matches_nothing")


@dataclass
class Start:
    """How a ``celery worker`` process ended its start."""

    ready: bool
    returncode: int | None
    output: str


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    """The broker and claim store of every case: a worker that is not refused gets ready."""
    with redis_server() as server:
        yield server


def _env(case: str, broker: RedisServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    return {**env, "CLAIMS_TEST_CASE": case, "CLAIMS_TEST_BROKER": broker.url}


def start_worker(case: str, broker: RedisServer, *options: str) -> Start:
    """Start ``celery -A app worker`` on ``case``; stop it once ready (if it gets there)."""
    command = [
        sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-l", "INFO",
        "-n", f"{case}@names", "--without-mingle", "--without-gossip", "--without-heartbeat",
        *options,
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            command,
            env=_env(case, broker),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        ready = False
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                log.seek(0)
                if b" ready." in log.read():
                    ready = True
                    break
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.seek(0)
        output = log.read().decode(errors="replace")
    return Start(ready, None if ready else proc.returncode, output)


def check(case: str, broker: RedisServer, *options: str) -> subprocess.CompletedProcess[str]:
    """``celery -A app claims check`` on ``case``."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "claims", "check", *options],
        env=_env(case, broker),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).parents[2],
    )


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_worker_and_check_refuse_each_broken_app_naming_the_same_thing(
    case: str, broker: RedisServer
) -> None:
    # Given an app with one thing wrong in its claims configuration
    # When a real worker starts on it, and `celery claims check` checks it
    started = start_worker(case, broker)
    checked = check(case, broker)

    # Then the worker stops before it is ready, with one line and no traceback
    assert not started.ready, started.output[-3000:]
    assert started.returncode not in (0, None), started.output[-3000:]
    assert "Traceback" not in started.output, started.output[-3000:]
    [refusal] = [line for line in started.output.splitlines() if line.startswith("Error: ")]
    # And check exits non-zero with the same words on one line
    assert checked.returncode != 0, checked.stdout + checked.stderr
    assert "Traceback" not in checked.stderr, checked.stderr
    said = refusal.removeprefix("Error: ")
    assert said in checked.stderr, (said, checked.stderr)
    # And both name what is at fault
    for words in REFUSED[case]:
        assert words in said, (words, said)


@pytest.mark.parametrize("case", ACCEPTED)
def test_the_worker_and_check_accept_a_good_app(case: str, broker: RedisServer) -> None:
    # Given a valid app (settings of its own outside the claims_ namespace are its business)
    # When a real worker starts on it, and `celery claims check` checks it
    started = start_worker(case, broker)
    checked = check(case, broker)

    # Then the worker gets ready and check exits 0
    assert started.ready, started.output[-3000:]
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_lane_that_matches_nothing_is_a_warning_naming_what_it_could_have_meant(
    broker: RedisServer,
) -> None:
    # Given a lane on a queue the app does not declare, a letter off the one it does
    # When a worker starts and check checks the app
    started = start_worker("lane_matches_nothing", broker)
    checked = check("lane_matches_nothing", broker)

    # Then both say so, naming the lane and the queue it could have meant, and go on
    for output in (started.output, checked.stdout):
        [line] = [line for line in output.splitlines() if "lane 'video'" in line]
        assert "claims_lanes" in line
        assert "'names-vidoe'" in line
        assert "did you mean 'names-video'?" in line
    assert started.ready
    assert checked.returncode == 0


def test_a_lane_on_a_queue_the_worker_consumes_matches_something(broker: RedisServer) -> None:
    # Given a strict app whose lane is on a queue it does not declare
    # When a worker consuming that queue (-Q) starts, and check is told of it
    started = start_worker("lane_matches_nothing_strict", broker, "-Q", "names-vidoe")
    checked = check("lane_matches_nothing_strict", broker, "-Q", "names-vidoe")

    # Then the lane matches the worker's queue: nothing is refused
    assert started.ready, started.output[-3000:]
    assert "matches nothing" not in started.output
    assert checked.returncode == 0, checked.stdout + checked.stderr
