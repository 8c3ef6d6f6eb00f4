"""apply_once on SQLite and PostgreSQL: the write and its marker commit together, once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_claims import BackendError, InvalidArgument
from celery_claims.effects import (
    MAX_EFFECT_KEY_CHARS,
    applied,
    apply_once,
    effect_key,
    effects_table,
)
from celery_claims.fencing import TaskClaim
from celery_claims.model import ClaimToken
from tests.effects.conftest import Sql, sql_snapshot


class Boom(Exception):
    """A write that fails."""


def writer(db: Sql, name: str, calls: list[str]) -> Callable[[sa.Connection], int]:
    """A write that records its call and adds one sink row named ``name``."""

    def write(conn: sa.Connection) -> int:
        calls.append(name)
        conn.execute(sa.insert(db.sink).values(writer=name))
        return len(calls)

    return write


def sink_writers(db: Sql) -> list[str]:
    with db.engine.connect() as conn:
        return list(conn.execute(sa.select(db.sink.c.writer).order_by(db.sink.c.id)).scalars())


def test_first_copy_applies_and_a_second_copy_of_the_same_attempt_skips_without_writing(
    sql: Sql,
) -> None:
    # Given the key of one task attempt
    key = effect_key(ClaimToken("orders", "abc:0:0", "w/1/n", 5, 1_000, 61_000))
    calls: list[str] = []

    # When the first copy applies its effect, and a second copy of the attempt comes later
    with sql.engine.begin() as conn:
        first = apply_once(conn, key, writer(sql, "first", calls), instance=5, table=sql.markers)
    with sql.engine.begin() as conn:
        second = apply_once(conn, key, writer(sql, "second", calls), instance=6, table=sql.markers)

    # Then the first wrote and returned its result; the second's write was never called
    assert first == (True, 1)
    assert second == (False, None)
    assert calls == ["first"]
    assert sink_writers(sql) == ["first"]
    # ... and the marker names the instance that applied it
    with sql.engine.connect() as conn:
        assert applied(conn, key, table=sql.markers)
        rows = conn.execute(sa.select(sql.markers.c.key, sql.markers.c.instance)).all()
    assert [tuple(row) for row in rows] == [("orders/abc:0:0", 5)]


def test_another_attempt_of_the_same_task_has_its_own_key_and_applies(sql: Sql) -> None:
    # Given the first attempt applied its effect
    calls: list[str] = []
    first = ClaimToken("orders", "abc:0:0", "w/1/n", 5, 1_000, 61_000)
    retry = ClaimToken("orders", "abc:1:0", "w/1/m", 7, 2_000, 62_000)
    with sql.engine.begin() as conn:
        apply_once(conn, effect_key(first), writer(sql, "try-0", calls), table=sql.markers)

    # When the retry (the next attempt) applies its own
    with sql.engine.begin() as conn:
        result = apply_once(conn, effect_key(retry), writer(sql, "try-1", calls), table=sql.markers)

    # Then it is applied too
    assert result == (True, 2)
    assert sink_writers(sql) == ["try-0", "try-1"]


def test_a_write_that_raises_rolls_its_marker_back_and_a_retry_applies(sql: Sql) -> None:
    # Given a write that inserts its row and then fails
    def failing(conn: sa.Connection) -> None:
        conn.execute(sa.insert(sql.sink).values(writer="half"))
        raise Boom

    # When it runs in a transaction whose caller catches the error and commits the rest
    with sql.engine.begin() as conn:
        conn.execute(sa.insert(sql.sink).values(writer="caller"))
        with pytest.raises(Boom):
            apply_once(conn, "effect-1", failing, table=sql.markers)
        assert not applied(conn, "effect-1", table=sql.markers)

    # Then neither the marker nor the half write was kept, only the caller's own row
    assert sink_writers(sql) == ["caller"]
    with sql.engine.connect() as conn:
        assert not applied(conn, "effect-1", table=sql.markers)

    # And when the effect is tried again, it applies
    calls: list[str] = []
    with sql.engine.begin() as conn:
        assert apply_once(conn, "effect-1", writer(sql, "retry", calls), table=sql.markers)[0]
    assert sink_writers(sql) == ["caller", "retry"]


def test_a_rolled_back_transaction_takes_the_marker_with_it(sql: Sql) -> None:
    # Given an effect applied in a transaction that then fails after apply_once returned
    calls: list[str] = []

    def apply_then_fail() -> None:
        with sql.engine.begin() as conn:
            assert apply_once(conn, "effect-2", writer(sql, "lost", calls), table=sql.markers)[0]
            raise Boom

    with pytest.raises(Boom):
        apply_then_fail()

    # When it is applied again, Then it applies (nothing of the first try was committed)
    with sql.engine.begin() as conn:
        assert apply_once(conn, "effect-2", writer(sql, "kept", calls), table=sql.markers)[0]
    assert sink_writers(sql) == ["kept"]


def test_tables_given_by_name_are_used_and_a_missing_one_is_a_typed_error(
    tmp_path: Path,
) -> None:
    # Given a SQLite database with the marker table under its default name
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'named.db'}")
    effects_table(sa.MetaData()).create(engine)
    calls: list[str] = []
    try:
        with engine.begin() as conn:
            # When an effect is applied and read back through the default name
            done, _ = apply_once(conn, "named", lambda c: calls.append("named"))
            # Then it applied and is marked
            assert done
            assert applied(conn, "named")
            # ... and a table name that does not exist is a typed error, and nothing is written
            with pytest.raises(BackendError, match="no_such_table"):
                apply_once(conn, "other", lambda c: calls.append("other"), table="no_such_table")
        assert calls == ["named"]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_two_racing_copies_on_postgresql_apply_exactly_once_every_time(
    postgres: Any,
) -> None:
    # Given marker and sink tables in PostgreSQL, and two copies of each of 50 effects
    metadata = sa.MetaData(schema=postgres.schema)
    markers = effects_table(metadata, "fx_race")
    sink = sa.Table(
        "sink_race",
        metadata,
        sa.Column("effect", sa.Text, nullable=False),
        sa.Column("writer", sa.Text, nullable=False),
    )
    metadata.create_all(postgres.engine)
    rounds = 50
    results: dict[int, list[bool]] = {n: [] for n in range(rounds)}
    errors: list[BaseException] = []
    try:

        def copy(number: int, name: str, barrier: threading.Barrier) -> None:
            def write(conn: sa.Connection) -> None:
                conn.execute(sa.insert(sink).values(effect=f"e{number}", writer=name))
                # hold the uncommitted marker a moment, so the other copy meets it
                time.sleep(0.005)

            try:
                # each copy on its own connection (own transaction), started together
                with postgres.engine.begin() as conn:
                    barrier.wait(timeout=10)
                    done, _ = apply_once(conn, f"e{number}", write, table=markers)
                results[number].append(done)
            except BaseException as exc:  # reported below, not lost in the thread
                errors.append(exc)

        # When the two copies of every effect race
        for number in range(rounds):
            barrier = threading.Barrier(2)
            threads = [threading.Thread(target=copy, args=(number, name, barrier)) for name in "ab"]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)

        # Then each effect was applied by exactly one copy, and written exactly once
        assert errors == []
        assert all(sorted(done) == [False, True] for done in results.values()), results
        with postgres.engine.connect() as conn:
            effects = conn.execute(sa.select(sink.c.effect)).scalars().all()
            marked = conn.execute(sa.select(sa.func.count()).select_from(markers)).scalar()
        assert sorted(effects) == sorted(f"e{n}" for n in range(rounds))
        assert marked == rounds
    finally:
        metadata.drop_all(postgres.engine)


def _bad_calls(db: Sql, never: Callable[[sa.Connection], None]) -> list[Any]:
    """(what, call) pairs that must each raise InvalidArgument, given a live connection."""
    no_columns = sa.Table("plain", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    long_key = "k" * (MAX_EFFECT_KEY_CHARS + 1)
    return [
        ("key", lambda c: apply_once(c, "", never, table=db.markers)),
        ("key", lambda c: apply_once(c, 42, never, table=db.markers)),
        ("key", lambda c: apply_once(c, long_key, never, table=db.markers)),
        ("key", lambda c: apply_once(c, "a\x00b", never, table=db.markers)),
        ("instance", lambda c: apply_once(c, "k", never, instance=-1, table=db.markers)),
        ("instance", lambda c: apply_once(c, "k", never, instance=True, table=db.markers)),
        ("instance", lambda c: apply_once(c, "k", never, instance=2**63, table=db.markers)),
        ("instance", lambda c: apply_once(c, "k", never, instance="1", table=db.markers)),
        ("table", lambda c: apply_once(c, "k", never, table=no_columns)),
        ("table", lambda c: apply_once(c, "k", never, table="")),
        ("table", lambda c: apply_once(c, "k", never, table=3)),
        ("write", lambda c: apply_once(c, "k", "not callable", table=db.markers)),
        ("conn", lambda c: apply_once(db.engine, "k", never, table=db.markers)),
        ("key", lambda c: applied(c, "", table=db.markers)),
        ("table", lambda c: applied(c, "k", table=no_columns)),
    ]


def test_bad_input_is_refused_before_the_database_is_touched(sql: Sql) -> None:
    # Given a database holding one applied effect
    calls: list[str] = []
    with sql.engine.begin() as conn:
        apply_once(conn, "k", writer(sql, "first", calls), table=sql.markers)
    before = sql_snapshot(sql)

    def never(conn: sa.Connection) -> None:
        raise AssertionError("write called on bad input")

    # When each bad call is made (and its transaction committed)
    refused = []
    for what, call in _bad_calls(sql, never):
        with sql.engine.begin() as conn, pytest.raises(InvalidArgument) as raised:
            call(conn)
        refused.append((what, raised.value.name))

    # Then each was refused naming the bad argument, and the database is unchanged
    assert [name for name, _ in refused] == [got for _, got in refused]
    assert sql_snapshot(sql) == before


def test_effect_key_names_the_attempt_and_refuses_what_is_not_a_claim() -> None:
    # Given a task's claim and a plain token of the same attempt
    token = ClaimToken("orders", "abc:2:1", "w/1/n", 9, 1_000, 61_000)
    claim = TaskClaim.of(token, 60_000)

    # Then both name the same attempt, and a queue with "/" cannot collide with another
    assert effect_key(claim) == effect_key(token) == "orders/abc:2:1"
    slashed = ClaimToken("a/b", "c:0:0", "w", 1, 0, 1)
    other = ClaimToken("a", "b/c:0:0", "w", 1, 0, 1)
    assert effect_key(slashed) == "a%2Fb/c:0:0" != effect_key(other) == "a/b/c:0:0"

    # And anything else, or a key that would be too long, is refused
    with pytest.raises(InvalidArgument, match="claim"):
        effect_key("orders/abc:0:0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="claim"):
        effect_key(ClaimToken("q", "t" * MAX_EFFECT_KEY_CHARS, "w", 1, 0, 1))


def test_effects_table_declares_the_marker_columns_once_per_metadata() -> None:
    # Given a metadata
    metadata = sa.MetaData()

    # When the marker table is declared twice
    table = effects_table(metadata)
    again = effects_table(metadata)

    # Then it is one table with the documented columns
    assert again is table
    assert table.name == "claims_effects"
    assert [c.name for c in table.primary_key] == ["key"]
    assert isinstance(table.c.key.type, sa.String)
    assert table.c.key.type.length == MAX_EFFECT_KEY_CHARS
    assert isinstance(table.c.instance.type, sa.BigInteger)
    assert not table.c.instance.nullable
    assert table.c.applied_at.server_default is not None
    with pytest.raises(InvalidArgument, match="metadata"):
        effects_table("not metadata")  # type: ignore[arg-type]
