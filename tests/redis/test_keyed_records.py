"""Keyed claims in the claim store: a claim held on a business key whose owner names the
attempt, its completion record under the attempt, and a key kept done for a while."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_claims import AlreadyClaimed, AlreadyDone, RedisClaimManager, Success, TookOver
from celery_claims.claims.keys import keyed_owner, owner_key_ttl_ms, owner_task_key
from celery_claims.worker.identity import new_owner
from tests.servers import RedisServer

Q = "syncs"
KEY = "tasks.sync[42]"
LEASE = 60_000
DONE_TTL = 3_600_000


@pytest.fixture
def manager(redis_server: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    claims = RedisClaimManager(url=redis_server.url, prefix=key_prefix)
    try:
        yield claims
    finally:
        claims.client.close()


def owner_for(task_key: str, key_ttl_ms: int = 0) -> str:
    return keyed_owner(new_owner("w1@host"), task_key, key_ttl_ms)


def test_a_keyed_owner_names_its_attempt_whatever_the_task_id_holds() -> None:
    # Given task ids with every character the owner's format uses
    for task_key in ("a.b/c~d%e:0:0", "plain:1:2", "ünï/cödé:0:0"):
        # When it is named in a keyed owner
        owner = keyed_owner("host/12/ab12cd34.1f", task_key, 5000)
        # Then it reads back exactly, and the owner's head is still the worker process's
        assert owner_task_key(owner) == task_key
        assert owner_key_ttl_ms(owner) == 5000
        assert owner.startswith("host/12/ab12cd34.1f~k")
        assert "/" not in owner.removeprefix("host/12/ab12cd34.")
        assert "." not in owner[20:]
    assert owner_task_key("host/12/ab12cd34.1f") is None


def test_a_completed_keyed_claim_records_the_attempt_and_frees_the_key(
    manager: RedisClaimManager,
) -> None:
    # Given task A holding the key
    a = owner_for("task-a:0:0")
    held = manager.claim_unless_done(Q, KEY, a, LEASE)
    assert isinstance(held, Success)
    assert held.token is not None

    # When task B asks for the key meanwhile
    b = owner_for("task-b:0:0")
    refused = manager.claim_unless_done(Q, KEY, b, LEASE)

    # Then B is refused with A as the holder, whose attempt the owner names
    assert isinstance(refused, AlreadyClaimed)
    assert owner_task_key(refused.owner) == "task-a:0:0"

    # When A completes
    manager.complete(held.token, DONE_TTL)

    # Then the record is A's attempt's, not the key's: B gets the key at once, and another
    # copy of A is skipped as done
    assert manager.done_record(Q, "task-a:0:0") is not None
    assert manager.done_record(Q, KEY) is None
    assert isinstance(manager.claim_unless_done(Q, KEY, b, LEASE), Success)
    again = manager.claim_unless_done(Q, KEY, owner_for("task-a:0:0"), LEASE)
    assert isinstance(again, AlreadyDone)
    assert again.owner == a


def test_a_key_with_a_retention_skips_any_task_id_until_it_ends(
    manager: RedisClaimManager,
) -> None:
    # Given task A holding the key with a key retention of one hour, and completing
    a = owner_for("pay-a:0:0", key_ttl_ms=3_600_000)
    held = manager.claim_unless_done(Q, KEY, a, LEASE)
    assert held.token is not None
    manager.complete(held.token, DONE_TTL)

    # When task B (another task id) asks for the key
    found = manager.claim_unless_done(Q, KEY, owner_for("pay-b:0:0"), LEASE)

    # Then B finds the key done by A: both records are kept, each holding its owner reference
    assert isinstance(found, AlreadyDone)
    assert owner_task_key(found.owner) == "pay-a:0:0"
    assert manager.done_record(Q, "pay-a:0:0") is not None
    owners = manager.client.hgetall(manager.keys(Q).owners)
    refs = {k: v for k, v in owners.items() if k.startswith(b"r")}
    assert list(refs.values()) == [b"2"]


def test_a_dead_holders_key_is_taken_over_with_a_larger_fencing_number(
    manager: RedisClaimManager,
) -> None:
    # Given task A holding the key with a lease of 0 (dead at once)
    held = manager.claim_unless_done(Q, KEY, owner_for("task-a:0:0"), 0)
    assert held.token is not None

    # When task B asks for the key
    took = manager.claim_unless_done(Q, KEY, owner_for("task-b:0:0"), LEASE)

    # Then B takes it over, with a larger instance, and A's late completion is refused
    assert isinstance(took, TookOver)
    assert took.token is not None
    assert took.token.instance > held.token.instance
    with pytest.raises(Exception, match=r"Stale|Not claim owner"):
        manager.complete(held.token, DONE_TTL)
    assert manager.done_record(Q, "task-a:0:0") is None
