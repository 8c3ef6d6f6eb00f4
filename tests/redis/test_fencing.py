"""The fencing helpers: a write guarded by the claim instance refuses a stale writer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

from celery_claims import InvalidArgument
from celery_claims.fencing import TaskClaim, fenced_get, fenced_set, fenced_update, fenced_upsert
from celery_claims.model import ClaimToken


def test_redis_compare_and_set_keeps_the_write_of_the_largest_instance(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a guarded key written by instance 5
    key = f"{key_prefix}:fenced"
    assert fenced_set(redis_client, key, "five", 5)

    # When instance 4 (stale) and then instance 5 again (same) write, and then instance 6
    stale = fenced_set(redis_client, key, "four", 4)
    same = fenced_set(redis_client, key, "five again", 5)
    newer = fenced_set(redis_client, key, "six", 6)

    # Then only the larger instance's write landed
    assert (stale, same, newer) == (False, False, True)
    assert fenced_get(redis_client, key) == (b"six", 6)
    assert fenced_get(redis_client, f"{key_prefix}:absent") is None


def test_redis_fences_compare_as_integers_beyond_double_precision(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a fence above 2**53 (a double would round 2**53 + 1 down to 2**53)
    key = f"{key_prefix}:big"
    assert fenced_set(redis_client, key, "a", 2**53 + 1)

    # When a writer with 2**53 comes, Then it is refused; 2**53 + 2 is accepted
    assert not fenced_set(redis_client, key, "b", 2**53)
    assert fenced_set(redis_client, key, "c", 2**53 + 2)


@pytest.fixture
def sqlite_table() -> Iterator[tuple[sa.Engine, sa.Table]]:
    engine = sa.create_engine("sqlite://")
    metadata = sa.MetaData()
    table = sa.Table(
        "rows",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("writer", sa.Text, nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
    )
    metadata.create_all(engine)
    yield engine, table
    engine.dispose()


def test_sql_upsert_and_update_refuse_a_smaller_instance(
    sqlite_table: tuple[sa.Engine, sa.Table],
) -> None:
    engine, table = sqlite_table
    with engine.begin() as conn:
        # Given a row first written by instance 2
        assert fenced_upsert(conn, table, {"id": 1}, {"writer": "new"}, 2)

        # When instance 1 upserts and updates it, Then nothing changes
        assert not fenced_upsert(conn, table, {"id": 1}, {"writer": "stale"}, 1)
        assert not fenced_update(conn, table, {"id": 1}, {"writer": "stale"}, 1)
        # ... and instance 3 may
        assert fenced_update(conn, table, {"id": 1}, {"writer": "newer"}, 3)
        rows = conn.execute(sa.select(table.c.writer, table.c.fence)).all()
    assert rows == [("newer", 3)]


def test_sql_helpers_refuse_bad_arguments(sqlite_table: tuple[sa.Engine, sa.Table]) -> None:
    engine, table = sqlite_table
    with engine.begin() as conn:
        with pytest.raises(InvalidArgument, match="instance"):
            fenced_update(conn, table, {"id": 1}, {"writer": "x"}, -1)
        with pytest.raises(InvalidArgument, match="key"):
            fenced_upsert(conn, table, {}, {"writer": "x"}, 1)
        with pytest.raises(InvalidArgument, match="fence_column"):
            fenced_update(conn, table, {"id": 1}, {"writer": "x"}, 1, fence_column="nope")


def test_a_task_claim_round_trips_to_its_token() -> None:
    token = ClaimToken("q", "t:0:0", "w/1/n", 7, 1_000, 61_000)
    claim = TaskClaim.of(token, 60_000)
    assert claim.instance == 7
    assert claim.lease_ms == 60_000
    assert claim.token() == token


@pytest.mark.parametrize("instance", [2**63, 2**64 + 1])
def test_a_fence_beyond_a_signed_64_bit_integer_is_refused_before_any_write(
    instance: int,
    redis_client: redis.Redis,
    key_prefix: str,
    sqlite_table: tuple[sa.Engine, sa.Table],
) -> None:
    # Given a fence no SQL bigint (nor the effect guard) can hold
    # When a fenced write is asked with it, Then it is refused as bad input, nothing written
    key = f"{key_prefix}:huge"
    with pytest.raises(InvalidArgument, match=r"instance.*2\*\*63-1"):
        fenced_set(redis_client, key, "x", instance)
    assert redis_client.exists(key) == 0
    engine, table = sqlite_table
    with engine.begin() as conn:
        with pytest.raises(InvalidArgument, match=r"instance.*2\*\*63-1"):
            fenced_upsert(conn, table, {"id": 9}, {"writer": "x"}, instance)
        with pytest.raises(InvalidArgument, match=r"instance.*2\*\*63-1"):
            fenced_update(conn, table, {"id": 9}, {"writer": "x"}, instance)
        assert conn.execute(sa.select(table.c.id)).all() == []
