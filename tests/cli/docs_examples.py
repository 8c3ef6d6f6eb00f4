"""Print the outputs docs/cli.md and docs/celery.md show, from real workers and a real Redis.

``python -m tests.cli.docs_examples`` starts a private ``redis-server`` and two ``celery
worker`` processes (``tests.cli.lanes_app`` with lane ``video`` limited to 1, and the keyed
tasks of ``tests.worker.apps.keyed_app``), makes a task run, wait for its lane, be held, fail
and be skipped for its key, runs ``celery claims stats`` and ``inspect`` on them as an operator
would, prints each command with its output, and stops everything. Paste from what it prints;
``tests/cli/test_docs_examples.py`` checks that the docs show what it prints (times, hosts,
process ids and counts aside).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.servers import redis_server
from tests.worker.helpers import wait_for
from tests.worker.processes import Fleet


def _claims(url: str, app: str, queue: str, *args: str) -> str:
    env = {**os.environ, "CLAIMS_TEST_BROKER": url, "CLAIMS_TEST_BACKEND": url,
           "CLAIMS_TEST_QUEUE": queue}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "claims", *args],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    return f"$ celery -A proj claims {' '.join(args)}\n{result.stdout}{result.stderr}"


def examples() -> list[str]:
    """Each command with what it printed, in the order the docs show them."""
    fleet = Fleet()
    try:
        with redis_server() as server:
            url = server.url
            fleet.worker("w1", broker=url, backend=url, queue="video", app="tests.cli.lanes_app")
            fleet.worker("w2", broker=url, backend=url, queue="sync",
                         app="tests.worker.apps.keyed_app", concurrency=4)  # fmt: skip
            for proc in fleet.procs:
                proc.wait_ready()
            video = fleet.client(url, url, "video")
            sync = fleet.client(url, url, "sync")
            claims = fleet.claims(url)
            # render-1 runs, render-2 waits for the lane, a second copy of render-1 is held
            video.send_task("lanes.job", (60,), task_id="render-1")
            wait_for(lambda: claims.list_claims("video"), timeout=20, what="render-1")
            video.send_task("lanes.job", (5,), task_id="render-2")
            video.send_task("lanes.job", (60,), task_id="render-1")
            failed = video.send_task("lanes.fail", task_id="fails-1")
            # sync-1 holds customer acme (skip policy); sync-2 for acme is skipped
            sync.send_task("keyed.skip", ("acme",), {"seconds": 60}, task_id="sync-1")
            wait_for(lambda: claims.list_claims("sync"), timeout=20, what="sync-1")
            sync.send_task("keyed.skip", ("acme",), task_id="sync-2")
            wait_for(lambda: failed.ready(), timeout=20, what="fails-1")
            time.sleep(2)  # the journal's writer, the held copy's first hold
            lanes = ("tests.cli.lanes_app", "video")
            commands = (("stats",), ("inspect", "render-1"), ("inspect", "render-2"),
                        ("inspect", "fails-1"))  # fmt: skip
            shown = [_claims(url, *lanes, *args) for args in commands]
            return [
                *shown,
                _claims(url, "tests.worker.apps.keyed_app", "sync", "inspect", "sync-2"),
            ]
    finally:
        fleet.cleanup()


def main() -> None:
    for example in examples():
        print(example)


if __name__ == "__main__":
    main()
