"""Where a worker's main thread spends its Python work per message, function by function.

    python bench/opcodes.py [--pools solo,prefork] [--variants claims] [--baseline TREE]
                            [--tasks 100,400] [--top 40] [--pool-processes]

callgrind (``bench/counts.py``) counts machine instructions, but names C functions only:
every Python function is ``_PyEval_EvalFrameDefault`` to it. This runs the same worker as
``bench/counts.py`` (one real ``celery worker`` per pool and variant on private
``redis-server``s) with a trace function on its main thread (``opcodes_hook/sitecustomize.py``,
``sys.settrace`` with opcode events) and prints, per message, the bytecodes each Python
function ran and its calls: the difference of two batches (``--tasks``), so that the worker's
start and stop cancel out. ``--pool-processes`` counts a prefork worker's pool processes
instead (where the guard around each body and its settle run), every process summed.
Deterministic, as callgrind's counts are (bytecodes, not time; C
work such as ``json`` or ``pickle`` is not in them). ``--baseline TREE`` runs the same
variants from another checkout and prints the functions whose counts differ most, matched by
file (the package's, with its folder dropped: a function moved from ``worker/gate.py`` to
``worker/delivery/gate.py`` stays one row) and name. A minute or two a variant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import celery_overhead as overhead  # noqa: E402
from bench import counts  # noqa: E402

#: The folder whose ``sitecustomize`` installs the trace function in the worker.
HOOK = Path(__file__).resolve().parent / "opcodes_hook"

Counts = dict[str, tuple[float, float]]  # function -> (bytecodes, calls) a message


def traced(variant: str, pool: str, tasks: int, logs: Path) -> dict[str, list[int]]:
    """One worker of ``variant`` draining a start batch, then ``tasks`` tasks: its counts."""
    out = logs / f"opcodes.{variant}.{pool}.{tasks}.json"
    os.environ["BENCH_OPCODES"] = str(out)
    with overhead.private_redis() as url, overhead.private_redis() as store_url:
        os.environ["BENCH_STORE_URL"] = store_url
        broker = redis.Redis.from_url(url, client_name=counts.OWN_CLIENT)
        queue = f"opcodes-{variant}-{pool}"
        publisher = overhead.Publisher(url, variant, queue, logs / f"{queue}.producer.log")
        try:
            with counts.worker(variant, pool, url, queue, logs, callgrind=False):
                log = logs / f"{queue}.log"
                for n in (1, 20, tasks):
                    overhead.run_batch(broker, publisher, variant, queue, "bench.noop", n, log=log)
                time.sleep(counts.SETTLE_S)
        finally:
            publisher.close()
            broker.close()
    del os.environ["BENCH_OPCODES"]
    if not os.environ.get("BENCH_OPCODES_POOL"):
        found: dict[str, list[int]] = json.loads(out.read_text())
        return found
    merged: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # every pool process's
    files = list(logs.glob(f"{out.name}.*"))
    if not files:
        raise SystemExit(f"no pool process wrote its counts ({out}.<pid>)")
    for path in files:
        for name, (ops, calls) in json.loads(path.read_text()).items():
            merged[name][0] += ops
            merged[name][1] += calls
    return dict(merged)


def per_message(variant: str, pool: str, sizes: tuple[int, int], logs: Path) -> Counts:
    """Bytecodes and calls a message of each function: two batches' difference."""
    small, large = (traced(variant, pool, n, logs) for n in sizes)
    tree = str(overhead.checkout(variant)[0])
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name in set(small) | set(large):
        a, b = small.get(name, [0, 0]), large.get(name, [0, 0])
        # the package's path without its checkout and folder; the rest without site-packages
        key = re.sub(r"^.*/celery_claims/(worker/)?(\w+/)?", "", name.replace(tree, ""))
        key = re.sub(r"^.*/(site-packages|python3\.\d+)/", "", key)
        for i in (0, 1):
            per[key][i] += (b[i] - a[i]) / (sizes[1] - sizes[0])
    return {k: (v[0], v[1]) for k, v in per.items() if abs(v[0]) >= 0.5 or abs(v[1]) >= 0.01}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pools", default="solo,prefork")
    parser.add_argument("--variants", default="claims")
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier commit")
    parser.add_argument("--tasks", default="100,400", help="the two batch sizes")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--pool-processes",
        action="store_true",
        help="count the prefork pool processes (where the guard and its settle run) instead "
        "of the main thread",
    )
    opts = parser.parse_args()
    if opts.pool_processes:
        os.environ["BENCH_OPCODES_POOL"] = "1"
        opts.pools = "prefork"
    small, large = (int(n) for n in opts.tasks.split(","))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])
    )
    if opts.baseline is not None:
        overhead.BASELINE = opts.baseline.resolve()
    logs = Path(tempfile.mkdtemp(prefix="bench-opcodes-"))
    print(f"batches of {small} and {large} no-op tasks; logs in {logs}", flush=True)
    for pool in opts.pools.split(","):
        for variant in opts.variants.split(","):
            now = per_message(variant, pool, (small, large), logs)
            print(
                f"\n{pool} {variant}: {sum(v[0] for v in now.values()):,.0f} bytecodes, "
                f"{sum(v[1] for v in now.values()):,.0f} Python calls a message"
            )
            if opts.baseline is None:
                rows = sorted(now.items(), key=lambda kv: -kv[1][0])[: opts.top]
                for name, (ops, calls) in rows:
                    print(f"{ops:9.1f} {calls:6.2f}  {name}")
                continue
            base = per_message(f"{variant}-base", pool, (small, large), logs)
            print(
                f"{pool} {variant}-base: {sum(v[0] for v in base.values()):,.0f} bytecodes, "
                f"{sum(v[1] for v in base.values()):,.0f} Python calls a message"
            )
            print("bytecodes now / base (calls now / base)  function")
            names = sorted(
                set(now) | set(base),
                key=lambda k: -abs(now.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]),
            )
            for name in names[: opts.top]:
                (a, ca), (b, cb) = now.get(name, (0, 0)), base.get(name, (0, 0))
                print(f"{a:7.1f} {b:7.1f} {a - b:+7.1f}  ({ca:5.2f} {cb:5.2f})  {name}")


if __name__ == "__main__":
    main()
