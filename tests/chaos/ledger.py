"""The soak's PostgreSQL ledger: every execution, and each task's effect applied three ways.

- ``executions``: one row per execution that reached its write (no guard: the raw count);
- ``rows.fenced``: incremented with :func:`celery_claims.fencing.fenced_update` (a write of an
  older claim instance after a newer one is refused; one that lands first is not);
- ``rows.once``: incremented with :func:`celery_claims.effects.apply_once` (the write and a
  marker keyed by the task id and attempt in one transaction): the exactly-once guard.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_claims.effects import effects_table


class Ledger:
    """The tables of one soak run (suffix ``run``) on ``engine``."""

    def __init__(self, engine: sa.Engine, run: str) -> None:
        self.engine = engine
        self.meta = sa.MetaData()
        self.rows = sa.Table(
            f"chaos_rows_{run}",
            self.meta,
            sa.Column("task", sa.String(64), primary_key=True),
            sa.Column("fence", sa.BigInteger, nullable=False, default=0),
            sa.Column("fenced", sa.Integer, nullable=False, default=0),
            sa.Column("once", sa.Integer, nullable=False, default=0),
        )
        self.executions = sa.Table(
            f"chaos_exec_{run}",
            self.meta,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("task", sa.String(64), nullable=False),
            sa.Column("worker", sa.String(200), nullable=False),
            sa.Column("at", sa.Float, nullable=False),
        )
        self.markers = effects_table(self.meta, f"chaos_effects_{run}")

    def create(self, task_ids: list[str]) -> None:
        """Create the tables and one ledger row per task."""
        self.meta.create_all(self.engine)
        with self.engine.begin() as conn:
            conn.execute(
                sa.insert(self.rows),
                [{"task": t, "fence": 0, "fenced": 0, "once": 0} for t in task_ids],
            )

    def drop(self) -> None:
        """Drop the run's tables."""
        self.meta.drop_all(self.engine)

    def applied(self) -> dict[str, tuple[int, int]]:
        """task -> (fenced count, once count)."""
        with self.engine.connect() as conn:
            return {
                r.task: (r.fenced, r.once)
                for r in conn.execute(
                    sa.select(self.rows.c.task, self.rows.c.fenced, self.rows.c.once)
                )
            }

    def executions_of(self) -> dict[str, list[tuple[float, str]]]:
        """task -> [(at, worker)] of every execution."""
        found: dict[str, list[tuple[float, str]]] = {}
        with self.engine.connect() as conn:
            for r in conn.execute(sa.select(self.executions).order_by(self.executions.c.at)):
                found.setdefault(r.task, []).append((r.at, r.worker))
        return found
