"""The publish journal's write rides kombu's own LPUSH, and steps aside where it cannot.

With the claim store on the Redis broker's server, a producer's publish and its journal
entry are one script (``journal_put.lua`` with the queue's list as ``KEYS[4]``, the push
first): the journal costs no write of its own. Where kombu's ``_put`` does more than one
push to a list the ride knows (a transport that prefixes keys), kombu publishes as it always
does and the journal writes on its own. Counted on the server with MONITOR.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from celery_claims import RedisClaimManager
from celery_claims.claims.journal import RedisJournal
from celery_claims.worker.identity import Attempt, claim_task_id
from celery_claims.worker.publish.envelope import Envelope
from celery_claims.worker.transport.publish import PublishRide
from tests.servers import RedisServer
from tests.worker.helpers import FAST_REDELIVERY, close_app, in_process_worker, make_app, wait_for
from tests.worker.test_ack_ride import Monitor


@pytest.fixture
def store(private_redis: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    with RedisClaimManager(url=private_redis.url, prefix=key_prefix) as manager:
        yield manager


def _journal_sha(store: RedisClaimManager, key_prefix: str) -> str:
    return RedisJournal(client=store.client, prefix=key_prefix).scripts["journal_put"].sha


@pytest.mark.parametrize("priority", [None, 6])
def test_a_publish_and_its_journal_entry_are_one_script_on_the_queues_own_list(
    private_redis: RedisServer,
    store: RedisClaimManager,
    queue: str,
    key_prefix: str,
    priority: int | None,
) -> None:
    app = make_app(private_redis.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.echo", ignore_result=True)
    def echo(i: int) -> int:
        return i

    sha = _journal_sha(store, key_prefix)
    options = {} if priority is None else {"priority": priority}
    try:
        echo.delay(0)  # the producer's connection and scripts
        monitor = Monitor(private_redis)
        sent = echo.apply_async((1,), **options)
        commands = monitor.stop()
        # the entry is the message kombu pushed, as it is, and reads as what a re-publish needs
        list_key = queue if not priority else f"{queue}\x06\x16{priority}"
        journal = RedisJournal(client=store.client, prefix=key_prefix)
        entry = journal.entries(queue)[claim_task_id(sent.id, Attempt(0, 0))][0]
        assert entry.encode() == store.client.lindex(list_key, 0)
        envelope = Envelope.loads(entry)
        assert (envelope.task, envelope.task_id, envelope.routing_key) == ("t.echo", sent.id, queue)
        assert json.loads(envelope.body)[0] == [1]
        assert envelope.properties["correlation_id"] == sent.id
        assert envelope.properties["priority"] == (priority or 0)
        with in_process_worker(app) as worker:
            counters = worker.claims.counters
            wait_for(lambda: counters.get("completed") == 2, timeout=30, what="both tasks")
    finally:
        close_app(app)
    puts = [w for _, w in commands if w[:2] == ["EVALSHA", sha]]
    assert len(puts) == 1
    # KEYS[4] is the list kombu pushes to: the queue's own, or its list for that priority;
    # the message goes once (ARGV[2]: pushed and journaled)
    channel_key = queue if not priority else f"{queue}\\x06\\x16{priority}"
    assert puts[0][2] == "4"
    assert puts[0][6].strip('"') == channel_key
    assert sum(word == '{"body":' for word in puts[0]) == 1
    assert [w for _, w in commands if w[0] == "LPUSH"] == []
    assert store.done_record(queue, claim_task_id(sent.id, Attempt(0, 0))) is not None


def test_a_transport_that_prefixes_keys_publishes_as_kombu_does_and_journals_apart(
    private_redis: RedisServer, store: RedisClaimManager, queue: str, key_prefix: str
) -> None:
    app = make_app(
        private_redis.url,
        queue=queue,
        claims_prefix=key_prefix,
        broker_transport_options={**FAST_REDELIVERY, "global_keyprefix": "pfx:"},
    )

    @app.task(shared=False, name="t.echo", ignore_result=True)
    def echo(i: int) -> int:
        return i

    sha = _journal_sha(store, key_prefix)
    try:
        echo.delay(0)
        monitor = Monitor(private_redis)
        echo.delay(1)
        commands = monitor.stop()
        with app.producer_or_acquire() as producer:
            assert getattr(producer.channel, PublishRide.CACHED)[1] is False
        with in_process_worker(app) as worker:
            counters = worker.claims.counters
            wait_for(lambda: counters.get("completed") == 2, timeout=30, what="both tasks")
    finally:
        close_app(app)
    pushes = [w for _, w in commands if w[0] == "LPUSH"]
    assert len(pushes) == 1
    assert pushes[0][1].strip('"') == f"pfx:{queue}"
    puts = [w for _, w in commands if w[:2] == ["EVALSHA", sha]]
    assert len(puts) == 1
    assert puts[0][2] == "3"  # the journal's own keys only


def test_a_publish_after_the_broker_restarted_rides_on_a_new_connection(
    private_redis: RedisServer, queue: str, key_prefix: str
) -> None:
    # Given a producer whose publishes ride on the connection it keeps for them
    app = make_app(private_redis.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.echo", ignore_result=True)
    def echo(i: int) -> int:
        return i

    try:
        echo.delay(0)
        with app.producer_or_acquire() as producer:
            assert getattr(producer.channel, PublishRide.CACHED)[1] is True
        # When the broker restarts (empty, its scripts gone) between two publishes
        private_redis.restart()
        sent = echo.delay(1)
        # Then the publish is written on a new connection, its journal entry with it
        with RedisClaimManager(url=private_redis.url, prefix=key_prefix) as store:
            journal = RedisJournal(client=store.client, prefix=key_prefix)
            assert private_redis.client().llen(queue) == 1
            assert list(journal.entries(queue)) == [claim_task_id(sent.id, Attempt(0, 0))]
            with in_process_worker(app) as worker:
                counters = worker.claims.counters
                wait_for(lambda: counters.get("completed") == 1, timeout=30, what="the task")
            assert store.done_record(queue, claim_task_id(sent.id, Attempt(0, 0))) is not None
    finally:
        close_app(app)
