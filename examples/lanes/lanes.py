"""A lane capped at 2 across 6 worker threads: never more than 2 "render" jobs at once.

Run it with ``python examples/lanes/lanes.py`` (a private Redis is started and stopped), or
``--redis-url redis://host:port/db`` to use yours. Each thread is a dispatch loop, as each
worker process of a fleet would run; the lane store decides, fleet-wide, who may start a job.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

from celery_claims.demo.runner import private_redis
from celery_claims.lanes import TaskLaneConfig, claim_due_for_lane
from celery_claims.lanes.redis import RedisTaskClaimStore

VIDEO = TaskLaneConfig(lane="video", kinds=("render",), limit=2)
JOBS = 10
WORKERS = 6


def run(url: str) -> None:
    prefix = f"lanes-example-{uuid.uuid4().hex[:6]}"
    store = RedisTaskClaimStore(url=url, lanes=[VIDEO], prefix=prefix)
    for job in range(1, JOBS + 1):
        store.enqueue(job, "render", payload=f"video-{job}.mp4")
    lock = threading.Lock()
    running, peak, done = 0, 0, []

    def worker(name: str) -> None:
        nonlocal running, peak
        while store.count_unfinished(["render"]):
            claimed = claim_due_for_lane(store, VIDEO, 30, lambda kind: "video")
            for task, lease in claimed:
                with lock:
                    running += 1
                    peak = max(peak, running)
                time.sleep(0.2)  # render it; a long job would store.heartbeat(...) meanwhile
                with lock:
                    running -= 1
                    done.append((name, task.payload))
                store.complete(lease.task_id, lease.processing_token)
            if not claimed:
                time.sleep(0.02)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"{len(done)} jobs rendered by {len({n for n, _ in done})} workers")
    print(f"lane limit {VIDEO.limit}, peak running {peak}")
    # leave nothing behind on a Redis you run
    keys = list(store.client.scan_iter(match=f"{prefix}:*"))
    if keys:
        store.client.delete(*keys)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    if args.redis_url:
        run(args.redis_url)
    else:
        with private_redis() as url:
            run(url)


if __name__ == "__main__":
    main()
