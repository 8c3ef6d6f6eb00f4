"""The app of the Celery overhead benchmark (see ``bench/celery_overhead.py``).

``BENCH_VARIANT`` picks what the tasks run under: ``plain`` (Celery alone), ``rt1`` (Celery
plus the least any execution-time claim costs: one blocking round trip of a one-line Lua
script to the store per message, in the consumer before the pool gets it), ``rt2-sep`` (the
least an execution-time claim costs with the store on a server of its own, ``BENCH_STORE_URL``,
and the completion recorded before the ack: one blocking round trip there before the pool gets
the message, and one more in the main process before Celery acks it), ``rt2p-sep``
(``rt2-sep`` with its second round trip in the pool process after the body, waited for
before the task reports back, where celery-claims records a prefork task: the least a store
apart costs while a main process stopped before its ack cannot let the task run again),
``ride0`` (the least a claim
that rides the broker's round trips can cost: kombu's delivery transaction carries a minimal
claim script and its ack transaction a minimal completion script, in the worker's main process,
no round trip of their own; see :class:`RideFloorQoS`), ``claims``
(``celery_claims.install``, the claim store on the broker's server, the default),
``claims-nj`` (``claims`` with the publish journal off), ``claims-np`` (``claims`` with
the pool process's part taken out: no waited settle, no record sent ahead; the ack alone
writes the record, as a measurement of what that part costs, never a mode to run: a main
process stopped after the body and before its ack then lets the task run again; see
:func:`without_the_pool_record`), ``claims-aoc`` (``claims`` acking
each message at claim, ``claims_ack_on_claim``), ``claims-sep`` (the same with the claim
store on a server of its own, ``BENCH_STORE_URL``, as a fleet on RabbitMQ has it),
``claims-sep-nj`` (``claims-sep`` with the publish journal off: what the journal costs a
store apart), ``once`` (celery-once's ``QueueOnce`` base) or ``singleton``
(celery-singleton's ``Singleton`` base). ``BENCH_URL`` is the Redis used as broker and as
every plugin's store; ``BENCH_QUEUE`` the queue; ``BENCH_PREFETCH`` the
``worker_prefetch_multiplier`` (1, what celery-claims recommends, unless given);
``BENCH_RENEW_MS`` the ``claims_renew_interval_ms`` (15 s unless given). No result
backend: the benchmark measures the time to drain the queue. The producer builds the same app
with :func:`build`, since celery-once and celery-singleton take their lock when a task is
sent.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import redis
from celery import Celery, bootsteps
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual


class OneRoundTrip(bootsteps.StartStopStep):  # type: ignore[misc]
    """The ``rt1`` reference: one ``EVALSHA`` round trip per message before the pool runs it."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    #: one more round trip before the main process acks the message
    before_ack = False

    def store_url(self, c: Any) -> str:
        return str(c.app.conf.broker_url)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        client = redis.Redis.from_url(self.store_url(c))
        script = client.register_script("return 1")
        inner = c.on_task_request
        before_ack = self.before_ack

        def on_task_request(request: Any) -> Any:
            script(keys=[request.id], args=[])
            if before_ack:
                acknowledge = request.acknowledge

                def acknowledge_after_a_round_trip() -> None:
                    script(keys=[request.id], args=[])
                    acknowledge()

                request.acknowledge = acknowledge_after_a_round_trip  # the instance's own
            return inner(request)

        c.on_task_request = on_task_request
        super().__init__(c, **kwargs)


class RecordInThePool(OneRoundTrip):
    """The ``rt2p-sep`` reference: ``rt2-sep`` with its second round trip made where
    celery-claims makes it on prefork, in the pool process once the body has run and before
    the task reports back (a ``task_postrun`` receiver, waited for), so that a main process
    stopped before its ack cannot let the task run again: the least a store apart costs with
    that property kept. On solo the pool process is the main process."""

    def store_url(self, c: Any) -> str:
        return os.environ["BENCH_STORE_URL"]


#: The pool process's client and script for ``rt2p-sep`` (made in the process, after the fork).
_POOL_SCRIPT: dict[int, Any] = {}


def record_in_the_pool(task_id: str | None = None, **_: Any) -> None:
    """``rt2p-sep``'s record: one waited ``EVALSHA`` round trip from the process that ran the
    body."""
    script = _POOL_SCRIPT.get(os.getpid())
    if script is None:
        client = redis.Redis.from_url(os.environ["BENCH_STORE_URL"])
        script = _POOL_SCRIPT[os.getpid()] = client.register_script("return 1")
    script(keys=[task_id or ""], args=[])


class TwoRoundTrips(OneRoundTrip):
    """The ``rt2-sep`` reference: one ``EVALSHA`` round trip per message to a server of its own
    before the pool runs it, and one before the main process acks it (where a claim store apart
    claims, and records the completion the ack must wait for)."""

    before_ack = True

    def store_url(self, c: Any) -> str:
        return os.environ["BENCH_STORE_URL"]


#: The ``ride0`` claim: refuse a task recorded done or claimed live by another owner, else
#: claim it (entry: owner and expiry in ms). KEYS: the claims hash, the records hash.
#: ARGV: task id, owner, lease ms. Returns 1 (claimed), 2 (held by another) or 7 (done).
RIDE0_CLAIM = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 7 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local e = redis.call('HGET', KEYS[1], ARGV[1])
if e then
  local owner, expires = string.match(e, '^(.*) (%d+)$')
  if owner ~= ARGV[2] and now < tonumber(expires) then return 2 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. (now + tonumber(ARGV[3])))
return 1
"""
#: The ``ride0`` completion: only the claim's owner records it (the claim goes, the record
#: stays). KEYS, ARGV[1..2] as above. Returns 1 (recorded) or 5 (not this owner's claim).
RIDE0_DONE = """
local e = redis.call('HGET', KEYS[1], ARGV[1])
if not e or string.sub(e, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return 5 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], '1')
return 1
"""


def ride0_keys(queue: str) -> tuple[str, str]:
    """The ``ride0`` variant's claims hash and records hash for ``queue``."""
    return f"ride0:{queue}:c", f"ride0:{queue}:d"


class RideFloorQoS(kombu_redis.QoS):  # type: ignore[misc]  # kombu is untyped
    """kombu's Redis QoS with a claim in its delivery transaction and a completion in its ack
    transaction (the ``ride0`` reference): what an execution-time claim on the broker's own
    Redis costs at the least, with nothing else (no renewal, no journal, no pool settle, no
    lifecycle). A copy refused a claim would be skipped by a real design; here every claim
    must succeed, and the benchmark checks that every task left one record and no claim."""

    owner = f"{socket.gethostname()}:{os.getpid()}"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ids: dict[str, tuple[str, tuple[str, str]]] = {}
        with self.channel.conn_or_acquire() as client:
            self._claim = client.script_load(RIDE0_CLAIM)
            self._done = client.script_load(RIDE0_DONE)

    def append(self, message: Any, delivery_tag: str) -> None:
        task_id = message.headers["id"]
        delivery = message.delivery_info
        keys = ride0_keys(delivery["routing_key"])
        raw = kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.pipe_or_acquire() as pipe:
            replies = (
                pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
                .hset(self.unacked_key, delivery_tag, raw)
                .evalsha(self._claim, 2, *keys, task_id, self.owner, 60_000)
                .execute()
            )
        if replies[-1] != 1:
            raise RuntimeError(f"ride0: claim of {task_id} refused ({replies[-1]})")
        self._ids[delivery_tag] = (task_id, keys)
        kombu_virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        task_id, keys = self._ids.pop(delivery_tag)
        replies = (
            self._remove_from_indices(delivery_tag)
            .evalsha(self._done, 2, *keys, task_id, self.owner)
            .execute()
        )
        if replies[-1] != 1:
            raise RuntimeError(f"ride0: completion of {task_id} refused ({replies[-1]})")
        kombu_virtual.QoS.ack(self, delivery_tag)


class RideFloor(bootsteps.StartStopStep):  # type: ignore[misc]
    """The ``ride0`` reference: the consumer's channels use :class:`RideFloorQoS`."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        kombu_redis.Channel.QoS = RideFloorQoS
        super().__init__(c, **kwargs)


def build(variant: str, url: str, queue: str) -> Celery:
    """The benchmark app for one variant."""
    app = Celery(f"bench-{variant}", broker=url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        # the settings celery-claims recommends, for every variant alike
        task_acks_late=True,
        worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "1")),
        task_ignore_result=True,
        task_time_limit=600,
        worker_hijack_root_logger=False,
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": url, "default_timeout": 600},
        },
        singleton_backend_url=url,
        claims_lease_ms=60_000,
        # BENCH_RENEW_MS: bench/ceiling.py shortens it so each batch's journal entries are
        # cleared (on the keeper's beat) within a second of its last ack
        claims_renew_interval_ms=int(os.environ.get("BENCH_RENEW_MS", "15000")),
    )
    base: Any = None
    if variant == "rt1":
        app.steps["consumer"].add(OneRoundTrip)
    elif variant == "rt2-sep":
        app.steps["consumer"].add(TwoRoundTrips)
    elif variant == "rt2p-sep":
        from celery import signals

        app.steps["consumer"].add(RecordInThePool)
        signals.task_postrun.connect(record_in_the_pool, weak=False)
    elif variant == "ride0":
        app.steps["consumer"].add(RideFloor)
    elif variant in (
        "claims",
        "claims-sep",
        "claims-nj",
        "claims-sep-nj",
        "claims-aoc",
        "claims-np",
    ):
        from celery_claims.worker import install

        if variant == "claims-np":
            without_the_pool_record()

        if variant == "claims-aoc":
            # acknowledged once claimed: one waited journal write per message, on the loop
            app.conf.claims_ack_on_claim = True
        if variant in ("claims-sep", "claims-sep-nj"):
            app.conf.claims_redis_url = os.environ["BENCH_STORE_URL"]
        if variant in ("claims-nj", "claims-sep-nj"):
            # the producer's publish journal off: what it costs the batch (one round trip per
            # publish, made by the producer, counted in the batch's time)
            app.conf.claims_journal = False
        install(app)
    elif variant == "once":
        from celery_once import QueueOnce

        base = QueueOnce
    elif variant == "singleton":
        from celery_singleton import Singleton

        base = Singleton
    options: dict[str, Any] = {} if base is None else {"base": base}

    @app.task(name="bench.noop", shared=False, **options)
    def noop(i: int) -> None:
        """Nothing: the per-task cost of the machinery alone."""
        return

    @app.task(name="bench.sleep10", shared=False, **options)
    def sleep10(i: int) -> None:
        """10 ms of work."""
        time.sleep(0.01)

    return app


def without_the_pool_record() -> None:
    """``claims-np``: the pool process neither settles a succeeded task (``ack_done.lua``,
    waited for) nor sends its record ahead; the worker's ack writes the record alone, in the
    one script that replaces kombu's ack. What is left of ``claims`` is what a claim costs
    without the property the pool's part keeps (a main process stopped after the body and
    before its ack cannot let the task run again): the benchmark's measure of that part."""
    from celery_claims.worker.delivery import guard
    from celery_claims.worker.delivery.completion import Completion

    Completion.pool_settle = lambda self, copy: None  # type: ignore[method-assign]
    guard._Verifier.send_record = lambda self, claim: None  # type: ignore[method-assign]


def profile_main_process(path: str) -> None:
    """Profile the worker's main thread (cProfile) from ``worker_init`` until
    ``worker_shutdown`` and write the stats to ``path`` (``BENCH_PROFILE``): where its CPU
    per message goes."""
    import cProfile

    from celery.signals import worker_init, worker_shutdown

    profiler = cProfile.Profile()

    @worker_init.connect(weak=False)
    def _start(**_: Any) -> None:
        profiler.enable()  # the main thread: the consumer's event loop runs on it

    @worker_shutdown.connect(weak=False)
    def _stop(**_: Any) -> None:
        profiler.disable()
        profiler.dump_stats(path)


def profile_pool_processes(path: str) -> None:
    """Profile each prefork pool process (cProfile) from ``worker_process_init`` until it
    ends, one file per process: ``path`` with the pid appended (``BENCH_PROFILE``)."""
    import atexit
    import cProfile

    from celery.signals import worker_process_init, worker_process_shutdown

    profiler = cProfile.Profile()

    def _stop(**_: Any) -> None:
        profiler.disable()
        profiler.dump_stats(f"{path}.pool-{os.getpid()}")

    @worker_process_init.connect(weak=False)
    def _start(**_: Any) -> None:
        atexit.register(_stop)
        profiler.enable()

    worker_process_shutdown.connect(_stop, weak=False)


def name_threads() -> None:
    """Give each Python thread its name in the kernel (``prctl(PR_SET_NAME)``), as
    ``/proc/PID/task/*/status`` shows it (``BENCH_THREAD_NAMES``: ``bench/switches.py``)."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None)
    inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named(self: threading.Thread) -> None:
        libc.prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        inner(self)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]


if "BENCH_URL" in os.environ and "BENCH_VARIANT" in os.environ:
    if os.environ.get("BENCH_THREAD_NAMES"):
        name_threads()
    if os.environ.get("BENCH_TRACE"):
        import bench.trace_path  # noqa: F401  # a message's path as timestamps
    if os.environ.get("BENCH_PROFILE"):
        profile_main_process(os.environ["BENCH_PROFILE"])
        profile_pool_processes(os.environ["BENCH_PROFILE"])
    app = build(
        os.environ["BENCH_VARIANT"], os.environ["BENCH_URL"], os.environ.get("BENCH_QUEUE", "b")
    )
