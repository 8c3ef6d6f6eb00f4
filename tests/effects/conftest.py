"""Effect-guard fixtures: a marker table and a sink table in SQLite and PostgreSQL.

PostgreSQL is the session's private schema of the lane tests (``tests.lanes.conftest``): it
fails under CI when PostgreSQL is absent. Every test gets tables of its own. The Celery test
uses the worker tests' ``queue`` and ``claims`` fixtures.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_claims.effects import effects_table
from tests.lanes.conftest import Postgres, postgres
from tests.worker.conftest import claims, queue

__all__ = ["Sql", "claims", "postgres", "queue", "sql", "sql_snapshot"]


@dataclasses.dataclass(frozen=True)
class Sql:
    """A database under test: an engine, the marker table and a sink the effects write to."""

    name: str
    engine: sa.Engine
    markers: sa.Table
    sink: sa.Table


def sql_snapshot(db: Sql) -> list[list[tuple[object, ...]]]:
    """Every row of the marker and sink tables: the whole state the effects can change."""
    with db.engine.connect() as conn:
        return [
            [tuple(row) for row in conn.execute(sa.select(table).order_by(*table.primary_key))]
            for table in (db.markers, db.sink)
        ]


def sink_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """Where test effects write: one row per effect, named by the writer."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("writer", sa.Text, nullable=False),
    )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sql]:
    """Fresh marker and sink tables in SQLite (a temp file) or the session's PostgreSQL schema."""
    suffix = uuid.uuid4().hex[:10]
    if request.param == "postgres":
        pg: Postgres = request.getfixturevalue("postgres")
        engine, metadata, owned = pg.engine, sa.MetaData(schema=pg.schema), False
    else:
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'effects.db'}")
        metadata, owned = sa.MetaData(), True
    db = Sql(
        request.param,
        engine,
        effects_table(metadata, f"fx_{suffix}"),
        sink_table(metadata, f"sink_{suffix}"),
    )
    metadata.create_all(engine)
    try:
        yield db
    finally:
        metadata.drop_all(engine)
        if owned:
            engine.dispose()
