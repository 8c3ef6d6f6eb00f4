"""Benchmark: lane claims per second on Redis and PostgreSQL, against a peer in the same run.

Run it as ``python bench/lanes.py``. It starts its own ``redis-server`` on a free port and uses
the machine's PostgreSQL (``CLAIMS_POSTGRES_URL``, default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``) in a private schema it drops at the end.
Bounded to well under a minute.

What is measured: ``claim_candidates_for_lane`` with batches of 1, 10 and 100 due candidates
(every candidate claimable, the lane never full), as claimed tasks per second. The peers:

- Redis: a minimal one-key compare-and-swap Lua script (``GET`` == expected -> ``SET``), one
  task per round trip: the cheapest possible atomic claim of one task on the same server.
- PostgreSQL: a plain single-row ``UPDATE ... WHERE id = :id AND token = :expected``, one task
  per transaction: the cheapest possible atomic claim of one row on the same database.

It also counts the commands Redis received per batch (``INFO commandstats``), to show that a
batch of any size is one ``EVALSHA``: one round trip.

Keyed lanes (``--keyed-only`` runs just this part): a pass of a keyed lane (``limit_per_key``,
which also reads the key of every live lease) against a pass of a plain lane, interleaved in
the same run, on a lane holding 16 live leases: a pass of 4 candidates that claims one (its
one free slot; then given back with ``retry``, timed too), and a re-check of a full lane / of
keys at their limit that claims nothing. The plain pass is the reference (1.00).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import sqlalchemy as sa

from celery_claims.lanes import TaskClaimCandidate, TaskClaimStore, TaskLaneConfig
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.lanes.sql import SqlTaskClaimStore

#: Batch sizes, as the issue asks.
BATCHES = (1, 10, 100)
#: Tasks claimed per (store, batch size) measurement.
REDIS_TASKS = 4000
POSTGRES_TASKS = {1: 600, 10: 2000, 100: 4000}
#: Single-task peer operations per measurement.
REDIS_PEER_OPS = 4000
POSTGRES_PEER_OPS = 600
#: Each figure is the median of this many runs, each on fresh data.
REPEATS = 3
#: Runs of each keyed comparison (odd: a median; alternating which kind goes first).
KEYED_REPEATS = 5
#: A lane limit the benchmark never reaches, so every candidate is claimed.
UNBOUNDED = 10**9
POSTGRES_URL = os.environ.get(
    "CLAIMS_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)

CAS_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

T0 = datetime.now(timezone.utc) - timedelta(seconds=5)
LEASE = T0 + timedelta(hours=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def private_redis() -> Iterator[int]:
    """A ``redis-server`` of our own on a free port, stopped by its pid."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="bench-lanes-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=port).ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


#: The benchmark's lane.
LANE = TaskLaneConfig(lane="bench", kinds=("job",), limit=UNBOUNDED)


def claim_rate(store: TaskClaimStore[Any, str, str], tasks: int, batch: int) -> float:
    """Claimed tasks per second for ``tasks`` due tasks claimed ``batch`` at a time."""
    lane = LANE
    batches = [
        [TaskClaimCandidate(i, task_id, 0, 1) for i, task_id in enumerate(range(s, s + batch))]
        for s in range(0, tasks, batch)
    ]
    claim = store.claim_candidates_for_lane
    started = time.perf_counter()
    claimed = 0
    for candidates in batches:
        claimed += len(claim(lane, candidates, T0, T0, LEASE))
    elapsed = time.perf_counter() - started
    if claimed != tasks:
        raise SystemExit(f"claimed {claimed} of {tasks} tasks")
    return claimed / elapsed


def median(rates: list[float]) -> float:
    return sorted(rates)[len(rates) // 2]


def ops_rate(operation: Callable[[int], object], count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        operation(i)
    return count / (time.perf_counter() - started)


def commands_per_batch(client: redis.Redis, store: RedisTaskClaimStore, batch: int) -> str:
    """The top-level commands Redis received for one batch (script internals excluded)."""
    internal = {"hget", "hset", "zadd", "zrem", "zcount"}
    first = 10_000_000
    for task_id in range(first, first + batch):
        store.enqueue(task_id, "job", next_run_at=T0)
    candidates = [TaskClaimCandidate(i, first + i, 0, 1) for i in range(batch)]

    def calls() -> dict[str, int]:
        stats = client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    before = calls()
    store.claim_candidates_for_lane(LANE, candidates, T0, T0, LEASE)
    after = calls()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    delta["info"] -= 1  # our own INFO
    sent = {k: n for k, n in delta.items() if n and k not in internal}
    return ", ".join(f"{n} {k.upper()}" for k, n in sorted(sent.items()))


def bench_redis(rows: list[tuple[str, ...]]) -> None:
    with private_redis() as port:
        client = redis.Redis(port=port)
        cas = client.register_script(CAS_LUA)
        cas(keys=["warm"], args=["0", "1"])  # load the script outside the timing
        peers: list[float] = []
        rates: dict[int, list[float]] = {batch: [] for batch in BATCHES}
        # Peer and lane runs are interleaved, so drift on a shared machine hits both alike.
        for rep in range(REPEATS):
            pipe = client.pipeline(transaction=False)
            for i in range(REDIS_PEER_OPS):
                pipe.set(f"peer:{rep}:{i}", "0")
            pipe.execute()
            peers.append(
                ops_rate(
                    lambda i, r=rep: cas(keys=[f"peer:{r}:{i}"], args=["0", "1"]), REDIS_PEER_OPS
                )
            )
            for batch in BATCHES:
                store = RedisTaskClaimStore(client=client, lanes=[LANE], prefix=f"b{batch}.{rep}")
                for task_id in range(REDIS_TASKS):
                    store.enqueue(task_id, "job", next_run_at=T0)
                rates[batch].append(claim_rate(store, REDIS_TASKS, batch))
        peer = median(peers)
        rows.append(("redis", "peer: 1-key Lua CAS", "1", f"{peer:,.0f}", "1.00", "1 EVALSHA"))
        for batch in BATCHES:
            rate = median(rates[batch])
            store = RedisTaskClaimStore(client=client, lanes=[LANE], prefix=f"count{batch}")
            sent = commands_per_batch(client, store, batch)
            rows.append(
                ("redis", "lane claim", str(batch), f"{rate:,.0f}", f"{rate / peer:.2f}", sent)
            )
        client.close()


def bench_postgres(rows: list[tuple[str, ...]]) -> None:
    engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        rows.append(("postgres", f"skipped: {exc.orig}", "", "", "", ""))
        return
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        peer_table = sa.Table(
            "peer",
            sa.MetaData(schema=schema),
            sa.Column("id", sa.BigInteger, primary_key=True),
            sa.Column("token", sa.BigInteger, nullable=False),
        )
        peer_table.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(
                sa.insert(peer_table),
                [{"id": i, "token": 0} for i in range(REPEATS * POSTGRES_PEER_OPS)],
            )
        update = (
            sa.update(peer_table)
            .where(peer_table.c.id == sa.bindparam("key"), peer_table.c.token == 0)
            .values(token=1)
        )

        def peer_update(i: int) -> None:
            with engine.begin() as conn:
                conn.execute(update, {"key": i})

        peers: list[float] = []
        rates: dict[int, list[float]] = {batch: [] for batch in BATCHES}
        for rep in range(REPEATS):
            peers.append(
                ops_rate(lambda i, r=rep: peer_update(r * POSTGRES_PEER_OPS + i), POSTGRES_PEER_OPS)
            )
            for batch in BATCHES:
                tasks = POSTGRES_TASKS[batch]
                store = SqlTaskClaimStore(
                    engine=engine, lanes=[LANE], table_prefix=f"b{batch}_{rep}_", schema=schema
                )
                store.create_tables()
                with engine.begin() as conn:
                    conn.execute(
                        sa.insert(store.tasks),
                        [
                            {"id": i, "kind": "job", "status": "pending", "processing_token": 0,
                             "next_run_at": T0, "payload": ""}
                            for i in range(tasks)
                        ],
                    )  # fmt: skip
                rates[batch].append(claim_rate(store, tasks, batch))
        peer = median(peers)
        rows.append(("postgres", "peer: 1-row UPDATE", "1", f"{peer:,.0f}", "1.00", "1 txn"))
        for batch in BATCHES:
            rate = median(rates[batch])
            rows.append(
                ("postgres", "lane claim", str(batch), f"{rate:,.0f}", f"{rate / peer:.2f}",
                 f"1 txn: lock, check, count, {batch} UPDATE")
            )  # fmt: skip
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


#: The keyed pass scenario: a lane with this many live leases (one key each).
KEYED_LIVE = 16
#: Passes per measurement of the keyed comparison.
KEYED_PASSES = 3000


def pass_rate(store: RedisTaskClaimStore, keyed: bool, claims: bool, passes: int) -> float:
    """Lane passes per second on a lane with ``KEYED_LIVE`` live leases.

    ``claims``: each pass offers 4 candidates and claims one (a free key, then given back with
    ``retry``, timed too); else it offers 4 candidates of keys at their limit (plain: a full
    lane) and claims nothing, as a held message's re-check does.
    """
    # one slot free (claiming) or none (re-check), so both kinds of pass claim alike
    lane = TaskLaneConfig(lane="bench", kinds=("job",), limit=KEYED_LIVE + int(claims))
    live = [TaskClaimCandidate(i, 1 + i, 0, 1) for i in range(KEYED_LIVE)]
    held_keys = [f"'tenant-{i}'" for i in range(KEYED_LIVE)]
    store.claim_candidates_for_lane(
        lane, live, T0, T0, LEASE, **({"keys": held_keys, "limit_per_key": 1} if keyed else {})
    )
    first = 1 + KEYED_LIVE
    tokens = {first + i: 0 for i in range(4)}
    # a claiming pass: one free key first; a re-check: keys that are all at their limit
    keys = ["'tenant-free'", *held_keys[:3]] if claims else held_keys[:4]
    extra: dict[str, Any] = {"keys": keys, "limit_per_key": 1} if keyed else {}
    started = time.perf_counter()
    for _ in range(passes):
        candidates = [TaskClaimCandidate(i, t, n, n + 1) for i, (t, n) in enumerate(tokens.items())]
        claimed = store.claim_candidates_for_lane(lane, candidates, T0, T0, LEASE, **extra)
        if claims:
            (done,) = claimed
            tokens[done.task_id] = done.processing_token
            store.retry(done.task_id, done.processing_token, next_run_at=T0)
        elif claimed:
            raise SystemExit("a re-check pass claimed a slot")
    return passes / (time.perf_counter() - started)


def bench_keyed(rows: list[tuple[str, ...]]) -> None:
    """A keyed lane pass against a plain lane pass, interleaved in the same run."""
    with private_redis() as port:
        client = redis.Redis(port=port)
        passes = (
            (True, "pass claiming 1 of 4 + release", "1 EVALSHA + retry"),
            (False, "re-check, full", "1 EVALSHA"),
        )
        for claims, what, sent in passes:
            rates: dict[bool, list[float]] = {False: [], True: []}
            for rep in range(KEYED_REPEATS):
                # alternate which goes first, so drift on a shared machine hits both alike
                for keyed in (False, True) if rep % 2 == 0 else (True, False):
                    store = RedisTaskClaimStore(
                        client=client,
                        lanes=[LANE],
                        prefix=f"k{int(keyed)}{int(claims)}.{rep}",
                    )
                    for task_id in range(1, KEYED_LIVE + 5):
                        store.enqueue(task_id, "job", next_run_at=T0)
                    rates[keyed].append(pass_rate(store, keyed, claims, KEYED_PASSES))
            plain, keyed_rate = median(rates[False]), median(rates[True])
            rows.append(
                ("redis", f"plain lane {what} (passes/s)", "4", f"{plain:,.0f}", "1.00", sent)
            )
            rows.append(
                ("redis", f"keyed lane {what} (passes/s)", "4", f"{keyed_rate:,.0f}",
                 f"{keyed_rate / plain:.2f}", sent)
            )  # fmt: skip
        client.close()


def main() -> None:
    started = time.perf_counter()
    rows: list[tuple[str, ...]] = []
    if "--keyed-only" not in sys.argv[1:]:
        bench_redis(rows)
        bench_postgres(rows)
    bench_keyed(rows)
    header = ("store", "operation", "batch", "tasks/s", "vs peer", "per batch")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"\n(python {sys.version.split()[0]}, redis-py {redis.__version__}, "
          f"SQLAlchemy {sa.__version__}; {time.perf_counter() - started:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
