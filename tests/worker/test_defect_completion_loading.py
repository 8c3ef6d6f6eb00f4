"""Defect: a task completing while the claim store loads its dataset skips Celery's handler.

A claim store restarting from its AOF answers ``LOADING`` until its dataset is in memory. A
completion that meets that reply must be deferred like any other store outage: Celery's own
handler (the ack, ``task_ready``) runs anyway, and the completion is recorded once loading ends.

Two workers show it: one with a thread pool (its callbacks run off the consumer's thread, on
the blocking client), and a real prefork worker, whose callbacks run on the consumer's event
loop, where the worker's own store connection is used. That connection, connecting again to a
loading store, took ``LOADING`` for a hard error, which escaped before Celery's handler ran:
the message stayed unacked, the request active, the claim renewed, and the copy redelivered
was held by that claim (or, once it lapsed, ran again).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state
from kombu.transport.redis import Channel as RedisChannel

from celery_claims import RedisClaimManager
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import (
    FAST_REDELIVERY,
    RENEW_INTERVAL_MS,
    close_app,
    in_process_worker,
    make_app,
    paused_task,
    unique,
    wait_done,
    wait_for,
)
from tests.worker.processes import Fleet, events_of, executions, unacked_task_ids

pytestmark = pytest.mark.slow

#: Keys of filler data the restarted store loads, each delayed by ``KEY_LOAD_DELAY_US``: a few
#: seconds of ``LOADING``. Values are large and stored uncompressed, so the server answers
#: clients between chunks of loading (it does every 2 MB).
FILLER_KEYS = 20_000
FILLER_VALUE_BYTES = 2000
KEY_LOAD_DELAY_US = 200

#: The prefork test loads for longer (about 7 s): the completion must reach the worker's event
#: loop, which is busy for up to a second at a time with the held copy's re-checks (each one a
#: connection to the loading store), before loading ends.
PREFORK_KEY_LOAD_DELAY_US = 300


def _probe(server: RedisServer) -> redis.Redis:
    """A client that shows ``LOADING`` as it is: RESP2 without a handshake (redis-py's
    ``HELLO`` fails oddly on a loading server), and no retries."""
    return server.bare_client(socket_timeout=5)


def _restart(server: RedisServer) -> None:
    # start() waits for PING with redis-py's default client, whose handshake can fail on a
    # loading server with an error start() does not expect; the test waits for the server
    # with its own probe instead
    with contextlib.suppress(Exception):
        server.start()


def _up(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


def _loading(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.exceptions.BusyLoadingError:
        return True
    except redis.exceptions.ConnectionError:
        return False
    return False


@pytest.fixture
def store() -> Iterator[RedisServer]:
    """A claim store with AOF and a dataset that takes seconds to load."""
    args = ["--appendonly", "yes", "--appendfsync", "always", "--rdbcompression", "no"]
    with redis_server(args) as server:
        client = server.client()
        client.execute_command("DEBUG", "POPULATE", FILLER_KEYS, "filler", FILLER_VALUE_BYTES)
        client.bgrewriteaof()
        wait_for(
            lambda: (
                not any(
                    client.info("persistence")[k]
                    for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
                )
            ),
            timeout=30,
            what="the AOF rewrite",
        )
        yield server


def test_a_task_completing_while_the_claim_store_loads_is_acked_and_recorded_once_loaded(
    private_redis: RedisServer, store: RedisServer, key_prefix: str
) -> None:
    # Given an in-process worker whose claim store is a Redis with AOF, running a task
    queue = unique("q")
    app: Celery = make_app(
        private_redis.url, queue=queue, claims_prefix=key_prefix, claims_redis_url=store.url
    )
    finish, paused = paused_task(app, "t.finish_while_loading")

    broker = private_redis.client()
    claims = RedisClaimManager(url=store.url, prefix=key_prefix)
    probe = _probe(store)
    try:
        with in_process_worker(app, pool="threads") as worker:
            result = finish.apply_async(task_id=unique("loading"))
            assert paused.started.wait(20)

            # When the store crashes and restarts from its AOF, answering LOADING for a few
            # seconds, and the task returns while it loads
            store.stop(signal.SIGKILL)
            store.extra_args += ["--key-load-delay", str(KEY_LOAD_DELAY_US)]
            loader = threading.Thread(
                target=_restart, args=(store,), name="store-loader", daemon=True
            )
            loader.start()
            wait_for(lambda: _loading(probe), timeout=20, what="the store to answer LOADING")
            paused.release.set()

            # Then Celery's handler ran: the message is acked and the request is done
            wait_for(
                lambda: (
                    broker.hlen(RedisChannel.unacked_key) == 0 and not worker_state.active_requests
                ),
                timeout=60,
                what="the message to be acked and the request to be done",
            )
            assert result.get(timeout=10) == "done"

            # ... and once loading has ended the completion is recorded, the claim is no
            # longer renewed, and the message is not delivered again
            wait_for(lambda: _up(probe), timeout=60, what="the store to finish loading")
            wait_done(claims, queue, f"{result.id}:0:0", timeout=20)
            renewals = worker.claims.counters.get("renewals")
            time.sleep(FAST_REDELIVERY["visibility_timeout"] + 2 * RENEW_INTERVAL_MS / 1000)
            assert worker.claims.counters.get("renewals") == renewals
            assert paused.runs == [result.id]
            assert broker.hlen(RedisChannel.unacked_key) == 0
            assert broker.llen(queue) == 0
    finally:
        claims.client.close()
        broker.close()
        close_app(app)


def test_a_prefork_task_completing_while_the_claim_store_loads_is_acked_and_recorded_once_loaded(
    private_redis: RedisServer, store: RedisServer, fleet: Fleet
) -> None:
    # Given a real prefork worker whose claim store is a Redis with AOF (its own server, so
    # the main process claims through its own store connection and completes from the event
    # loop), running a task A that returns when the test says so
    broker, queue = private_redis.url, unique("q")
    name = f"a@{socket.gethostname()}"
    worker = fleet.worker(
        "a", broker=broker, backend=broker, queue=queue, concurrency=2,
        app="tests.worker.apps.defects_app", extra=("--claims-redis-url", store.url),
    ).wait_ready()  # fmt: skip
    client = fleet.client(broker, broker, queue)
    release = unique("release")
    task = client.send_task("defects.until", (release,), task_id=unique("loading-A"))
    wait_for(
        lambda: events_of(executions(broker, queue), "start", task.id),
        timeout=20,
        what="A to start",
    )
    claims = fleet.claims(store.url)
    probe = _probe(store)

    # When the store crashes; a message B arrives while it is down (the worker's own store
    # connection finds the store gone, B is held); the store restarts from its AOF, answering
    # LOADING for a few seconds, and A returns while it loads (the worker connects to the
    # store again to record A's completion)
    store.stop(signal.SIGKILL)
    other = client.send_task("defects.sleep", (0.1,), task_id=unique("loading-B"))
    wait_for(
        lambda: f"Held defects.sleep[{other.id}]: claim store unavailable" in worker.output(),
        timeout=10,
        what="B to be held while the store is down",
    )
    store.extra_args += ["--key-load-delay", str(PREFORK_KEY_LOAD_DELAY_US)]
    loader = threading.Thread(target=_restart, args=(store,), name="store-loader", daemon=True)
    loader.start()
    wait_for(lambda: _loading(probe), timeout=20, what="the store to answer LOADING")
    fleet.redis(broker).set(release, 1)
    wait_for(
        lambda: events_of(executions(broker, queue), "end", task.id),
        timeout=10,
        what="A to return",
    )
    returned_while_loading = _loading(probe)

    # Then once loading has ended A's message is acked, its request is done and its
    # completion recorded (its claim no longer renewed); B runs once; A ran once
    wait_for(lambda: _up(probe), timeout=60, what="the store to finish loading")
    assert returned_while_loading, "A returned after the store had loaded: make it load longer"
    key = f"{task.id}:0:0"
    broker_client = fleet.redis(broker)

    def settled() -> bool:
        return task.id not in unacked_task_ids(broker_client) and bool(
            claims.done_record(queue, key)
        )

    try:
        wait_for(settled, timeout=15, what="A to be acked and recorded done")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: unacked={unacked_task_ids(broker_client)} "
            f"done={claims.done_record(queue, key)} claim={claims.is_claimed(queue, key)}\n"
            f"{worker.output()[-6000:]}"
        ) from None
    assert claims.is_claimed(queue, key) is None
    assert task.get(timeout=10) == "done"
    active = client.control.inspect([name], timeout=2).active() or {}
    assert task.id not in [request["id"] for request in active.get(name, [])], active
    assert other.get(timeout=30) == 0.1, fleet.logs()
    wait_done(claims, queue, f"{other.id}:0:0", timeout=20)
    log = executions(broker, queue)
    assert len(events_of(log, "start", task.id)) == 1
    assert len(events_of(log, "start", other.id)) == 1
    assert worker.alive()
