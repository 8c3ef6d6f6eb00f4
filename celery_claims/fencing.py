"""Fencing: guard a downstream write with the claim's fencing number.

Every claim, takeover and re-claim of a task gets a strictly larger ``instance``. A copy that
lost its lease (it was paused, then taken over) still holds the old, smaller number, so a
write that stores the number next to the data and refuses a smaller one can never let the
stale copy overwrite the newer copy's work, whatever the order in which the two finish:

- SQL: :func:`fenced_update` (``UPDATE ... WHERE key = :key AND fence < :instance``) and
  :func:`fenced_upsert` (``INSERT ... ON CONFLICT DO UPDATE ... WHERE fence < excluded.fence``),
  on SQLAlchemy Core, imported only when called;
- Redis: :func:`fenced_set`, one Lua compare-and-set on a hash ``{fence, value}``, and
  :func:`fenced_get`.

In a Celery task the number is ``self.request.claim.instance`` (a :class:`TaskClaim`), or
``celery_claims.worker.current_claim().instance``. This module imports neither Celery nor kombu.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from celery_claims.errors import InvalidArgument
from celery_claims.model import ClaimToken
from celery_claims.validation import require_fence

__all__ = [
    "DEFAULT_FENCE_COLUMN",
    "TaskClaim",
    "fenced_get",
    "fenced_set",
    "fenced_update",
    "fenced_upsert",
]

#: Column that holds the fencing number of the last accepted write.
DEFAULT_FENCE_COLUMN = "fence"


@dataclass(frozen=True, slots=True)
class TaskClaim(ClaimToken):
    """The claim a running task holds, as its own code sees it (``self.request.claim``).

    A :class:`~celery_claims.ClaimToken` (``queue_id``, ``task_id`` as
    ``<celery task id>:<retries>:<nesting>``, ``owner``, ``instance``, ``created_at``, and
    ``expires_at`` as of the hand-off to the pool: the worker renews it while the task runs, so
    the live lease usually ends later) plus the lease each renewal extends to. It is a plain,
    picklable value: the worker puts it in the request it hands to the pool, so it reaches
    prefork children as well as thread and solo pools.

    Attributes:
        lease_ms: the lease each renewal extends to.
        mark_start: the claim was granted by a takeover under ``claims_max_takeovers``: the
            process that runs the task marks its start in the store before the body, so that
            only a holder that started the task counts toward the limit if it dies.
    """

    lease_ms: int
    mark_start: bool = False

    @classmethod
    def of(cls, token: ClaimToken, lease_ms: int, *, mark_start: bool = False) -> TaskClaim:
        """The task's view of ``token``."""
        return cls(
            token.queue_id,
            token.task_id,
            token.owner,
            token.instance,
            token.created_at,
            token.expires_at,
            lease_ms,
            mark_start,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled with every request handed to a prefork pool process: its fields as
        # arguments, where a slotted dataclass's own state (``fields()`` on each side) costs
        # twice the time
        return (
            type(self),
            (
                self.queue_id,
                self.task_id,
                self.owner,
                self.instance,
                self.created_at,
                self.expires_at,
                self.lease_ms,
                self.mark_start,
            ),
        )

    def token(self) -> ClaimToken:
        """The plain claim token (``expires_at`` as of the hand-off to the pool)."""
        return ClaimToken(
            self.queue_id, self.task_id, self.owner, self.instance, self.created_at, self.expires_at
        )


# --- SQL (SQLAlchemy Core) -------------------------------------------------------------------


def _checked(
    table: Any, key: Mapping[str, Any], instance: object, fence_column: str
) -> tuple[int, Any]:
    """The validated instance and the fence column of a fenced SQL write."""
    number = require_fence(instance)
    if not key:
        raise InvalidArgument("key", "must name at least one column")
    try:
        return number, table.c[fence_column]
    except KeyError:
        raise InvalidArgument(
            "fence_column", f"table {table.name!r} has no column {fence_column!r}"
        ) from None


def fenced_update(
    conn: Any,
    table: Any,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    instance: int,
    *,
    fence_column: str = DEFAULT_FENCE_COLUMN,
) -> bool:
    """Update the row ``key`` only if its fence is below ``instance``; store ``instance``.

    One statement: ``UPDATE table SET <values>, fence = :instance WHERE <key> AND fence <
    :instance``. A stale copy's update matches no row. The row must exist (see
    :func:`fenced_upsert` to create it).

    Args:
        conn: a SQLAlchemy ``Connection`` (the caller owns the transaction).
        table: the SQLAlchemy ``Table``.
        key: column -> value identifying the row.
        values: column -> new value.
        instance: the writer's fencing number (``self.request.claim.instance``).
        fence_column: the column holding the fence.

    Returns:
        True if the row was written, False if a newer (or the same) instance wrote it
        already, or no row has that key.

    Raises:
        InvalidArgument: no key, a bad instance, or an unknown fence column.
    """
    from sqlalchemy import and_, update  # the [sql] extra: imported on first use

    number, fence = _checked(table, key, instance, fence_column)
    where = and_(*(table.c[column] == value for column, value in key.items()), fence < number)
    stmt = update(table).where(where).values({**values, fence_column: number})
    return int(conn.execute(stmt).rowcount) > 0


def fenced_upsert(
    conn: Any,
    table: Any,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    instance: int,
    *,
    fence_column: str = DEFAULT_FENCE_COLUMN,
) -> bool:
    """Insert the row, or update it only if its fence is below ``instance`` (PostgreSQL, SQLite).

    One statement: ``INSERT ... ON CONFLICT (<key>) DO UPDATE SET ... WHERE table.fence <
    excluded.fence``. ``key`` must be the columns of a primary key or unique constraint.

    Returns:
        True if the row was inserted or updated, False if a newer (or the same) instance
        wrote it already.

    Raises:
        InvalidArgument: no key, a bad instance, an unknown fence column, or a database other
            than PostgreSQL and SQLite.
    """
    number, fence = _checked(table, key, instance, fence_column)
    dialect = conn.dialect.name
    insert: Any  # the [sql] extra, imported on first use: each dialect has its own insert
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise InvalidArgument(
            "conn",
            f"fenced_upsert supports PostgreSQL and SQLite, not {dialect}; "
            "use fenced_update on an existing row",
        )
    stmt = insert(table).values({**key, **values, fence_column: number})
    stmt = stmt.on_conflict_do_update(
        index_elements=list(key),
        set_={**values, fence_column: stmt.excluded[fence_column]},
        where=fence < stmt.excluded[fence_column],
    ).returning(fence)
    # RETURNING, not rowcount: drivers report -1 for an INSERT ... ON CONFLICT (psycopg 3)
    return conn.execute(stmt).first() is not None


# --- Redis ------------------------------------------------------------------------------------

_source: list[str] = []


def _fence_script(client: Any) -> Any:
    # registering only hashes the source locally (no round trip) and keeps no reference to
    # the client beyond this call; redis-py's Script loads it on NOSCRIPT (after SCRIPT FLUSH)
    if not _source:
        _source.append(
            (resources.files("celery_claims.claims") / "lua" / "fence_set.lua").read_text()
        )
    return client.register_script(_source[0])


def fenced_set(client: Any, key: str, value: str | bytes, instance: int) -> bool:
    """Set ``key`` to ``value`` only if its stored fence is below ``instance`` (one round trip).

    ``key`` holds a hash ``{fence, value}``: read it with :func:`fenced_get`. Works on Redis
    Cluster (one key).

    Args:
        client: a ``redis.Redis`` or ``redis.RedisCluster``.
        key: the guarded key.
        value: the new value.
        instance: the writer's fencing number.

    Returns:
        True if written, False if a newer (or the same) instance wrote it already.

    Raises:
        InvalidArgument: a bad instance.
    """
    number = require_fence(instance)
    reply = _fence_script(client)(keys=[key], args=[str(number), value])
    return int(reply[0]) == 1


def fenced_get(client: Any, key: str) -> tuple[bytes | str, int] | None:
    """The value and fence :func:`fenced_set` stored at ``key``, or None."""
    value, fence = client.hmget(key, ["value", "fence"])
    if fence is None:
        return None
    return value, int(fence)
