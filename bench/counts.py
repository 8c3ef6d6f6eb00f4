"""What one message costs, in counts that do not depend on the machine's load.

    python bench/counts.py [--tasks 200] [--pools solo,prefork]
                           [--variants plain,ride0,claims,claims-sep] [--baseline TREE]
                           [--no-callgrind] [--keep DIR]
    python bench/counts.py --pipe [--tasks 1000] [--baseline TREE]

Wall-clock ratios (``bench/celery_overhead.py``) move with whatever else runs on a shared
machine; these counts do not. For each pool and variant (those of ``bench/overhead_app.py``),
one real ``celery worker`` on private ``redis-server``s of its own (a second one is the claim
store of ``claims-sep``) drains a batch of no-op tasks, and this prints, per message:

- **commands** each server ran for the worker and the producer, by name, ``EVALSHA`` by script
  (the slow log set to record every command; a script's own ``redis.call``s and this process's
  polls are left out; a ``MULTI`` transaction's commands count one by one, ``EXEC`` is not
  logged): the store's script calls per message are the round trips a claim costs there;
- **instructions** of the worker's main process (``valgrind --tool=callgrind``, counters
  zeroed before the batch and dumped after it): repeatable whatever else runs; and, apart, of
  its prefork pool processes (every thread; ``--trace-children=yes`` gives a forked process
  valgrind's gdbserver, so ``callgrind_control`` zeroes and dumps them with the main process),
  where the guard around each body runs (its settle round trip). Its main thread (the
  consumer's loop, and a solo pool's tasks) is counted apart from its other threads: the lease
  keeper's beats and the journal's scans come every few seconds of wall time, and a batch
  drained at valgrind's pace meets none or a few of them (tens of thousands of instructions a
  message on prefork: what made two runs of the same code differ by 2 %). The main thread
  still includes its idle ``BRPOP`` timeouts: a few thousand instructions a message at these
  batch sizes. ``--no-callgrind`` skips it.
- **producer instructions** (the same, of ``bench/publisher.py``'s process, every thread, over
  the batch's publishes): what a publish costs its producer, the publish journal's write
  included (``claims-sep``'s: a script call sent to the store of its own).

``--baseline TREE`` adds ``claims-base`` and ``claims-sep-base`` (each where its variant is
chosen): the same variants run from another checkout (``git worktree add TREE <commit>``),
worker and producer, in the same run.
``--keep DIR`` writes the callgrind dumps and the workers' logs to ``DIR`` (else a new
temporary folder, printed): ``callgrind_annotate --inclusive=yes DIR/callgrind.counts-<variant>-
<pool>.<pid>.1-01`` shows where a variant's main thread spent its instructions in the batch.

``--pipe`` counts the consumer's pipe alone (``worker/transport/pipe.py``), as a store apart
uses it on a solo pool: a claim and its completion record, each deferred and its reply read
by a kombu hub's turns, ``--tasks`` times in a process under callgrind, less the same process
doing none (its start); the instructions of one claim and one record, with the building of
their calls. Under a minute a checkout, where a worker's figures take minutes; ``--baseline``
adds the same from another checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import celery_overhead as overhead  # noqa: E402
from bench.ceiling import script_names  # noqa: E402

#: This process's connections (its polls are not the message's cost).
OWN_CLIENT = "bench-counts"
#: Slow log entries kept per message (a claims message logs about 50, scripts' calls included).
LOG_PER_MESSAGE = 128
#: Longest wait for a worker under valgrind to drain its first task, in s.
START_TIMEOUT_S = 600.0
#: Pause after a batch's last ack: the last records and journal clearings come after it, in s.
SETTLE_S = 2.0


@contextlib.contextmanager
def worker(
    variant: str, pool: str, url: str, queue: str, logs: Path, callgrind: bool
) -> Iterator[Any]:
    """A worker of ``variant``, under callgrind if asked; yields its process."""
    tree, name = overhead.checkout(variant)
    extra: list[str] = []
    if variant in overhead.BASE_VARIANTS:
        if variant == "claims-sep-base":
            extra = ["--claims-redis-url", os.environ["BENCH_STORE_URL"]]
        name = "claims"
    env = overhead.tree_env(tree, BENCH_VARIANT=name, BENCH_URL=url, BENCH_QUEUE=queue)
    args = [
        sys.executable, "-m", "celery", "-A", "bench.overhead_app", "worker",
        "-P", pool, "-c", "2" if pool == "prefork" else "1", "-Q", queue, "-l", "WARNING",
        "--without-mingle", "--without-gossip", "--without-heartbeat", *extra,
    ]  # fmt: skip
    if callgrind:
        out = logs / f"callgrind.{queue}.%p"
        args = [
            # trace-children: a forked pool process gets valgrind's gdbserver too, so that
            # callgrind_control reaches it (its counts are zeroed and dumped with the main's)
            "valgrind", "--tool=callgrind", "--separate-threads=yes", "--trace-children=yes",
            f"--callgrind-out-file={out}", *args,
        ]  # fmt: skip
    with (logs / f"{queue}.log").open("wb") as log:
        proc = subprocess.Popen(
            args, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        overhead.stop(proc)


def callgrind_control(option: str, pid: int) -> None:
    done = subprocess.run(
        ["callgrind_control", option, str(pid)], check=True, capture_output=True, text=True
    )
    if "OK." not in done.stdout:  # it exits 0 on a process it cannot reach
        raise SystemExit(f"callgrind_control {option} {pid}: {done.stdout}{done.stderr}")


def children(pid: int) -> list[int]:
    """The worker's pool processes (forked under valgrind, each dumping its own counts)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def dumped_instructions(logs: Path, queue: str, pid: int) -> tuple[int, int]:
    """Instructions in the newest dump of ``pid`` (``callgrind_control -d``): its main
    thread's (the consumer's loop; a solo pool's tasks too) and its other threads' (the lease
    keeper, the journal's scanner and writer), one file per thread (``--separate-threads``)."""
    parts: dict[int, dict[int, int]] = {}
    for path in logs.glob(f"callgrind.{queue}.{pid}.*-*"):
        part, thread = path.name.rsplit(".", 1)[1].split("-")
        found = re.search(r"^(?:summary|totals): (\d+)", path.read_text(errors="replace"), re.M)
        assert found, f"no totals in {path}"
        parts.setdefault(int(part), {})[int(thread)] = int(found.group(1))
    threads = parts[max(parts)]
    return threads[1], sum(threads.values()) - threads[1]


def start_log(clients: dict[str, redis.Redis], n: int) -> None:
    for client in clients.values():
        client.config_set("slowlog-max-len", n * LOG_PER_MESSAGE)
        client.slowlog_reset()
        client.config_set("slowlog-log-slower-than", 0)


def read_log(
    clients: dict[str, redis.Redis], n: int, shas: dict[str, str]
) -> dict[str, dict[str, float]]:
    """Per server: command -> calls per message (top-level commands of the worker and the
    producer; ``EVALSHA`` named by its script)."""
    out: dict[str, dict[str, float]] = {}
    for name, client in clients.items():
        client.config_set("slowlog-log-slower-than", 10_000)
        logged = client.slowlog_get(n * LOG_PER_MESSAGE)
        client.slowlog_reset()
        if len(logged) >= n * LOG_PER_MESSAGE:
            raise SystemExit(f"{name}: slow log full, raise LOG_PER_MESSAGE")
        per: dict[str, float] = {}
        for entry in logged:
            if entry["client_address"] == b"?:0" or entry["client_name"] == OWN_CLIENT.encode():
                continue  # a script's own call; this process's polls and reads
            words = entry["command"].split(b" ", 2)
            command = words[0].decode().upper()
            if command in ("SLOWLOG", "CONFIG"):
                continue
            if command in ("EVALSHA", "EVAL") and len(words) > 1:
                sha = words[1].decode().lower()
                command = f"{command} {shas.get(sha, sha[:8])}"
            per[command] = per.get(command, 0) + 1 / n
        out[name] = per
    return out


def measure(
    variant: str, pool: str, tasks: int, logs: Path, callgrind: bool, shas: dict[str, str]
) -> dict[str, Any]:
    """One variant on one pool: its counts per message."""
    with overhead.private_redis() as url, overhead.private_redis() as store_url:
        os.environ["BENCH_STORE_URL"] = store_url
        broker = redis.Redis.from_url(url, client_name=OWN_CLIENT)
        store = redis.Redis.from_url(store_url, client_name=OWN_CLIENT)
        clients = {"broker": broker}
        if "sep" in variant:
            clients["store"] = store
        queue = f"counts-{variant}-{pool}"
        prefix: tuple[str, ...] = ()
        if callgrind:
            out = logs / f"callgrind.{queue}.producer.%p"
            prefix = (
                "valgrind", "--tool=callgrind", "--separate-threads=yes",
                f"--callgrind-out-file={out}",
            )  # fmt: skip
        publisher = overhead.Publisher(url, variant, queue, logs / f"{queue}.producer.log", prefix)
        try:
            with worker(variant, pool, url, queue, logs, callgrind) as proc:
                log = logs / f"{queue}.log"
                overhead.run_batch(
                    broker, publisher, variant, queue, "bench.noop", 1,
                    timeout=START_TIMEOUT_S, log=log,
                )  # fmt: skip
                overhead.run_batch(broker, publisher, variant, queue, "bench.noop", 20, log=log)
                time.sleep(SETTLE_S)
                start_log(clients, tasks)
                pool_pids = children(proc.pid) if callgrind else []
                if callgrind:
                    for pid in (proc.pid, *pool_pids, publisher.proc.pid):
                        callgrind_control("-z", pid)
                overhead.run_batch(broker, publisher, variant, queue, "bench.noop", tasks, log=log)
                time.sleep(SETTLE_S)
                instructions = others = in_pool = producer = None
                if callgrind:
                    callgrind_control("-d", proc.pid)
                    main, rest = dumped_instructions(logs, queue, proc.pid)
                    instructions, others = main / tasks, rest / tasks
                    if pool_pids:
                        for pid in pool_pids:
                            callgrind_control("-d", pid)
                        in_pool = sum(sum(dumped_instructions(logs, queue, p)) for p in pool_pids)
                        in_pool /= tasks
                    callgrind_control("-d", publisher.proc.pid)
                    dumped = dumped_instructions(logs, f"{queue}.producer", publisher.proc.pid)
                    producer = sum(dumped) / tasks
                commands = read_log(clients, tasks, shas)
        finally:
            publisher.close()
            for client in (broker, store):
                client.close()
    return {
        "commands": commands,
        "instructions": instructions,
        "others": others,
        "pool": in_pool,
        "producer": producer,
    }


#: ``--pipe``: ``n`` claims and records through a ``StorePipe`` on a kombu hub, on the store at
#: ``url`` under key ``prefix`` (``python -c PIPE_RUN n url prefix``, run from the checkout
#: measured: its ``celery_claims``).
PIPE_RUN = """
import sys
from kombu.asynchronous import Hub
from celery_claims import RedisClaimManager
from celery_claims.connection import connect
from celery_claims.worker.transport.pipe import StorePipe

n, url, prefix = int(sys.argv[1]), sys.argv[2], sys.argv[3]
manager = RedisClaimManager(client=connect(url, timeout_s=5), prefix=prefix)
hub = Hub()
pipe = StorePipe.for_manager(manager, hub)
box = []

def settled(call):
    pipe.defer(call, box.append)
    while not box:
        hub.run_once()
    return box.pop()

# the first calls connect and load the scripts: the same in the run of none
for i in range(-20, n):
    claim = settled(manager.claim_call("q", f"t{i}", "w@h/1/n", 30_000))
    assert settled(manager.record_call(claim.token, 60_000)) is True
pipe.close()
hub.close()
"""


def pipe_instructions(tree: Path, n: int, url: str, logs: Path) -> float:
    """Instructions per claim and record through the pipe (``PIPE_RUN``), run from ``tree``:
    the run of ``n`` less the run of none."""
    totals = []
    for count in (0, n):
        out = logs / f"callgrind.pipe.{tree.name}.{count}"
        subprocess.run(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                sys.executable, "-c", PIPE_RUN, str(count), url, out.name.replace(".", "-"),
            ],
            cwd=tree, env=overhead.tree_env(tree), check=True, capture_output=True,
        )  # fmt: skip
        found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
        assert found, f"no totals in {out}"
        totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / n


def scripts(per: dict[str, float]) -> float:
    return sum(v for k, v in per.items() if k.startswith("EVAL"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--pools", default="solo,prefork")
    parser.add_argument("--variants", default="plain,ride0,claims,claims-sep")
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier commit")
    parser.add_argument("--no-callgrind", action="store_true")
    parser.add_argument("--pipe", action="store_true", help="the consumer's pipe alone")
    parser.add_argument("--keep", type=Path, help="a folder for the callgrind dumps and logs")
    opts = parser.parse_args()
    if opts.keep is not None:
        opts.keep.mkdir(parents=True, exist_ok=True)
    if opts.pipe:
        if shutil.which("valgrind") is None:
            parser.error("valgrind is not on PATH")
        logs = opts.keep or Path(tempfile.mkdtemp(prefix="bench-counts-"))
        n = 1000 if opts.tasks == 200 else opts.tasks
        trees = [ROOT] + ([opts.baseline.resolve()] if opts.baseline is not None else [])
        with overhead.private_redis() as url:
            for tree in trees:
                per = pipe_instructions(tree, n, url, logs)
                print(f"pipe, {n} claims and records, {tree}: {per / 1000:,.0f}k instr a pair")
        return
    callgrind = not opts.no_callgrind
    if callgrind and shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH (or pass --no-callgrind)")
    variants = opts.variants.split(",")
    if opts.baseline is not None:
        overhead.BASELINE = opts.baseline
        # the baseline of each variant chosen that has one
        variants += [
            v
            for v in overhead.BASE_VARIANTS
            if v not in variants and v.removesuffix("-base") in variants
        ]
    logs = opts.keep or Path(tempfile.mkdtemp(prefix="bench-counts-"))
    shas = script_names()
    print(f"{opts.tasks} no-op tasks a batch; logs in {logs}", flush=True)
    rows = []
    for pool in opts.pools.split(","):
        for variant in variants:
            found = measure(variant, pool, opts.tasks, logs, callgrind, shas)
            rows.append((pool, variant, found))
            cmds = found["commands"]
            listed = "; ".join(
                f"{server}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items()) if v >= 0.005)
                for server, per in cmds.items()
            )
            ins = found["instructions"]
            shown = (
                f"{ins / 1000:,.0f}k instr/msg main thread (+{found['others'] / 1000:,.0f}k others"
                f"; producer {found['producer'] / 1000:,.0f}k)"
                if ins
                else "no callgrind"
            )
            if found["pool"] is not None:
                shown += f", {found['pool'] / 1000:,.0f}k pool processes"
            print(f"{pool:7} {variant:15} {shown}; {listed}", flush=True)
    print(
        "\n| pool | variant | main thread instructions/msg | pool processes instructions/msg "
        "| producer instructions/msg | broker commands/msg | broker scripts/msg "
        "| store commands/msg | store scripts/msg (journal_put) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for pool, variant, found in rows:
        cmds, ins, producer = found["commands"], found["instructions"], found["producer"]
        broker, store = cmds["broker"], cmds.get("store")
        on_store = (
            f"{sum(store.values()):.2f} | {scripts(store):.2f} "
            f"({store.get('EVALSHA journal_put', 0):.2f})"
            if store is not None
            else "- | -"
        )
        in_pool = found["pool"]
        print(
            f"| {pool} | {variant} | {f'{ins / 1000:,.0f}k' if ins else '-'} | "
            f"{f'{in_pool / 1000:,.0f}k' if in_pool is not None else '-'} | "
            f"{f'{producer / 1000:,.0f}k' if producer else '-'} | "
            f"{sum(broker.values()):.2f} | {scripts(broker):.2f} | {on_store} |"
        )


if __name__ == "__main__":
    main()
