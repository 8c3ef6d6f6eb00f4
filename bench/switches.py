"""Context switches per message, thread by thread, of a real worker draining no-op tasks.

    python bench/switches.py [--tasks 500] [--pools solo] [--variants plain,rt2-sep,claims-sep]
                             [--rounds 1] [--no-pin] [--strace=OPTIONS]

For each pool and variant (``bench/overhead_app.py``), one real ``celery worker`` on private
``redis-server``s (a second one is the store of the ``-sep`` variants) drains a batch of no-op
tasks, published while the worker is stopped (``SIGSTOP``: it drains it with no producer at
work beside it). ``/proc/PID/task/*/status`` (``voluntary_ctxt_switches``,
``nonvoluntary_ctxt_switches``) and ``schedstat`` are read before and after the batch, and
this prints per message, for each thread of the worker's main process and for each server,
its switches and its CPU time, and the batch's wall time. Threads are named after their
Python thread (``BENCH_THREAD_NAMES``: the app names each through ``prctl``), so the lease
keeper, the task history's writer and the journal's scanner show apart.

A blocking round trip costs the worker one switch, but which kind depends on where the server
runs: on another CPU, the worker sleeps in its poll or read (voluntary); on the worker's own
CPU, the woken server preempts it and has answered by the time it reads (involuntary). On a
shared machine the split moves from run to run, so by default the worker's threads are pinned
to one CPU and the servers to another (``--no-pin``: where the scheduler puts them): every
wait is then a voluntary switch, and those per message count the waits. ``--strace`` traces
the worker's threads over the batch (the output in the logs folder; the counts then include
strace's own switches).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import celery_overhead as overhead  # noqa: E402

#: Pause after a batch's last ack: the last records and journal clearings come after it, in s.
SETTLE_S = 1.0

#: tid -> (name, voluntary, involuntary, cpu ns)
Sample = dict[int, tuple[str, int, int, int]]
#: name, voluntary and involuntary switches, CPU µs (per message), a server's row
Row = tuple[str, float, float, float, bool]


def sample(pid: int) -> Sample:
    """Every live thread of ``pid``: its name, switches so far and CPU time."""
    out: Sample = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
            cpu = int((task / "schedstat").read_text().split()[0])
            out[int(task.name)] = (
                fields["Name"].strip(),
                int(fields["voluntary_ctxt_switches"]),
                int(fields["nonvoluntary_ctxt_switches"]),
                cpu,
            )
    return out


def pin_apart(worker_pid: int, urls: list[str]) -> None:
    """The worker's threads on the first CPU, the servers at ``urls`` on the last: every
    round trip is then a voluntary switch of the worker (a wait for the other CPU), never a
    preemption by a server woken on its own CPU (an involuntary one)."""
    cpus = sorted(os.sched_getaffinity(0))
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), {cpus[0]})
    for url in urls:
        server = server_pid(url)
        for task in Path(f"/proc/{server}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), {cpus[-1]})


def measure(
    variant: str, pool: str, tasks: int, logs: Path, trace: str = "", pin: bool = False
) -> tuple[list[Row], float]:
    """Per thread of the worker's main process, and per server: (name, voluntary, involuntary
    switches, CPU in µs, a server) per message over a batch of ``tasks`` no-op tasks; and the
    batch's wall time per message, in µs."""
    with overhead.private_redis() as url, overhead.private_redis() as store_url:
        os.environ["BENCH_STORE_URL"] = store_url
        os.environ["BENCH_THREAD_NAMES"] = "1"
        broker = redis.Redis.from_url(url)
        queue = f"switches-{variant}-{pool}"
        log = logs / f"{queue}.log"
        publisher = overhead.Publisher(url, variant, queue, logs / f"{queue}.producer.log")
        proc = overhead.start_worker(url, variant, pool, queue, log)
        servers = {"broker": server_pid(url), "store": server_pid(store_url)}
        try:
            overhead.wait_ready(broker, publisher, variant, queue, log)
            if pin:
                pin_apart(proc.pid, [url, store_url])
            overhead.run_batch(broker, publisher, variant, queue, "bench.noop", 50, log=log)
            time.sleep(SETTLE_S)
            tracer = None
            if trace:
                out = logs / f"{queue}.strace"
                tracer = subprocess.Popen(
                    ["strace", "-f", "-qq", "-o", str(out), *trace.split(), "-p", str(proc.pid)]
                )
                time.sleep(1.0)  # strace attached to every thread
            # the batch published while the worker is stopped: it drains it alone, without
            # the producer's process and its journal writes taking turns on the machine's cores
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                publisher.publish("bench.noop", tasks, overhead.unique_offset(), queue)
                overhead.PUBLISHED[queue] = overhead.PUBLISHED.get(queue, 0) + tasks
                before = sample(proc.pid)
                was = {name: sample(pid) for name, pid in servers.items()}
                start = time.perf_counter()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            overhead.run_batch(broker, publisher, variant, queue, "bench.noop", 0, log=log)
            wall = time.perf_counter() - start
            time.sleep(SETTLE_S)
            after = sample(proc.pid)
            now = {name: sample(pid) for name, pid in servers.items()}
            if tracer is not None:
                tracer.send_signal(signal.SIGINT)
                tracer.wait()
        finally:
            overhead.stop(proc)
            publisher.close()
            broker.close()
    rows = per_message(before, after, tasks, {proc.pid: "main"})
    for name, pid in servers.items():
        if name == "broker" or "sep" in variant:
            rows += per_message(was[name], now[name], tasks, {pid: f"{name} redis"}, server=True)
    return rows, wall / tasks * 1e6


def per_message(
    before: Sample, after: Sample, tasks: int, names: dict[int, str], server: bool = False
) -> list[Row]:
    """Each thread's switches and CPU per message between two samples (a server's threads
    as one row, its main thread's name)."""
    rows: list[Row] = []
    for tid, (name, vol, invol, cpu) in sorted(after.items()):
        was = before.get(tid, (name, 0, 0, 0))
        row = (
            names.get(tid, name),
            (vol - was[1]) / tasks,
            (invol - was[2]) / tasks,
            (cpu - was[3]) / tasks / 1e3,
            server,
        )
        if server and rows:
            rows[0] = (
                rows[0][0],
                *(a + b for a, b in zip(rows[0][1:4], row[1:4], strict=True)),
                server,
            )
        else:
            rows.append(row)
    return rows


def server_pid(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--pools", default="solo")
    parser.add_argument("--variants", default="plain,rt2-sep,claims-sep")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the worker and the servers where the scheduler puts them (the split of "
        "switches into voluntary and involuntary then depends on the machine's load)",
    )
    parser.add_argument(
        "--strace",
        default="",
        help="strace options (e.g. '-c' or '-e trace=poll'): the "
        "batch traced, its output in the logs folder (the counts then include strace's cost)",
    )
    opts = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-switches-"))
    print(f"logs: {logs}")
    for pool in opts.pools.split(","):
        for rnd in range(opts.rounds):
            for variant in opts.variants.split(","):
                rows, wall = measure(variant, pool, opts.tasks, logs, opts.strace, not opts.no_pin)
                total = [sum(r[i] for r in rows if not r[4]) for i in (1, 2, 3)]
                print(
                    f"{pool} {variant} round {rnd + 1}: {opts.tasks} tasks; per message: "
                    f"voluntary {total[0]:.2f}, involuntary {total[1]:.2f} "
                    f"(both {total[0] + total[1]:.2f}), CPU {total[2]:.0f} µs, wall {wall:.0f} µs"
                )
                for name, vol, invol, cpu, _ in rows:
                    print(f"    {name:<16} vol {vol:6.2f}  invol {invol:6.2f}  cpu {cpu:7.1f} µs")


if __name__ == "__main__":
    main()
