"""A prefork pool process settles its copy itself: the event loop makes no round trip to ack.

With the claim store on the Redis broker's server, a task after whose body nothing can fail
(no result stored, no callback) is settled by the process that ran it: one ``ack_done.lua``
call records the completion and removes the delivery from kombu's unacked set, and only then
is success reported. The worker's main process (the event loop, the bottleneck of short
tasks) then only forgets the delivery in kombu's memory. Counted on the server with MONITOR:
per message the claim inside kombu's delivery transaction and one ``ack_done`` from a pool
process; the consumer's connections send no ack of any kind.
"""

from __future__ import annotations

from collections import Counter

import pytest

from celery_claims import RedisClaimManager
from celery_claims.worker.identity import Attempt, claim_task_id
from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet
from tests.worker.test_ack_ride import UNACKED, Monitor

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"
TASKS = 30


def _run_a_batch(
    fleet: Fleet, private_redis: RedisServer, store_server: RedisServer
) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """Start a prefork worker (2 pool processes) with its claim store on ``store_server``,
    run a batch of tasks with nothing after their body, watching the store with MONITOR;
    check every task is recorded done and its message gone from the broker. Returns the
    store's script SHAs by name and the commands the store received."""
    broker, queue = private_redis.url, unique("q")
    fleet.worker(
        "a",
        broker=broker,
        backend=broker,
        queue=queue,
        concurrency=2,
        app=APP,
        # the store on the broker: the default (no URL of its own)
        extra=() if store_server is private_redis else ("--claims-redis-url", store_server.url),
    ).wait_ready()
    client = fleet.client(broker, broker, queue)
    redis = fleet.redis(broker)
    with RedisClaimManager(url=store_server.url, prefix="claims") as store:
        shas = {name: script.sha for name, script in store.scripts.items()}
        client.send_task("defects.quiet", args=(0,))  # warm-up: connections, scripts
        wait_for(lambda: store.stats().acks == 1, timeout=30, what="the warm-up task")

        monitor = Monitor(store_server)
        ids = [client.send_task("defects.quiet", args=(i,)).id for i in range(TASKS)]
        wait_for(lambda: store.stats().acks == TASKS + 1, timeout=60, what="the batch")
        wait_for(lambda: redis.hlen("unacked") == 0, timeout=10, what="every delivery gone")
        commands = monitor.stop()

        for task_id in ids:
            record = store.done_record(queue, claim_task_id(task_id, Attempt(0, 0)))
            assert record is not None, f"{task_id} has no completion record"
        assert redis.zcard("unacked_index") == 0
        assert redis.llen(queue) == 0
        assert store.active_claims(queue) == 0
    return shas, commands


def test_pool_processes_settle_their_copies_and_the_event_loop_sends_no_ack(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker with the claim store on its Redis broker, when a batch of tasks
    # runs: every task is recorded done and its message gone from the broker
    shas, commands = _run_a_batch(fleet, private_redis, private_redis)

    by_client: dict[str, list[list[str]]] = {}
    for client_id, words in commands:
        by_client.setdefault(client_id, []).append(words)
    sent = {
        client_id: Counter(words[1] for words in stream if words[0] == "EVALSHA")
        for client_id, stream in by_client.items()
    }
    scripts = sum(sent.values(), Counter())
    # one completion per message, written with the removal of its delivery; none on its own
    assert scripts[shas["ack_done"]] == TASKS
    assert scripts[shas["release"]] == 0, "a completion record was written on its own"
    # the consumer's connection (it sends the claims, in kombu's delivery transaction) and
    # the connections that send completions are not the same: the pool processes' own
    consumers = {c for c, counted in sent.items() if counted[shas["claim"]]}
    settlers = {c for c, counted in sent.items() if counted[shas["ack_done"]]}
    assert consumers
    assert settlers
    assert not consumers & settlers, "the event loop wrote a completion"
    assert all(set(sent[c]) == {shas["ack_done"]} for c in settlers)
    # and nobody sent kombu's own ack (ZREM / HDEL of the delivery)
    acks = [w for _, w in commands if w[0] in ("ZREM", "HDEL") and w[1].strip('"') in UNACKED]
    assert acks == []


def test_with_a_store_apart_pool_processes_record_and_the_worker_writes_nothing_more(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker whose claim store is a server of its own (as with RabbitMQ),
    # when a batch of tasks runs: every task is recorded done and its message acked
    store_server = RedisServer().start()
    try:
        shas, commands = _run_a_batch(fleet, private_redis, store_server)
    finally:
        store_server.cleanup()
    scripts = Counter(words[1] for _, words in commands if words[0] == "EVALSHA")
    # the worker's claims (one call each, or fewer when they share a claim_many call) and one
    # record per message, written by the pool process that ran it; none written again
    assert scripts[shas["release"]] == TASKS
    assert scripts[shas["ack_done"]] == 0, "the worker wrote a record its pool process wrote"
    assert scripts[shas["claim"]] + scripts[shas["claim_many"]] <= TASKS
