"""Redis memory per live claim and per completion record, on a private redis-server.

    python bench/memory.py [--records 100000] [--queue-sizes]

Claims ``N`` tasks with 36-character Celery task ids as the worker names them
(``<uuid>:<retries>:<nesting>``), by owners shaped like the worker's (``hostname/pid/nonce.n``,
one process), and reads ``used_memory`` before and after: the delta over ``N`` is the cost of
one live claim. Then it completes every claim with a 24 h retention and reads the delta again:
the cost of one completion record (the claims are gone by then). Nothing else runs on that
server, and the memory allocator's fragmentation is not in ``used_memory``, so the figure is
what the store's data itself costs. A second pass, on a fresh server state, reads the same
deltas as the sum of ``MEMORY USAGE`` (every field counted) of the queue's keys: the keys alone,
without the server's bookkeeping around them (a cross-check; a pass of its own because the
reads of the keys moved ``used_memory`` by a few bytes per entry).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the sibling benchmark's private server
from claims import private_redis

from celery_claims import RedisClaimManager
from celery_claims.claims.keys import QueueKeys

#: Lease of the measured claims (long enough that none expires while measuring).
LEASE_MS = 3_600_000
#: Completion record retention (the worker's default).
RETENTION_MS = 24 * 3600 * 1000
#: Owner of every claim: one worker process, one delivery each (as ``identity.new_owner``).
OWNER_HEAD = "celery@worker-7f9c8d6b5-x2k4q/12345/9f86d081"


def used_memory(client: redis.Redis) -> int:
    """``used_memory`` without the writers' connections: their query and reply buffers count
    in it (tens of KB after a pipeline), which would show as bytes per entry in a small run."""
    client.connection_pool.disconnect()
    return int(client.info("memory")["used_memory"])


def key_bytes(client: redis.Redis, queue: str) -> int:
    """``MEMORY USAGE`` of every key of ``queue`` (all fields counted: ``SAMPLES 0``)."""
    keys = client.scan_iter(match=f"{QueueKeys('claims', queue).tag}:*")
    return sum(int(client.memory_usage(key, samples=0) or 0) for key in keys)


def measure(
    port: int, records: int, queue: str = "celery", *, keys: bool = False
) -> tuple[float, float]:
    """Bytes per live claim and per completion record over ``records`` tasks in ``queue``:
    by ``used_memory``, or with ``keys`` by ``MEMORY USAGE`` of the queue's keys."""
    client = redis.Redis(port=port)

    def used(client: redis.Redis) -> int:
        return key_bytes(client, queue) if keys else used_memory(client)

    client.flushall()
    manager = RedisClaimManager(client=client)
    for script in manager.scripts.values():  # a script's body counts in used_memory
        client.script_load(script.script)
    manager.claim("warm", "warm", "w", 1)  # register a queue
    ids = [f"{uuid.uuid4()}:0:0" for _ in range(records)]
    before = used(client)
    tokens = []
    pipe_size = 1000
    for first in range(0, records, pipe_size):
        calls = [
            manager.claim_call(queue, task_id, f"{OWNER_HEAD}.{first + i:x}", LEASE_MS)
            for i, task_id in enumerate(ids[first : first + pipe_size])
        ]
        for result in manager.execute_many(calls):
            assert result.token is not None, result
            tokens.append(result.token)
    claimed = used(client)
    for first in range(0, records, pipe_size):
        calls = [manager.complete_call(t, RETENTION_MS) for t in tokens[first : first + pipe_size]]
        manager.execute_many(calls)
    completed = used(client)
    assert manager.active_claims(queue) == 0
    client.close()
    return (claimed - before) / records, (completed - before) / records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument(
        "--queue-sizes",
        action="store_true",
        help="also measure 10,000 and 1,000,000 records (the second takes a while)",
    )
    args = parser.parse_args()
    sizes = [args.records]
    if args.queue_sizes:
        sizes = [10_000, args.records, 1_000_000]
    with private_redis() as port:
        version = redis.Redis(port=port).info("server")["redis_version"]
        print(f"redis-server {version}, 36-character task ids, one queue")
        print(
            "| tasks | bytes per live claim | bytes per completion record "
            "| MEMORY USAGE: per claim | per record |"
        )
        print("|---|---:|---:|---:|---:|")
        for size in sizes:
            claim, record = measure(port, size)
            key_claim, key_record = measure(port, size, keys=True)
            print(f"| {size:,} | {claim:.0f} | {record:.0f} | {key_claim:.0f} | {key_record:.0f} |")


if __name__ == "__main__":
    main()
