"""Start a real worker of ``proj.py``, publish one invoice task twice, show it ran once.

Run it with ``python examples/dropin/run.py``: a private Redis is started, and the worker and
Redis are stopped at the end. It also runs ``celery -A proj claims check`` and ``inspect``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from celery_claims.demo.runner import private_redis

HERE = Path(__file__).resolve().parent


def celery(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", *args],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def main() -> None:
    with private_redis() as url:
        env = {**os.environ, "PROJ_BROKER": url}
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj", "worker", "-c", "2", "-l", "WARNING",
             "--without-mingle", "--without-gossip", "--without-heartbeat"],
            cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            sys.path.insert(0, str(HERE))
            os.environ["PROJ_BROKER"] = url
            from proj import app  # the producer side of the same app

            # a producer retry: the same task id published twice
            for _ in range(2):
                app.send_task("proj.send_invoice", ("inv-42",), task_id="invoice-42")
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 30
            while client.get("sent:inv-42") is None and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(2)  # time for the second copy to arrive and be skipped
            sent = int(client.get("sent:inv-42") or 0)
            print(f"invoice-42 was published 2 times and sent {sent} time(s)")
            client.close()
            app.close()
            print(celery("claims", "inspect", "invoice-42", env=env).stdout.rstrip())
            check = celery("claims", "check", env=env)
            print(f"claims check: {check.stdout.strip()}")
        finally:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)


if __name__ == "__main__":
    main()
