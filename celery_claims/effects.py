"""Exactly-once effects: a task's write and a per-attempt marker, committed together.

The fencing helpers (:mod:`celery_claims.fencing`) refuse a stale write that comes *after* a
newer one, not a stale write that lands *first*. The guard here is the idempotent-consumer
pattern: the write and a marker named after the task attempt are committed atomically, and a
later copy of the same attempt finds the marker and skips its write, whichever copy came first.

- SQL (SQLAlchemy Core, PostgreSQL and SQLite): :func:`apply_once` inserts the marker row and
  calls the caller's ``write(conn)`` inside one SAVEPOINT of the caller's transaction;
  :func:`applied` reads the marker; :func:`effects_table` declares the marker table.
- Redis: :func:`apply_once_redis` runs the marker check, a list of allowed write commands and
  the marker's ``SET`` in one Lua script.

:func:`effect_key` names the marker of a task attempt: ``<queue_id>/<task_id>``, where the task
id is ``<celery id>:<retries>:<nesting>``. SQLAlchemy is imported only when an SQL function is
called (it is the ``[sql]`` extra). This module imports neither Celery nor kombu.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.crc import key_slot

from celery_claims.claims.calls import translate_errors
from celery_claims.errors import BackendError, BackendUnavailable, InvalidArgument
from celery_claims.model import ClaimToken
from celery_claims.validation import (
    require_fence,
    require_id,
    require_ms,
    require_sequence,
    require_token,
)

if TYPE_CHECKING:
    import sqlalchemy

__all__ = [
    "DEFAULT_EFFECTS_TABLE",
    "MAX_EFFECT_KEY_CHARS",
    "REDIS_EFFECT_COMMANDS",
    "applied",
    "apply_once",
    "apply_once_redis",
    "effect_key",
    "effects_table",
]

T = TypeVar("T")

#: Name of the marker table :func:`apply_once` and :func:`applied` use unless told otherwise.
DEFAULT_EFFECTS_TABLE = "claims_effects"

#: Longest marker key, in characters: the width of the marker table's key column.
MAX_EFFECT_KEY_CHARS = 512

#: Longest marker TTL :func:`apply_once_redis` accepts: ten years (a marker outlives redelivery).
MAX_MARKER_TTL_MS = 10 * 365 * 24 * 3600 * 1000

#: Most ops one :func:`apply_once_redis` call runs, and most arguments one op takes (Lua
#: ``unpack`` has a stack limit near 8000).
MAX_OPS = 1000
MAX_OP_ARGS = 1000

#: The write commands :func:`apply_once_redis` runs: the arguments after the key, as a pattern
#: (``value``: str, bytes or int; ``int``: an int64; ``score``: a finite int or float) and
#: whether the pattern repeats (``HSET key f1 v1 f2 v2``). Every other command is refused.
REDIS_EFFECT_COMMANDS: Mapping[str, tuple[tuple[str, ...], bool]] = {
    "SET": (("value",), False),
    "DEL": ((), False),
    "INCRBY": (("int",), False),
    "HINCRBY": (("value", "int"), False),
    "HSET": (("value", "value"), True),
    "RPUSH": (("value",), True),
    "SADD": (("value",), True),
    "ZADD": (("score", "value"), True),
}

_INT64 = 2**63


# --- names and arguments ----------------------------------------------------------------------


def _key(name: str, value: object) -> str:
    key = require_id(name, value)
    if len(key) > MAX_EFFECT_KEY_CHARS:
        raise InvalidArgument(
            name, f"is {len(key)} characters long; the limit is {MAX_EFFECT_KEY_CHARS}"
        )
    return key


def effect_key(claim: ClaimToken) -> str:
    """The marker key of one task attempt: ``<queue_id>/<task_id>``.

    In a Celery task, ``effect_key(self.request.claim)``: the task id is already
    ``<celery id>:<retries>:<nesting>``, so a retry (a new attempt) gets a new key while a
    redelivered copy of the same attempt gets the same one. ``%`` and ``/`` in the queue id
    are escaped (``%25``, ``%2F``), so two different (queue, task) pairs never share a key.

    Args:
        claim: the attempt's claim, a :class:`~celery_claims.fencing.TaskClaim` or
            :class:`~celery_claims.ClaimToken`.

    Returns:
        The key, at most :data:`MAX_EFFECT_KEY_CHARS` characters.

    Raises:
        InvalidArgument: not a claim, a malformed one, or a key that would be too long.
    """
    if not isinstance(claim, ClaimToken):
        raise InvalidArgument("claim", f"must be a TaskClaim or ClaimToken, got {claim!r:.80}")
    require_token(claim)
    queue = claim.queue_id.replace("%", "%25").replace("/", "%2F")
    return _key("claim", f"{queue}/{claim.task_id}")


# --- SQL (SQLAlchemy Core) --------------------------------------------------------------------


def effects_table(
    metadata: sqlalchemy.MetaData, name: str = DEFAULT_EFFECTS_TABLE
) -> sqlalchemy.Table:
    """Declare the marker table in ``metadata`` (add it to your own migrations).

    Columns: ``key`` VARCHAR(512) primary key, ``instance`` BIGINT not null (the fencing
    number of the copy that applied the effect), ``applied_at`` timestamp with time zone
    (server default ``now()``). Markers are never deleted by celery-claims: delete old rows
    (by ``applied_at``) once no copy of their task can still arrive.

    Args:
        metadata: the ``MetaData`` the table belongs to (its schema, if any, applies).
        name: the table's name.

    Returns:
        The table; the one already declared in ``metadata`` under that name, if any.

    Raises:
        InvalidArgument: ``metadata`` is not a ``MetaData``, a bad name, or a table of that
            name without the marker columns already declared in ``metadata``.
    """
    import sqlalchemy as sa  # the [sql] extra: imported on first use

    if not isinstance(metadata, sa.MetaData):
        raise InvalidArgument("metadata", f"must be a sqlalchemy MetaData, got {metadata!r:.80}")
    require_id("name", name)
    existing = metadata.tables.get(name if metadata.schema is None else f"{metadata.schema}.{name}")
    if existing is not None:
        return _marker_table(existing)
    return sa.Table(
        name,
        metadata,
        sa.Column("key", sa.String(MAX_EFFECT_KEY_CHARS), primary_key=True),
        sa.Column("instance", sa.BigInteger, nullable=False),
        sa.Column(
            "applied_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )


@cache
def _named_table(name: str) -> sqlalchemy.Table:
    import sqlalchemy as sa  # the [sql] extra: imported on first use

    return effects_table(sa.MetaData(), name)


def _marker_table(table: object) -> sqlalchemy.Table:
    """The marker table: a ``Table`` with ``key`` and ``instance`` columns, or its name."""
    import sqlalchemy as sa  # the [sql] extra: imported on first use

    if isinstance(table, str):
        require_id("table", table)
        return _named_table(table)
    if not isinstance(table, sa.Table):
        raise InvalidArgument("table", f"must be a table name or Table, got {table!r:.80}")
    missing = sorted({"key", "instance"} - set(table.c.keys()))
    if missing:
        raise InvalidArgument("table", f"{table.name!r} has no column {', '.join(missing)}")
    return table


def _connection(conn: object) -> sqlalchemy.Connection:
    import sqlalchemy as sa  # the [sql] extra: imported on first use

    if not isinstance(conn, sa.Connection):
        raise InvalidArgument("conn", f"must be a SQLAlchemy Connection, got {conn!r:.80}")
    if conn.dialect.name not in ("postgresql", "sqlite"):
        raise InvalidArgument(
            "conn", f"apply_once supports PostgreSQL and SQLite, not {conn.dialect.name}"
        )
    return conn


def _open_sqlite_transaction(conn: sqlalchemy.Connection) -> None:
    """Make sure SQLite is inside a transaction before the SAVEPOINT.

    pysqlite (in its default, legacy mode) sends no ``BEGIN`` before a ``SAVEPOINT``; SQLite then
    opens the transaction at the savepoint, and releasing it commits the marker at once, before
    the caller's transaction ends (measured: a caller rollback kept the marker). sqlite3 reads
    the real state (``sqlite3_get_autocommit``) on commit and rollback, so an explicit ``BEGIN``
    is then committed or rolled back with the caller's transaction.
    """
    if conn.dialect.name != "sqlite":
        return
    raw = conn.connection.dbapi_connection
    if raw is not None and not getattr(raw, "in_transaction", True):
        conn.exec_driver_sql("BEGIN")


def _translated(exc: Exception, operation: str) -> BackendError:
    """A database error of a marker statement, as the package's error (the cause kept)."""
    invalidated = bool(getattr(exc, "connection_invalidated", False))
    error = BackendUnavailable if invalidated else BackendError
    return error(f"effects: {operation} failed: {exc}")


def _insert_marker(
    conn: sqlalchemy.Connection, markers: sqlalchemy.Table, marker: str, number: int
) -> Any:
    """``INSERT`` the marker ``ON CONFLICT (key) DO NOTHING RETURNING key`` (conn's dialect)."""
    # the [sql] extra, imported on first use; each dialect spells ON CONFLICT in its own insert
    insert: Any
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return (
        insert(markers)
        .values(key=marker, instance=number)
        .on_conflict_do_nothing(index_elements=[markers.c.key])
        .returning(markers.c.key)
    )


def apply_once(
    conn: sqlalchemy.Connection,
    key: str,
    write: Callable[[sqlalchemy.Connection], T],
    *,
    instance: int = 0,
    table: str | sqlalchemy.Table = DEFAULT_EFFECTS_TABLE,
) -> tuple[bool, T | None]:
    """Run ``write(conn)`` only if no copy applied the effect ``key`` yet, atomically with it.

    The caller owns the transaction (as with :func:`~celery_claims.fencing.fenced_update`):
    open it with ``with engine.begin() as conn:``; the marker and the write commit or roll back
    with it. Inside, ``apply_once`` opens a SAVEPOINT, inserts the marker (``INSERT ... ON
    CONFLICT (key) DO NOTHING``) and, only if the row was inserted, calls ``write(conn)``. If
    ``write`` raises, the savepoint is rolled back (marker included) and the error propagates,
    so a retry can apply the effect, even if the caller catches the error and commits.

    Two copies racing on PostgreSQL (READ COMMITTED): the second ``INSERT`` waits for the
    first's uncommitted marker; if the first commits, the second skips; if it rolls back, the
    second applies. Under REPEATABLE READ or SERIALIZABLE the second raises a serialization
    failure instead (as :class:`BackendError`): retry the transaction, it will then skip.

    Args:
        conn: a SQLAlchemy ``Connection`` inside the caller's transaction; ``write`` must not
            commit or roll it back.
        key: the effect's marker, usually ``effect_key(self.request.claim)``.
        write: the effect; called with ``conn`` at most once, and never if already applied.
        instance: the fencing number stored with the marker (``self.request.claim.instance``).
        table: the marker table (see :func:`effects_table`), or its name in the default schema.

    Returns:
        ``(True, write's result)`` if this call applied the effect; ``(False, None)`` if a
        copy had applied it already (``write`` not called).

    Raises:
        InvalidArgument: a bad connection, key, write, instance or table (nothing executed).
        BackendError: the marker statement failed (e.g. the table does not exist); nothing
            was written. Errors raised by ``write`` propagate unchanged.
    """
    import sqlalchemy as sa  # the [sql] extra: imported on first use

    connection = _connection(conn)
    marker = _key("key", key)
    if not callable(write):
        raise InvalidArgument("write", f"must be callable, got {write!r:.80}")
    number = require_fence(instance)
    stmt = _insert_marker(connection, _marker_table(table), marker, number)
    _open_sqlite_transaction(connection)
    with connection.begin_nested():
        try:
            # RETURNING, not rowcount: drivers report -1 for INSERT ... ON CONFLICT (psycopg 3)
            inserted = connection.execute(stmt).first() is not None
        except sa.exc.DBAPIError as exc:
            raise _translated(exc, f"marking {marker!r}") from exc
        if not inserted:
            return False, None
        return True, write(connection)


def applied(
    conn: sqlalchemy.Connection, key: str, *, table: str | sqlalchemy.Table = DEFAULT_EFFECTS_TABLE
) -> bool:
    """Whether the effect ``key`` was applied (its marker is committed, or in this transaction).

    Args:
        conn: a SQLAlchemy ``Connection``.
        key: the effect's marker.
        table: the marker table, or its name in the default schema.

    Raises:
        InvalidArgument: a bad connection, key or table.
        BackendError: the read failed (e.g. the table does not exist).
    """
    import sqlalchemy as sa  # the [sql] extra: imported on first use

    connection = _connection(conn)
    marker = _key("key", key)
    markers = _marker_table(table)
    try:
        row = connection.execute(sa.select(markers.c.key).where(markers.c.key == marker)).first()
    except sa.exc.DBAPIError as exc:
        raise _translated(exc, f"reading {marker!r}") from exc
    return row is not None


# --- Redis ------------------------------------------------------------------------------------


@cache
def _effect_source() -> str:
    return (resources.files("celery_claims.claims") / "lua" / "effect_apply.lua").read_text("utf-8")


def _argument(where: str, kind: str, value: object) -> str | bytes:
    """One op argument as sent to Redis, checked against its kind in the command's pattern."""
    if isinstance(value, bool):
        raise InvalidArgument(where, "must not be a bool")
    if kind == "int":
        if not isinstance(value, int) or not -_INT64 <= value < _INT64:
            raise InvalidArgument(where, f"must be an int64, got {value!r:.80}")
        return str(value)
    if kind == "score":
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(where, f"must be a finite int or float, got {value!r:.80}")
        return repr(value)
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, int):
        return str(value)
    raise InvalidArgument(where, f"must be a str, bytes or int, got {type(value).__name__}")


def _op(index: int, op: object) -> tuple[str, str, list[str | bytes]]:
    """An op as (command, key, arguments), or :class:`InvalidArgument`."""
    where = f"ops[{index}]"
    if not isinstance(op, tuple) or len(op) < 2 or not isinstance(op[0], str):
        raise InvalidArgument(where, f"must be a tuple (COMMAND, key, ...), got {op!r:.80}")
    command = op[0].upper()
    if command not in REDIS_EFFECT_COMMANDS:
        allowed = ", ".join(REDIS_EFFECT_COMMANDS)
        raise InvalidArgument(where, f"{op[0]!r} is not one of {allowed}")
    key = require_id(f"{where} key", op[1])
    pattern, repeats = REDIS_EFFECT_COMMANDS[command]
    args = op[2:]
    width = len(pattern)
    arity_ok = (
        len(args) == width
        if not repeats
        else len(args) >= width and len(args) % width == 0 and len(args) <= MAX_OP_ARGS
    )
    if not arity_ok:
        shape = " ".join(pattern) + (" [...]" if repeats else "")
        raise InvalidArgument(where, f"{command} takes key {shape}, got {len(args)} arguments")
    values = [
        _argument(f"{where}[{2 + i}]", pattern[i % width], value) for i, value in enumerate(args)
    ]
    return command, key, values


def _effect_result(reply: Any, ops: Sequence[tuple[str, str, list[str | bytes]]]) -> bool:
    """Map the script's reply to the result or an error (the one place codes are read)."""
    code = int(reply[0])
    if code == 1:
        return True
    if code == 0:
        return False
    if code in (2, 3, 4):
        index = int(reply[1]) - 1
        command, key = ops[index][:2]
        reason = {
            2: f"{key!r} holds another type than {command} writes",
            3: f"{command} on {key!r} meets a value that is not an integer or could overflow",
            4: f"{command} is not allowed by the script",
        }[code]
        raise InvalidArgument(f"ops[{index}]", f"{reason}; nothing was written")
    raise BackendError(f"effects: unknown status from the effect script: {reply!r}")


def _ops(ops: object) -> list[tuple[str, str, list[str | bytes]]]:
    """``ops`` checked, each as (command, key, arguments): 1 to :data:`MAX_OPS` of them."""
    given = require_sequence("ops", ops, "tuples")  # untyped callers may pass anything
    if not 1 <= len(given) <= MAX_OPS:
        raise InvalidArgument("ops", f"must hold 1 to {MAX_OPS} ops, got {len(given)}")
    return [_op(index, op) for index, op in enumerate(given)]


def _effect_keys(
    client: redis.Redis | redis.RedisCluster,
    marker: str,
    ops: Sequence[tuple[str, str, list[str | bytes]]],
) -> list[str]:
    """The script's KEYS: the marker, then each op's key; one hash slot on Redis Cluster."""
    keys = [marker, *(key for _, key, _ in ops)]
    if marker in keys[1:]:
        raise InvalidArgument("ops", f"an op writes the marker key {marker!r}")
    if isinstance(client, redis.RedisCluster):
        slots = {key_slot(key.encode("utf-8")) for key in keys}
        if len(slots) > 1:
            raise InvalidArgument(
                "ops", "the marker and every written key must share a hash slot on Redis Cluster"
            )
    return keys


def apply_once_redis(
    client: redis.Redis | redis.RedisCluster,
    marker_key: str,
    ops: Sequence[tuple[Any, ...]],
    *,
    ttl_ms: int | None = None,
    instance: int = 0,
) -> bool:
    """Run ``ops`` and set ``marker_key``, unless the marker exists: one Lua script, atomic.

    ``ops`` are write commands from :data:`REDIS_EFFECT_COMMANDS`, e.g. ``("SET", key, value)``,
    ``("HSET", key, field, value)``, ``("INCRBY", key, n)``, ``("HINCRBY", key, field, n)``,
    ``("RPUSH", key, v, ...)``, ``("SADD", key, m, ...)``, ``("ZADD", key, score, m, ...)``,
    ``("DEL", key)``. The script checks every op against the keys' current types and values
    before the first write, so an op Redis would refuse (a key of another type, an increment
    of a non-integer or one that could overflow) writes nothing, marker included. On Redis
    Cluster the marker and every written key must share a hash slot: give them one hash tag,
    e.g. ``{invoice:42}:effect:<effect_key>`` next to ``{invoice:42}:total``.

    Args:
        client: a ``redis.Redis`` or ``redis.RedisCluster``.
        marker_key: the effect's marker key (build it from :func:`effect_key`).
        ops: the writes, in order; at least one, at most :data:`MAX_OPS`.
        ttl_ms: how long the marker lives, in ms (None: until deleted). It must outlive every
            copy of the task that can still arrive.
        instance: the fencing number stored as the marker's value.

    Returns:
        True if this call ran the ops; False if the marker existed (nothing written).

    Raises:
        InvalidArgument: a bad client, marker key, op, TTL or instance, keys in several hash
            slots on Cluster, or an op the keys' current contents would make fail (nothing
            written in every case).
        BackendUnavailable: Redis could not be reached.
        BackendError: Redis answered with an unexpected error.
    """
    if not isinstance(client, (redis.Redis, redis.RedisCluster)):
        raise InvalidArgument("client", f"must be a redis-py client, got {client!r:.80}")
    marker = _key("marker_key", marker_key)
    checked = _ops(ops)
    if ttl_ms is not None:
        require_ms("ttl_ms", ttl_ms, maximum=MAX_MARKER_TTL_MS)
        if ttl_ms == 0:
            raise InvalidArgument("ttl_ms", "must be positive (or None: no expiry)")
    number = require_fence(instance)
    keys = _effect_keys(client, marker, checked)
    args: list[str | bytes] = [str(number), "" if ttl_ms is None else str(ttl_ms)]
    for command, _, values in checked:
        args.extend([command, str(len(values)), *values])
    # registering only hashes the source locally; redis-py's Script reloads it on NOSCRIPT
    script = client.register_script(_effect_source())
    with translate_errors():
        reply = script(keys=keys, args=args)
    return _effect_result(reply, checked)
