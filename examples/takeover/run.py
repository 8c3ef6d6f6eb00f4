"""Crash takeover: SIGKILL the worker running a task, watch the other worker finish it once.

Run it with ``python examples/takeover/run.py``. It starts a private ``redis-server`` on a
free port (broker, result backend and claim store), two real ``celery worker`` processes
(prefork, ``-c 2``) of ``proj.py``, sends one 6 s task, kills the whole process group of the
worker running it 2 s in, and waits for the other worker to take the task over. Everything it
started is stopped at the end, whatever happens; it takes about 20 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import redis

from celery_claims import ClaimToken, RedisClaimManager
from celery_claims.demo.runner import private_redis

HERE = Path(__file__).resolve().parent
T = TypeVar("T")

#: Seconds the task works; it is killed ``KILL_AFTER_S`` into the first execution.
TASK_S = 6.0
KILL_AFTER_S = 2.0
#: The whole run's budget: past it the runner gives up (and still stops everything).
BUDGET_S = 55.0
QUEUE = "reports"
TASK_ID = "report-7"


class Worker:
    """One ``celery worker`` subprocess in a process group of its own, logging to a file."""

    def __init__(self, name: str, url: str, logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "proj", "worker", "-P", "prefork",
                 "-c", "2", "-n", f"{name}@takeover", "-l", "INFO",
                 "--without-mingle", "--without-gossip", "--without-heartbeat"],
                cwd=HERE, env={**os.environ, "TAKEOVER_BROKER": url},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: killing it kills its pool children too
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ready(self) -> bool:
        if self.popen.poll() is not None:
            raise SystemExit(f"worker {self.name} exited:\n{self.output()[-2000:]}")
        return " ready." in self.output()

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once, like a host losing power."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


@contextlib.contextmanager
def workers(url: str, names: tuple[str, ...]) -> Iterator[dict[str, Worker]]:
    logdir = Path(tempfile.mkdtemp(prefix="claims-takeover-"))
    started: dict[str, Worker] = {}
    try:
        for name in names:
            started[name] = Worker(name, url, logdir)
        yield started
    finally:
        for worker in started.values():
            worker.kill()
        for worker in started.values():
            worker.log.unlink(missing_ok=True)
        logdir.rmdir()


def wait_for(check: Callable[[], T | None], deadline: float, what: str) -> T:
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.05)


def run(url: str) -> None:
    deadline = time.monotonic() + BUDGET_S
    os.environ["TAKEOVER_BROKER"] = url
    sys.path.insert(0, str(HERE))
    from proj import RUNS_KEY, app  # the producer side of the same app

    client = redis.Redis.from_url(url)
    claims = RedisClaimManager(url=url)  # the workers' store: same Redis, default prefix
    with contextlib.ExitStack() as stack:
        stack.callback(app.close)
        stack.callback(client.close)
        stack.callback(claims.close)
        fleet = stack.enter_context(workers(url, ("a", "b")))

        def runs() -> list[dict[str, str]]:
            return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]

        try:
            for worker in fleet.values():
                wait_for(worker.ready, deadline, f"worker {worker.name} to be ready")
            print(f"2 workers ready (prefork -c 2, task_acks_late, lease 3 s, "
                  f"visibility_timeout 3 s); sending {TASK_ID}, a {TASK_S:g} s task")  # fmt: skip
            result = app.send_task("takeover.build_report", (TASK_S,), task_id=TASK_ID)

            first = wait_for(lambda: runs(), deadline, "the first execution")[0]
            holder = first["worker"].split("@")[0]
            [token] = wait_for(lambda: claims.list_claims(QUEUE), deadline, "the first claim")
            print(f"worker {holder} started it (pid {first['pid']}), claim instance "
                  f"{token.instance}, owner {token.owner}")  # fmt: skip

            time.sleep(KILL_AFTER_S)
            fleet[holder].kill()
            killed_at = time.monotonic()
            print(f"SIGKILLed worker {holder}'s whole process group {KILL_AFTER_S:g} s into "
                  "the task")  # fmt: skip

            def took_over() -> ClaimToken | None:
                live = [t for t in claims.list_claims(QUEUE) if t.instance > token.instance]
                return live[0] if live else None

            new = wait_for(took_over, deadline, "the takeover")
            taker = new.owner.split("@")[0]
            print(f"worker {taker} took it over {time.monotonic() - killed_at:.1f} s after "
                  f"the kill: claim instance {new.instance}, owner {new.owner}")  # fmt: skip

            value = result.get(timeout=max(deadline - time.monotonic(), 1))
            done = wait_for(lambda: claims.done_record(QUEUE, token.task_id), deadline, "done")
            print(f"result: {result.state} {value!r}; done record: instance {done.instance}")
        except BaseException:
            for worker in fleet.values():
                print(f"===== worker {worker.name}\n{worker.output()[-3000:]}", file=sys.stderr)
            raise
        time.sleep(1)  # time for any further copy to show up (there is none)

        events = runs()
        starts = [e["worker"].split("@")[0] for e in events if e["event"] == "start"]
        ends = [e["worker"].split("@")[0] for e in events if e["event"] == "end"]
        stats = claims.queue_stats()[QUEUE]
        print(f"executions: {len(starts)} started ({', '.join(starts)}), "
              f"{len(ends)} finished ({', '.join(ends)})")  # fmt: skip
        print(f"claim store, queue {QUEUE!r}: takeovers {stats.takeovers}, successes "
              f"{stats.successes}, contentions {stats.contentions}, acks {stats.acks}")  # fmt: skip
        client.delete(RUNS_KEY)


def main() -> None:
    started_at = time.monotonic()
    with private_redis() as url:
        run(url)
    print(f"stopped 2 workers and the private Redis; {time.monotonic() - started_at:.1f} s in all")


if __name__ == "__main__":
    main()
