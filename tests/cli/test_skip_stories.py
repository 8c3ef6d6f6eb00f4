"""``claims inspect`` tells each skipped copy's own story, and a keyed skip's log names its key
(issue 30, items 4 and 6), on a real prefork worker of keyed tasks with a Redis broker.

One worker, one queue: a duplicate of a finished task (``done``), a task skipped while another
holds its key (``key_held``), one rescheduled while another holds it (``key_rescheduled``), a
payment whose key was done moments ago (``key_done``) and a message whose key cannot be made
(``key_refused``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery.exceptions import TaskRevokedError

from celery_claims.observe import History, SkipReason
from tests.servers import redis_server
from tests.worker.helpers import wait_for
from tests.worker.processes import Fleet, Proc

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.keyed_app"
#: a queue name with a "/" in it: a keyed claim id is `<queue>/<key field>`, so a skip's key
#: cannot be read back from the claim id (the worker writes it on the event)
QUEUE = "stories/eu"


@dataclass
class Stories:
    """The worker, its store and its log, once every skip has happened."""

    url: str
    worker: Proc

    def inspect(self, task_id: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery_claims.cli", "--redis-url", self.url, "inspect",
             task_id, *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def skipped_text(self, task_id: str) -> list[str]:
        """The history lines ``inspect`` prints for the task's skipped copies."""
        data = json.loads(self.inspect(task_id, "--json").stdout)
        return [e["text"] for e in data["history"] if e["event"] == "skipped"]


def _skips(client: redis.Redis, task_id: str) -> list[Any]:
    return [e for e in History(client, "claims").read(task_id) if e.event == "skipped"]


def _started(client: redis.Redis, task_id: str) -> bool:
    return any(
        json.loads(raw)["id"] == task_id and json.loads(raw)["event"] == "start"
        for raw in client.lrange(f"runs:{QUEUE}", 0, -1)
    )


@pytest.fixture(scope="module")
def stories() -> Iterator[Stories]:
    """A keyed worker after one skip of every reason a worker gives."""
    fleet = Fleet()
    try:
        with redis_server() as server:
            url = server.url
            # four pool processes: the two holders leave prefetch slots for the other copies
            worker = fleet.worker(
                "a", broker=url, backend=url, queue=QUEUE, app=APP, concurrency=4
            ).wait_ready()
            client = fleet.client(url, url, QUEUE)
            plain = fleet.redis(url)
            # a payment done, a finished task, and holders of c1 (skip policy) and r1
            # (reschedule policy) running
            assert client.send_task("keyed.pay", ("p1",), task_id="pay-1").get(timeout=30)
            assert client.send_task("keyed.sync", ("d1",), task_id="dup").get(timeout=30)
            client.send_task("keyed.skip", ("c1",), {"seconds": 6}, task_id="holder")
            client.send_task("keyed.resched", ("r1",), {"seconds": 6}, task_id="r-holder")
            wait_for(lambda: _started(plain, "holder") and _started(plain, "r-holder"),
                     timeout=30, what="the holders' start")  # fmt: skip
            # then a copy of every kind the worker does not run
            client.send_task("keyed.sync", ("d1",), task_id="dup")
            skipped = client.send_task("keyed.skip", ("c1",), task_id="skipped")
            client.send_task("keyed.resched", ("r1",), task_id="rescheduled")
            again = client.send_task("keyed.pay", ("p1",), task_id="pay-2")
            refused = client.send_task("keyed.export", (), {"kind": "csv"}, task_id="refused")
            for result in (skipped, again):
                with pytest.raises(TaskRevokedError):
                    result.get(timeout=30)
            with pytest.raises(Exception, match="do not bind"):
                refused.get(timeout=30)
            for task_id in ("dup", "skipped", "rescheduled", "pay-2", "refused"):
                wait_for(lambda t=task_id: _skips(plain, t), timeout=30, what=f"{task_id} skip")
            yield Stories(url, worker)
    finally:
        fleet.cleanup()


def test_each_skip_reason_is_told_in_its_own_words_naming_who_and_which_key(
    stories: Stories,
) -> None:
    # Given a copy skipped for every reason (see the fixture)
    # When the operator inspects each task
    told = {
        task_id: stories.skipped_text(task_id)
        for task_id in ("dup", "skipped", "rescheduled", "pay-2", "refused")
    }

    # Then only the duplicate of a finished attempt reads "already done"; each keyed skip
    # names the task that held (or finished) the key and the key itself
    assert told["dup"][0].startswith("copy acked without running on a@")
    assert "already done by a@" in told["dup"][0]
    [held] = told["skipped"]
    assert "already done" not in held
    assert "task holder held its key keyed.skip['c1']" in held
    assert "claims_key_conflict skip" in held
    assert "REVOKED" in held
    assert "already done" not in told["rescheduled"][0]
    assert "task r-holder held its key keyed.resched['r1']" in told["rescheduled"][0]
    assert "published again" in told["rescheduled"][0]
    [key_done] = told["pay-2"]
    assert "already done" not in key_done
    assert "its key keyed.pay['p1'] was done by task pay-1" in key_done
    assert "claims_key_done_ttl" in key_done
    [key_refused] = told["refused"]
    assert "already done" not in key_refused
    assert "never run: no key could be made" in key_refused
    assert "do not bind" in key_refused
    assert "KeyRefused" in key_refused


def test_inspect_of_a_task_id_that_never_had_a_claim_says_its_copy_was_not_run(
    stories: Stories,
) -> None:
    result = stories.inspect("skipped")

    assert result.returncode == 0, result.stderr
    head = result.stdout.splitlines()[1]
    assert head.startswith("  no claim and no completion record of its own: its last copy "
                           "was not run (key_held, on a@")  # fmt: skip
    assert "record expired" not in result.stdout


def test_the_worker_gives_only_reasons_of_the_skip_reason_enum(stories: Stories) -> None:
    client = redis.Redis.from_url(stories.url)
    try:
        reasons = {
            e.reason
            for task_id in ("dup", "skipped", "rescheduled", "pay-2", "refused")
            for e in _skips(client, task_id)
        }
    finally:
        client.close()

    assert {SkipReason(r) for r in reasons} == {
        SkipReason.DONE,
        SkipReason.KEY_HELD,
        SkipReason.KEY_RESCHEDULED,
        SkipReason.KEY_DONE,
        SkipReason.KEY_REFUSED,
    }


def test_the_log_line_of_a_keyed_skip_names_the_key_and_the_holder(stories: Stories) -> None:
    log = stories.worker.output()

    [held] = [line for line in log.splitlines() if "Skipped keyed.skip[skipped]" in line]
    [done] = [line for line in log.splitlines() if "Skipped keyed.pay[pay-2]" in line]

    assert "key keyed.skip['c1'] is held by task holder" in held, held
    assert "key keyed.pay['p1'] was done by task pay-1" in done, done
