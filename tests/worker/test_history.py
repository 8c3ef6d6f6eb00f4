"""The task history never holds up the worker's loop, even while the claim store hangs.

A held copy is recorded in its history while the claim store cannot be reached: exactly when a write
to the store blocks until its socket timeout. Real ``celery worker`` subprocess (the history is
bound to a worker by ``worker_ready``, which only the ``celery worker`` command sends); the claim
store is a private ``redis-server`` stopped with SIGSTOP, so it accepts connections and never
answers, as a store that hangs or reloads does.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from datetime import datetime

import pytest

from celery_claims.observe import History
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet

pytestmark = pytest.mark.slow

#: Copies held while the store hangs.
HELD = 3
#: The worker's claim store socket timeout: a write to the hung store takes at least this.
SOCKET_TIMEOUT_S = 2.0

_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/MainProcess\] (.*)$", re.M)


@pytest.fixture
def store() -> Iterator[RedisServer]:
    """The worker's claim store, a Redis of its own (the test stops and resumes it)."""
    with redis_server() as server:
        yield server


def _signal(server: RedisServer, sig: signal.Signals) -> None:
    assert server.proc is not None
    server.proc.send_signal(sig)


def _main_process_log(output: str) -> list[tuple[datetime, str]]:
    return [
        (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f"), text)
        for stamp, text in _LINE.findall(output)
    ]


def _at(log: list[tuple[datetime, str]], prefix: str) -> datetime:
    [at] = [at for at, text in log if text.startswith(prefix)]
    return at


def test_a_held_copy_journaled_while_the_store_hangs_neither_stalls_the_loop_nor_is_lost(
    fleet: Fleet, private_redis: RedisServer, store: RedisServer
) -> None:
    # Given a prefork worker whose claim store is a Redis of its own, and that has run a task
    # (held copies are re-checked only after the store is back)
    broker, queue = private_redis.url, unique("q")
    worker = fleet.worker(
        "j", broker=broker, backend=broker, queue=queue, app="tests.worker.apps.history_app",
        extra=("--claims-redis-url", store.url,
               "--claims-socket-timeout-ms", str(int(SOCKET_TIMEOUT_S * 1000)),
               "--claims-unavailable-retry-ms", "8000",
               "--claims-unavailable-retry-max-ms", "8000"),
    ).wait_ready()  # fmt: skip
    client = fleet.client(broker, broker, queue)
    assert client.send_task("history.claimed", (0,)).get(timeout=20) == 0

    # When the claim store hangs and copies of claimed tasks arrive: each is held, unclaimed,
    # and journaled
    _signal(store, signal.SIGSTOP)
    try:
        held = [client.send_task("history.claimed", (i,), task_id=f"held-{i}") for i in range(HELD)]
        last = f"Held history.claimed[held-{HELD - 1}]: claim store unavailable"
        wait_for(lambda: last in worker.output(), timeout=30, what=f"{last}\n{fleet.logs()}")
        assert all(r.state == "PENDING" for r in held), "a task ran while its claim was unknown"
    finally:
        _signal(store, signal.SIGCONT)

    # Then the loop took each next message as soon as it had held a copy: it did not wait on
    # the hung store for the history (a write there takes at least the socket timeout)
    log = _main_process_log(worker.output())
    for i in range(HELD - 1):
        held_at = _at(log, f"Held history.claimed[held-{i}]: claim store unavailable")
        next_at = _at(log, f"Task history.claimed[held-{i + 1}] received")
        assert (next_at - held_at).total_seconds() < SOCKET_TIMEOUT_S, worker.output()[-3000:]

    # And once the store answers again every held task runs, and the history tells that each
    # copy was held while the store was down: written then, not lost
    assert [r.get(timeout=30) for r in held] == list(range(HELD))
    history = History(fleet.claims(store.url).client, "claims")
    histories = wait_for(
        lambda: all((j := history.read_many(r.id for r in held)).values()) and j,
        timeout=10,
        what="the history of the held copies",
    )
    for result in held:
        events = [(e.event, e.reason) for e in histories[result.id]]
        assert ("held", "unavailable") in events, (result.id, events)
    assert worker.alive()
