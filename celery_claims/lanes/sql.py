"""The SQL lane store on SQLAlchemy 2 Core: PostgreSQL, or SQLite as the embedded default.

``claim_candidates_for_lane`` follows the reference product store: one transaction that locks
the lane's row in the lock table, recounts the lane's live leases at ``claimed_at``, and claims
each candidate with a compare-and-swap
``UPDATE ... WHERE id = :id AND processing_token = :expected AND <claimable>``.

The lane lock is ``SELECT ... FOR UPDATE`` on PostgreSQL. SQLite has no row locks; there the
transaction starts by writing the lane's lock row, which takes SQLite's single write lock at
once, so claim passes (of every lane) run one at a time, and no reads happen before the lock.
Every SQLAlchemy error is raised as :class:`~celery_claims.errors.IoError` with the driver error
as its ``__cause__``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Dialect, Engine

from celery_claims.connection import describe
from celery_claims.errors import InvalidValueError, IoError
from celery_claims.lanes import _validate as check
from celery_claims.lanes.dispatch import Clock, available_capacity, utc_now
from celery_claims.lanes.model import (
    ClaimedTask,
    StoreStatus,
    TaskClaimCandidate,
    TaskLaneConfig,
    TaskRecord,
    TaskStatus,
    raise_for_status,
    settle_status,
)

__all__ = ["DEFAULT_TABLE_PREFIX", "SqlTaskClaimStore", "UtcDateTime"]

#: The default first part of the store's table names.
DEFAULT_TABLE_PREFIX = "claims_"

_WAITING = (TaskStatus.PENDING.value, TaskStatus.RETRY.value)


class UtcDateTime(sa.types.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every dialect.

    PostgreSQL stores ``timestamptz``; SQLite, which has no time zones, stores naive UTC text
    whose order is time order. Values come back as UTC ``datetime`` either way.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Normalise to UTC (naive UTC on SQLite)."""
        if value is None:
            return None
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        """Attach or convert to UTC."""
        if value is None:
            return None
        assert isinstance(value, datetime)
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


@contextlib.contextmanager
def _driver_errors(operation: str) -> Iterator[None]:
    try:
        yield
    except sa.exc.SQLAlchemyError as exc:
        raise IoError(f"sql lane store: {operation} failed: {exc}") from exc


class SqlTaskClaimStore:
    """A lane store in two SQL tables: tasks, and one lock row per lane.

    Args:
        url: an SQLAlchemy URL, for an engine the store creates (and disposes in
            :meth:`close`), e.g. ``postgresql+psycopg://user@host/db`` or
            ``sqlite:///lanes.db``.
        engine: an engine to use instead.
        lanes: the lanes the store serves; kinds and lane keys are non-empty ``str`` of at
            most 255 characters.
        table_prefix: the first part of the table and index names.
        schema: the database schema of the tables (``None`` for the default).
        clock: the time source of ``enqueue``'s default ``next_run_at``.

    Call :meth:`create_tables` once before use.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        engine: Engine | None = None,
        lanes: Iterable[TaskLaneConfig[str, Any]],
        table_prefix: str = DEFAULT_TABLE_PREFIX,
        schema: str | None = None,
        clock: Clock = utc_now,
    ) -> None:
        if (url is None) == (engine is None):
            raise InvalidValueError("pass exactly one of url= and engine=")
        self._lanes: check.LaneRegistry[str, Any] = check.LaneRegistry(lanes, str_kinds=True)
        if not isinstance(table_prefix, str) or not table_prefix.isidentifier():
            raise InvalidValueError(f"table_prefix must be an identifier, got {table_prefix!r}")
        self._clock = clock
        self._owns_engine = engine is None
        if engine is None:
            try:
                engine = sa.create_engine(url)  # type: ignore[arg-type]  # checked just below
            except (sa.exc.ArgumentError, TypeError, ValueError) as exc:
                # kombu's sanitiser masks the password; SQLAlchemy's own text names no URL
                raise InvalidValueError(
                    f"not a usable SQLAlchemy URL: {describe(url)}: {exc}"
                ) from exc
        self.engine: Engine = engine
        self.metadata = sa.MetaData(schema=schema)
        self.tasks = sa.Table(
            f"{table_prefix}lane_tasks",
            self.metadata,
            sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("kind", sa.String(check.MAX_NAME_LENGTH), nullable=False),
            sa.Column("status", sa.String(16), nullable=False),
            sa.Column("processing_token", sa.BigInteger, nullable=False),
            sa.Column("next_run_at", UtcDateTime, nullable=False),
            sa.Column("lease_expires_at", UtcDateTime, nullable=True),
            sa.Column("claimed_at", UtcDateTime, nullable=True),
            sa.Column("payload", sa.Text, nullable=False),
        )
        # The listing and the recount read by kind and status, then by time.
        sa.Index(
            f"ix_{table_prefix}lane_tasks_due",
            self.tasks.c.kind,
            self.tasks.c.status,
            self.tasks.c.next_run_at,
        )
        sa.Index(
            f"ix_{table_prefix}lane_tasks_lease",
            self.tasks.c.kind,
            self.tasks.c.status,
            self.tasks.c.lease_expires_at,
        )
        self.locks = sa.Table(
            f"{table_prefix}lane_locks",
            self.metadata,
            sa.Column("lock_key", sa.String(check.MAX_NAME_LENGTH), primary_key=True),
        )

    # --- schema ------------------------------------------------------------------------------

    def create_tables(self) -> None:
        """Create the tables if missing, and the lock row of every lane."""
        with _driver_errors("create_tables"):
            self.metadata.create_all(self.engine)
            with self.engine.begin() as conn:
                for key in self._lanes.by_key:
                    self._insert_lock_row(conn, key)

    def drop_tables(self) -> None:
        """Drop the store's tables (and every task in them)."""
        with _driver_errors("drop_tables"):
            self.metadata.drop_all(self.engine)

    def close(self) -> None:
        """Dispose of the engine if the store created it from ``url=``."""
        if self._owns_engine:
            self.engine.dispose()

    def _insert_lock_row(self, conn: Connection, lock_key: str) -> None:
        if conn.dialect.name == "postgresql":
            conn.execute(
                postgresql.insert(self.locks)
                .values(lock_key=lock_key)
                .on_conflict_do_nothing(index_elements=["lock_key"])
            )
        elif conn.dialect.name == "sqlite":
            conn.execute(
                sqlite.insert(self.locks)
                .values(lock_key=lock_key)
                .on_conflict_do_nothing(index_elements=["lock_key"])
            )
        else:
            exists = conn.execute(
                sa.select(self.locks.c.lock_key).where(self.locks.c.lock_key == lock_key)
            ).first()
            if exists is None:
                conn.execute(sa.insert(self.locks).values(lock_key=lock_key))

    def _lock_lane(self, conn: Connection, lock_key: str) -> None:
        """Take the lane's lock for the rest of the transaction."""
        row = self.locks.c.lock_key == lock_key
        if conn.dialect.name == "postgresql":
            if conn.execute(sa.select(self.locks.c.lock_key).where(row).with_for_update()).first():
                return
            self._insert_lock_row(conn, lock_key)
            conn.execute(sa.select(self.locks.c.lock_key).where(row).with_for_update())
            return
        # A no-op write: on SQLite it takes the database's write lock before anything is read.
        touched = conn.execute(sa.update(self.locks).where(row).values(lock_key=lock_key))
        if touched.rowcount == 0:
            self._insert_lock_row(conn, lock_key)

    # --- helpers -----------------------------------------------------------------------------

    def _record(self, row: sa.Row[Any]) -> TaskRecord[str]:
        return TaskRecord(
            id=row.id,
            kind=row.kind,
            status=TaskStatus(row.status),
            processing_token=row.processing_token,
            next_run_at=row.next_run_at,
            lease_expires_at=row.lease_expires_at,
            claimed_at=row.claimed_at,
            payload=row.payload,
        )

    def _claimable(self, at: datetime) -> sa.ColumnElement[bool]:
        t = self.tasks.c
        return sa.or_(
            sa.and_(t.status.in_(_WAITING), t.next_run_at <= at),
            sa.and_(
                t.status == TaskStatus.PROCESSING.value,
                sa.or_(t.lease_expires_at.is_(None), t.lease_expires_at <= at),
            ),
        )

    def _active(self, at: datetime) -> sa.ColumnElement[bool]:
        t = self.tasks.c
        return sa.and_(t.status == TaskStatus.PROCESSING.value, t.lease_expires_at > at)

    def _settle(
        self,
        operation: str,
        task_id: int,
        processing_token: int,
        values: dict[str, Any],
        *,
        completing: bool = False,
    ) -> bool:
        """Apply ``values`` to the attempt's task by compare-and-swap, or report why not."""
        t = self.tasks.c
        with _driver_errors(operation), self.engine.begin() as conn:
            changed = conn.execute(
                sa.update(self.tasks)
                .where(
                    t.id == task_id,
                    t.processing_token == processing_token,
                    t.status == TaskStatus.PROCESSING.value,
                )
                .values(**values)
            )
            if changed.rowcount == 1:
                status = StoreStatus.OK
            else:
                # Only the reason is read here; the decision not to write is already made.
                row = conn.execute(sa.select(self.tasks).where(t.id == task_id)).first()
                record = None if row is None else self._record(row)
                status = settle_status(record, processing_token, completing=completing)
        return raise_for_status(status, task_id=task_id, processing_token=processing_token)

    # --- producer and worker operations ---------------------------------------------------

    def enqueue(
        self,
        task_id: int,
        kind: str,
        *,
        next_run_at: datetime | None = None,
        payload: str = "",
    ) -> TaskRecord[str]:
        """Add a pending task; see :meth:`MemoryTaskClaimStore.enqueue`."""
        _, record = self._lanes.new_task(task_id, kind, next_run_at, payload, self._clock)
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    sa.insert(self.tasks).values(
                        id=task_id,
                        kind=kind,
                        status=record.status.value,
                        processing_token=0,
                        next_run_at=record.next_run_at,
                        payload=payload,
                    )
                )
        except sa.exc.IntegrityError:
            raise_for_status(StoreStatus.EXISTS, task_id=task_id)
        except sa.exc.SQLAlchemyError as exc:
            raise IoError(f"sql lane store: enqueue failed: {exc}") from exc
        return record

    def get_task(self, task_id: int) -> TaskRecord[str] | None:
        """The task with this id, or ``None``."""
        check.task_id(task_id)
        with _driver_errors("get_task"), self.engine.connect() as conn:
            row = conn.execute(sa.select(self.tasks).where(self.tasks.c.id == task_id)).first()
        return None if row is None else self._record(row)

    def complete(self, task_id: int, processing_token: int) -> bool:
        """Mark the task done; see :meth:`MemoryTaskClaimStore.complete`."""
        check.attempt(task_id, processing_token)
        return self._settle(
            "complete",
            task_id,
            processing_token,
            {"status": TaskStatus.DONE.value},
            completing=True,
        )

    def retry(self, task_id: int, processing_token: int, *, next_run_at: datetime) -> None:
        """Give the task back for another attempt; see :meth:`MemoryTaskClaimStore.retry`."""
        check.attempt(task_id, processing_token)
        due = check.utc("next_run_at", next_run_at)
        self._settle(
            "retry",
            task_id,
            processing_token,
            {"status": TaskStatus.RETRY.value, "next_run_at": due, "lease_expires_at": None},
        )

    def heartbeat(self, task_id: int, processing_token: int, *, lease_expires_at: datetime) -> None:
        """Renew the attempt's lease; see :meth:`MemoryTaskClaimStore.heartbeat`."""
        check.attempt(task_id, processing_token)
        lease = check.utc("lease_expires_at", lease_expires_at)
        self._settle("heartbeat", task_id, processing_token, {"lease_expires_at": lease})

    def count_unfinished(self, kinds: Sequence[str]) -> int:
        """How many tasks of ``kinds`` are pending, retry or processing."""
        wanted = self._lanes.check_kinds(kinds)
        t = self.tasks.c
        query = sa.select(sa.func.count()).where(
            t.kind.in_(wanted), t.status != TaskStatus.DONE.value
        )
        with _driver_errors("count_unfinished"), self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    # --- TaskClaimStore ---------------------------------------------------------------------

    def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[str], limit: int
    ) -> list[TaskRecord[str]]:
        """List at most ``limit`` claimable tasks of ``kinds``, most overdue first."""
        at, _ = check.listing_times(now, stale_before)
        wanted = self._lanes.check_kinds(kinds)
        count = check.non_negative_int("limit", limit)
        if count == 0:
            return []
        t = self.tasks.c
        due_at = sa.case(
            (t.status == TaskStatus.PROCESSING.value, t.lease_expires_at), else_=t.next_run_at
        )
        query = (
            sa.select(self.tasks)
            .where(t.kind.in_(wanted), self._claimable(at))
            .order_by(due_at, t.id)
            .limit(count)
        )
        with _driver_errors("list_claimable_by_kinds"), self.engine.connect() as conn:
            return [self._record(row) for row in conn.execute(query)]

    def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[str]) -> int:
        """Count the tasks of ``kinds`` whose lease is live at ``now``."""
        at = check.utc("now", now)
        wanted = self._lanes.check_kinds(kinds)
        query = sa.select(sa.func.count()).where(self.tasks.c.kind.in_(wanted), self._active(at))
        with _driver_errors("count_active_processing_by_kinds"), self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[str, Any],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> list[ClaimedTask]:
        """Claim candidates in order until the lane is full, in one transaction.

        Raises:
            InvalidValueError: on a bad argument, a lane this store does not serve, or a
                candidate that is not a task of the lane; nothing is claimed.
            IoError: the database failed.
        """
        lane = self._lanes.registered(lane_config)
        checked = check.candidates(candidates)
        _, at, lease = check.claim_window(stale_before, claimed_at, lease_expires_at)
        if not checked:
            return []
        t = self.tasks.c
        claimed: list[ClaimedTask] = []
        with _driver_errors("claim_candidates_for_lane"), self.engine.begin() as conn:
            self._lock_lane(conn, lane.lane_key)
            self._require_lane_tasks(conn, lane, checked)
            active = conn.execute(
                sa.select(sa.func.count()).where(t.kind.in_(lane.kinds), self._active(at))
            ).scalar_one()
            available = available_capacity(lane_config.limit, int(active))
            for candidate in checked:
                if len(claimed) >= available:
                    break
                if self._swap(conn, candidate, at, lease):
                    claimed.append(
                        ClaimedTask(
                            candidate.index, candidate.task_id, candidate.next_processing_token
                        )
                    )
        return claimed

    def _require_lane_tasks(
        self,
        conn: Connection,
        lane: TaskLaneConfig[str, Any],
        checked: Sequence[TaskClaimCandidate],
    ) -> None:
        """Refuse (NOT_FOUND) the first candidate that is no task of ``lane``.

        Raised inside the caller's transaction: it rolls back, nothing was written.
        """
        t = self.tasks.c
        ids = sorted({candidate.task_id for candidate in checked})
        kinds_by_id = {
            row.id: row.kind for row in conn.execute(sa.select(t.id, t.kind).where(t.id.in_(ids)))
        }
        for candidate in checked:
            if kinds_by_id.get(candidate.task_id) not in lane.kinds:
                raise_for_status(StoreStatus.NOT_FOUND, task_id=candidate.task_id, lane=lane.lane)

    def _swap(
        self, conn: Connection, candidate: TaskClaimCandidate, at: datetime, lease: datetime
    ) -> bool:
        """Compare-and-swap one claimable candidate to processing; whether it was swapped."""
        t = self.tasks.c
        swapped = conn.execute(
            sa.update(self.tasks)
            .where(
                t.id == candidate.task_id,
                t.processing_token == candidate.expected_processing_token,
                self._claimable(at),
            )
            .values(
                status=TaskStatus.PROCESSING.value,
                processing_token=candidate.next_processing_token,
                lease_expires_at=lease,
                claimed_at=at,
            )
        )
        return swapped.rowcount == 1
