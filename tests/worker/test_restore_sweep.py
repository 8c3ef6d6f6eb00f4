"""A dead consumer's unacked Redis message comes back at the configured restore cadence, on
every kombu and in every pool.

kombu 5.7 sweeps ``unacked_index`` every ``unacked_restore_interval`` seconds and scans on every
``unacked_restore_throttle``-th sweep. kombu 5.3 to 5.6 have neither option: their event loop
sweeps every 10 s and scans every 10th time, so a killed worker's message came back up to
~100 s after its ``visibility_timeout`` (3 s here), and its task was taken over that late.
Seen on tox ``celery56`` before the fix: ``test_fleet.py``'s SIGKILL takeover timed out after
20 s, as did the tests below.

The gevent and eventlet pools run without an event loop (Celery's blocking ``synloop``), where
kombu's Redis transport never runs its restore sweep on any kombu: the sweep is attempted only
after a poll that saw nothing, and the consumer's ``BRPOP`` answers every second. Measured on
kombu 5.7 before celery-claims ran it there: the dead worker's message stayed in ``unacked``
for good (40 s with a 3 s visibility timeout), on plain Celery as with claims.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
from celery import Celery
from kombu import Connection

from celery_claims.worker.transport.broker import Delivery, refresh_unacked
from celery_claims.worker.transport.sweep import restore_cadence, restore_visible
from tests.servers import RedisServer
from tests.worker.helpers import (
    FAST_REDELIVERY,
    LEASE_MS,
    close_app,
    in_process_worker,
    make_app,
    unique,
    wait_done,
    wait_for,
)
from tests.worker.processes import Fleet, executions

#: kombu restores an unacked Redis message after this many seconds (FAST_REDELIVERY).
VISIBILITY_TIMEOUT_S = 3
#: Seconds a test waits beyond the visibility timeout: far below kombu 5.6's ~100 s.
MARGIN_S = 15


def kombu_reads_restore_options() -> bool:
    """True on the kombu versions whose Redis transport reads both restore options (5.7 on)."""
    return (kombu.VERSION.major, kombu.VERSION.minor) >= (5, 7)


# --- which cadence a connection has, and who sweeps ----------------------------------------


@pytest.mark.parametrize(
    ("options", "cadence"),
    [
        ({}, (10.0, 10)),
        ({"unacked_restore_interval": 1, "unacked_restore_throttle": 1}, (1.0, 1)),
        ({"unacked_restore_interval": 0.5}, (0.5, 10)),
        ({"unacked_restore_interval": 0, "unacked_restore_throttle": 0}, (10.0, 1)),
        ({"unacked_restore_interval": "1", "unacked_restore_throttle": -2}, (10.0, 10)),
    ],
    ids=["defaults", "every-second", "interval-only", "zeros", "invalid"],
)
def test_the_restore_cadence_is_read_from_the_transport_options_as_kombu_5_7_reads_it(
    options: dict[str, Any], cadence: tuple[float, int]
) -> None:
    # Given a Redis broker connection with these transport options (not connected)
    with Connection("redis://127.0.0.1:1/0", transport_options=options) as conn:
        # When its cadence is read
        found = restore_cadence(conn)

    # Then it is kombu 5.7's, and kombu's own loop keeps it only where kombu reads the
    # options, or where it is kombu 5.3 to 5.6's fixed one (the defaults)
    assert found is not None
    assert (found.interval_s, found.throttle) == cadence
    assert found.kombu_loop_sweeps is (kombu_reads_restore_options() or cadence == (10.0, 10))


def test_another_transport_has_no_restore_cadence() -> None:
    with Connection("amqp://guest:guest@127.0.0.1:1//") as conn:
        assert restore_cadence(conn) is None
        assert restore_visible(conn) is False


# --- in-process workers (an event loop): solo and threads ----------------------------------


@pytest.fixture
def app(private_redis: RedisServer, key_prefix: str) -> Iterator[Celery]:
    queue = unique("q-restore")
    app = make_app(private_redis.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.echo")
    def echo(value: Any) -> Any:
        return value

    try:
        yield app
    finally:
        close_app(app)


class DeadConsumer:
    """A consumer of the app's queue that takes one message without acking it, refreshes its
    ``unacked_index`` score while alive (as the lease keeper does for a running task), and
    dies when told: it stops refreshing and never acks, as a killed worker."""

    def __init__(self, app: Celery) -> None:
        self.conn = Connection(app.conf.broker_url, transport_options=dict(FAST_REDELIVERY))
        self.queue = self.conn.SimpleQueue(app.conf.task_default_queue)
        self.message: Any = None
        self.alive = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def take(self) -> None:
        self.message = self.queue.get(block=True, timeout=10)
        delivery = Delivery.of(self.message)
        assert delivery is not None
        self.delivery = delivery
        self.alive.set()
        self._thread.start()

    def _refresh(self) -> None:
        while self.alive.is_set():
            refresh_unacked([self.delivery])
            time.sleep(0.3)

    def die(self) -> None:
        self.alive.clear()
        self._thread.join(5)

    def close(self) -> None:
        self.die()
        self.queue.close()
        self.conn.release()


@pytest.mark.parametrize(
    ("pool", "private_redis"),
    [
        ("solo", "redis"),
        ("threads", "redis"),
        # on Valkey in one pool: the server's part (unacked_index, the restore) is the same
        # in both, and each run waits out the visibility timeout (8 s)
        pytest.param("solo", "valkey", marks=pytest.mark.valkey),
    ],
    indirect=["private_redis"],
)
def test_a_message_its_dead_consumer_left_unacked_runs_on_the_next_sweep_in_a_loop_worker(
    pool: str, app: Celery, private_redis: RedisServer
) -> None:
    # Given a task message taken (and not acked) by a consumer that is alive
    result = app.tasks["t.echo"].delay("back")
    dead = DeadConsumer(app)
    client = private_redis.client()
    try:
        dead.take()

        # When a claim-aware worker with an event loop runs past the visibility timeout while
        # that consumer refreshes the delivery, as a live holder's keeper does
        with in_process_worker(app, pool=pool, concurrency=1) as worker:
            assert worker.hub is not None
            time.sleep(VISIBILITY_TIMEOUT_S + 2)

            # Then the live consumer's message is not restored, however often the sweep runs
            assert result.state == "PENDING"
            assert client.hexists("unacked", dead.delivery.tag)

            # And once the consumer dies, the worker gets the message back and runs it within
            # the visibility timeout and a sweep, not kombu 5.3 to 5.6's ~100 s
            dead.die()
            assert result.get(timeout=VISIBILITY_TIMEOUT_S + MARGIN_S) == "back"
        assert not client.hexists("unacked", dead.delivery.tag)
    finally:
        dead.close()
        client.close()


# --- real worker subprocesses, SIGKILLed, in every pool but prefork (test_fleet.py) --------


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "solo", "gevent", "eventlet"])
def test_killing_the_holding_worker_hands_the_task_to_the_other_worker_in_every_pool(
    pool: str, fleet: Fleet, private_redis: RedisServer
) -> None:
    if pool in ("gevent", "eventlet"):
        # a test extra (setup.cfg): missing fails, never skips (not imported here: eventlet warns)
        assert importlib.util.find_spec(pool) is not None, f"{pool} is not installed"
    # Given two workers of one queue in this pool and a task running on one of them
    url, queue = private_redis.url, unique(f"q-{pool}")
    concurrency = 4 if pool in ("gevent", "eventlet") else 2
    for name in ("a", "b"):
        fleet.worker(name, broker=url, backend=url, queue=queue, pool=pool, concurrency=concurrency)
    workers = {p.name: p.wait_ready() for p in fleet.procs}
    client = fleet.client(url, url, queue)
    result = client.send_task("fleet.sleep", (4,), task_id=f"loop-{pool}")
    first = wait_for(
        lambda: [e for e in executions(url, queue) if e["event"] == "start"],
        timeout=20,
        what="the first run",
    )[0]
    holder = str(first["worker"]).split("@")[0]

    # When the holding worker is killed mid-task
    workers[holder].kill_group()
    killed_at = time.monotonic()

    # Then the survivor gets the message back within the lease, the visibility timeout and a
    # margin far below kombu 5.3 to 5.6's ~100 s, and takes the expired claim over
    timeout_s = LEASE_MS / 1000 + VISIBILITY_TIMEOUT_S + 4 + MARGIN_S
    assert result.get(timeout=timeout_s) == 4, fleet.logs()
    runs = [e for e in executions(url, queue) if e["event"] == "start"]
    survivor = ({"a", "b"} - {holder}).pop()
    assert [str(r["worker"]).split("@")[0] for r in runs] == [holder, survivor], (
        time.monotonic() - killed_at
    )
    claims = fleet.claims(url)
    wait_done(claims, queue, f"loop-{pool}:0:0")
    assert claims.queue_stats()[queue].takeovers == 1
