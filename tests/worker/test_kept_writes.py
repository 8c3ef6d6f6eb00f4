"""kombu's own writes on a connection kept for them, where no claim rides them (``keep_writes``).

With the claim store apart from a Redis broker, kombu's ``QoS.append`` (the ``MULTI``/``EXEC``
that records a delivery in ``unacked``) and ``QoS.ack`` (the one that removes it) carry no
claim, but they still cost the worker's main process a redis-py pipeline each: a client built
per call, its pool taken and given back, its replies parsed. The worker sends the same
commands in the same transactions on a connection kept for them
(``sender.ScriptCaller.commands``). What kombu's pipeline did, the kept connection must do
too, or hand the write back to kombu: each case is checked here on a real kombu channel
against a private ``redis-server``, and once through a real worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_claims.worker.transport.broker import keep_writes
from tests.servers import RedisServer, command_calls, free_port, redis_server
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_for
from tests.worker.kombu_channel import Channel


class Kept(Channel):
    """A kombu channel on ``server`` whose QoS's writes go on a kept connection."""

    def __init__(self, server: RedisServer, **options: Any) -> None:
        super().__init__(server, **options)
        assert keep_writes(self.channel)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as started:
        yield started


@pytest.fixture
def kept(server: RedisServer) -> Iterator[Kept]:
    channel = Kept(server)
    try:
        yield channel
    finally:
        channel.close()


def test_deliveries_and_acks_write_what_kombu_writes_on_one_kept_connection(
    kept: Kept, server: RedisServer
) -> None:
    # Given three messages, and beside the kept channel one with kombu's own writes
    kept.publish("t1", "t2", "t3")
    kept.deliver()  # the kept connection is made
    made = int(kept.store.info("stats")["total_connections_received"])
    before = command_calls(kept.store)
    # When two more are delivered and then all three acked
    messages = [kept.deliver(), kept.deliver()]
    assert kept.unacked() == (3, 3)
    recorded = kept.store.hgetall("unacked")
    for message in messages:
        message.ack()
    # (run by the server once it reads them: their replies are not waited for)
    wait_for(lambda: kept.unacked() == (1, 1), timeout=5, what="the acks")
    # Then each write was one transaction of kombu's commands, on the connection the first
    # delivery made (no connection made since)
    calls = command_calls(kept.store)
    counted = ("multi", "exec", "zadd", "hset", "zrem", "hdel")
    assert [calls.get(c, 0) - before.get(c, 0) for c in counted] == [4, 4, 2, 2, 2, 2]
    assert int(kept.store.info("stats")["total_connections_received"]) == made
    assert kept.unacked() == (1, 1)
    # and each delivery was recorded as kombu's own append records it
    own = Channel(server)
    try:
        own.publish("t4")
        for channel, message in ((kept, messages[0]), (own, own.deliver())):
            tag = message.delivery_tag
            entry = recorded.get(tag.encode()) or kept.store.hget("unacked", tag)
            delivery = message.delivery_info
            expected = [message._raw, delivery["exchange"], delivery["routing_key"]]
            assert entry is not None, channel
            assert json.loads(entry) == expected, channel
    finally:
        own.close()
    # and kombu closing the channel closes the kept connection too
    before_close = len(kept.store.client_list())
    kept.channel.close()
    deadline = time.monotonic() + 5
    while len(kept.store.client_list()) > before_close - 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # kombu's own connection and the kept one
    assert len(kept.store.client_list()) <= before_close - 2


def test_writes_after_the_broker_restarted_go_on_a_new_connection(
    kept: Kept, server: RedisServer
) -> None:
    kept.publish("t1")
    kept.deliver().ack()
    # When the server restarts between two deliveries (the kept connection is closed by then)
    server.restart()
    kept.publish("t2")
    message = kept.deliver()
    # Then the delivery is recorded, and its ack removes it
    assert kept.unacked() == (1, 1)
    message.ack()
    wait_for(lambda: kept.unacked() == (0, 0), timeout=5, what="the ack")


def test_a_write_whose_reply_timed_out_is_sent_again_through_kombus_pipeline(
    server: RedisServer,
) -> None:
    # Given a channel with a 1 s socket timeout, its kept connection made by a delivery
    channel = Kept(server, socket_timeout=1.0)
    try:
        channel.publish("t1")
        message = channel.deliver()
        qos = channel.channel.qos
        # When the server stalls for 1.6 s just before a delivery is recorded (here the same
        # message's again, under a tag of its own: the kept connection times out and is
        # closed; kombu's pipeline, sent then, is answered once it wakes)
        stall = threading.Thread(
            target=lambda: server.client().execute_command("DEBUG", "SLEEP", 1.6)
        )
        stall.start()
        time.sleep(0.1)
        qos.append(message, "again")
        stall.join()
        # Then the delivery is recorded (whether the first transaction ran too or not), and
        # the acks and the next delivery go on a kept connection again
        assert channel.store.hexists("unacked", "again")
        assert channel.unacked() == (2, 2)
        message.ack()
        qos.ack("again")
        channel.publish("t2")
        channel.deliver().ack()
        wait_for(lambda: channel.unacked() == (0, 0), timeout=5, what="the acks")
    finally:
        channel.close()


def test_an_ack_is_sent_without_waiting_for_the_brokers_reply(
    kept: Kept, server: RedisServer
) -> None:
    # Given a delivered message, its kept connection made
    kept.publish("t1", "t2")
    message = kept.deliver()
    # When it is acked while the broker answers nothing (stopped: SIGSTOP)
    acked = threading.Event()
    with server.paused():
        acker = threading.Thread(target=lambda: (message.ack(), acked.set()))
        acker.start()
        # Then the ack returns without the broker's reply, the delivery forgotten in kombu's
        # memory (its prefetch slot free)
        assert acked.wait(timeout=3), "the ack waited for the broker"
        qos = kept.channel.qos
        assert message.delivery_tag in qos._dirty  # kombu's forget (flushed lazily)
    acker.join()
    # and the broker runs it once it answers again; the next write reads its replies first
    wait_for(lambda: kept.unacked() == (0, 0), timeout=5, what="the ack")
    kept.deliver().ack()
    wait_for(lambda: kept.unacked() == (0, 0), timeout=5, what="the second ack")


@pytest.mark.parametrize("late", [False, True], ids=["soon", "past-half-the-visibility-timeout"])
def test_an_ack_the_broker_never_read_is_sent_again_once_its_connection_is_found_lost(
    late: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a broker that writes every command to its AOF, a channel whose visibility timeout
    # is 1 s, and a delivered message
    server = RedisServer(["--appendonly", "yes", "--appendfsync", "always"]).start()
    kept = Kept(server, visibility_timeout=1)
    try:
        kept.publish("t1", "t2")
        message = kept.deliver()
        # When it is acked while the broker reads nothing (SIGSTOP), and the broker is then
        # killed with the ack unread and started again from its AOF (the delivery still
        # recorded there)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        message.ack()
        server.stop(signal.SIGKILL)
        server.start()
        assert server.client().hexists("unacked", message.delivery_tag)
        if late:
            time.sleep(0.6)  # more than half the visibility timeout since the ack
        # Then the next write finds the ack's connection lost and sends the removal again
        # through kombu's own pipeline: the delivery is not left to be redelivered. Past half
        # the visibility timeout it is left (restored and delivered again by then, its copy
        # would have this very record in unacked)
        with caplog.at_level("WARNING", logger="celery_claims.worker"):
            second = kept.deliver()
        assert kept.store.hexists("unacked", message.delivery_tag) == late
        assert ("not sent again" in caplog.text) == late, caplog.text
        second.ack()
        wait_for(lambda: kept.unacked() == (int(late), int(late)), timeout=5, what="the ack")
    finally:
        kept.close()
        server.cleanup()


@contextlib.contextmanager
def refusing(kept: Kept, refusal: str, tag: str) -> Iterator[None]:
    """The broker refuses the ack of ``tag`` sent in the block: one command of it (kombu's
    unacked index clobbered with a string: the ``ZREM`` is refused, the ``HDEL`` runs), or the
    whole transaction (the broker a read-only replica of no master that answers, its data
    kept: ``EXECABORT``). The refusal is lifted once the server ran the ack (its reply is
    not waited for: lifted sooner, the ack could run after it)."""
    store = kept.store
    if refusal == "a command":
        store.delete("unacked_index")
        store.set("unacked_index", "not a sorted set")
        try:
            yield
            wait_for(lambda: not store.hexists("unacked", tag), timeout=5, what="the ack")
        finally:
            store.delete("unacked_index")
    else:

        def refused() -> int:
            return int(store.info("errorstats").get("errorstat_READONLY", {}).get("count", 0))

        before = refused()
        store.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        try:
            yield
            wait_for(lambda: refused() > before, timeout=5, what="the ack refused")
        finally:
            store.execute_command("REPLICAOF", "NO", "ONE")


@pytest.mark.parametrize(
    ("refusal", "cause", "left"),
    [("a command", "WRONGTYPE", 0), ("whole", "read only replica", 1)],
)
def test_an_ack_the_broker_refuses_is_logged_with_its_cause_at_the_next_write(
    kept: Kept, caplog: pytest.LogCaptureFixture, refusal: str, cause: str, left: int
) -> None:
    # Given a delivered message, and a broker that refuses its ack
    kept.publish("t1", "t2")
    message = kept.deliver()
    with refusing(kept, refusal, message.delivery_tag):
        # When it is acked, nothing is raised (the reply is not waited for)
        message.ack()
    # Then the next write reads the ack's replies first, logs the refusal with its cause,
    # and goes on
    with caplog.at_level("WARNING", logger="celery_claims.worker"):
        second = kept.deliver()
    assert "kombu's ack of" in caplog.text
    assert cause in caplog.text, caplog.text
    # and a transaction refused whole left the delivery in unacked (to be restored and
    # redelivered, as after a lost ack)
    assert kept.store.hexists("unacked", message.delivery_tag) == bool(left)
    second.ack()
    wait_for(lambda: kept.unacked() == (left, left), timeout=5, what="the second ack")


def test_a_write_the_server_refuses_fails_as_kombus_would(kept: Kept) -> None:
    # Given kombu's unacked hash clobbered with a string (every HSET on it is refused)
    kept.publish("t1")
    kept.store.set("unacked", "not a hash")
    # When the message is delivered, kombu's error is raised, as its own append raises it
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        kept.deliver()
    # and the kept connection answers the next delivery with its own replies
    kept.store.delete("unacked")
    kept.publish("t2")
    kept.deliver().ack()
    # (t1's index entry went in with the refused HSET)
    wait_for(lambda: kept.unacked() == (0, 1), timeout=5, what="the ack")


def test_channels_whose_keys_kombu_prefixes_keep_kombus_own_writes(server: RedisServer) -> None:
    # Given a transport that prefixes its keys (kombu's client adds the prefix itself)
    channel = Channel(server, global_keyprefix="app:")
    try:
        # Then nothing is hooked, and kombu's own writes record the delivery under the prefix
        assert not keep_writes(channel.channel)
        channel.publish("t1")
        message = channel.deliver()
        assert channel.store.hlen("app:unacked") == 1
        message.ack()
        assert channel.store.hlen("app:unacked") == 0
    finally:
        channel.close()


@pytest.fixture
def app(redis_server: RedisServer, private_redis: RedisServer, key_prefix: str) -> Iterator[Celery]:
    app = make_app(
        redis_server.url, queue=unique("q"), claims_prefix=key_prefix,
        claims_redis_url=private_redis.url,
    )  # fmt: skip

    @app.task(shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        return x + y

    try:
        yield app
    finally:
        close_app(app)


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_worker_with_its_claim_store_apart_sends_kombus_writes_on_a_kept_connection(
    app: Celery, redis_server: RedisServer, pool: str
) -> None:
    # Given a worker on a Redis broker whose claim store is a server of its own
    broker = redis_server.client()
    with in_process_worker(app, pool=pool, concurrency=2) as worker:
        qos = worker.consumer.task_consumer.channel.qos
        before = command_calls(broker)
        # When tasks run
        results = [app.send_task("t.add", (i, 1)) for i in range(6)]
        # Then each runs once, its delivery recorded and removed by the kept writes: a
        # transaction each, and none through kombu's pipeline
        assert [r.get(timeout=20) for r in results] == [i + 1 for i in range(6)]
        assert qos.append.__self__.qos is qos
        assert qos.ack.__self__.qos is qos
        wait_for(lambda: broker.hlen("unacked") == 0, timeout=10, what="every ack")
        calls = command_calls(broker)
        assert calls["zrem"] - before.get("zrem", 0) >= 6
    assert broker.zcard("unacked_index") == 0
