"""Lane store fixtures: one harness per store, and the session's PostgreSQL schema.

Every contract test takes the ``harness`` fixture, parametrized over the memory store, the Redis
store (bytes and decoded replies), the same store on Valkey, the Redis Cluster store, PostgreSQL
and SQLite. A harness
builds the store for the test's lanes, dumps its whole state for before/after comparisons, and
can force a task's token (the only way to reach a token like ``2**63 - 1`` in a test).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_claims.lanes import MemoryTaskClaimStore, TaskLaneConfig
from celery_claims.lanes.keys import member
from celery_claims.lanes.redis import RedisTaskClaimStore, decode_record, encode_record
from celery_claims.lanes.sql import SqlTaskClaimStore
from tests.servers import RedisClusterNodes, RedisServer, missing_service

#: A fixed, far-future base time: tests never depend on the wall clock.
T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)

#: The lane most tests claim for, and a second lane to show lanes do not mix.
MAIL = TaskLaneConfig(lane="mail", kinds=("send_email", "send_sms"), limit=2)
REPORTS = TaskLaneConfig(lane="reports", kinds=("render",), limit=1)
LANES = (MAIL, REPORTS)

#: Where the machine's PostgreSQL is (trust auth); override with CLAIMS_POSTGRES_URL.
POSTGRES_URLS = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)


def lane_of(kind: str) -> str:
    """The ``task_lane`` of the test lanes."""
    for config in LANES:
        if kind in config.kinds:
            return str(config.lane)
    raise KeyError(kind)


@dataclasses.dataclass
class Harness:
    """A store under test plus the backdoors a contract test needs."""

    name: str
    store: Any
    snapshot: Callable[[], object]
    force_token: Callable[[int, int], None]


def memory_harness(lanes: tuple[TaskLaneConfig[Any, Any], ...]) -> Harness:
    store: MemoryTaskClaimStore[Any, Any] = MemoryTaskClaimStore(lanes=lanes)

    def force_token(task_id: int, token: int) -> None:
        # Test backdoor: the memory store has no public way to set a token.
        with store._lock:
            task = store._tasks[task_id]
            store._tasks[task_id] = dataclasses.replace(task, processing_token=token)

    return Harness("memory", store, store.snapshot, force_token)


def redis_dump(client: Any, prefix: str) -> dict[bytes, bytes]:
    """Every key under ``prefix`` with its ``DUMP`` (type, encoding and content, byte for byte)."""
    keys = sorted(
        key if isinstance(key, bytes) else key.encode()
        for key in client.scan_iter(match=f"{prefix}:*", count=1000)
    )
    return {key: client.dump(key) for key in keys}


def redis_harness(name: str, client: Any, lanes: tuple[TaskLaneConfig[Any, Any], ...]) -> Harness:
    prefix = f"t{uuid.uuid4().hex[:12]}"
    store = RedisTaskClaimStore(client=client, lanes=lanes, prefix=prefix)
    raw_client = client

    def force_token(task_id: int, token: int) -> None:
        located = store._locate(task_id)
        assert located is not None
        keys, _ = located
        record = decode_record(member(task_id), raw_client.hget(keys.tasks, member(task_id)))
        record = dataclasses.replace(record, processing_token=token)
        raw_client.hset(keys.tasks, member(task_id), encode_record(record))

    return Harness(name, store, lambda: redis_dump(raw_client, prefix), force_token)


def sql_harness(
    name: str, engine: sa.Engine, schema: str | None, lanes: tuple[TaskLaneConfig[Any, Any], ...]
) -> Harness:
    store = SqlTaskClaimStore(
        engine=engine, lanes=lanes, table_prefix=f"t{uuid.uuid4().hex[:10]}_", schema=schema
    )
    store.create_tables()

    def snapshot() -> object:
        with engine.connect() as conn:
            tasks = conn.execute(sa.select(store.tasks).order_by(store.tasks.c.id)).all()
            locks = conn.execute(sa.select(store.locks).order_by(store.locks.c.lock_key)).all()
        return [tuple(row) for row in tasks], [tuple(row) for row in locks]

    def force_token(task_id: int, token: int) -> None:
        with engine.begin() as conn:
            conn.execute(
                sa.update(store.tasks)
                .where(store.tasks.c.id == task_id)
                .values(processing_token=token)
            )

    return Harness(name, store, snapshot, force_token)


# --- PostgreSQL ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Postgres:
    """The session's PostgreSQL: a URL and a private schema dropped at the end."""

    url: str
    schema: str
    engine: sa.Engine


def _connectable_postgres_url() -> str | None:
    candidates = [os.environ["CLAIMS_POSTGRES_URL"]] if "CLAIMS_POSTGRES_URL" in os.environ else []
    candidates.extend(POSTGRES_URLS)
    for url in candidates:
        engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            return url
        except sa.exc.OperationalError:
            continue
        finally:
            engine.dispose()
    return None


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A private schema in the machine's PostgreSQL; fails under CI when PostgreSQL is absent."""
    url = _connectable_postgres_url()
    if url is None:
        missing_service("PostgreSQL at 127.0.0.1:5432 (database test)")
    assert url is not None
    schema = f"lanes_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(url, pool_size=8, max_overflow=8)
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield Postgres(url, schema, engine)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


# --- the store parametrization ---------------------------------------------------------------

STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", id="redis"),
    pytest.param("redis-decoded", id="redis-decoded"),
    pytest.param("valkey", id="valkey", marks=pytest.mark.valkey),
    pytest.param("redis-cluster", id="redis-cluster", marks=pytest.mark.cluster),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("sqlite", id="sqlite"),
]


@pytest.fixture
def make_harness(
    request: pytest.FixtureRequest, tmp_path: Any
) -> Iterator[Callable[[str, tuple[TaskLaneConfig[Any, Any], ...]], Harness]]:
    """Build a harness of a given store kind for given lanes (cleaned up after the test)."""
    cleanups: list[Callable[[], None]] = []

    def make(kind: str, lanes: tuple[TaskLaneConfig[Any, Any], ...] = LANES) -> Harness:
        if kind == "memory":
            return memory_harness(lanes)
        if kind in ("redis", "redis-decoded", "valkey"):
            server: RedisServer = request.getfixturevalue(
                "valkey_server" if kind == "valkey" else "redis_server"
            )
            client = server.client(decode_responses=kind == "redis-decoded")
            cleanups.append(client.close)
            return redis_harness(kind, client, lanes)
        if kind == "redis-cluster":
            nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")
            cluster = nodes.client()
            cleanups.append(cluster.close)
            return redis_harness(kind, cluster, lanes)
        if kind == "postgres":
            pg: Postgres = request.getfixturevalue("postgres")
            harness = sql_harness(kind, pg.engine, pg.schema, lanes)
            cleanups.append(harness.store.drop_tables)
            return harness
        if kind == "sqlite":
            engine = sa.create_engine(f"sqlite:///{tmp_path / f'lanes-{uuid.uuid4().hex}.db'}")
            cleanups.append(engine.dispose)
            return sql_harness(kind, engine, None, lanes)
        raise ValueError(kind)

    try:
        yield make
    finally:
        for cleanup in reversed(cleanups):
            cleanup()


@pytest.fixture(params=STORES)
def harness(
    request: pytest.FixtureRequest,
    make_harness: Callable[[str, tuple[TaskLaneConfig[Any, Any], ...]], Harness],
) -> Harness:
    """The store under test, for the two test lanes."""
    return make_harness(request.param, LANES)


def as_json(value: object) -> str:
    """A stable text form of a snapshot, for readable assertion diffs."""
    return json.dumps(value, default=repr, sort_keys=True)


@pytest.fixture
def plain_redis(store_server: RedisServer) -> Iterator[redis.Redis]:
    """A bytes client of the test's private server (the Redis unless the test is parametrized
    over ``SERVERS``; not flushed: tests use unique prefixes)."""
    client = store_server.client()
    try:
        yield client
    finally:
        client.close()
