"""``celery-claims`` and ``celery -A app claims`` against a live fleet of real workers."""

from __future__ import annotations

import json

import pytest

from celery_claims import RedisClaimManager
from celery_claims.lanes import TaskLaneConfig, claim_due_for_lane
from celery_claims.lanes.redis import RedisTaskClaimStore
from tests.cli.conftest import QUEUE, LiveFleet, json_of, run_celery, run_cli
from tests.servers import free_port

pytestmark = pytest.mark.slow


def test_list_shows_the_live_claim_with_owner_attempt_instance_and_lease(
    live_fleet: LiveFleet,
) -> None:
    # Given a fleet running live-1 (see conftest)
    # When the operator lists live claims
    result = live_fleet.cli("list")

    # Then the table shows live-1 in its queue, the worker holding it and its lease
    assert result.returncode == 0, result.stderr
    header, _rule, *rows = result.stdout.splitlines()
    assert header.split() == [
        "QUEUE", "TASK", "ATTEMPT", "STATE", "OWNER", "INSTANCE", "LEASE", "LEFT"
    ]  # fmt: skip
    [row] = [r for r in rows if "live-1" in r]
    queue, task, attempt, state, owner, instance, lease = row.split()
    assert (queue, task, attempt, state) == (QUEUE, "live-1", "0.0", "running")
    assert owner.startswith("cli-")
    assert int(instance) > 0
    assert 0 < float(lease.rstrip("s")) <= 3.0


def test_list_json_parses_and_names_the_same_claim(live_fleet: LiveFleet) -> None:
    data = json_of(live_fleet.cli("list", QUEUE, "--json"))

    [claim] = [c for c in data["claims"] if c["task_id"] == "live-1"]
    assert data["queues"] == [QUEUE]
    assert claim["state"] == "running"
    assert claim["remaining_ms"] > 0
    assert claim["until_ms"] > data["now_ms"]


def test_list_of_a_queue_without_claims_says_so(live_fleet: LiveFleet) -> None:
    result = live_fleet.cli("list", "nothing-here")

    assert result.returncode == 0
    assert result.stdout.strip() == "no live claims in queue 'nothing-here'"


def test_stats_shows_the_queue_counters_and_a_busy_lane(live_fleet: LiveFleet) -> None:
    # Given a lane of the lanes Redis store with one task processing
    lane = TaskLaneConfig(lane="video", kinds=("render",), limit=2)
    store = RedisTaskClaimStore(url=live_fleet.url, lanes=[lane], prefix=live_fleet.ns)
    try:
        store.enqueue(7001, "render")
        store.enqueue(7002, "render")
        [(task, _lease)] = claim_due_for_lane(
            store, TaskLaneConfig(lane="video", kinds=("render",), limit=1), 60, lambda k: "video"
        )

        # When the operator asks for stats, as a table and as JSON
        table = live_fleet.cli("stats")
        data = json_of(live_fleet.cli("stats", "--json"))
    finally:
        store.close()

    # Then the queue's counters show the claims, the contention of the held copy, and the lane
    # shows one of its tasks running and one waiting
    assert table.returncode == 0, table.stderr
    assert "CONTENTIONS" in table.stdout
    assert any(line.split()[:2] == ["video", "render"] for line in table.stdout.splitlines())
    counters = data["queues"][QUEUE]
    assert counters["live"] == 1
    assert counters["successes"] >= 2
    assert counters["contentions"] >= 1
    assert data["lanes"] == [
        {"lane": "video", "kind": "render", "active": 1, "waiting": 1, "limit": None, "keys": []}
    ]
    assert task.id in (7001, 7002)


def test_inspect_of_a_running_task_shows_its_holder_and_the_held_copy(
    live_fleet: LiveFleet,
) -> None:
    result = live_fleet.cli("inspect", "live-1")

    assert result.returncode == 0, result.stderr
    assert "RUNNING, held by cli-" in result.stdout
    assert "lease until" in result.stdout
    assert "copy held unacked on cli-" in result.stdout
    assert "lease held by cli-" in result.stdout


def test_inspect_of_a_finished_task_shows_done_and_why_the_copy_was_skipped(
    live_fleet: LiveFleet,
) -> None:
    data = json_of(live_fleet.cli("inspect", "done-1", "--json"))

    [record] = data["claims"]
    assert (record["queue"], record["attempt"], record["state"]) == (QUEUE, "0.0", "done")
    [skipped] = [e for e in data["history"] if e["event"] == "skipped"]
    assert skipped["reason"] == "done"
    assert skipped["other"] == record["owner"]
    assert skipped["instance"] == record["instance"]
    assert "acked without running" in skipped["text"]


def test_inspect_of_an_unknown_task_says_so_and_exits_1(live_fleet: LiveFleet) -> None:
    result = live_fleet.cli("inspect", "no-such-task")

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "task 'no-such-task' is unknown to the claim store" in result.stderr


def test_key_of_a_name_that_is_not_a_key_says_so_and_where_it_looked(
    live_fleet: LiveFleet,
) -> None:
    # Given a fleet whose store knows queue cli and task live-1
    # When the operator asks `claims key` about a task id, which is not a key
    table = live_fleet.cli("key", "live-1")
    data = json.loads(live_fleet.cli("key", "live-1", "--json").stdout)

    # Then it says the name is not a key, what a key looks like and which queues it looked
    # in, instead of calling it free
    assert table.returncode == 1
    assert table.stdout == ""
    assert table.stderr.count("\n") == 1
    assert "'live-1' is not a key" in table.stderr
    assert "<task or namespace>[<key>]" in table.stderr
    assert f"looked in queue(s) {QUEUE}" in table.stderr
    assert "free" not in table.stderr
    assert (data["is_key"], data["queues"], data["claims"]) == (False, [QUEUE], [])


def test_key_of_a_key_nothing_holds_says_it_is_free_and_where_it_looked(
    live_fleet: LiveFleet,
) -> None:
    result = live_fleet.cli("key", "demo.work['nobody']")

    assert result.returncode == 1
    assert "key \"demo.work['nobody']\" is free" in result.stderr
    assert f"looked in queue(s) {QUEUE}" in result.stderr


def test_cleanup_removes_expired_claims_and_reports_how_many(live_fleet: LiveFleet) -> None:
    # Given two claims whose leases have run out, under a prefix of their own
    prefix = f"{live_fleet.ns}x"
    manager = RedisClaimManager(url=live_fleet.url, prefix=prefix)
    try:
        for task in ("gone-1", "gone-2"):
            manager.claim("q", task, "crashed/1/1", lease_ms=1)
        manager.claim("q", "alive", "worker/1/1", lease_ms=60_000)

        # When the operator runs cleanup
        result = run_cli("--redis-url", live_fleet.url, "--prefix", prefix, "cleanup", "--json")

        # Then the two expired claims are gone and the live one stays
        assert json_of(result) == {"removed": 2}
        assert [t.task_id for t in manager.list_claims("q")] == ["alive"]
    finally:
        manager.client.close()


def test_celery_claims_subcommand_reads_the_store_from_the_app(live_fleet: LiveFleet) -> None:
    # Given the app's own settings (its broker is the claim store; claims_prefix is set)
    # When the claims command runs through `celery -A app`
    result = run_celery("-A", "celery_claims.demo.app", "claims", "list", "--json",
                        env=live_fleet.env())  # fmt: skip

    # Then it finds the fleet's live claim without --redis-url
    assert [c["task_id"] for c in json_of(result)["claims"]] == ["live-1"]


@pytest.mark.parametrize("command", [["list"], ["stats"], ["inspect", "x"], ["cleanup"]])
def test_an_unreachable_redis_gives_one_line_on_stderr_and_exit_code_2(
    command: list[str],
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"

    result = run_cli("--redis-url", url, *command)

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"celery-claims: error: cannot reach the claim store at {url}")


def test_no_store_at_all_is_a_usage_error_with_exit_code_2() -> None:
    result = run_cli("list", env={"PATH": "/usr/bin:/bin"})

    assert result.returncode == 2
    assert "pass --redis-url" in result.stderr


def test_check_of_a_safe_app_passes_and_of_an_unsafe_one_names_each_fix(
    live_fleet: LiveFleet,
) -> None:
    safe = run_celery("-A", "celery_claims.demo.app", "claims", "check", env=live_fleet.env())
    unsafe = run_cli("-A", "tests.cli.unsafe_app", "check", "--json")

    assert safe.returncode == 0, safe.stderr
    assert safe.stdout.strip() == "no unsafe settings found"
    assert unsafe.returncode == 1
    findings = {f["key"]: f for f in json.loads(unsafe.stdout)["findings"]}
    assert set(findings) == {
        "task_acks_late",
        "broker_transport_options.visibility_timeout",
        "task_time_limit",
    }
    assert findings["task_acks_late"]["severity"] == "error"
    assert "Set task_acks_late = True" in findings["task_acks_late"]["message"]
