"""The chaos soak: a real fleet under the ordinary faults of production, and what was lost.

Three ``celery worker`` subprocesses (prefork -c 2, acks_late, visibility_timeout 5 s, lease
3 s) run 300 tasks whose side effects go to a PostgreSQL ledger (``ledger.py``), while a
seeded random sequence of faults hits the fleet: a worker SIGKILLed and restarted, a worker's
main process paused past its lease (SIGSTOP/SIGCONT), the claim store killed and restarted
from its AOF, the claim store answering ``LOADING`` for seconds, the broker killed and
restarted from its AOF (Redis) or every broker connection dropped at a proxy (RabbitMQ), a
worker restarted with its wall clock 60 s off, and a poison task that crashes its
worker every time. Then the fleet is healed and drained, and the report says what was lost
(no effect ever applied), what was applied twice, and which faults came before each.

``python -m tests.chaos.soak --seed 7 --duration 60 [--broker rabbitmq] [--plain]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
import sqlalchemy as sa

from celery_claims import GivenUp, RedisClaimManager
from celery_claims.claims.journal import RedisJournal
from tests.chaos.ledger import Ledger
from tests.servers import RedisServer, missing_service
from tests.worker.processes import ROOT, Fleet, Proc

#: The ledger database (the machine's PostgreSQL).
PG_URL = os.environ.get("CLAIMS_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
RABBITMQ = ("127.0.0.1", 5672)
#: Holds the sitecustomize that skews a worker's wall clock (see skew/sitecustomize.py).
SKEW_DIR = Path(__file__).resolve().parent / "skew"
#: Takeovers before a poison task is given up (the soak's workers). A takeover follows any
#: death of the holder: with a worker killed every few seconds an ordinary task is sometimes
#: taken over twice (seen: seed 11), so the soak allows a few.
MAX_TAKEOVERS = 4
#: The publish journal settings of the soak's producer and workers (app.py): recovery acts
#: 60 s after a publish (the lease is 3 s, the visibility timeout 5 s) and looks every 2 s. Far
#: below it, messages only waiting in the soak's backlog (300 tasks published at once) were
#: re-published up to the limit and given up, and the flood of duplicates held up the drain
#: (seen with 15 s: seed 3 left one task unfinished, its copies behind the duplicates).
CHAOS_JOURNAL = {
    "claims_journal_recover_after_ms": 60_000,
    "claims_journal_scan_interval_ms": 2_000,
}
#: Filler the claim store reloads slowly in the LOADING fault (about 4 s with the delay).
FILLER_KEYS, FILLER_BYTES, LOAD_DELAY_US = 20_000, 2000, 200


@dataclass
class Report:
    """What one soak run measured."""

    seed: int
    broker: str
    plugin: bool
    tasks: int
    unfinished: int = 0
    given_up: int = 0
    lost: int = 0
    double_execution: int = 0
    double_effect_fenced: int = 0
    double_effect: int = 0
    executions: dict[int, int] = field(default_factory=dict)
    poison_executions: int = 0
    actions: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    drained_s: float = 0.0

    def line(self) -> str:
        """One line for the results table."""
        return (
            f"seed={self.seed} broker={self.broker} "
            f"{'claims' if self.plugin else 'plain'} tasks={self.tasks} "
            f"unfinished={self.unfinished} given_up={self.given_up} lost={self.lost} "
            f"double_execution={self.double_execution} "
            f"double_effect_fenced={self.double_effect_fenced} "
            f"double_effect={self.double_effect} executions={self.executions} "
            f"poison_executions={self.poison_executions} faults={len(self.actions)}"
        )


class TcpProxy:
    """A loopback TCP proxy whose connections can all be dropped at once."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True, name="chaos-proxy").start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def drop_all(self) -> int:
        """Cut every open connection; returns how many sockets were cut."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(conns)

    def close(self) -> None:
        self._stop = True
        self.drop_all()
        self.server.close()


def _probe(server: RedisServer) -> redis.Redis:
    # RESP2 without a handshake and without retries: a loading server answers LOADING to it
    return server.bare_client(socket_timeout=2)


def _ping(client: redis.Redis) -> str:
    try:
        client.ping()
        return "up"
    except redis.exceptions.BusyLoadingError:
        return "loading"
    except redis.exceptions.ConnectionError:
        return "down"


class Soak:
    """One soak run (see the module docstring)."""

    def __init__(
        self,
        seed: int,
        *,
        duration_s: float = 60.0,
        broker: str = "redis",
        plugin: bool = True,
        tasks: int = 300,
        workers: int = 3,
        drain_s: float = 240.0,
        log: Callable[[str], None] = print,
        ack_on_claim: bool = False,
    ) -> None:
        #: the workers acknowledge each message once claimed (``claims_ack_on_claim``)
        self.ack_on_claim = ack_on_claim
        self.seed = seed
        self.rng = random.Random(seed)
        self.duration_s = duration_s
        self.broker_kind = broker
        self.plugin = plugin
        self.n_tasks = tasks
        self.n_workers = workers
        self.drain_s = drain_s
        self.log = log
        self.run_id = uuid.uuid4().hex[:10]
        self.queue = f"chaos-{self.run_id}"
        self.fleet = Fleet()
        self.slots: list[Proc | None] = [None] * workers
        self.slot_locks = [threading.Lock() for _ in range(workers)]
        self.store_lock = threading.Lock()
        self.broker_lock = threading.Lock()
        self.actions: list[tuple[float, str]] = []
        self.t0 = time.time()
        self.store = RedisServer(
            ["--appendonly", "yes", "--appendfsync", "always", "--rdbcompression", "no"]
        )
        self.broker_server: RedisServer | None = None
        self.proxy: TcpProxy | None = None
        self.ledger = Ledger(sa.create_engine(PG_URL), self.run_id)
        self._manager: RedisClaimManager | None = None

    # --- set-up -----------------------------------------------------------------------------

    def _start_services(self) -> str:
        self.store.start()
        client = self.store.client()
        client.execute_command("DEBUG", "POPULATE", FILLER_KEYS, "filler", FILLER_BYTES)
        client.bgrewriteaof()
        deadline = time.monotonic() + 60
        while any(
            client.info("persistence")[k]
            for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
        ):
            assert time.monotonic() < deadline, "the claim store's AOF rewrite did not end"
            time.sleep(0.1)
        if self.broker_kind == "shared":
            # the default deployment: the claim store is the Redis broker itself, so claims
            # and completions ride kombu's own round trips; a store fault is a broker fault
            return self.store.url
        if self.broker_kind == "redis":
            self.broker_server = RedisServer(["--appendonly", "yes", "--appendfsync", "always"])
            self.broker_server.start()
            return self.broker_server.url
        try:
            socket.create_connection(RABBITMQ, timeout=2).close()
        except OSError:
            missing_service("RabbitMQ on 127.0.0.1:5672")
        self.proxy = TcpProxy(RABBITMQ)
        return f"amqp://guest:guest@127.0.0.1:{self.proxy.port}//"

    def _worker(self, slot: int, *, skew: str | None = None) -> Proc:
        env = {
            "CHAOS_STORE": self.store.url,
            "CHAOS_PG": PG_URL,
            "CHAOS_RUN": self.run_id,
        }
        if skew:
            path = os.pathsep.join(p for p in (str(SKEW_DIR), str(ROOT)) if p)
            env |= {"PYTHONPATH": path, "CHAOS_CLOCK_SKEW_S": skew}
        extra: tuple[str, ...] = (
            ("--claims-max-takeovers", str(MAX_TAKEOVERS)) if self.plugin else ()
        )
        if self.plugin and self.ack_on_claim:
            extra += ("--claims-ack-on-claim", "true")
        proc = self.fleet.worker(
            f"w{slot}-{len(self.fleet.procs)}",
            broker=self.broker_url,
            backend=self.store.url,  # results are ignored; a Redis URL for every broker
            queue=self.queue,
            plugin=self.plugin,
            app="tests.chaos.app",
            env=env,
            extra=extra,
        )
        self.slots[slot] = proc
        return proc

    # --- faults -----------------------------------------------------------------------------

    def _note(self, what: str) -> None:
        self.actions.append((time.time(), what))
        self.log(f"[{time.time() - self.t0:6.1f}s] {what}")

    def _kill(self, slot: int) -> None:
        proc = self.slots[slot]
        if proc is not None:
            proc.kill_group(signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.popen.wait(timeout=10)

    def kill_worker(self) -> None:
        slot = self.rng.randrange(self.n_workers)
        delay = self.rng.uniform(1, 3)
        with self.slot_locks[slot]:
            self._kill(slot)
            self._note(f"SIGKILL worker slot {slot}, restart in {delay:.1f} s")
            time.sleep(delay)
            self._worker(slot)

    def pause_worker(self) -> None:
        slot = self.rng.randrange(self.n_workers)
        pause = self.rng.uniform(6, 12)
        proc = self.slots[slot]
        if proc is None or not proc.alive():
            return
        self._note(f"SIGSTOP worker slot {slot} main process for {pause:.1f} s")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGSTOP)
        time.sleep(pause)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGCONT)

    def kill_store(self) -> None:
        delay = self.rng.uniform(0.3, 2)
        with self.store_lock:
            self._note(f"kill -9 claim store, restart from AOF in {delay:.1f} s")
            self.store.stop(signal.SIGKILL)
            time.sleep(delay)
            self._restart_store()

    def store_loading(self) -> None:
        with self.store_lock:
            self._note("kill -9 claim store, restart answering LOADING while it reloads")
            self.store.stop(signal.SIGKILL)
            self.store.extra_args += ["--key-load-delay", str(LOAD_DELAY_US)]
            try:
                self._restart_store(expect_loading=True)
            finally:
                self.store.extra_args = self.store.extra_args[:-2]

    def _restart_store(self, *, expect_loading: bool = False) -> None:
        loader = threading.Thread(target=self._quiet_start, args=(self.store,), daemon=True)
        loader.start()
        probe = _probe(self.store)
        deadline = time.monotonic() + 60
        saw_loading = False
        while (state := _ping(probe)) != "up":
            saw_loading |= state == "loading"
            assert time.monotonic() < deadline, "the claim store did not come back"
            time.sleep(0.05)
        loader.join(timeout=30)
        if expect_loading:
            self._note(f"claim store answered LOADING: {saw_loading}")

    @staticmethod
    def _quiet_start(server: RedisServer) -> None:
        # start() waits with redis-py's handshake, which fails oddly on a loading server
        with contextlib.suppress(Exception):
            server.start()

    def kill_broker(self) -> None:
        assert self.broker_server is not None
        delay = self.rng.uniform(0.3, 2)
        with self.broker_lock:
            self._note(f"kill -9 broker, restart from AOF in {delay:.1f} s")
            self.broker_server.stop(signal.SIGKILL)
            time.sleep(delay)
            self.broker_server.start()

    def drop_broker_connections(self) -> None:
        assert self.proxy is not None
        self._note(f"dropped {self.proxy.drop_all()} broker sockets at the proxy")

    def skew_worker(self) -> None:
        slot = self.rng.randrange(self.n_workers)
        skew = self.rng.choice(["60", "-60"])
        with self.slot_locks[slot]:
            self._kill(slot)
            self._note(f"restart worker slot {slot} with its wall clock {skew} s off")
            self._worker(slot, skew=skew)

    def _faults(self) -> list[Callable[[], None]]:
        faults = [self.kill_worker, self.pause_worker, self.kill_store, self.store_loading]
        if self.broker_kind == "redis":
            faults.append(self.kill_broker)
        elif self.broker_kind == "rabbitmq":
            faults.append(self.drop_broker_connections)
        faults.append(self.skew_worker)
        return faults

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> Report:
        """Run the soak and return its report (everything it started is stopped)."""
        try:
            return self._run()
        finally:
            self._cleanup()

    def _run(self) -> Report:
        self.broker_url = self._start_services()
        task_ids = [f"t{i:04d}" for i in range(self.n_tasks)]
        self.ledger.create([*task_ids, "poison"])
        for slot in range(self.n_workers):
            self._worker(slot)
        for slot in range(self.n_workers):
            proc = self.slots[slot]
            assert proc is not None
            proc.wait_ready(timeout=60)
        # with claims, the producer journals what it publishes (so a message lost between
        # the broker and a killed worker is re-published); the soak's journal settings
        client = self.fleet.client(
            self.broker_url,
            self.store.url,
            self.queue,
            plugin=self.plugin,
            conf={**CHAOS_JOURNAL, "claims_redis_url": self.store.url},
        )
        durations = [
            self.rng.uniform(6, 9) if self.rng.random() < 0.03 else self.rng.uniform(0.1, 3)
            for _ in task_ids
        ]
        for task_id, seconds in zip(task_ids, durations, strict=True):
            client.send_task("chaos.effect", (round(seconds, 2),), task_id=task_id)
        if self.plugin:
            client.send_task("chaos.poison", task_id="poison")
        self.t0 = time.time()

        # chaos: a fault every 3-8 s, each in a thread of its own, so faults overlap
        faults = self._faults()
        threads: list[threading.Thread] = []
        end = time.monotonic() + self.duration_s
        while time.monotonic() < end:
            fault = self.rng.choice(faults)
            thread = threading.Thread(target=self._guarded, args=(fault,), daemon=True)
            thread.start()
            threads.append(thread)
            time.sleep(self.rng.uniform(3, 8))
            self._revive()
        for thread in threads:
            thread.join(timeout=60)

        # heal: every worker resumed and alive, then drain
        self._note("chaos over: heal and drain")
        for slot, proc in enumerate(self.slots):
            if proc is not None and proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.popen.pid, signal.SIGCONT)
            else:
                self._worker(slot)
        drained_at = self._drain(task_ids)
        return self._report(task_ids, drained_at)

    def _revive(self) -> None:
        """Restart workers that died by themselves (the poison task crashes its worker)."""
        for slot, proc in enumerate(self.slots):
            lock = self.slot_locks[slot]
            if (proc is None or not proc.alive()) and lock.acquire(blocking=False):
                try:
                    self._note(f"worker slot {slot} died; restarted")
                    self._worker(slot)
                finally:
                    lock.release()

    def _guarded(self, fault: Callable[[], None]) -> None:
        try:
            fault()
        except Exception as exc:  # a fault that fails is reported, never silently dropped
            self._note(f"fault {fault.__name__} failed: {exc!r}")

    def _drain(self, task_ids: list[str]) -> float:
        start = time.monotonic()
        last_progress, last_done = start, -1
        while True:
            applied = self.ledger.applied()
            done = sum(1 for t in task_ids if applied.get(t, (0, 0))[1] > 0)
            if done == len(task_ids):
                break
            now = time.monotonic()
            if done != last_done:
                last_progress, last_done = now, done
            # a lost message comes back within the journal's recovery delay: wait longer
            if now - last_progress > 120 or now - start > self.drain_s:
                break
            self._revive()
            time.sleep(0.5)
        # a few more seconds for late duplicates to show
        time.sleep(5)
        return time.monotonic() - start

    def _report(self, task_ids: list[str], drained_s: float) -> Report:
        applied = self.ledger.applied()
        runs = self.ledger.executions_of()
        kind = f"{self.broker_kind}+ack_on_claim" if self.ack_on_claim else self.broker_kind
        report = Report(self.seed, kind, self.plugin, len(task_ids), drained_s=drained_s)
        report.actions = [f"{at - self.t0:6.1f}s {what}" for at, what in self.actions]
        report.poison_executions = len(runs.get("poison", []))
        left = self._left_in_broker()
        counts: Counter[int] = Counter()
        for task_id in task_ids:
            fenced, once = applied.get(task_id, (0, 0))
            executed = runs.get(task_id, [])
            counts[len(executed)] += 1
            problems = []
            if once == 0:
                report.unfinished += 1
                if self.plugin and isinstance(
                    self._claims().done_record(self.queue, f"{task_id}:0:0"), GivenUp
                ):
                    report.given_up += 1
                    problems.append("GIVEN UP as poison (its holders kept dying)")
                    problems.append(self._whereabouts(task_id))
                elif task_id in left:
                    problems.append("NOT RUN (a copy is still in the broker)")
                    problems.append(self._whereabouts(task_id))
                else:
                    report.lost += 1
                    problems.append("LOST (no copy left in the broker)")
            if len(executed) > 1:
                report.double_execution += 1
                problems.append(f"executed {len(executed)}x")
            if fenced > 1:
                report.double_effect_fenced += 1
                problems.append(f"fenced effect {fenced}x")
            if once > 1:
                report.double_effect += 1
                problems.append(f"guarded effect {once}x")
            if problems and (once != 1 or not self.plugin or fenced > 1):
                when = ", ".join(f"{at - self.t0:.1f}s on {w}" for at, w in executed) or "never"
                before = [
                    f"{at - self.t0:.1f}s {what}"
                    for at, what in self.actions
                    if (not executed or at <= executed[-1][0] + 1)
                    and (not executed or at >= executed[0][0] - 20)
                ]
                report.details.append(
                    f"{task_id}: {'; '.join(problems)}; ran at {when}; faults around: {before}"
                )
        report.executions = dict(sorted(counts.items()))
        return report

    def _whereabouts(self, task_id: str) -> str:
        """Where an unfinished task's copies are and what the store and the workers said of it
        (the clue to why it was not run)."""
        parts: list[str] = []
        key = f"{task_id}:0:0"
        if self.plugin:
            stored = self._claims().read(self.queue, [key])[0]
            parts.append(f"store: {stored!r}")
            journal = RedisJournal(client=self._claims().client)
            entry = journal.entries(self.queue).get(key)
            due = "none" if entry is None else f"due in {entry[1] / 1000 - time.time():.0f} s"
            count = journal.client.hget(journal.keys(self.queue).journal_republished, key)
            parts.append(f"journal: {due}, republished {int(count or 0)}")
        if self.broker_kind != "rabbitmq":
            client = (self.broker_server or self.store).client()
            queued = sum(
                task_id in item.decode(errors="replace")
                for item in client.lrange(self.queue, 0, -1)
            )
            now = time.time()
            unacked = [
                f"{tag.decode()} {now - (client.zscore('unacked_index', tag) or 0):.0f}s old"
                for tag, item in client.hgetall("unacked").items()
                if f'"id": "{task_id}"' in item.decode(errors="replace")
            ]
            mutex_ms = client.pttl("unacked_mutex")
            parts.append(f"broker: {queued} queued, unacked {unacked}, mutex ttl {mutex_ms} ms")
        mentions = [
            f"{proc.name}: {line.strip()[:200]}"
            for proc in self.fleet.procs
            for line in proc.output().splitlines()
            if task_id in line
        ]
        parts.append(f"worker logs ({len(mentions)} lines): {mentions[-8:]}")
        return "; ".join(parts)

    def _claims(self) -> RedisClaimManager:
        if self._manager is None:
            self._manager = RedisClaimManager(client=self.store.client())
        return self._manager

    def _left_in_broker(self) -> set[str]:
        """Ids of the tasks a copy of which is still in the broker (queue or unacked).

        On RabbitMQ a queued message cannot be read without taking it: every unfinished task
        counts as having a copy left while the queue is not empty.
        """
        if self.broker_kind == "rabbitmq":
            from kombu import Connection

            with Connection(f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}//") as conn:
                queue = conn.SimpleQueue(self.queue)
                try:
                    waiting = queue.qsize()
                finally:
                    queue.close()
            return {"*"} if waiting else set()
        client = (self.broker_server or self.store).client()
        raw = [*client.lrange(self.queue, 0, -1), *client.hvals("unacked")]
        found = set()
        for item in raw:
            text = item.decode(errors="replace")
            for part in text.split('"id": "')[1:]:
                found.add(part.split('"', 1)[0])
        return found

    def _cleanup(self) -> None:
        self.fleet.cleanup()
        if self.broker_kind == "rabbitmq" and self.proxy is not None:
            self.proxy.close()
            with contextlib.suppress(Exception):
                from kombu import Connection

                with Connection(f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}//") as conn:
                    conn.default_channel.queue_delete(self.queue)
        for server in (self.store, self.broker_server):
            if server is not None:
                server.cleanup()
        with contextlib.suppress(Exception):
            self.ledger.drop()
        self.ledger.engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--broker", choices=("redis", "shared", "rabbitmq"), default="redis")
    parser.add_argument("--plain", action="store_true", help="the same fleet without claims")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = Soak(
        args.seed,
        duration_s=args.duration,
        broker=args.broker,
        plugin=not args.plain,
        tasks=args.tasks,
    ).run()
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(report.line())
        for detail in report.details:
            print("  " + detail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
