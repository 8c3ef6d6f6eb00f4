"""Completion records written through a Sentinel failover: how many an acknowledged write loses.

Starts a master, one replica and three Sentinels (``tests/servers.py``), writes claims and
completion records in a loop as a worker does (``claim_unless_done`` then ``complete``; a
write that fails is retried the worker's way, through ``record_done``), sends
``SENTINEL FAILOVER`` after a few seconds, goes on until the old master has been demoted, and
then counts the records acknowledged to the writer that the new master does not have. Three
ways of writing, each on a fresh setup:

- ``plain``: one client, no help (redis-py moves only once the old master refuses a write);
- ``follow``: the same client asks the Sentinels for the master every 0.5 s and follows it
  (what a worker's lease keeper does, without writing records again);
- ``wait``: ``wait_replicas=1`` (``WAIT 1 500`` after each write).

Run from the repository root: ``PYTHONPATH=. python bench/failover_writes.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time

from celery_claims import RedisClaimManager
from celery_claims.connection import sentinel_master
from celery_claims.errors import ClaimError
from celery_claims.worker.delivery.verdict import Verdict, record_done
from tests.servers import RedisSentinels

#: Seconds of writing before the failover, and after it (past the old master's demotion).
BEFORE_S = 3.0
AFTER_S = 16.0
LEASE_MS = 60_000
TTL_MS = 3_600_000
QUEUE = "bench"


def run(mode: str) -> str:
    group = RedisSentinels().start()
    try:
        manager = RedisClaimManager(
            url=group.url,
            options=group.options,
            wait_replicas=1 if mode == "wait" else 0,
            wait_timeout_ms=500,
        )
        acknowledged: list[str] = []
        errors = 0
        longest_s = 0.0
        began = time.monotonic()
        last_ack = began
        failover = threading.Thread(target=lambda: (time.sleep(BEFORE_S), group.failover()))
        failover.start()
        followed = began
        i = 0
        while time.monotonic() - began < BEFORE_S + AFTER_S:
            if mode == "follow" and time.monotonic() - followed > 0.5:
                followed = time.monotonic()
                with contextlib.suppress(ClaimError):
                    sentinel_master(manager.client)
            task = f"t{i}"
            i += 1
            while True:
                try:
                    result = manager.claim_unless_done(QUEUE, task, "writer", LEASE_MS)
                    if result.token is None:
                        break  # recorded already
                    verdict = record_done(
                        manager, result.token, lease_ms=LEASE_MS, done_ttl_ms=TTL_MS
                    ).verdict
                    if verdict is Verdict.RECORDED:
                        acknowledged.append(task)
                    break
                except ClaimError:
                    errors += 1
                    time.sleep(0.1)
            now = time.monotonic()
            longest_s = max(longest_s, now - last_ack)
            last_ack = now
            time.sleep(0.01)
        failover.join()
        manager.close()
        with RedisClaimManager(url=group.url, options=group.options) as check:
            lost = [t for t in acknowledged if check.done_record(QUEUE, t) is None]
        return (
            f"{mode:>6}: {len(acknowledged)} records acknowledged, {len(lost)} lost, "
            f"{errors} failed writes retried, longest wait for one record {longest_s:.1f} s"
        )
    finally:
        group.cleanup()


if __name__ == "__main__":
    for mode in ("plain", "follow", "wait"):
        print(run(mode), flush=True)
