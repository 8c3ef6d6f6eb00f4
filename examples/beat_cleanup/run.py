"""Beat cleanup: expired claims removed by the beat task, the user's own beat entry kept.

Run it with ``python examples/beat_cleanup/run.py``. It starts a private ``redis-server`` on a
free port, leaves 5 expired claims in it (as workers that crashed would) next to 1 live claim,
then runs a real ``celery worker`` and ``celery beat`` of ``proj.py`` with
``claims_cleanup_interval_s = 2``, until the expired claims are gone and the user's own entry
has run. Everything it started is stopped at the end, whatever happens; about 15 s.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from celery_claims import RedisClaimManager
from celery_claims.demo.runner import private_redis

HERE = Path(__file__).resolve().parent

#: The whole run's budget: past it the runner gives up (and still stops everything).
BUDGET_S = 45.0
QUEUE = "imports"
EXPIRED = 5
SENT = re.compile(r"Sending due task (\S+) \(")


class Proc:
    """A ``celery`` subprocess in a process group of its own, logging to a file."""

    def __init__(self, name: str, args: list[str], url: str, logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "proj", *args],
                cwd=HERE, env={**os.environ, "BEAT_CLEANUP_BROKER": url},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


@contextlib.contextmanager
def processes() -> Iterator[tuple[list[Proc], Path]]:
    logdir = Path(tempfile.mkdtemp(prefix="claims-beat-cleanup-"))
    started: list[Proc] = []
    try:
        yield started, logdir
    finally:
        for proc in started:
            proc.stop()
        for leftover in logdir.iterdir():
            leftover.unlink()
        logdir.rmdir()


def run(url: str) -> None:
    deadline = time.monotonic() + BUDGET_S
    sys.path.insert(0, str(HERE))
    from proj import DIGESTS_KEY

    claims = RedisClaimManager(url=url)  # the workers' store: same Redis, default prefix
    client = claims.client
    keys = claims.keys(QUEUE)

    def stored() -> tuple[int, int]:
        """(claims stored in the queue, of which expired), by the Redis server's clock."""
        total = int(client.hlen(keys.claims))
        return total, total - claims.active_claims(QUEUE)

    with contextlib.ExitStack() as stack:
        stack.callback(claims.close)
        # Given claims left behind by workers that crashed (short leases, never released)
        for n in range(1, EXPIRED + 1):
            claims.claim(QUEUE, f"import-{n}:0:0", f"crashed-{n}@host/100{n}/0", lease_ms=100)
        claims.claim(QUEUE, "import-live:0:0", "alive@host/2000/0", lease_ms=120_000)
        time.sleep(0.2)
        total, expired = stored()
        print(f"before: {total} claims stored in queue {QUEUE!r}, {expired} of them expired")

        procs, logdir = stack.enter_context(processes())
        worker = Proc(
            "worker",
            ["worker", "-P", "solo", "-n", "cleanup@example", "-l", "INFO",
             "--without-mingle", "--without-gossip", "--without-heartbeat"],
            url, logdir,
        )  # fmt: skip
        procs.append(worker)
        while " ready." not in worker.output():
            if worker.popen.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the worker did not start:\n{worker.output()[-2000:]}")
            time.sleep(0.05)
        beat = Proc("beat", ["beat", "-l", "INFO", "-s", str(logdir / "schedule")], url, logdir)
        procs.append(beat)
        print("started celery worker and celery beat (claims_cleanup_interval_s = 2)")

        def finished() -> bool:
            sent = Counter(SENT.findall(beat.output()))
            return stored() == (1, 0) and int(client.get(DIGESTS_KEY) or 0) > 0 and len(sent) == 2

        while not finished():
            if beat.popen.poll() is not None or time.monotonic() > deadline:
                print(f"===== beat\n{beat.output()[-3000:]}", file=sys.stderr)
                print(f"===== worker\n{worker.output()[-3000:]}", file=sys.stderr)
                raise SystemExit("gave up waiting for the cleanup")
            time.sleep(0.1)

        sent = Counter(SENT.findall(beat.output()))
        for entry, times in sorted(sent.items()):
            print(f"beat sent {entry!r} {times} time(s)")
        total, expired = stored()
        [live] = claims.list_claims(QUEUE)
        print(f"after: {total} claim stored in queue {QUEUE!r}, {expired} expired; "
              f"left: {live.task_id} held by {live.owner}")  # fmt: skip
        print(f"cleanup removed {claims.stats().expirations} expired claims (store counter "
              "'expirations')")  # fmt: skip
        print(f"the user's own entry ran: {int(client.get(DIGESTS_KEY) or 0)} digest(s) sent")


def main() -> None:
    started_at = time.monotonic()
    with private_redis() as url:
        run(url)
    print(f"stopped celery beat, the worker and the private Redis; "
          f"{time.monotonic() - started_at:.1f} s in all")  # fmt: skip


if __name__ == "__main__":
    main()
