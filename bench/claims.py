"""Claim-core cost against references measured in the same run on the same private Redis.

    python bench/claims.py [--ops 5000] [--rounds 5]

Each round times, on one connection, N cycles of:
- ``lua-ref``: a minimal 1-round-trip Lua lock (SET NX PX) and its owner-checked delete:
  the floor for any "take then give back" protocol (2 round trips a cycle);
- ``redis-lock``: redis-py's ``Lock`` acquire + release (also Lua, also 2 round trips);
- ``claims``: ``claim`` + ``complete`` (2 round trips, plus fencing, stats, done record);
- ``gate`` and ``keyed``: what the worker's gate does for a plain task (``claim_unless_done``
  on the task id, then ``complete``) and for a keyed one (the same on a key of 50, its owner
  naming the attempt: the record goes to the attempt). Both 2 round trips; the ratio is the
  keyed claim's extra script work;
- ``renew``: renewing N live claims one ``extend`` each vs one batched ``renew`` per 100.
Ratios are printed per round against ``lua-ref``; the median over rounds is the summary.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from celery_claims import RedisClaimManager
from celery_claims.claims.keys import keyed_owner

LOCK_SCRIPT = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])"
UNLOCK_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@contextmanager
def private_redis() -> Iterator[int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    workdir = tempfile.mkdtemp(prefix="claims-bench-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        client.close()
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def timed(ops: int, cycle: Callable[[int], None]) -> float:
    """Cycles per second of ``cycle`` over ``ops`` distinct task numbers."""
    start = time.perf_counter()
    for i in range(ops):
        cycle(i)
    return ops / (time.perf_counter() - start)


def run_round(port: int, ops: int) -> dict[str, float]:
    client = redis.Redis(port=port)
    client.flushall()
    run = uuid.uuid4().hex[:6]
    lock = client.register_script(LOCK_SCRIPT)
    unlock = client.register_script(UNLOCK_SCRIPT)
    claims = RedisClaimManager(client=client, prefix=f"bench{run}")
    claims.claim("warm", "warm", "w", 1)  # register the queue and load the scripts

    def lua_ref(i: int) -> None:
        key = f"ref{run}:{i}"
        lock(keys=[key], args=["owner", 30_000])
        unlock(keys=[key], args=["owner"])

    def redis_lock(i: int) -> None:
        held = client.lock(f"lock{run}:{i}", timeout=30)
        held.acquire(blocking=False)
        held.release()

    def claim_complete(i: int) -> None:
        token = claims.claim("bench", f"t{i}", "worker", 30_000).token
        assert token is not None
        claims.complete(token, 60_000)

    owner = f"w@host/{run}/abcd1234."

    def gate(i: int) -> None:
        token = claims.claim_unless_done("gate", f"t{i}:0:0", f"{owner}{i:x}", 30_000).token
        assert token is not None
        claims.complete(token, 60_000)

    def keyed(i: int) -> None:
        attempt = keyed_owner(f"{owner}{i:x}", f"t{i}:0:0", 0)
        token = claims.claim_unless_done("keyed", f"sync[{i % 50}]", attempt, 30_000).token
        assert token is not None
        claims.complete(token, 60_000)

    results = {
        "lua-ref": timed(ops, lua_ref),
        "redis-lock": timed(ops, redis_lock),
        "claims": timed(ops, claim_complete),
        "gate": timed(ops, gate),
        "keyed": timed(ops, keyed),
    }

    live = [claims.claim("renew", f"r{i}", "worker", 60_000).token for i in range(ops)]
    tokens = [t for t in live if t is not None]
    start = time.perf_counter()
    for token in tokens:
        claims.extend("renew", token, 1)
    results["extend-each"] = len(tokens) / (time.perf_counter() - start)
    start = time.perf_counter()
    for first in range(0, len(tokens), 100):
        claims.renew("renew", tokens[first : first + 100], 60_000)
    results["renew-batched"] = len(tokens) / (time.perf_counter() - start)
    client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 round of 500 cycles")
    args = parser.parse_args()
    if args.quick:
        args.ops, args.rounds = 500, 1
    rounds: list[dict[str, float]] = []
    with private_redis() as port:
        for n in range(1, args.rounds + 1):
            r = run_round(port, args.ops)
            rounds.append(r)
            print(
                f"round {n}: lua-ref {r['lua-ref']:8.0f}/s  redis-lock {r['redis-lock']:8.0f}/s "
                f"({r['lua-ref'] / r['redis-lock']:.2f}x ref time)  claims {r['claims']:8.0f}/s "
                f"({r['lua-ref'] / r['claims']:.2f}x ref time)  renew: extend-each "
                f"{r['extend-each']:8.0f}/s, batched {r['renew-batched']:8.0f}/s "
                f"({r['renew-batched'] / r['extend-each']:.1f}x faster)  keyed "
                f"{r['keyed']:8.0f}/s vs gate {r['gate']:8.0f}/s "
                f"({r['gate'] / r['keyed']:.2f}x gate time)"
            )
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"\nmedian of {args.rounds} rounds x {args.ops} cycles"
        " (time per cycle relative to lua-ref):"
        f"\n  lua-ref     1.00x  ({med['lua-ref']:.0f} cycles/s)"
        f"\n  redis-lock  {med['lua-ref'] / med['redis-lock']:.2f}x  ({med['redis-lock']:.0f}/s)"
        f"\n  claims      {med['lua-ref'] / med['claims']:.2f}x  ({med['claims']:.0f}/s)"
        f"\n  gate        {med['lua-ref'] / med['gate']:.2f}x  ({med['gate']:.0f}/s)"
        f"\n  keyed       {med['lua-ref'] / med['keyed']:.2f}x  ({med['keyed']:.0f}/s; "
        f"{med['gate'] / med['keyed']:.2f}x the gate's plain claim)"
        f"\n  renewals: batched renew {med['renew-batched']:.0f} claims/s vs extend each "
        f"{med['extend-each']:.0f}/s ({med['renew-batched'] / med['extend-each']:.1f}x)"
    )


if __name__ == "__main__":
    main()
