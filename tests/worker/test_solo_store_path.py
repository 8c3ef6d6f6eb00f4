"""A solo worker with a claim store apart reads each store reply right after its call.

On the solo pool the body runs on the consumer's own loop, so nothing overlaps a store round
trip: the consumer's pipe waits a moment for the reply of each claim and record it sends
(``InlineStorePipe``) instead of leaving it to another pass of the loop. A reply that does not
come by then is the event loop's, as on the other pools: a paused store holds the claimed copy
(never run unverified) and the loop goes on.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from kombu.asynchronous import Hub

from celery_claims import BackendUnavailable, RedisClaimManager, Success
from celery_claims.connection import close, connect
from celery_claims.worker.transport.pipe import InlineStorePipe, StorePipe
from tests.servers import RedisServer, command_calls
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_for

OWNER = "worker-1/1/solo"
LEASE_MS = 60_000


def app_with_store_apart(
    broker: str, store: RedisServer, queue: str, prefix: str, **conf: object
) -> Celery:
    """An app on ``broker`` (results there too) whose claim store is ``store``."""
    app = make_app(
        broker,
        queue=queue,
        claims_prefix=prefix,
        claims_redis_url=store.url,
        claims_lease_ms=60_000,
        claims_renew_interval_ms=25_000,
        **conf,
    )
    app.conf.result_backend = broker
    return app


def frames() -> set[str]:
    """The calls the caller runs inside, as ``file:function``."""
    return {f"{Path(frame.filename).name}:{frame.function}" for frame in inspect.stack(0)}


@pytest.fixture
def hub() -> Iterator[Hub]:
    hub = Hub()
    try:
        yield hub
    finally:
        hub.close()


@pytest.fixture
def manager(private_redis: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    client = connect(private_redis.url, timeout_s=2.0)
    try:
        yield RedisClaimManager(client=client, prefix=key_prefix)
    finally:
        close(client)


def test_an_inline_pipe_hands_over_the_reply_before_the_call_returns(
    manager: RedisClaimManager, hub: Hub
) -> None:
    # Given a pipe that reads replies inline (the solo pool's) and one that does not
    inline = InlineStorePipe.for_manager(manager, hub)
    looped = StorePipe.for_manager(manager, hub)
    assert inline is not None
    assert looped is not None
    try:
        got: list[object] = []
        # When each sends a claim
        inline.defer(manager.claim_call("q", "t1", OWNER, LEASE_MS), got.append)
        # Then the inline pipe's claim is decided before defer returns, with no loop pass
        assert len(got) == 1
        assert isinstance(got[0], Success)
        assert inline.waiting == 0
        # and the other's waits for the event loop
        later: list[object] = []
        looped.defer(manager.claim_call("q", "t2", OWNER, LEASE_MS), later.append)
        assert later == []
        assert looped.waiting == 1
        looped.drain()
        assert len(later) == 1
        assert isinstance(later[0], Success)
    finally:
        inline.close()
        looped.close()


def test_an_inline_pipe_leaves_a_late_reply_to_the_loop_and_fails_closed(
    manager: RedisClaimManager, hub: Hub, private_redis: RedisServer
) -> None:
    # Given an inline pipe whose store stops answering (paused, as a partition looks)
    pipe = InlineStorePipe.for_manager(manager, hub)
    assert pipe is not None
    assert private_redis.proc is not None
    got: list[object] = []
    try:
        pipe.call(manager.claim_call("q", "warm", OWNER, LEASE_MS))  # connected, script loaded
        with private_redis.paused():
            # When a claim is sent
            pipe.defer(manager.claim_call("q", "t1", OWNER, LEASE_MS), got.append)
            # Then the call returns undecided, its reply left to the loop
            assert got == []
            assert pipe.waiting == 1
            # and a reply that never comes ends as "unavailable" (the copy is held, not run)
            pipe.drain()
        assert len(got) == 1
        assert isinstance(got[0], BackendUnavailable)
    finally:
        pipe.close()


def test_a_solo_worker_runs_a_claimed_body_from_the_claims_own_call_on_its_pipe(
    redis_server: RedisServer, private_redis: RedisServer, queue: str, key_prefix: str
) -> None:
    # Given a solo worker whose claim store is a server of its own, and a task that notes the
    # calls its body runs inside
    app = app_with_store_apart(redis_server.url, private_redis, queue, key_prefix)
    seen: list[set[str]] = []

    @app.task(shared=False, name="t.where")
    def where(i: int) -> int:
        seen.append(frames())
        return i

    observer = private_redis.client()
    try:
        with in_process_worker(app, hostname=f"{unique('solo')}@localhost") as worker:
            assert where.delay(0).get(timeout=30) == 0  # connects, loads the scripts
            before = command_calls(observer)
            # When tasks run one after the other
            assert [where.delay(i).get(timeout=30) for i in range(1, 11)] == list(range(1, 11))
            wait_for(
                lambda: worker.claims.counters.get("completed") == 11,
                timeout=10,
                what="11 completions",
            )
            after = command_calls(observer)
            gate = worker.consumer.claim_gate
            assert gate is not None
            assert gate.store_pipe is not None
            assert gate.store_pipe.waiting == 0
    finally:
        close_app(app)
    # Then each body ran inside the gate's claim call, its reply read right after the send
    # on the consumer's pipe, not from a later pass of the event loop
    for calls in seen[1:]:
        assert {"gate.py:_claim", "pipe.py:_read_one"} <= calls
        assert "pipe.py:_on_readable" not in calls
    # and each message cost the store its claim and its record (and the producer's publish
    # journal write), as before
    assert after["evalsha"] - before["evalsha"] == 10 * 3
    stats = RedisClaimManager(client=observer, prefix=key_prefix).stats()
    assert (stats.successes, stats.acks) == (11, 11)


def test_a_solo_worker_holds_a_claim_the_store_does_not_answer_and_serves_other_messages(
    redis_server: RedisServer, private_redis: RedisServer, queue: str, key_prefix: str
) -> None:
    # Given a solo worker whose claim store is a server of its own, with a task that is
    # claimed and one that is not (claims = False)
    app = app_with_store_apart(
        redis_server.url,
        private_redis,
        queue,
        key_prefix,
        claims_socket_timeout_ms=5000,
        worker_prefetch_multiplier=4,
    )
    runs: list[str] = []

    @app.task(shared=False, name="t.claimed")
    def claimed() -> str:
        runs.append("claimed")
        return "claimed"

    @app.task(shared=False, name="t.free", claims=False)
    def free() -> str:
        return "free"

    try:
        with in_process_worker(app, hostname=f"{unique('solo')}@localhost") as worker:
            assert claimed.delay().get(timeout=30) == "claimed"  # the pipe is connected
            assert private_redis.proc is not None
            # When the store stops answering and a claimed task is sent, then a free one
            with private_redis.paused():
                pending = claimed.delay()
                wait_for(
                    lambda: worker.consumer.claim_gate.store_pipe.waiting == 1,
                    timeout=10,
                    what="the claim to be sent",
                )
                # Then the free task runs meanwhile: the loop did not wait for the store
                assert free.delay().get(timeout=10) == "free"
                # and the claimed one has not run unverified
                assert runs == ["claimed"]
            # and it runs once the store answers, once
            assert pending.get(timeout=30) == "claimed"
            assert runs == ["claimed", "claimed"]
    finally:
        close_app(app)


def test_an_inline_pipe_reads_inline_only_after_a_call_sent_on_an_idle_connection(
    manager: RedisClaimManager, hub: Hub, private_redis: RedisServer
) -> None:
    # Given an inline pipe with a reply awaited (its store paused past the inline wait)
    pipe = InlineStorePipe.for_manager(manager, hub)
    assert pipe is not None
    assert private_redis.proc is not None
    order: list[str] = []
    try:
        pipe.call(manager.claim_call("q", "warm", OWNER, LEASE_MS))
        with private_redis.paused():
            pipe.defer(manager.claim_call("q", "a", OWNER, LEASE_MS), lambda _: order.append("a"))
        assert pipe.waiting == 1
        # When another call is sent while that reply is awaited
        pipe.submit(manager.claim_call("q", "b", OWNER, LEASE_MS), lambda _: order.append("b"))
        # Then it leaves both replies to their reader (the loop), which hands them over in order
        assert order == []
        assert pipe.waiting == 2
        pipe.drain()
        assert order == ["a", "b"]
    finally:
        pipe.close()
