"""Server time of the claim scripts a worker runs per message, against references in the run.

    python bench/scripts.py [--ops 3000] [--rounds 5] [--baseline TREE]

What a Celery worker asks of its claim store for each message, measured on the server alone
(``INFO commandstats``, µs per ``EVALSHA``; the client's time is not in it): the gate's claim
(``claim.lua`` with records, a fresh 36-character task id, a worker-shaped owner) and the
completion that acknowledges the delivery (``ack_done.lua``, with kombu's unacked keys). Each
round, every variant runs on a private ``redis-server`` with the script cache flushed and then
every claim script registered, as a worker registers them (the server's Lua heap, which its
garbage collector walks, holds them all). The variants:

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
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

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
print(json.dumps({name: script_source(name) for name in names}))
"""

OWNER_HEAD = "celery@worker-7f9c8d6b5-x2k4q/12345/9f86d081."
CLAIM_KEYS = ["c:{q}:c", "c:{q}:n", "c:{q}:s", "c:{q}:d", "c:{q}:o"]
ACK_KEYS = ["c:{q}:c", "c:{q}:s", "c:{q}:d", "c:{q}:o", "unacked_index", "unacked"]
LEASE_MS = 60_000
DONE_TTL_MS = 86_400_000


def sources(tree: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", SOURCES, str(tree)], capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def usec_per_call(client: redis.Redis) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


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
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout: adds the variant base")
    parser.add_argument("--quick", action="store_true", help="1 round of 300 calls")
    parser.add_argument("--client-only", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_only:
        # one client_cpu measurement, as JSON, by the package of BENCH_TREE (see main)
        print(json.dumps(client_cpu(args.client_only, args.ops)))
        return
    if args.quick:
        args.ops, args.rounds = 300, 1
    trees = {"tree": sources(ROOT)}
    if args.baseline is not None:
        trees["base"] = sources(args.baseline)
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


def _row(name: str, r: dict[str, float]) -> str:
    return f"{name} " + "/".join(f"{v:.2f}" for v in r.values())


if __name__ == "__main__":
    main()
