"""Server time of the claim scripts a worker runs per message, against references in the run.

    python bench/scripts.py [--ops 3000] [--rounds 5] [--baseline TREE]
    python bench/scripts.py --callgrind [--ops 1000] [--baseline TREE]

What a Celery worker asks of its claim store for each message, measured on the server alone
(``INFO commandstats``, µs per ``EVALSHA``; the client's time is not in it): the gate's claim
(``claim.lua`` with records, a fresh 36-character task id, a worker-shaped owner) and the
completion that acknowledges the delivery (``ack_done.lua``, with kombu's unacked keys). Each
round, every variant runs on a private ``redis-server`` with the script cache flushed and then
every claim script and the publish journal's registered, as a worker registers them (the
server's Lua heap, which its garbage collector walks, holds them all). The variants:

- ``floor``: ``return 1``, the cost of any script call on this server;
- ``ride0``: the minimal claim and completion scripts of ``bench/overhead_app.py`` (no
  fencing, owners, stats or takeover count; its ack's ``ZREM`` and ``HDEL`` are commands of
  their own there, not counted here): what a claim riding the broker cannot go below;
- ``tree``: this checkout's scripts;
- ``base``: the scripts of another checkout (``--baseline TREE``, e.g. a ``git worktree`` of an
  earlier commit), to show a change's effect in the same run.

Printed per round and as medians: µs per call of each script, and each variant's claim +
completion against ``floor``.

Then the client's side of one such call, which a pool process pays for each settle: CPU µs
(``time.process_time``, system time included) of one waited ``ack_done`` call on a kept
connection (``sender.ScriptCaller``, what the worker uses), through redis-py's client
(``Script.__call__``), and, as the floor, the same bytes written and read on a raw socket.

``--callgrind``: exact counts instead of times. Each variant gets a fresh private
``redis-server`` (``--hz 1``: few timer runs among the calls) under ``valgrind
--tool=callgrind``, its scripts loaded, 1,200 messages journaled and claimed, half of them
completed (the queue's hashes past their listpack sizes: a listpack is scanned at each
lookup, its cost growing with its length); then the server's instructions
(``callgrind_control -z`` before and ``-d`` after each run of ``--ops`` calls, network and
command parsing included) per call of the producer's publish-journal entry riding its push
(``journal_put.lua`` with the queue's list), the gate's claim and the completion that acks
(``ack_done.lua``), in that order, on task ids and owners that are the same every run:
numbers a reviewer re-runs to within a few hundred instructions (the server's hash seeds are
random).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
#: The checkout whose package this process measures (``--client-only`` runs under another's).
TREE = Path(os.environ.get("BENCH_TREE", str(ROOT)))
sys.path.insert(0, str(TREE))

from bench.overhead_app import RIDE0_CLAIM, RIDE0_DONE  # noqa: E402
from celery_claims import RedisClaimManager  # noqa: E402
from celery_claims.demo.runner import private_redis  # noqa: E402
from celery_claims.worker.transport.sender import ScriptCaller, _commands, pack_commands  # noqa: E402

#: Writes the sources a checkout registers, as JSON {name: source}; run with that checkout first
#: on sys.path (an earlier commit had ``claims/redis.py``'s ``_source``, not ``scripts.py``, and
#: its ``_SCRIPTS``, not ``claims/calls.py``'s ``SCRIPTS``).
SOURCES = """
import json, sys
sys.path.insert(0, sys.argv[1])
from celery_claims.claims import redis as claims_redis
try:
    from celery_claims.claims.scripts import script_source
except ImportError:
    script_source = claims_redis._source
try:
    from celery_claims.claims.calls import SCRIPTS as names
except ImportError:
    names = claims_redis._SCRIPTS
sources = {name: script_source(name) for name in names}
try:
    import redis
    from celery_claims.claims.journal import RedisJournal
except ImportError:  # a checkout before the publish journal
    pass
else:
    journal = RedisJournal(client=redis.Redis())  # registering connects to nothing
    sources.update({name: s.script for name, s in journal.scripts.items()})
print(json.dumps(sources))
"""

OWNER_HEAD = "celery@worker-7f9c8d6b5-x2k4q/12345/9f86d081."
CLAIM_KEYS = ["c:{q}:c", "c:{q}:n", "c:{q}:s", "c:{q}:d", "c:{q}:o"]
ACK_KEYS = ["c:{q}:c", "c:{q}:s", "c:{q}:d", "c:{q}:o", "unacked_index", "unacked"]
JOURNAL_KEYS = ["c:{q}:j", "c:{q}:jt", "c:{q}:jn", "q"]
LEASE_MS = 60_000
DONE_TTL_MS = 86_400_000
RECOVER_AFTER_MS = 300_000
#: A message as the journal keeps it and as kombu pushes it (a small task's sizes).
MESSAGE = json.dumps(
    {
        "body": "W1tdLCB7fSwgeyJjYWxsYmFja3MiOiBudWxsLCAiZXJyYmFja3MiOiBudWxsfV0=" * 2,
        "headers": {"lang": "py", "task": "tasks.noop", "id": "0" * 36, "argsrepr": "()"},
        "content-type": "application/json",
        "properties": {"delivery_tag": "0" * 36, "priority": 0},
    }
)
PAYLOAD = json.dumps({"message": MESSAGE, "exchange": "", "routing_key": "q"})


def sources(tree: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", SOURCES, str(tree)], capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def usec_per_call(client: redis.Redis) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def task_ids(ops: int, salt: str = "") -> list[str]:
    """``ops`` task ids shaped as a worker's claim ids, the same every run."""
    return [f"{uuid.uuid5(uuid.NAMESPACE_OID, f'{salt}{i}')}:0:0" for i in range(ops)]


def measure(client: redis.Redis, scripts: dict[str, str], ops: int) -> dict[str, float]:
    """µs per call of ``claim`` and ``ack_done`` (or ``call`` alone), all of ``scripts`` loaded."""
    client.flushall()
    client.script_flush()
    loaded = {name: client.register_script(source) for name, source in scripts.items()}
    for script in loaded.values():
        client.script_load(script.script)
    if "claim" not in loaded:
        client.config_resetstat()
        for _ in range(ops):
            loaded["call"]()
        return {"call": usec_per_call(client)}
    ids = [f"{uuid.uuid4()}:0:0" for _ in range(ops)]
    client.hset("unacked", mapping={str(i): "m" for i in range(ops)})
    client.config_resetstat()
    instances = []
    for i, task in enumerate(ids):
        reply = loaded["claim"](
            keys=CLAIM_KEYS, args=[task, f"{OWNER_HEAD}{i:x}", LEASE_MS, "", "1", "", 0]
        )
        instances.append(reply[1])
    claim = usec_per_call(client)
    client.config_resetstat()
    for i, task in enumerate(ids):
        owner = f"{OWNER_HEAD}{i:x}"
        reply = loaded["ack_done"](
            keys=ACK_KEYS, args=[task, owner, instances[i], DONE_TTL_MS, "", str(i)]
        )
        assert reply[0] == 1, reply
    return {"claim": claim, "ack_done": usec_per_call(client)}


def measure_ride0(client: redis.Redis, ops: int) -> dict[str, float]:
    client.flushall()
    client.script_flush()
    claim, done = client.register_script(RIDE0_CLAIM), client.register_script(RIDE0_DONE)
    ids = [f"{uuid.uuid4()}:0:0" for _ in range(ops)]
    client.config_resetstat()
    for i, task in enumerate(ids):
        reply = claim(keys=["r:c", "r:d"], args=[task, f"{OWNER_HEAD}{i:x}", LEASE_MS])
        assert reply == 1, reply
    claimed = usec_per_call(client)
    client.config_resetstat()
    for i, task in enumerate(ids):
        reply = done(keys=["r:c", "r:d"], args=[task, f"{OWNER_HEAD}{i:x}"])
        assert reply == 1, reply
    return {"claim": claimed, "ack_done": usec_per_call(client)}


class _Utf8:
    """What ``sender.pack_commands`` reads of a connection: its encoder."""

    class encoder:  # the attribute's name in redis-py
        encoding, encoding_errors = "utf-8", "strict"


def client_cpu(url: str, ops: int) -> dict[str, float]:
    """Client CPU µs per waited ``ack_done`` call: kept connection, redis-py client, raw."""
    client = redis.Redis.from_url(url)
    client.flushall()
    manager = RedisClaimManager(client=client)
    tokens = [
        manager.claim_unless_done("q", f"{uuid.uuid4()}:0:0", f"{OWNER_HEAD}{i:x}", LEASE_MS).token
        for i in range(3 * ops + 1)
    ]
    calls = [
        manager.ack_done_call(t, DONE_TTL_MS, ("ui", "u"), str(i))
        for i, t in enumerate(tokens)
        if t is not None
    ]
    caller, pool = ScriptCaller(), client.connection_pool
    caller.call(pool, calls.pop())  # connected, script loaded
    out: dict[str, float] = {}
    start = time.process_time()
    for call in calls[:ops]:
        caller.call(pool, call)
    out["kept"] = (time.process_time() - start) / ops * 1e6
    start = time.process_time()
    for call in calls[ops : 2 * ops]:
        call.script(keys=call.keys, args=call.args)
    out["client"] = (time.process_time() - start) / ops * 1e6
    kwargs = pool.connection_kwargs
    sock = socket.create_connection((kwargs["host"], kwargs["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    packed = [
        pack_commands(_commands(c, {c.script.sha}), _Utf8)[0] for c in calls[2 * ops : 3 * ops]
    ]
    start = time.process_time()
    for data in packed:
        sock.sendall(data)
        sock.recv(65536)  # one small reply: ":1" in an array
    out["raw"] = (time.process_time() - start) / ops * 1e6
    sock.close()
    caller.close()
    # every call of the three ways completed its claim (a refused one would leave it live)
    assert manager.active_claims("q") == 0, "a completion was refused"
    return out


def base_client_cpu(tree: Path, url: str, ops: int) -> dict[str, float]:
    """:func:`client_cpu` measured with the package of the checkout ``tree``."""
    out = subprocess.run(
        [sys.executable, __file__, "--client-only", url, "--ops", str(ops)],
        env={**os.environ, "BENCH_TREE": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--ops", type=int)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout: adds the variant base")
    parser.add_argument("--quick", action="store_true", help="1 round of 300 calls")
    parser.add_argument(
        "--callgrind", action="store_true", help="exact instruction counts (--ops 1000 default)"
    )
    parser.add_argument("--client-only", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ops is None:
        args.ops = 1000 if args.callgrind else 3000
    if args.client_only:
        # one client_cpu measurement, as JSON, by the package of BENCH_TREE (see main)
        print(json.dumps(client_cpu(args.client_only, args.ops)))
        return
    if args.quick:
        args.ops, args.rounds = 300, 1
    trees = {"tree": sources(ROOT)}
    if args.baseline is not None:
        trees["base"] = sources(args.baseline)
    if args.callgrind:
        main_callgrind(trees, args.ops)
        return
    results: dict[str, list[dict[str, float]]] = {}
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        for n in range(1, args.rounds + 1):
            row = {"floor": measure(client, {"call": "return 1"}, args.ops)}
            row["ride0"] = measure_ride0(client, args.ops)
            for name, scripts in trees.items():
                row[name] = measure(client, scripts, args.ops)
            row["client"] = client_cpu(url, args.ops)
            if args.baseline is not None:
                row["client-base"] = base_client_cpu(args.baseline, url, args.ops)
            for name, r in row.items():
                results.setdefault(name, []).append(r)
            print(f"round {n}: " + "  ".join(_row(name, r) for name, r in row.items()))
    cpu = results.pop("client")
    base_cpu = results.pop("client-base", None)
    floor = statistics.median(r["call"] for r in results.pop("floor"))
    print(f"\nmedian of {args.rounds} rounds x {args.ops} calls (µs per call on the server):")
    print(f"  floor     {floor:6.2f}  (return 1)")
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"  {name:8s}  claim {med['claim']:6.2f}  ack_done {med['ack_done']:6.2f}  "
            f"per message {med['claim'] + med['ack_done']:6.2f} "
            f"({(med['claim'] + med['ack_done']) / (2 * floor):.1f}x two floor calls)"
        )
    med = {k: statistics.median(r[k] for r in cpu) for k in cpu[0]}
    print(
        "client CPU µs per waited ack_done call: "
        f"kept connection {med['kept']:.1f} ({med['kept'] / med['raw']:.2f}x raw), "
        f"redis-py client {med['client']:.1f} ({med['client'] / med['raw']:.2f}x raw), "
        f"raw socket {med['raw']:.1f}"
    )
    if base_cpu is not None:
        base = {k: statistics.median(r[k] for r in base_cpu) for k in base_cpu[0]}
        print(
            f"  base: kept connection {base['kept']:.1f} ({base['kept'] / base['raw']:.2f}x raw), "
            f"raw socket {base['raw']:.1f}"
        )


# --- exact counts: the server under callgrind (--callgrind) ----------------------------------


#: Messages journaled and claimed before the counted ones, half of them completed: the
#: queue's claims and records hashes past Redis' default hash-max-listpack-entries (512),
#: each lookup a hash table's, not a scan of a listpack (whose cost grows with its length).
_WARM = 1200


class CallgrindServer:
    """A private ``redis-server`` under callgrind: instructions of runs of calls."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="claims-cg-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.dir}/cg.%p",
             "redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
             "--hz", "1", "--dynamic-hz", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = redis.Redis(port=port)
        for _ in range(300):
            with contextlib.suppress(redis.ConnectionError):
                self.client.ping()
                return
            time.sleep(0.2)
        self.close()
        raise SystemExit("redis-server under valgrind did not start")

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def per_call(self, run: Callable[[], object], ops: int) -> float:
        """Instructions of the server per call of ``run`` (which makes ``ops`` calls)."""
        before = set(self.dir.glob("cg.*"))
        self._control("-z")
        run()
        self._control("-d")
        for _ in range(100):
            for path in set(self.dir.glob("cg.*")) - before:
                found = re.search(r"^(?:summary|totals):\s+(\d+)", path.read_text(), re.M)
                if found:
                    return int(found.group(1)) / ops
            time.sleep(0.1)
        raise SystemExit("callgrind wrote no dump")

    def _control(self, option: str) -> None:
        command = ["callgrind_control", option, str(self.proc.pid)]
        subprocess.run(command, check=True, capture_output=True)


class MessageCalls:
    """The script calls of one message each of ``ids``, a phase at a time: its journal entry
    riding its push, its claim, its completion acking delivery tag ``first_tag + i``."""

    def __init__(self, loaded: dict[str, Any], ids: list[str], first_tag: int) -> None:
        self.loaded, self.ids, self.first_tag = loaded, ids, first_tag
        self.instances: list[int] = []

    def journal_put(self) -> None:
        for task in self.ids:
            args = [task, MESSAGE, RECOVER_AFTER_MS, "", PAYLOAD]
            self.loaded["journal_put"](keys=JOURNAL_KEYS, args=args)

    def claim(self) -> None:
        for i, task in enumerate(self.ids):
            args = [task, f"{OWNER_HEAD}{i:x}", LEASE_MS, "", "1", "", 0]
            reply = self.loaded["claim"](keys=CLAIM_KEYS, args=args)
            assert reply[0] == 1, reply
            self.instances.append(reply[1])

    def ack_done(self, count: int | None = None) -> None:
        for i, task in enumerate(self.ids[:count]):
            owner, tag = f"{OWNER_HEAD}{i:x}", self.first_tag + i
            args = [task, owner, self.instances[i], DONE_TTL_MS, "", tag]
            reply = self.loaded["ack_done"](keys=ACK_KEYS, args=args)
            assert reply[0] == 1, reply

    def phases(self) -> dict[str, Callable[[], None]]:
        names = ("journal_put", "claim", "ack_done")
        return {name: getattr(self, name) for name in names if name in self.loaded}


def count_scripts(scripts: dict[str, str], ops: int) -> dict[str, float]:
    """Instructions per call of each phase of :class:`MessageCalls` (``journal_put`` when
    the tree has it) on a fresh server, every script of ``scripts`` loaded."""
    with contextlib.closing(CallgrindServer()) as server:
        client = server.client
        loaded = {name: client.register_script(source) for name, source in scripts.items()}
        for script in loaded.values():
            client.script_load(script.script)
        client.hset("unacked", mapping={str(i): "m" for i in range(ops + _WARM)})
        warm = MessageCalls(loaded, task_ids(_WARM, "warm"), ops)
        warm.journal_put()
        warm.claim()
        warm.ack_done(_WARM // 2)
        calls = MessageCalls(loaded, task_ids(ops), 0)
        return {name: server.per_call(run, ops) for name, run in calls.phases().items()}


def count_ride0(ops: int) -> dict[str, float]:
    """As :func:`count_scripts`, for the ``ride0`` claim and completion."""
    with contextlib.closing(CallgrindServer()) as server:
        claim = server.client.register_script(RIDE0_CLAIM)
        done = server.client.register_script(RIDE0_DONE)

        def run(script: Any, ids: list[str], args: list[Any]) -> Callable[[], None]:
            def calls() -> None:
                for i, task in enumerate(ids):
                    reply = script(keys=["r:c", "r:d"], args=[task, f"{OWNER_HEAD}{i:x}", *args])
                    assert reply == 1, reply

            return calls

        warm = task_ids(_WARM, "warm")
        run(claim, warm, [LEASE_MS])()
        run(done, warm[: _WARM // 2], [])()
        ids = task_ids(ops)
        return {
            "claim": server.per_call(run(claim, ids, [LEASE_MS]), ops),
            "ack_done": server.per_call(run(done, ids, []), ops),
        }


def count_floor(ops: int) -> float:
    with contextlib.closing(CallgrindServer()) as server:
        sha = server.client.script_load("return 1")
        server.client.evalsha(sha, 0)
        return server.per_call(lambda: [server.client.evalsha(sha, 0) for _ in range(ops)], ops)


def main_callgrind(trees: dict[str, dict[str, str]], ops: int) -> None:
    """Print instructions per call of each variant (see the module's docstring)."""
    floor = count_floor(ops)
    print(f"server instructions per call, {ops} calls, a fresh server a variant (k = 1000):")
    print(f"  floor     call {floor / 1000:7.1f}k  (return 1)", flush=True)
    rows = {"ride0": count_ride0(ops)}
    rows.update({name: count_scripts(scripts, ops) for name, scripts in trees.items()})
    for name, row in rows.items():
        cells = "  ".join(f"{op} {n / 1000:7.1f}k" for op, n in row.items())
        print(f"  {name:8s}  {cells}  per message {sum(row.values()) / 1000:7.1f}k", flush=True)
    if "base" in rows:
        tree, base = rows["tree"], rows["base"]
        cells = "  ".join(
            f"{op} {(tree[op] - base[op]) / 1000:+.1f}k ({tree[op] / base[op] - 1:+.1%})"
            for op in tree
            if op in base
        )
        print(f"  tree-base {cells}")


def _row(name: str, r: dict[str, float]) -> str:
    return f"{name} " + "/".join(f"{v:.2f}" for v in r.values())


if __name__ == "__main__":
    main()
