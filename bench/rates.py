"""Server time of one fleet-wide rate check, against the claim script and a lane pass in the
same run.

    python bench/rates.py [--ops 3000] [--rounds 5] [--quick]

What a worker would ask of its claim store per message with a rate (issue 32), measured on the
server alone (``INFO commandstats``, µs per ``EVALSHA``; the client's time is not in it), with
every claim script, ``rate.lua`` and the lane store's scripts loaded (as a worker with lanes
loads them) on a private ``redis-server`` (the machine's, on PATH, before a packaged Valkey;
its name and version are printed):

- ``floor``: ``return 1``, the cost of any script call on this server;
- ``claim``: ``claim.lua`` with records, a fresh task id and a worker-shaped owner (as in
  ``bench/scripts.py``): the gate's one call per message today;
- ``rate1``: ``rate.lua`` with one limit, allowed (a key per call: a start that writes);
- ``rate1-refused``: the same limit asked again before its turn (reads only);
- ``rate3``: three limits at once (a task's, its lane's, its key's), allowed;
- ``lane``: ``lane_claim.lua``, a worker's lane pass letting one copy in (one candidate, its
  lane ticket, claimed; the lane never full, holding ``LANE_LIVE`` live leases at the start).

A rated copy's start costs its claim (or its lane pass) plus one ``rate1`` call (``rate3``
with a task's, a lane's and a key's limit): the worker sends the rate check as a call of its
own, before the lane. Printed per round and as medians: µs per call, each rate variant
against ``claim``, and a rated claim and a rated lane pass against the plain ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_claims.claims.calls import SCRIPTS, ScriptCall  # noqa: E402
from celery_claims.claims.keys import QueueKeys  # noqa: E402
from celery_claims.claims.scripts import script_source  # noqa: E402
from celery_claims.demo.runner import private_redis  # noqa: E402
from celery_claims.lanes import TaskClaimCandidate, TaskLaneConfig  # noqa: E402
from celery_claims.lanes.redis import RedisTaskClaimStore  # noqa: E402
from celery_claims.rates import Limit, Rate, RedisRateLimiter  # noqa: E402

OWNER_HEAD = "celery@worker-7f9c8d6b5-x2k4q/12345/9f86d081."
LEASE_MS = 60_000
QUEUE = "emails"
#: A rate that allows every start of a run on fresh keys and refuses a second on one key.
RATE = Rate(10, 60_000)
#: A worker's lane: one kind, named as the lane (``worker/delivery/lane_model.py``), never full.
LANE = TaskLaneConfig(lane="mail", kinds=("mail",), limit=10**9)
#: Live leases the lane holds before the measured passes (as ``bench/lanes.py``'s keyed ones).
LANE_LIVE = 16
T0 = datetime.now(timezone.utc) - timedelta(seconds=5)
LEASE = T0 + timedelta(hours=1)


def usec_per_call(client: redis.Redis) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def fresh(client: redis.Redis) -> tuple[RedisRateLimiter, RedisTaskClaimStore]:
    """An empty server with every claim, rate and lane script loaded; the limiter, the lanes."""
    client.flushall()
    client.script_flush()
    for name in SCRIPTS:
        client.script_load(script_source(name))
    lanes = RedisTaskClaimStore(client=client, lanes=[LANE], prefix="claims")
    every = ("_enqueue", "_list", "_claim", "_complete", "_retry", "_heartbeat", "_purge")
    for name in every:
        client.script_load(getattr(lanes, name).script)
    return RedisRateLimiter(client=client), lanes


def measure(client: redis.Redis, ops: int) -> dict[str, float]:
    """µs per call of each variant (see the module doc)."""
    out: dict[str, float] = {}
    limiter, lanes = fresh(client)
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
    out["lane"] = _lane_passes(client, lanes, ops)
    return out


def _lane_passes(client: redis.Redis, lanes: RedisTaskClaimStore, ops: int) -> float:
    """µs per ``lane_claim.lua`` call: ``ops`` passes, each claiming its one candidate."""
    total = LANE_LIVE + ops
    for task_id in range(total):
        lanes.enqueue(task_id, "mail", next_run_at=T0)
    live = [TaskClaimCandidate(i, i, 0, 1) for i in range(LANE_LIVE)]
    assert len(lanes.claim_candidates_for_lane(LANE, live, T0, T0, LEASE)) == LANE_LIVE
    client.config_resetstat()
    for task_id in range(LANE_LIVE, total):
        one = [TaskClaimCandidate(0, task_id, 0, 1)]
        assert len(lanes.claim_candidates_for_lane(LANE, one, T0, T0, LEASE)) == 1
    return usec_per_call(client)


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
    with private_redis(path_first=True) as url:
        client = redis.Redis.from_url(url)
        info = client.info("server")
        name = str(info.get("server_name", "redis")).capitalize()
        print(f"server: {name} {info.get(name.lower() + '_version', info['redis_version'])}")
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
    print(f"  lane           {med['lane']:6.2f}  (lane_claim.lua, one copy let in)")
    print("a start's server time, rated (one rate1 call more) against plain:")
    for base in ("claim", "lane"):
        rated = med[base] + med["rate1"]
        print(f"  {base:5s} + rate1  {rated:6.2f}  ({rated / med[base]:.2f}x {base} alone)")


if __name__ == "__main__":
    main()
