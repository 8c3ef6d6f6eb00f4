"""Claims and completions ride kombu's own round trips where the store is the broker's server.

kombu's Redis transport records each delivery in ``unacked_index``/``unacked`` in one
MULTI/EXEC and removes it on ack in another. With the claim store on that server the claim is
sent inside the first transaction, and the ack is replaced by ``ack_done.lua``, which records
the completion and removes the delivery in one script, only when the record is the copy's
own. Counted on the server with MONITOR: per message no round trip of the claims' own.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from celery_claims import ClaimNotFound, RedisClaimManager, StaleClaimToken
from celery_claims.claims.journal import RedisJournal
from celery_claims.worker.identity import Attempt, claim_task_id
from tests.servers import RedisServer, on_every_private_server
from tests.worker.helpers import close_app, in_process_worker, make_app, wait_for

TASKS = 20
UNACKED = ("unacked_index", "unacked")


class Monitor:
    """Every command the server receives from clients (not from scripts), until stopped."""

    END = "celery-claims-monitor-end"

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.commands: list[tuple[str, list[str]]] = []
        self._client = redis.Redis(port=server.port, socket_timeout=60)
        self._monitor = self._client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while True:
            seen = self._monitor.next_command()
            if seen["client_type"] == "lua":
                continue
            words = str(seen["command"]).split()
            if words[:2] == ["ECHO", self.END]:
                return
            self.commands.append((f"{seen['client_address']}:{seen['client_port']}", words))

    def stop(self) -> list[tuple[str, list[str]]]:
        with redis.Redis(port=self.server.port) as client:
            client.echo(self.END)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "MONITOR never saw the end marker"
        self._monitor.__exit__(None, None, None)
        self._client.close()
        return self.commands


@pytest.fixture
def store(private_redis: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    with RedisClaimManager(url=private_redis.url, prefix=key_prefix) as manager:
        yield manager


@on_every_private_server
def test_claims_and_completions_ride_kombus_own_round_trips(
    private_redis: RedisServer, store: RedisClaimManager, queue: str, key_prefix: str
) -> None:
    # broker, claim store and (unused) result backend: one private server
    app = make_app(private_redis.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.ride", ignore_result=True)
    def ride(i: int) -> int:
        return i

    shas = {name: script.sha for name, script in store.scripts.items()}
    journal = RedisJournal(client=store.client, prefix=key_prefix)
    shas |= {name: script.sha for name, script in journal.scripts.items()}
    try:
        with in_process_worker(app) as worker:
            counters = worker.claims.counters
            assert worker.claims.life.ride_acks
            ride.delay(0)  # connects, registers the queue
            wait_for(lambda: counters.get("completed") == 1, timeout=30, what="warm-up")
            monitor = Monitor(private_redis)
            ids = [ride.delay(i).id for i in range(1, TASKS + 1)]
            wait_for(lambda: counters.get("completed") == TASKS + 1, timeout=60, what="the batch")
            commands = monitor.stop()
    finally:
        close_app(app)
    scripts = Counter(words[1] for _, words in commands if words[0] == "EVALSHA")
    assert scripts[shas["claim"]] == TASKS
    assert scripts[shas["ack_done"]] == TASKS
    assert scripts[shas["release"]] == 0, "a completion was written on its own"
    # the producer (this process) journals each message it publishes, in the same script as
    # the publish itself: kombu's LPUSH of the message rides the journal's write
    assert scripts[shas["journal_put"]] == TASKS
    assert [w for _, w in commands if w[0] == "LPUSH"] == [], "a publish went on its own"
    for _, words in commands:
        if words[0] == "EVALSHA" and words[1] == shas["journal_put"]:
            assert words[2] == "4", words[:7]
            assert words[6].strip('"') == queue, words[:7]  # KEYS[4]: the queue's list
    allowed = {shas[name] for name in ("claim", "ack_done", "renew", "journal_put", "journal_take")}
    assert set(scripts) <= allowed
    # each claim is sent inside kombu's transaction recording the delivery, not on its own
    by_client: dict[str, list[list[str]]] = {}
    for client_id, words in commands:
        by_client.setdefault(client_id, []).append(words)
    for stream in by_client.values():
        for i, words in enumerate(stream):
            if words[0] == "EVALSHA" and words[1] == shas["claim"]:
                assert stream[i - 3][0] == "MULTI", stream[i - 3 : i + 2]
                assert stream[i - 1][:2] == ["HSET", "unacked"], stream[i - 3 : i + 2]
                assert stream[i + 1][0] == "EXEC", stream[i - 3 : i + 2]
    kombu_acks = [w for _, w in commands if w[0] == "ZREM" and w[1].strip('"') in UNACKED]
    assert kombu_acks == []
    client = private_redis.client()
    assert client.hlen("unacked") == 0
    assert client.zcard("unacked_index") == 0
    for task_id in ids:
        record = store.done_record(queue, claim_task_id(task_id, Attempt(0, 0)))
        assert record is not None, f"{task_id} has no completion record"
    assert store.active_claims(queue) == 0


def _delivery(client: redis.Redis, tag: str) -> tuple[Any, Any]:
    return client.zscore("unacked_index", tag), client.hget("unacked", tag)


def test_a_refused_token_leaves_the_delivery_and_writes_nothing(
    private_redis: RedisServer, store: RedisClaimManager, queue: str
) -> None:
    client = private_redis.client()
    tag = "tag-shared-by-two-copies"
    old = store.claim(queue, "T", "old-owner", 100).token
    assert old is not None
    new = wait_for(
        lambda: store.claim(queue, "T", "new-owner", 60_000).token, timeout=5, what="takeover"
    )
    client.zadd("unacked_index", {tag: 1.0})
    client.hset("unacked", tag, "message")
    with pytest.raises(StaleClaimToken):
        store.execute(store.ack_done_call(old, 60_000, UNACKED, tag))
    assert _delivery(client, tag) == (1.0, b"message")
    assert store.done_record(queue, "T") is None
    assert store.get_token(queue, "T", "new-owner") == new
    # the live owner's ride records it and removes the delivery
    assert store.execute(store.ack_done_call(new, 60_000, UNACKED, tag)) is True
    assert _delivery(client, tag) == (None, None)
    assert store.done_record(queue, "T") is not None


def test_a_completion_recorded_before_by_the_same_token_is_acked(
    private_redis: RedisServer, store: RedisClaimManager, queue: str
) -> None:
    client = private_redis.client()
    token = store.claim(queue, "T", "owner", 60_000).token
    assert token is not None
    store.complete(token, 60_000)  # the pool process wrote it (its lease was near its end)
    client.zadd("unacked_index", {"tag": 1.0})
    client.hset("unacked", "tag", "message")
    assert store.execute(store.ack_done_call(token, 60_000, UNACKED, "tag")) is False
    assert _delivery(client, "tag") == (None, None)
    # another owner's record is not this token's: refused, the delivery stays
    other = store.claim(queue, "U", "owner", 60_000).token
    assert other is not None
    store.complete(other, 60_000)
    forged = type(other)(queue, "U", "someone-else", other.instance, 0, 0)
    client.zadd("unacked_index", {"tag-u": 1.0})
    client.hset("unacked", "tag-u", "message")
    with pytest.raises(ClaimNotFound):
        store.execute(store.ack_done_call(forged, 60_000, UNACKED, "tag-u"))
    assert _delivery(client, "tag-u") == (1.0, b"message")


def test_a_claim_sent_for_a_message_celery_drops_is_released(
    private_redis: RedisServer, store: RedisClaimManager, queue: str, key_prefix: str
) -> None:
    # An expired message is acked by Celery's strategy without reaching the gate, after its
    # claim rode kombu's delivery transaction: that claim must not hold the task for a lease.
    app = make_app(
        private_redis.url,
        queue=queue,
        claims_prefix=key_prefix,
        claims_lease_ms=60_000,
        claims_renew_interval_ms=20_000,
    )

    @app.task(shared=False, name="t.ride", ignore_result=True)
    def ride(i: int) -> int:
        return i

    # loads the claim script (a fresh server answers a pre-claim NOSCRIPT: claimed by the gate)
    assert store.claim(queue, "warm-up", "owner", 1000).acquired
    try:
        # it expires while it waits in the queue
        ride.apply_async((1,), expires=datetime.now(timezone.utc) + timedelta(seconds=0.2))
        ride.delay(2)
        time.sleep(0.5)
        with in_process_worker(app) as worker:
            counters = worker.claims.counters
            wait_for(lambda: counters.get("completed") == 1, timeout=30, what="the live task")
            # the live task's delivery released the expired one's claim, or its own request did
            store.release(store.get_token(queue, "warm-up", "owner"))
            wait_for(lambda: store.active_claims(queue) == 0, timeout=10, what="no claim held")
            assert store.stats().successes == 3  # the expired message's claim was taken
            assert counters.get("completed") == 1
    finally:
        close_app(app)
