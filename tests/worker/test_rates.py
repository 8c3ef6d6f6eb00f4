"""Fleet-wide rates (issue 32) with real prefork workers on Redis and RabbitMQ.

2 workers x prefork ``-c 2``; each task logs its start time (``tests/worker/apps/rates_app.py``)
and the test reads the windows from that log.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections import Counter
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_claims.model import AlreadyDone
from tests.cli.conftest import json_of, run_cli
from tests.cli.test_metrics import scrape, total
from tests.servers import RedisServer, free_port
from tests.worker.helpers import (
    HELD_RECHECK_MS,
    LEASE_MS,
    RENEW_INTERVAL_MS,
    unique,
    wait_done,
    wait_for,
)
from tests.worker.processes import Fleet, Proc

pytestmark = pytest.mark.slow

#: The issue's scenario: 120 short tasks at "10/s" across the fleet: about 12 s.
TASKS, RATE_PER_S = 120, 10
#: Whole-fleet slack on the batch's length (the issue asks for at most 20 % over 12 s).
SLACK = 1.2


def rates_worker(
    fleet: Fleet,
    name: str,
    *,
    broker: str,
    backend: str,
    queue: str,
    env: dict[str, str] | None = None,
    pool: tuple[str, ...] = ("-P", "prefork", "-c", "2"),
) -> Proc:
    """``celery worker`` on ``tests.worker.apps.rates_app``, prefork ``-c 2`` (or ``pool``),
    consuming ``queue`` and ``<queue>-other``, with the short leases of the worker tests."""
    args = [
        "-A", "tests.worker.apps.rates_app", "worker",
        *pool, "-n", f"{name}@%h", "-l", "INFO",
        "-Q", f"{queue},{queue}-other",
        "--without-mingle", "--without-gossip", "--without-heartbeat",
        "--claims-lease-ms", str(LEASE_MS),
        "--claims-renew-interval-ms", str(RENEW_INTERVAL_MS),
        "--claims-held-recheck-ms", str(HELD_RECHECK_MS),
        "--claims-socket-timeout-ms", "1000",
    ]  # fmt: skip
    environ = {
        "CLAIMS_TEST_BROKER": broker,
        "CLAIMS_TEST_BACKEND": backend,
        "CLAIMS_TEST_QUEUE": queue,
        **(env or {}),
    }
    return fleet._spawn(name, args, environ)


def _log(backend: str, queue: str) -> list[dict[str, Any]]:
    with contextlib.closing(redis.Redis.from_url(backend)) as client:
        return [json.loads(raw) for raw in client.lrange(f"starts:{queue}", 0, -1)]


def _starts(backend: str, queue: str, task: str) -> list[dict[str, Any]]:
    return [e for e in _log(backend, queue) if e["event"] == "start" and e["task"] == task]


#: Jitter allowed between starts. A rated task logs when the store let it start (its grant,
#: by the store's clock, ``claims_rate_at_ms``), so its rate is checked exactly; the margin is
#: for the tasks that log their own start time (Celery's rate_limit, unrated ones), after the
#: event loop handed them to a pool process (their logged starts jittered by 120 ms on a loaded
#: machine: a lane-rate test then saw 4 starts of a 3/s key within 1 s).
JITTER_S = 0.05


def _most_in_window(times: list[float], window_s: float = 1.0) -> int:
    """The most starts logged in any half-open window of ``window_s`` minus the jitter."""
    times = sorted(times)
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= window_s - JITTER_S:
            first += 1
        most = max(most, last - first + 1)
    return most


def _fleet(
    fleet: Fleet, request: pytest.FixtureRequest, broker: str, backend: str, **env: str
) -> tuple[str, dict[str, Proc]]:
    queue = unique("q")
    if hasattr(request.node, "rabbitmq_queues"):
        request.node.rabbitmq_queues.extend([queue, f"{queue}-other"])
    workers = {
        name: rates_worker(fleet, name, broker=broker, backend=backend, queue=queue, env=env)
        for name in ("a", "b")
    }
    for proc in workers.values():
        proc.wait_ready()
    return queue, workers


@pytest.mark.timeout(90)
def test_a_task_rate_holds_across_the_fleet_without_slowing_it_and_other_queues_flow(
    request: pytest.FixtureRequest, broker: str, fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given 2 workers x prefork -c 2 and a task with claims_rate="10/s"
    backend = private_redis.url
    queue, _ = _fleet(fleet, request, broker, backend)
    client = fleet.client(broker, backend, queue)

    # When 120 of them are sent at once, and a task of the other queue once they wait
    began = time.time()
    results = [client.send_task("rates.tick", task_id=f"tick-{i}") for i in range(TASKS)]
    wait_for(
        lambda: any(e["event"] == "held" for e in _log(backend, queue)),
        timeout=10,
        what="a copy held for its rate",
    )
    other_sent = time.time()
    other = client.send_task("rates.other", queue=f"{queue}-other", task_id="other")
    other.get(timeout=10)
    other_ran = _starts(backend, queue, "rates.other")[0]["at"] - other_sent
    for result in results:
        result.get(timeout=40)
    log = _log(backend, queue)
    starts = sorted(e["at"] for e in log if e["event"] == "start" and e["task"] == "rates.tick")
    # each start is the store's grant (claims_rate_at_ms), not when a pool process got to it
    ticks = [e for e in log if e["event"] == "start" and e["task"] == "rates.tick"]
    assert all(e["at"] != e["logged"] for e in ticks), ticks[:3]

    # Then every task ran once, never more than 10 started in any 1 s window, the batch took
    # no more than 20 % over its 12 s, and the other queue's task did not wait for the batch
    assert len(starts) == TASKS, fleet.logs()
    assert _most_in_window(starts) <= RATE_PER_S, starts
    took = starts[-1] - began
    assert took <= TASKS / RATE_PER_S * SLACK, took
    assert other_ran < 2.0, other_ran
    held = [e for e in log if e["event"] == "held"]
    assert held
    assert all(e["reason"] == "rate" for e in held)
    assert all(e["rate"] == "task:rates.tick" for e in held)
    assert "rate task:rates.tick is used up" in fleet.logs()


@pytest.mark.timeout(60)
def test_celerys_own_rate_limit_holds_per_worker_only(
    request: pytest.FixtureRequest, fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given the same fleet (Redis broker) and a task with Celery's rate_limit="10/s" (control)
    backend = broker = private_redis.url
    queue, _ = _fleet(fleet, request, broker, backend)
    client = fleet.client(broker, backend, queue)

    # When 120 are sent
    results = [client.send_task("rates.celery_tick", task_id=f"c-{i}") for i in range(TASKS)]
    for result in results:
        result.get(timeout=40)
    starts = [e["at"] for e in _starts(backend, queue, "rates.celery_tick")]

    # Then each worker keeps its own 10/s: about twice as many per second across the fleet
    assert len(starts) == TASKS
    assert _most_in_window(starts) >= 1.6 * RATE_PER_S, _most_in_window(starts)


@pytest.mark.timeout(60)
def test_celerys_rate_limit_made_fleetwide_holds_across_the_fleet(
    request: pytest.FixtureRequest, fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given claims_rate_limit_fleetwide and a task with Celery's rate_limit="10/s"
    backend = broker = private_redis.url
    queue, _ = _fleet(fleet, request, broker, backend, CLAIMS_TEST_FLEETWIDE="1")
    client = fleet.client(broker, backend, queue)

    # When 60 are sent
    began = time.time()
    results = [client.send_task("rates.celery_tick", task_id=f"c-{i}") for i in range(60)]
    for result in results:
        result.get(timeout=30)
    starts = sorted(e["at"] for e in _starts(backend, queue, "rates.celery_tick"))

    # Then the fleet, not each worker, keeps 10/s, and about as fast as that allows
    assert len(starts) == 60
    assert _most_in_window(starts) <= RATE_PER_S, starts
    assert starts[-1] - began <= 6 * SLACK


@pytest.mark.timeout(60)
def test_a_fleetwide_worker_no_longer_sleeps_on_celerys_own_rate_limit(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given claims_rate_limit_fleetwide, one worker, and a task with rate_limit="5/s" and a
    # looser claims_rate="20/s" (which wins: Celery's token bucket must be off for it)
    backend = broker = private_redis.url
    queue = unique("q")
    env = {"CLAIMS_TEST_FLEETWIDE": "1"}
    rates_worker(fleet, "a", broker=broker, backend=backend, queue=queue, env=env).wait_ready()
    client = fleet.client(broker, backend, queue)

    # When 40 are sent
    began = time.time()
    results = [client.send_task("rates.both", task_id=f"b-{i}") for i in range(40)]
    for result in results:
        result.get(timeout=30)
    starts = sorted(e["at"] for e in _starts(backend, queue, "rates.both"))

    # Then they ran at 20/s (about 2 s), not at Celery's 5/s (8 s)
    assert len(starts) == 40
    assert _most_in_window(starts) <= 20
    assert starts[-1] - began <= 2 * SLACK + 0.5, starts[-1] - began


@pytest.mark.timeout(60)
def test_a_rate_per_key_holds_per_customer_and_customers_take_turns(
    request: pytest.FixtureRequest, broker: str, fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given claims_rate="2/s" per customer (claims_rate_key="customer")
    backend = private_redis.url
    queue, _ = _fleet(fleet, request, broker, backend, CLAIMS_TEST_RATE="2/s")
    client = fleet.client(broker, backend, queue)

    # When 5 customers send 8 tasks each, one customer's all before the next one's
    results = [
        client.send_task("rates.customer", (f"c{c}",), task_id=f"k-{c}-{i}")
        for c in range(5)
        for i in range(8)
    ]
    for result in results:
        result.get(timeout=30)
    starts = sorted(_starts(backend, queue, "rates.customer"), key=lambda e: e["at"])

    # Then never more than 2 per customer per second, and the customers are interleaved:
    # the first 10 starts cover every customer (none waits for another's backlog)
    assert len(starts) == 40
    for c in range(5):
        times = [e["at"] for e in starts if e["customer"] == f"c{c}"]
        assert _most_in_window(times) <= 2, (c, times)
    assert {e["customer"] for e in starts[:10]} == {f"c{c}" for c in range(5)}
    # 8 per customer at 2/s: about 3.5 s, all customers at once
    assert starts[-1]["at"] - starts[0]["at"] <= 3.5 * SLACK + 0.5


@pytest.mark.timeout(90)
def test_a_worker_killed_mid_batch_loses_nothing_and_the_rate_still_holds(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given the fleet on the Redis broker and 60 tasks at 10/s on their way
    backend = broker = private_redis.url
    queue = unique("q")
    workers = {
        name: rates_worker(fleet, name, broker=broker, backend=backend, queue=queue)
        for name in ("a", "b")
    }
    for proc in workers.values():
        proc.wait_ready()
    client = fleet.client(broker, backend, queue)
    results = [client.send_task("rates.tick", task_id=f"t-{i}") for i in range(60)]

    # When worker a is SIGKILLed (with its held copies) 2 s in
    wait_for(lambda: len(_starts(backend, queue, "rates.tick")) >= 20, timeout=10, what="20")
    workers["a"].kill_group(signal.SIGKILL)

    # Then every task completes (a's copies come back and are taken over), none ran twice
    # after completing, and never more than 10 started in any second
    store = fleet.claims(broker)
    unstored = []
    for result in results:
        record = wait_done(store, queue, f"{result.id}:0:0", timeout=50)
        assert isinstance(record, AlreadyDone), record
        if record.owner.startswith("b@") or result.ready():
            result.get(timeout=10)  # b stores its results right after their records
        else:
            unstored.append(result.id)
    # a task whose body a ended just before the kill may have no result: a records the
    # completion as the body returns, before Celery stores the result, and it never runs
    # again (docs/semantics.md, "What is left"): at most a's pool of 2 (seen 1 in ~20 runs
    # under load, its record 2 ms before the kill)
    assert len(unstored) <= 2, unstored
    starts = _starts(backend, queue, "rates.tick")
    ids = Counter(e["id"] for e in starts)
    assert set(ids) == {f"t-{i}" for i in range(60)}
    # a task a was running when killed may start again on b: at most its pool's 2
    assert sum(n - 1 for n in ids.values()) <= 2, ids
    assert _most_in_window([e["at"] for e in starts]) <= RATE_PER_S


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"CLAIMS_TEST_BAD": "rate"}, "rates.tick.claims_rate: unit must be s, m or h"),
        ({"CLAIMS_TEST_RATE": "-1/s"}, ".claims_rate: must be a whole number"),
        ({"CLAIMS_TEST_RATE": "0/s"}, ".claims_rate: must allow at least 1 start"),
        ({"CLAIMS_TEST_BAD": "key"}, "rates.customer.claims_rate_key: rates.customer takes no"),
    ],
)
def test_a_bad_rate_stops_the_worker_with_an_error_naming_it(
    fleet: Fleet, private_redis: RedisServer, env: dict[str, str], words: str
) -> None:
    # Given a task with a bad rate declaration
    backend = private_redis.url
    # When a worker starts
    proc = rates_worker(fleet, "bad", broker=backend, backend=backend, queue=unique("q"), env=env)
    # Then it exits with one line naming the attribute
    assert proc.popen.wait(timeout=30) != 0
    line = next(line for line in proc.output().splitlines() if line.startswith("Error: "))
    assert line.startswith("Error: rates."), line
    assert words in line, line


@pytest.mark.timeout(60)
def test_a_message_whose_rate_key_cannot_be_made_is_refused_and_recorded(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given the fleet and a per-key task sent without its customer argument
    backend = broker = private_redis.url
    queue = unique("q")
    rates_worker(fleet, "a", broker=broker, backend=backend, queue=queue).wait_ready()
    client = fleet.client(broker, backend, queue)

    # When it arrives
    result = client.send_task("rates.customer", (), task_id="nokey")

    # Then it is recorded as failed with KeyRefused, acked, never run
    with pytest.raises(Exception, match="do not bind") as raised:
        result.get(timeout=15)
    assert type(raised.value).__name__ == "KeyRefused"
    assert result.state == "FAILURE"
    assert not _starts(backend, queue, "rates.customer")
    with contextlib.closing(redis.Redis.from_url(broker)) as plain:
        wait_for(lambda: plain.llen(queue) == 0, timeout=5, what="queue empty")


@pytest.mark.timeout(60)
def test_a_lane_rate_holds_across_the_fleet_alone_and_per_key(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a lane on the other queue with a rate only, "5/s", and on the limited queue a lane
    # with a rate per customer, "2/s" (keyed lanes hold their key inside the lane)
    backend = broker = private_redis.url
    queue = unique("q")
    lanes = {
        "mail": {"queues": [f"{queue}-other"], "rate": "5/s"},
        "sms": {"queues": [queue], "kinds": ["rates.customer"], "rate": "3/s", "key": "customer"},
    }
    workers = [
        rates_worker(
            fleet, name, broker=broker, backend=backend, queue=queue,
            env={"CLAIMS_TEST_LANES": json.dumps(lanes)},
        )
        for name in ("a", "b")
    ]  # fmt: skip
    for proc in workers:
        proc.wait_ready()
    client = fleet.client(broker, backend, queue)

    # When 20 tasks go to the mail lane, and 3 customers send 6 tasks each to the sms lane
    # (whose task's own claims_rate, 10/s per customer, is looser than the lane's)
    began = time.time()
    results = [
        client.send_task("rates.other", queue=f"{queue}-other", task_id=f"m-{i}") for i in range(20)
    ]
    results += [
        client.send_task("rates.customer", (f"c{c}",), task_id=f"s-{c}-{i}")
        for c in range(3)
        for i in range(6)
    ]
    for result in results:
        result.get(timeout=20)
    mail = sorted(e["at"] for e in _starts(backend, queue, "rates.other"))
    sms = _starts(backend, queue, "rates.customer")

    # Then at most 5 mail tasks start per second across the fleet, as fast as that allows,
    # and at most 3 sms tasks per customer, the customers side by side
    assert len(mail) == 20
    assert _most_in_window(mail) <= 5, mail
    assert 3.5 <= mail[-1] - began <= 4 * SLACK + 0.5
    assert len(sms) == 18
    for c in range(3):
        times = [e["at"] for e in sms if e["customer"] == f"c{c}"]
        assert _most_in_window(times) <= 3, (c, times)
    assert _most_in_window([e["at"] for e in sms]) >= 6  # customers do not wait on each other


@pytest.mark.timeout(60)
def test_stats_list_and_inspect_say_which_rate_holds_a_waiting_copy(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given one worker and a task at "1/s" with 4 copies sent at once: 3 wait for the rate
    backend = broker = private_redis.url
    queue, port = unique("q"), free_port()
    env = {"CLAIMS_TEST_RATE": "1/m", "CLAIMS_TEST_METRICS_PORT": str(port)}
    rates_worker(fleet, "a", broker=broker, backend=backend, queue=queue, env=env).wait_ready()
    client = fleet.client(broker, backend, queue)
    for i in range(4):
        client.send_task("rates.tick", task_id=f"v-{i}")
    held = wait_for(
        lambda: [e["id"] for e in _log(backend, queue) if e["event"] == "held"],
        timeout=10,
        what="held copies",
    )
    cli = ("--redis-url", backend, "--prefix", "claims")

    # When the operator asks for stats, the live claims and one held task
    # (the worker's history writer posts each hold a moment after it)
    stats = wait_for(
        lambda: (
            (found := json_of(run_cli(*cli, "stats", "--json")))["rates"]
            and found["rates"][0]["waiting"] == 3
            and found
        ),
        timeout=10,
        what="the 3 waiting copies in stats",
    )
    text = run_cli(*cli, "stats").stdout
    listed = run_cli(*cli, "list").stdout
    inspected = run_cli(*cli, "inspect", held[0]).stdout
    scraped = scrape(port)

    # Then each names the rate, and stats counts the copies waiting for it
    assert stats["rates"] == [{"rate": "task:rates.tick", "waiting": 3}]
    assert "task:rates.tick" in text
    assert "waiting (rate task:rates.tick)" in listed, listed
    assert "WAITING for rate task:rates.tick (claimed, not running yet)" in inspected, inspected
    assert "waiting for rate task:rates.tick (used up)" in inspected
    # and the worker's exporter counts them, and its checks: the allowance of the first copy,
    # which said when the next start may go, and a refusal for each other copy, each asked in
    # its claim's own call (claim_rated.lua), and at most one more; none since: nothing polls
    waiting = {
        dict(labels)["rate"]: value
        for (name, labels), value in scraped.items()
        if name == "celery_claims_worker_rate_waiting"
    }
    assert waiting == {"task:rates.tick": 3}
    assert total([scraped], "celery_claims_worker_rate_checks_total", outcome="allowed") == 1
    assert total([scraped], "celery_claims_worker_rate_checks_total", outcome="limited") <= 4


@pytest.mark.timeout(60)
def test_a_lost_broker_connection_releases_the_claims_of_copies_waiting_for_their_rate(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given one worker on the Redis broker, a task at "1/m", 4 copies sent: 3 wait
    backend = broker = private_redis.url
    queue = unique("q")
    rates_worker(
        fleet, "a", broker=broker, backend=backend, queue=queue, env={"CLAIMS_TEST_RATE": "1/m"}
    ).wait_ready()
    client = fleet.client(broker, backend, queue)
    for i in range(4):
        client.send_task("rates.tick", task_id=f"w-{i}")
    wait_for(
        lambda: len([e for e in _log(backend, queue) if e["event"] == "held"]) == 3,
        timeout=10,
        what="3 copies waiting for the rate",
    )
    waiting = sorted({e["id"] for e in _log(backend, queue) if e["event"] == "held"})
    cli = ("--redis-url", backend, "--prefix", "claims")

    # When every connection of the worker is killed (its consumer reconnects)
    with contextlib.closing(redis.Redis.from_url(backend)) as plain:
        plain.client_kill_filter(_type="normal", skipme=True)

    # Then each waiting copy's claim was released, and its message, delivered again, is
    # claimed again and waits again: nothing ran early, nothing was lost
    def released_and_waiting_again() -> bool:
        for task_id in waiting:
            text = run_cli(*cli, "inspect", task_id).stdout
            if "connection closed before it ran" not in text or "WAITING for rate" not in text:
                return False
        return True

    wait_for(released_and_waiting_again, timeout=30, what="released, then waiting again")
    assert [e["id"] for e in _starts(backend, queue, "rates.tick")] == [
        next(f"w-{i}" for i in range(4) if f"w-{i}" not in waiting)
    ]


#: A backlog far longer than any worker's prefetch window, of a task whose rate lets one
#: start an hour: everything after the first waits for the whole test.
BACKLOG = 500


def _ready(broker: str, queue: str) -> int:
    """The messages of ``queue`` still in the broker, not delivered to any worker."""
    if broker.startswith("redis"):
        with contextlib.closing(redis.Redis.from_url(broker)) as client:
            return int(client.llen(queue))
    with Connection(broker) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "pool", [("-P", "prefork", "-c", "2"), ("-P", "solo", "-c", "1")], ids=["prefork", "solo"]
)
def test_a_backlog_over_its_rate_waits_within_the_prefetch_window_and_other_queues_flow(
    request: pytest.FixtureRequest,
    broker: str,
    fleet: Fleet,
    private_redis: RedisServer,
    pool: tuple[str, ...],
) -> None:
    # Given one worker consuming two queues, and a task of the first at "1/h"
    backend = private_redis.url
    queue = unique("q")
    if hasattr(request.node, "rabbitmq_queues"):
        request.node.rabbitmq_queues.extend([queue, f"{queue}-other"])
    env = {"CLAIMS_TEST_RATE": "1/h"}
    proc = rates_worker(fleet, "a", broker=broker, backend=backend, queue=queue, env=env, pool=pool)
    proc.wait_ready()
    window = 4 * (2 if "prefork" in pool else 1)  # worker_prefetch_multiplier x concurrency
    client = fleet.client(broker, backend, queue)

    # When a backlog of 500 of them is sent, and a task of the other queue once they wait
    for i in range(BACKLOG):
        client.send_task("rates.tick", task_id=f"tick-{i}")
    wait_for(
        lambda: len({e["id"] for e in _log(backend, queue) if e["event"] == "held"}) >= window,
        timeout=30,
        what="a window of copies waiting for their rate",
    )
    other = client.send_task("rates.other", queue=f"{queue}-other", task_id="other")

    # Then the other queue's task runs without waiting for the backlog (an hour), and the
    # worker keeps no more than three times its prefetch window of the backlog (two close
    # the queue, a window's slots may be on their way): the rest stays in the broker
    other.get(timeout=30)
    waited = {e["id"] for e in _log(backend, queue) if e["event"] == "held"}
    assert len(_starts(backend, queue, "rates.tick")) == 1
    assert len(waited) <= 3 * window, len(waited)
    assert _ready(broker, queue) >= BACKLOG - 1 - 3 * window
