"""``celery-claims inspect`` of a task given up as poison (taken over too often)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_claims import GivenUp, RedisClaimManager
from celery_claims.observe import History, HistoryEvent
from tests.cli.conftest import json_of, run_cli
from tests.servers import RedisServer

QUEUE = "cli"
TASK = "poison-1"


@pytest.fixture
def given_up(redis_server: RedisServer, key_prefix: str) -> Iterator[tuple[str, GivenUp]]:
    """A task claimed, taken over once and then given up (limit 1); returns the prefix."""
    manager = RedisClaimManager(url=redis_server.url, prefix=key_prefix)
    claim_id = f"{TASK}:0:0"
    try:
        # leases of 0 ms run out at once: each holder "crashed" as soon as it started the task
        manager.claim_unless_done(QUEUE, claim_id, "host-a/11/x", 0, max_takeovers=1)
        took_over = manager.claim_unless_done(QUEUE, claim_id, "host-b/22/y", 0, max_takeovers=1)
        assert took_over.token is not None
        manager.mark_started(took_over.token)
        result = manager.claim_unless_done(QUEUE, claim_id, "host-c/33/z", 0, max_takeovers=1)
        assert isinstance(result, GivenUp)
        yield key_prefix, result
    finally:
        manager.close()


def test_inspect_shows_a_given_up_task_with_its_takeovers_and_when(
    redis_server: RedisServer, given_up: tuple[str, GivenUp]
) -> None:
    # Given a task given up after one takeover, host-b being the last holder
    prefix, record = given_up

    # When the operator inspects it, as JSON and as text
    data = json_of(run_cli("--redis-url", redis_server.url, "--prefix", prefix, "inspect", TASK,
                           "--json"))  # fmt: skip
    text = run_cli("--redis-url", redis_server.url, "--prefix", prefix, "inspect", TASK)

    # Then the record reads as given up, with the count, the last holder and the time
    [view] = data["claims"]
    assert view["state"] == "given_up"
    assert (view["queue"], view["attempt"]) == (QUEUE, "0.0")
    assert view["takeovers"] == record.takeovers == 1
    assert view["owner"] == record.previous_owner == "host-b/22/y"
    assert view["since_ms"] == record.given_up_at
    assert view["until_ms"] > data["now_ms"]
    assert text.returncode == 0, text.stderr
    assert "GIVEN UP as poison" in text.stdout
    assert "(takeovers: 1, last holder whose lease ran out: host-b/22/y)" in text.stdout
    assert "later copies are acked unrun until" in text.stdout


def test_inspect_explains_a_copy_skipped_because_the_task_was_given_up(
    redis_server: RedisServer, given_up: tuple[str, GivenUp]
) -> None:
    # Given the journal entry a worker writes when it acks a copy of a given-up task unrun
    prefix, record = given_up
    client = redis_server.client()
    try:
        History(client, prefix).record(
            TASK,
            HistoryEvent(record.given_up_at, "skipped", "given_up", "cli-c@test",
                         f"{QUEUE}/{TASK}:0:0", record.previous_owner),
        )  # fmt: skip
    finally:
        client.close()

    # When the operator inspects the task
    result = run_cli("--redis-url", redis_server.url, "--prefix", prefix, "inspect", TASK)

    # Then the copy's line says it was given up, not done
    assert result.returncode == 0, result.stderr
    assert "acked without running on cli-c@test: the task was given up as poison" in result.stdout
    assert "already done" not in result.stdout
