"""Server time of a rated claim (the claim's script counting its start) against a plain claim,
and of the rate checks of their own and a lane pass, in the same run.

    python bench/rates.py [--ops 3000] [--rounds 5] [--quick]

What a worker asks of its claim store per message with a rate (issue 32), measured on the
server alone (``INFO commandstats``, µs per ``EVALSHA``; the client's time and the round trip
are not in it), with every claim script, ``rate.lua`` and the lane store's scripts loaded (as a
worker with lanes loads them) on a private ``redis-server`` (the machine's, on PATH, before a
packaged Valkey; its name and version are printed). Each call is built as the worker builds it
(``RedisClaimManager.claim_call``, ``RedisRateLimiter.claim_part`` and ``acquire_call``, the
worker's rate scope), each reply checked:

- ``floor``: ``return 1``, the cost of any script call on this server;
- ``claim``: ``claim.lua`` with records, a fresh task id and a worker-shaped owner (as in
  ``bench/scripts.py``): the gate's one call per message;
- ``claim_rated1``: ``claim_rated.lua``, the same claim with one limit counted in its call,
  granted and allowed (a fresh limit per call: a start that writes its key);
- ``claim_rated1-refused``: the same, the limit used up (the claim granted, the start refused:
  it reads the limit only);
- ``claim_rated3``: three limits at once (a task's, its lane's, its key's), allowed;
- ``rate1``, ``rate1-refused``, ``rate3``: ``rate.lua``, the check as a call of its own
  (allowed, refused, three limits): a waiting copy's re-check, and on a Redis Cluster every
  first check (there the rates' keys are in another slot than the claim's);
- ``lane``: ``lane_claim.lua``, a worker's lane pass letting one copy in (one candidate, its
  lane ticket, claimed; the lane never full, holding ``LANE_LIVE`` live leases at the start).

What the worker sends for a rated copy's start: on a standalone or Sentinel store one
``claim_rated`` call (its task's, its key's and its lane's limits all in it); on a Redis Cluster
``claim`` and then ``rate1`` (measured here on one server: the scripts' time, not the Cluster's
own). A lane's rate is counted in the claim's call too, before the lane (``worker/delivery``'s
``gate.py`` and ``rates.py``): the lane pass carries no rate and costs the same, so a rated copy
in a lane costs ``claim_rated1 + lane`` (Cluster: ``claim + rate1 + lane``) against a plain
one's ``claim + lane``. Printed per round and as medians: µs per call, each rated variant
against ``claim``, and each rated start against the plain one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_claims.claims.calls import SCRIPTS, RatedClaim, ScriptCall  # noqa: E402
from celery_claims.claims.redis import RedisClaimManager  # noqa: E402
from celery_claims.claims.scripts import script_source  # noqa: E402
from celery_claims.demo.runner import private_redis  # noqa: E402
from celery_claims.lanes import TaskClaimCandidate, TaskLaneConfig  # noqa: E402
from celery_claims.lanes.redis import RedisTaskClaimStore  # noqa: E402
from celery_claims.model import Success  # noqa: E402
from celery_claims.rates import Limit, Rate, RateAllowed, RateLimited, RedisRateLimiter  # noqa: E402
from celery_claims.worker.delivery.rates import RATE_SCOPE  # noqa: E402

OWNER_HEAD = "celery@worker-7f9c8d6b5-x2k4q/12345/9f86d081."
LEASE_MS = 60_000
QUEUE = "emails"
#: A rate that allows every start of a run on fresh keys.
RATE = Rate(10, 60_000)
#: A limit used up before the refused variants (its next start an hour away).
USED = Limit("key:used", Rate(1, 3_600_000))
#: The variants with a rate, printed against ``claim``.
RATED = ("claim_rated1", "claim_rated1-refused", "claim_rated3", "rate1", "rate1-refused", "rate3")
#: A worker's lane: one kind, named as the lane (``worker/delivery/lane_model.py``), never full.
LANE = TaskLaneConfig(lane="mail", kinds=("mail",), limit=10**9)
#: Live leases the lane holds before the measured passes (as ``bench/lanes.py``'s keyed ones).
LANE_LIVE = 16
T0 = datetime.now(timezone.utc) - timedelta(seconds=5)
LEASE = T0 + timedelta(hours=1)


def usec_per_call(client: redis.Redis) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def fresh(client: redis.Redis) -> tuple[RedisClaimManager, RedisRateLimiter, RedisTaskClaimStore]:
    """An empty server with every claim, rate and lane script loaded; the claim manager, the
    limiter and the lanes on it."""
    client.flushall()
    client.script_flush()
    for name in SCRIPTS:
        client.script_load(script_source(name))
    lanes = RedisTaskClaimStore(client=client, lanes=[LANE], prefix="claims")
    every = ("_enqueue", "_list", "_claim", "_complete", "_retry", "_heartbeat", "_purge")
    for name in every:
        client.script_load(getattr(lanes, name).script)
    manager = RedisClaimManager(client=client, prefix="claims")
    return manager, RedisRateLimiter(client=client, prefix="claims"), lanes


def measure(client: redis.Redis, ops: int) -> dict[str, float]:
    """µs per call of each variant (see the module doc)."""
    out: dict[str, float] = {}
    manager, limiter, lanes = fresh(client)
    floor = client.register_script("return 1")
    floor()
    client.config_resetstat()
    for _ in range(ops):
        floor()
    out["floor"] = usec_per_call(client)

    # the queue registered, the script's first call
    manager.execute(_claims(manager, limiter, 1, "warm", None)[0])
    out["claim"] = _run(client, _claims(manager, limiter, ops, "plain", None), Success)
    rated1 = _claims(manager, limiter, ops, "rated1", lambda i: [Limit(f"key:1:{i}", RATE)])
    out["claim_rated1"] = _run(client, rated1, RateAllowed)
    limiter.acquire(RATE_SCOPE, [USED])
    refused = _claims(manager, limiter, ops, "refused", lambda i: [USED])
    out["claim_rated1-refused"] = _run(client, refused, RateLimited)
    rated3 = _claims(manager, limiter, ops, "rated3", _three)
    out["claim_rated3"] = _run(client, rated3, RateAllowed)

    one = [limiter.acquire_call(RATE_SCOPE, [Limit(f"key:r1:{i}", RATE)]) for i in range(ops)]
    out["rate1"] = _run(client, one, RateAllowed)
    again = limiter.acquire_call(RATE_SCOPE, [USED])
    out["rate1-refused"] = _run(client, [again] * ops, RateLimited)
    three = [limiter.acquire_call(RATE_SCOPE, _three(ops + i)) for i in range(ops)]
    out["rate3"] = _run(client, three, RateAllowed)
    out["lane"] = _lane_passes(client, lanes, ops)
    return out


def _claims(
    manager: RedisClaimManager,
    limiter: RedisRateLimiter,
    ops: int,
    tag: str,
    limits: Callable[[int], list[Limit]] | None,
) -> list[ScriptCall[Any]]:
    """``ops`` gate-shaped claims of fresh task ids, the ``i``-th with ``limits(i)`` counted in
    its call (``claim_rated.lua``), or plain (``claim.lua``) without ``limits``."""
    calls: list[ScriptCall[Any]] = []
    for i in range(ops):
        rate = None if limits is None else limiter.claim_part(RATE_SCOPE, limits(i))
        task = f"{tag}-{uuid.uuid4()}:0:0"
        calls.append(manager.claim_call(QUEUE, task, f"{OWNER_HEAD}{i:x}", LEASE_MS, rate=rate))
    return calls


def _three(i: int) -> list[Limit]:
    """A task's, its lane's and its key's limits, fresh for ``i``."""
    return [Limit(f"task:{i}", RATE), Limit(f"lane:{i}", RATE), Limit(f"key:3:{i}", RATE)]


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


def _run(client: redis.Redis, calls: Sequence[ScriptCall[Any]], expected: type) -> float:
    """µs per call of ``calls``, each answered ``expected`` (a granted claim, or the verdict
    of a rated claim's or a rate call's start)."""
    client.config_resetstat()
    for call in calls:
        answer = call.decode(call.script(keys=call.keys, args=call.args))
        if isinstance(answer, RatedClaim):
            assert isinstance(answer.claim, Success), answer
            answer = answer.rate
        assert isinstance(answer, expected), answer
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
    print(f"  {'floor':20s}  {med['floor']:6.2f}  (return 1)")
    print(f"  {'claim':20s}  {med['claim']:6.2f}  (claim.lua with records)")
    for name in RATED:
        print(f"  {name:20s}  {med[name]:6.2f}  ({med[name] / med['claim']:.2f}x claim)")
    print(f"  {'lane':20s}  {med['lane']:6.2f}  (lane_claim.lua, one copy let in)")
    print(
        "a rated start's server time against a plain one, as the worker sends it; of each"
        "\npair the first on a standalone or Sentinel store, the second on a Redis Cluster:"
    )
    lane = med["claim"] + med["lane"]
    starts = (
        ("claim_rated1", med["claim_rated1"], med["claim"], "claim alone"),
        ("claim + rate1", med["claim"] + med["rate1"], med["claim"], "claim alone"),
        ("claim_rated1 + lane", med["claim_rated1"] + med["lane"], lane, "claim + lane"),
        ("claim + rate1 + lane", med["claim"] + med["rate1"] + med["lane"], lane, "claim + lane"),
    )
    for what, rated, plain, base in starts:
        print(f"  {what:20s} = {rated:6.2f}  ({rated / plain:.2f}x {base})")


if __name__ == "__main__":
    main()
