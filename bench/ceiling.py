"""The fleet ceiling: the Redis server CPU each message costs, and what one Redis core sustains.

    python bench/ceiling.py [--tasks 2000] [--rounds 3] [--pool prefork] [--quick]

Three deployments, each on private ``redis-server``s of its own (nothing else on them), each
with one real ``celery worker`` (``bench/overhead_app.py``, prefork ``-c 2`` unless ``--pool
solo``) draining batches of no-op tasks published by this process:

- ``plain``: Celery alone on the Redis broker (the reference every ratio is taken against);
- ``claims``: ``celery_claims.install(app)`` with the claim store on the broker's server
  (the default): the claim rides kombu's delivery transaction, the completion replaces its
  ack, the journal entry its ``LPUSH``;
- ``claims-sep``: the same with the claim store on a second private server
  (``claims_redis_url``): the broker's costs and the store's are read separately.

Each round, for each deployment (in a rotated order), two batches:

1. **CPU batch**: ``CONFIG RESETSTAT``, then the batch is published and drained, every
   completion recorded and every journal entry cleared (the workers' keeper beats every
   second here); then the server's own figures: ``INFO cpu`` (its main thread's user + system
   time: commands, and the reading, parsing and writing around them: what a core runs out
   of), ``total_reads_processed`` (about one a round trip), ``INFO commandstats`` (``EVALSHA``
   µs in all) and, on the claim store, ``MEMORY USAGE`` of the queue's keys (what the finished
   tasks leave behind: their completion records).
2. **Attribution batch** (a quarter of the tasks, at most 500): the slow log set to record
   every command, to split the server's time by command, and ``EVALSHA`` by script
   (the script's SHA1 names it). Only commands of real clients are summed: a script's own
   ``redis.call``s are in its ``EVALSHA``'s time already (they are listed apart, as the
   script's inside), and a ``MULTI``'s commands are logged one by one (``EXEC`` itself is
   not logged). Writing the log inside a script makes its ``EVALSHA`` look slower, so each
   script's share is scaled to the ``EVALSHA`` total of the CPU batch (``INFO commandstats``,
   no log).

Each round also measures a saturated server's main thread CPU per request (``redis-benchmark``,
50 clients, ``PING``, on a server of its own): a server kept busy serves several requests per
wake of its event loop and spends less on each than at one worker's load.

Printed (medians of the rounds): per deployment and server, µs per message by command and
inside each script; the main thread's CPU µs per message as measured and at saturation
(estimate: the commands' µs plus the reads per message times the saturated cost per request),
and the messages per second one core sustains (1e6 / each), against plain Celery's broker in
the same run; then what a fleet of N queues reaches on M masters (Redis Cluster for the store,
the broker a single server: kombu has no Cluster transport). Idle cost (the server's cron,
the workers' idle ``BRPOP`` timeouts and keeper beats) falls into the CPU batch too: a few µs
per message at most at these batch sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import statistics
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
from bench.overhead_app import build  # noqa: E402
from celery_claims.claims.keys import QueueKeys  # noqa: E402
from celery_claims.claims.scripts import script_source  # noqa: E402
from celery_claims.worker.publish.producer import PUBLISH_COUNTERS  # noqa: E402

VARIANTS = ("plain", "claims", "claims-sep")
#: Prefix of the keys of a script's own calls (``in claim: HGET``) in the attributed figures.
INSIDE = "in "
#: Script names as a reader of the worker knows them (``complete`` runs ``release.lua``).
LABELS = {"release": "release/complete"}
#: Clients of the saturation reference (``redis-benchmark``): enough that each wake of the
#: server's event loop finds several requests, as a saturated server does.
SATURATION_CLIENTS = 50
#: Queue counts and master counts of the printed fleet table.
QUEUES = (1, 4, 16)
MASTERS = (1, 3, 6)
#: How often a batch's end is polled, in s (each poll a round trip to each server: every
#: 5 ms, as the overhead benchmark polls, came to 0.1 of a message's 4 reads here).
POLL_S = 0.05
#: The client name of this process's own reads, left out of the attribution.
BENCH_CLIENT = "bench-ceiling"
#: Slow log entries kept per attributed message (a claims message logs about 50, scripts'
#: own calls included).
LOG_PER_MESSAGE = 128


def script_names() -> dict[str, str]:
    """SHA1 -> name of every script the claim store ships, as it is loaded: with the preamble
    it names (``claims/scripts.py``) or as the file stands (the journal's scripts)."""
    names = {}
    for path in (ROOT / "celery_claims" / "claims" / "lua").glob("*.lua"):
        if path.name.startswith("_"):
            continue
        name = LABELS.get(path.stem, path.stem)
        names[hashlib.sha1(path.read_bytes()).hexdigest()] = name
        with contextlib.suppress(Exception):  # a script the preamble does not serve
            names[hashlib.sha1(script_source(path.stem).encode()).hexdigest()] = name
    return names


def _reads(client: redis.Redis) -> int:
    return int(client.info("stats")["total_reads_processed"])


def saturated_request_us(url: str, requests: int) -> float:
    """Main thread CPU µs per request of a server kept busy by ``SATURATION_CLIENTS`` clients
    (``redis-benchmark``, ``PING``): what reading one request and writing its reply cost the
    server when each wake of its event loop serves many (one client: about 3x as much)."""
    client = redis.Redis.from_url(url)
    port = str(client.connection_pool.connection_kwargs["port"])
    before = main_thread_cpu_us(client)
    subprocess.run(
        ["redis-benchmark", "-p", port, "-c", str(SATURATION_CLIENTS), "-n", str(requests),
         "-t", "ping_mbulk", "-q"],
        check=True, capture_output=True,
    )  # fmt: skip
    used = main_thread_cpu_us(client) - before
    client.close()
    return used / requests


def main_thread_cpu_us(client: redis.Redis) -> float:
    """The server's main thread CPU so far (user + system), µs, as the server reports it."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"]) * 1e6


@contextlib.contextmanager
def servers(count: int) -> Iterator[list[str]]:
    """``count`` private ``redis-server``s (the one on PATH), as URLs."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(overhead.private_redis()) for _ in range(count)]


class Deployment:
    """One deployment's worker, its broker and its claim store (the broker itself unless apart)."""

    def __init__(self, variant: str, broker_url: str, store_url: str, pool: str, log: Path):
        self.variant, self.pool, self.log = variant, pool, log
        self.url = broker_url
        self.queue = f"ceiling-{variant}"
        self.broker = redis.Redis.from_url(broker_url, client_name=BENCH_CLIENT)
        self.store = redis.Redis.from_url(store_url, client_name=BENCH_CLIENT)
        #: the servers whose cost is read: name -> client
        self.servers = {"broker": self.broker}
        if variant == "claims-sep":
            self.servers["store"] = self.store
        self.keys = QueueKeys("claims", self.queue)
        #: round trips of this process's polls to each server in the last batch
        self.polls: dict[str, int] = {}
        #: publishes of the last batches whose journal write failed (see :meth:`drain`)
        self.unjournaled = 0
        #: this deployment's producer (built on its first batch)
        self.app: Any = None
        self.proc = overhead.start_worker(broker_url, variant, pool, self.queue, log)

    def ready(self) -> None:
        """Once the worker drained a first task (it may take a while to start)."""
        self.drain(1)

    def drain(self, n: int) -> None:
        """Publish ``n`` no-op tasks and return once they are done and the store has settled:
        every task acked, its completion recorded, its journal entry cleared.

        Polled every ``POLL_S`` with one pipelined round trip per server, counted in
        :attr:`polls`: this process's requests are the server's too (``run_batch`` of the
        overhead benchmark polls every 5 ms, two round trips each: 0.1 reads a message here).
        """
        if self.app is None:
            # in this process: the journal's failed writes are read from its counters
            self.app = build(self.variant, self.url, self.queue)
        sender = self.app.tasks["bench.noop"]
        offset = int(time.time() * 1000) * 10_000
        failed = PUBLISH_COUNTERS.get("journal_write_failed")
        with self.app.producer_or_acquire() as producer:
            for i in range(n):
                sender.apply_async((offset + i,), queue=self.queue, producer=producer)
        published = overhead.PUBLISHED[self.queue] = overhead.PUBLISHED.get(self.queue, 0) + n
        deadline = time.monotonic() + 120
        while True:
            found = self._poll()
            if found == (0, 0, 0, published):
                # publishes this process could not journal (a store that did not answer 64
                # writes in time is skipped for a second or more): they cost the store nothing
                self.unjournaled += PUBLISH_COUNTERS.get("journal_write_failed") - failed
                return
            if time.monotonic() > deadline:
                tail = self.log.read_text()[-2000:]
                raise SystemExit(
                    f"{self.variant}: (queue, unacked, journal, records) {found}, "
                    f"expected (0, 0, 0, {published})\n{tail}"
                )
            time.sleep(POLL_S)

    def _poll(self) -> tuple[int, int, int, int]:
        """The queue's length, kombu's unacked deliveries, the journal's entries and the
        completion records (0 and the published count for plain Celery)."""
        broker = self.broker.pipeline(transaction=False)
        broker.llen(self.queue).hlen("unacked")
        self.polls["broker"] = self.polls.get("broker", 0) + 1
        if self.variant == "plain":
            queued, unacked = broker.execute()
            return queued, unacked, 0, overhead.PUBLISHED[self.queue]
        store = broker if self.variant == "claims" else self.store.pipeline(transaction=False)
        store.hlen(self.keys.journal).hlen(self.keys.done)
        if store is broker:
            queued, unacked, journal, records = broker.execute()
        else:
            self.polls["store"] = self.polls.get("store", 0) + 1
            queued, unacked = broker.execute()
            journal, records = store.execute()
        return queued, unacked, journal, records

    def cpu_batch(self, n: int) -> dict[str, dict[str, float]]:
        """Per server, per message: main thread CPU µs, ``EVALSHA`` µs, reads (the server's
        ``total_reads_processed``: about one per round trip), and on the claim store the bytes
        its keys of the queue grew by (``MEMORY USAGE``: the completion records left)."""
        before = {}
        for name, client in self.servers.items():
            client.config_resetstat()
            before[name] = (main_thread_cpu_us(client), self.key_bytes(client))
        reads = {name: _reads(client) for name, client in self.servers.items()}
        self.polls, self.unjournaled = {}, 0
        self.drain(n)
        out = {}
        for name, client in self.servers.items():
            cpu, key_bytes = before[name]
            evalsha = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0})
            out[name] = {
                "cpu": (main_thread_cpu_us(client) - cpu) / n,
                "evalsha": float(evalsha["usec"]) / n,
                # less this process's polls (and the INFO before this read)
                "reads": (_reads(client) - reads[name] - self.polls.get(name, 0) - 2) / n,
                "bytes": (self.key_bytes(client) - key_bytes) / n,
            }
        return out

    def key_bytes(self, client: redis.Redis) -> int:
        """``MEMORY USAGE`` (every field counted) of the claim store's keys of the queue."""
        if self.variant == "plain" or (self.variant == "claims-sep" and client is self.broker):
            return 0
        keys = list(client.scan_iter(match=f"{self.keys.tag}:*"))
        return sum(int(client.memory_usage(key, samples=0) or 0) for key in keys)

    def attribution_batch(self, n: int, shas: dict[str, str]) -> dict[str, dict[str, float]]:
        """Per server: command -> (calls, µs) per message, from a slow log of every command."""
        for client in self.servers.values():
            client.config_set("slowlog-max-len", n * LOG_PER_MESSAGE)
            client.slowlog_reset()
            client.config_set("slowlog-log-slower-than", 0)
        self.unjournaled = 0
        try:
            self.drain(n)
        finally:
            entries = {}
            for name, client in self.servers.items():
                client.config_set("slowlog-log-slower-than", 10_000)
                entries[name] = client.slowlog_get(n * LOG_PER_MESSAGE)
                client.slowlog_reset()
        out: dict[str, dict[str, float]] = {}
        own = BENCH_CLIENT.encode()
        for name, logged in entries.items():
            if len(logged) >= n * LOG_PER_MESSAGE:
                raise SystemExit(f"{self.variant} {name}: slow log full, raise LOG_PER_MESSAGE")
            per: dict[str, float] = {}
            nested: list[dict[str, Any]] = []  # a script's own calls, logged before it
            for entry in reversed(logged):  # the log lists the newest first
                if entry["client_address"] == b"?:0":
                    nested.append(entry)
                    continue
                if entry["client_name"] == own:
                    continue  # this process's own reads
                words = entry["command"].split(b" ", 2)
                command = words[0].decode().upper()
                if command in ("EVALSHA", "EVAL") and len(words) > 1:
                    sha = words[1].decode().lower()
                    command = f"EVALSHA {shas.get(sha, sha[:8])}"
                    # a script runs alone: its calls are the entries just before it
                    for call in nested:
                        inner = f"{INSIDE}{command[8:]}: {_name(call)}"
                        per[f"{inner} calls"] = per.get(f"{inner} calls", 0) + 1 / n
                        per[inner] = per.get(inner, 0) + float(call["duration"]) / n
                nested = []
                per[f"{command} calls"] = per.get(f"{command} calls", 0) + 1 / n
                per[command] = per.get(command, 0) + entry["duration"] / n
            out[name] = per
        return out

    def close(self) -> None:
        overhead.stop(self.proc)
        if self.app is not None:
            self.app.close()
        self.broker.close()
        self.store.close()


def _name(entry: dict[str, Any]) -> str:
    return str(entry["command"].split(b" ", 1)[0].decode().upper())


def scale_scripts(attributed: dict[str, float], evalsha_us: float) -> dict[str, float]:
    """Each script's µs scaled so that together they make ``evalsha_us`` (the CPU batch's
    ``EVALSHA`` total, measured without the slow log's writes inside the scripts)."""
    scripts = [k for k in attributed if k.startswith("EVALSHA") and not k.endswith(" calls")]
    logged = sum(attributed[k] for k in scripts)
    out = dict(attributed)
    if logged > 0:
        for k in scripts:
            out[k] = attributed[k] * evalsha_us / logged
    return out


def fleet(core: dict[str, float], queues: int, masters: int) -> tuple[float, str]:
    """Messages/s a fleet of ``queues`` equally busy queues reaches, and what bounds it.

    ``core`` gives messages/s one core sustains for ``broker`` (always one server) and, with
    the store apart, ``store`` (one queue's keys share a hash tag, so one queue lives on one
    master; the busiest of ``masters`` carries ``ceil(queues / masters)`` queues at best).
    """
    bounds = {"broker": core["broker"]}
    if "store" in core:
        bounds["store"] = core["store"] * queues / math.ceil(queues / masters)
    which = min(bounds, key=lambda k: bounds[k])
    return bounds[which], which


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per CPU batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool", default="prefork", choices=("prefork", "solo"))
    parser.add_argument("--quick", action="store_true", help="1 round of 200 tasks")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.rounds = 200, 1
    attributed_n = max(50, min(500, args.tasks // 4))
    os.environ["BENCH_RENEW_MS"] = "1000"  # journal entries cleared within a second of the ack
    shas = script_names()
    logs = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    rounds = Rounds()
    # one server per deployment's broker, claims-sep's store, the saturation reference's
    with servers(len(VARIANTS) + 2) as urls:
        info = redis.Redis.from_url(urls[0]).info("server")
        print(f"server: Redis {info['redis_version']}, {len(urls)} private servers", flush=True)
        store_url, reference_url = urls[-2:]
        os.environ["BENCH_STORE_URL"] = store_url  # claims-sep's store, read by its worker
        deployments: dict[str, Deployment] = {}
        try:
            for variant, url in zip(VARIANTS, urls, strict=False):
                store = store_url if variant == "claims-sep" else url
                log = logs / f"{variant}.log"
                deployments[variant] = Deployment(variant, url, store, args.pool, log)
            for d in deployments.values():
                d.ready()
                d.drain(max(20, args.tasks // 10))  # warm: scripts loaded, connections made
            for rnd in range(args.rounds):
                rounds.request_us.append(saturated_request_us(reference_url, 20 * args.tasks))
                print(
                    f"round {rnd + 1} saturated server: {rounds.request_us[-1]:.2f} µs of main "
                    f"thread CPU per request ({SATURATION_CLIENTS} clients, PING)",
                    flush=True,
                )
                order = VARIANTS[rnd % len(VARIANTS) :] + VARIANTS[: rnd % len(VARIANTS)]
                for variant in order:
                    d = deployments[variant]
                    measured = d.cpu_batch(args.tasks)
                    unjournaled = d.unjournaled
                    attributed = d.attribution_batch(attributed_n, shas)
                    unjournaled += d.unjournaled
                    rounds.unjournaled[variant] = rounds.unjournaled.get(variant, 0) + unjournaled
                    for name, figures in measured.items():
                        per = scale_scripts(attributed[name], figures["evalsha"])
                        rounds.cpu.setdefault((variant, name), []).append(figures)
                        rounds.split.setdefault((variant, name), []).append(per)
                        print(
                            f"round {rnd + 1} {variant:10} {name:6} main thread CPU "
                            f"{figures['cpu']:6.1f} µs/msg  reads {figures['reads']:4.2f}/msg  "
                            f"EVALSHA {figures['evalsha']:5.1f} µs/msg  keys "
                            f"{figures['bytes']:+5.0f} B/msg  unjournaled {unjournaled}",
                            flush=True,
                        )
        finally:
            for d in deployments.values():
                d.close()
    rounds.report(args)


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def _commands_us(per: dict[str, float]) -> float:
    return sum(v for k, v in per.items() if _top(k))


def _top(key: str) -> bool:
    """A command clients sent (not a count, not a script's own call)."""
    return not key.endswith(" calls") and not key.startswith(INSIDE)


class Rounds:
    """What each round measured, and the report made of their medians."""

    def __init__(self) -> None:
        #: (deployment, server) -> per round: cpu, evalsha, reads, bytes (per message)
        self.cpu: dict[tuple[str, str], list[dict[str, float]]] = {}
        #: (deployment, server) -> per round: command -> µs per message, "<command> calls"
        self.split: dict[tuple[str, str], list[dict[str, float]]] = {}
        #: per round: the saturated server's main thread µs per request
        self.request_us: list[float] = []
        #: deployment -> publishes whose journal write failed, every batch counted
        self.unjournaled: dict[str, int] = {}

    def report(self, args: argparse.Namespace) -> None:
        plain = _median(self.cpu[("plain", "broker")], "cpu")
        request_us = statistics.median(self.request_us)
        print(
            f"\n{args.tasks} no-op tasks per CPU batch, {args.rounds} round(s), {args.pool} "
            "pool; medians of the rounds; x = against plain Celery's broker in the same run"
        )
        unjournaled = ", ".join(f"{k} {v}" for k, v in self.unjournaled.items() if k != "plain")
        print(
            f"publishes whose journal write failed (their batches miss journal_put): {unjournaled}"
        )
        print("\nServer time per message by command (slow log; EVALSHA by script):")
        print("| deployment | server | command | calls/msg | µs/msg |")
        print("|---|---|---|---:|---:|")
        for (variant, name), rows in self.split.items():
            commands = sorted(
                {k for r in rows for k in r if _top(k)},
                key=lambda k: -_median(rows, k),
            )
            for command in commands:
                calls = _median(rows, f"{command} calls")
                used = _median(rows, command)
                if used >= 0.05:  # a keeper beat's or recovery scan's call: nothing per message
                    print(f"| {variant} | {name} | {command} | {calls:.3f} | {used:.1f} |")
        print(
            "\nInside the scripts (slow log; each script's own redis.call()s, and the rest: Lua,"
            "\nits call overhead, argument and reply conversion):"
        )
        print("| deployment | server | script | command | calls/msg | µs/msg |")
        print("|---|---|---|---|---:|---:|")
        for (variant, name), rows in self.split.items():
            for script in sorted(
                {
                    k
                    for r in rows
                    for k in r
                    if k.startswith("EVALSHA ") and _top(k) and _median(rows, k) >= 0.05
                },
                key=lambda k: -_median(rows, k),
            ):
                label = script[len("EVALSHA ") :]
                prefix = f"{INSIDE}{label}: "
                inner = sorted(
                    {k for r in rows for k in r if k.startswith(prefix) and k[-6:] != " calls"},
                    key=lambda k: -_median(rows, k),
                )
                for key in inner:
                    used = _median(rows, key)
                    calls = _median(rows, f"{key} calls")
                    command = key[len(prefix) :]
                    print(
                        f"| {variant} | {name} | {label} | {command} | {calls:.2f} | {used:.1f} |"
                    )
                rest = statistics.median(
                    r.get(script, 0) - sum(r.get(k, 0) for k in inner) for r in rows
                )
                print(f"| {variant} | {name} | {label} | (the rest) | | {rest:.1f} |")
        print(
            "\nPer server: commands (above), the main thread's CPU as measured (commands and the"
            "\nI/O around them, one worker's load), and at saturation (estimate: commands +"
            f"\nreads x {request_us:.2f} µs, a saturated server's CPU per request in this run):"
        )
        print(
            "| deployment | server | commands µs/msg | reads/msg | CPU µs/msg measured | x plain "
            "| CPU µs/msg saturated | x plain | msgs/s one core (measured - saturated) "
            "| store keys B/msg |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
        plain_sat = 0.0
        core: dict[str, dict[str, tuple[float, float]]] = {}
        for (variant, name), rows in self.cpu.items():
            used = _median(rows, "cpu")
            reads = _median(rows, "reads")
            commands = statistics.median(_commands_us(r) for r in self.split[(variant, name)])
            saturated = commands + reads * request_us
            if (variant, name) == ("plain", "broker"):
                plain_sat = saturated
            core.setdefault(variant, {})[name] = (1e6 / used, 1e6 / saturated)
            print(
                f"| {variant} | {name} | {commands:.1f} | {reads:.2f} | {used:.1f} | "
                f"{used / plain:.2f} | {saturated:.1f} | {saturated / plain_sat:.2f} | "
                f"{1e6 / used:,.0f} - {1e6 / saturated:,.0f} | {_median(rows, 'bytes'):.0f} |"
            )
        print(
            "\nA queue lives on one Redis (its claim keys share one hash tag). N equally busy"
            "\nqueues on M masters reach min(broker, store x N / ceil(N / M)) msgs/s: the broker"
            "\nis one server (kombu has no Cluster transport); with the store on the broker the"
            "\nstore is that server (plain and claims: one server whatever M). msgs/s,"
            "\nmeasured - saturated (what bounds it):"
        )
        names = list(core)
        print("| N queues | M masters | " + " | ".join(names) + " |")
        print("|---:|---:|" + "---|" * len(names))
        for m in MASTERS:
            for n in QUEUES:
                cells = []
                for variant in names:
                    cores = core[variant]
                    low, which = fleet({k: v[0] for k, v in cores.items()}, n, m)
                    high, which_high = fleet({k: v[1] for k, v in cores.items()}, n, m)
                    bound = which if which == which_high else f"{which} - {which_high}"
                    cells.append(f"{low:,.0f} - {high:,.0f} ({bound})")
                print(f"| {n} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
