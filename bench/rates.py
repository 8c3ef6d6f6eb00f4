"""Server time of one fleet-wide rate check, against the claim script in the same run.

    python bench/rates.py [--ops 3000] [--rounds 5] [--quick]

What a worker would ask of its claim store per message with a rate (issue 32), measured on the
server alone (``INFO commandstats``, µs per ``EVALSHA``; the client's time is not in it), with
every claim script and ``rate.lua`` loaded (as a worker loads them) on a private
``redis-server``:

- ``floor``: ``return 1``, the cost of any script call on this server;
- ``claim``: ``claim.lua`` with records, a fresh task id and a worker-shaped owner (as in
  ``bench/scripts.py``): the gate's one call per message today;
- ``rate1``: ``rate.lua`` with one limit, allowed (a key per call: a start that writes);
- ``rate1-refused``: the same limit asked again before its turn (reads only);
- ``rate3``: three limits at once (a task's, its lane's, its key's), allowed.

Printed per round and as medians: µs per call, and each rate variant against ``claim``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_claims.claims.calls import SCRIPTS, ScriptCall  # noqa: E402
from celery_claims.claims.keys import QueueKeys  # noqa: E402
from celery_claims.claims.scripts import script_source  # noqa: E402
from celery_claims.demo.runner import private_redis  # noqa: E402
from celery_claims.rates import Limit, Rate, RedisRateLimiter  # noqa: E402

OWNER_HEAD = "celery@worker-7f9c8d6b5-x2k4q/12345/9f86d081."
LEASE_MS = 60_000
QUEUE = "emails"
#: A rate that allows every start of a run on fresh keys and refuses a second on one key.
RATE = Rate(10, 60_000)


def usec_per_call(client: redis.Redis) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def fresh(client: redis.Redis) -> RedisRateLimiter:
    """An empty server with every claim script and the rate script loaded; the limiter."""
    client.flushall()
    client.script_flush()
    for name in SCRIPTS:
        client.script_load(script_source(name))
    return RedisRateLimiter(client=client)


def measure(client: redis.Redis, ops: int) -> dict[str, float]:
    """µs per call of each variant (see the module doc)."""
    out: dict[str, float] = {}
    limiter = fresh(client)
    floor = client.register_script("return 1")
    floor()
    client.config_resetstat()
    for _ in range(ops):
        floor()
    out["floor"] = usec_per_call(client)

    claim = client.register_script(script_source("claim"))
    keys = QueueKeys("claims", QUEUE).claim_keys
    ids = [f"{uuid.uuid4()}:0:0" for _ in range(ops)]
    claim(keys=keys, args=["warm", f"{OWNER_HEAD}0", LEASE_MS, "", "1", "", 0])
    client.config_resetstat()
    for i, task in enumerate(ids):
        reply = claim(keys=keys, args=[task, f"{OWNER_HEAD}{i:x}", LEASE_MS, "", "1", "", 0])
        assert reply[0] == 1, reply
    out["claim"] = usec_per_call(client)

    calls = [limiter.acquire_call(QUEUE, [Limit(f"key:{i}", RATE)]) for i in range(ops)]
    out["rate1"] = _run(client, calls, allowed=True)
    one = limiter.acquire_call(QUEUE, [Limit("key:0", RATE)])
    out["rate1-refused"] = _run(client, [one] * ops, allowed=False)
    three = [
        limiter.acquire_call(
            QUEUE,
            [Limit(f"task:{i}", RATE), Limit(f"lane:{i}", RATE), Limit(f"key:3:{i}", RATE)],
        )
        for i in range(ops)
    ]
    out["rate3"] = _run(client, three, allowed=True)
    return out


def _run(client: redis.Redis, calls: Sequence[ScriptCall[Any]], allowed: bool) -> float:
    client.config_resetstat()
    for call in calls:
        reply = call.script(keys=call.keys, args=call.args)
        assert (int(reply[0]) == 1) == allowed, reply
    return usec_per_call(client)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 round of 300 calls")
    args = parser.parse_args()
    if args.quick:
        args.ops, args.rounds = 300, 1
    rows: list[dict[str, float]] = []
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        for n in range(1, args.rounds + 1):
            row = measure(client, args.ops)
            rows.append(row)
            print(f"round {n}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
        client.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\nmedian of {args.rounds} rounds x {args.ops} calls (µs per call on the server):")
    print(f"  floor          {med['floor']:6.2f}  (return 1)")
    print(f"  claim          {med['claim']:6.2f}  (claim.lua with records)")
    for name in ("rate1", "rate1-refused", "rate3"):
        print(f"  {name:13s}  {med[name]:6.2f}  ({med[name] / med['claim']:.2f}x claim)")


if __name__ == "__main__":
    main()
