"""Real ``celery worker`` and ``celery beat`` subprocesses, each in its own process group.

Every process is started with ``start_new_session=True`` so a test can SIGKILL a worker's whole
process group (main process and pool children) like a crashed host, and the fixture's
finalizer kills every group it started, whatever the test's outcome. On Linux each one also
asks the kernel to SIGKILL it when the test process dies (``PR_SET_PDEATHSIG``), so a test run
killed from outside, where no finalizer runs, leaves no worker behind.

Each test's processes log to a folder of its own (``/tmp/claims-fleet-*``), removed at the
end; with ``CLAIMS_TEST_KEEP_FLEET=1`` in the environment it is kept (and its path printed),
to read every process's whole log after an intermittent failure (debugging only: nothing
removes those folders afterwards).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import redis
from celery import Celery
from kombu import Connection, Consumer, Queue
from kombu.transport.redis import Channel as RedisChannel

from celery_claims import RedisClaimManager
from celery_claims.worker import install
from celery_claims.worker.transport.sweep import restore_cadence, restore_visible
from tests.worker.helpers import (
    FAST_REDELIVERY,
    HELD_RECHECK_MS,
    LEASE_MS,
    RENEW_INTERVAL_MS,
    close_app,
    unique,
)

ROOT = Path(__file__).resolve().parents[2]

#: Seconds a worker gets to print "ready".
READY_TIMEOUT_S = 30.0

#: Runs ``python -m <argv...>`` after asking to be killed with the test process (Linux).
_LAUNCH = """
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != int(os.environ["CLAIMS_TEST_PARENT"]):
    sys.exit("the test process is gone")
os.execv(sys.executable, [sys.executable, "-m", *sys.argv[1:]])
"""


def _command(module: str, args: list[str]) -> list[str]:
    if sys.platform.startswith("linux"):
        return [sys.executable, "-c", _LAUNCH, module, *args]
    return [sys.executable, "-m", module, *args]


class Proc:
    """One subprocess with its log file."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the worker and its pool children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout
        while " ready." not in self.output():
            if not self.alive():
                raise AssertionError(f"{self.name} exited early:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready:\n{self.output()[-3000:]}")
            time.sleep(0.1)
        return self


class Fleet:
    """Starts worker and beat subprocesses for one test and kills them all at the end."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="claims-fleet-"))
        self.procs: list[Proc] = []
        self._apps: list[Celery] = []
        self._clients: list[Any] = []

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        log = self.dir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                _command("celery", args),
                cwd=ROOT,
                env={**os.environ, **env, "CLAIMS_TEST_PARENT": str(os.getpid())},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def worker(
        self,
        name: str,
        *,
        broker: str,
        backend: str,
        queue: str,
        plugin: bool = True,
        pool: str = "prefork",
        concurrency: int = 2,
        claims_prefix: str = "claims",
        extra: tuple[str, ...] = (),
        app: str = "tests.worker.apps.fleet",
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``celery worker`` on ``app`` (claims set on the CLI; ``env`` added to the
        ``CLAIMS_TEST_*`` variables the app reads)."""
        args = [
            "-A", app, "worker",
            "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-l", "INFO",
            "--without-mingle", "--without-gossip", "--without-heartbeat",
        ]  # fmt: skip
        if plugin:
            args += [
                "--claims-prefix", claims_prefix,
                "--claims-lease-ms", str(LEASE_MS),
                "--claims-renew-interval-ms", str(RENEW_INTERVAL_MS),
                "--claims-held-recheck-ms", str(HELD_RECHECK_MS),
                "--claims-unavailable-retry-ms", "200",
                "--claims-unavailable-retry-max-ms", "1000",
                "--claims-socket-timeout-ms", "1000",
            ]  # fmt: skip
        environ = {
            "CLAIMS_TEST_BROKER": broker,
            "CLAIMS_TEST_BACKEND": backend,
            "CLAIMS_TEST_QUEUE": queue,
            "CLAIMS_TEST_PLUGIN": "1" if plugin else "0",
        }
        return self._spawn(name, [*args, *extra], {**environ, **(env or {})})

    def beat(self, name: str, *, broker: str, queue: str) -> Proc:
        """Start ``celery beat`` on ``tests.worker.apps.beat_app``."""
        env = {"CLAIMS_TEST_BROKER": broker, "CLAIMS_TEST_QUEUE": queue}
        schedule = self.dir / f"{name}-schedule"
        args = ["-A", "tests.worker.apps.beat_app", "beat", "-l", "INFO", "-s", str(schedule)]
        return self._spawn(name, args, env)

    def celery(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start ``celery ARGS...`` as a user types it (``-b``, ``-A`` and the sub-command)."""
        return self._spawn(name, args, env or {})

    def client(
        self,
        broker: str,
        backend: str,
        queue: str,
        *,
        plugin: bool = False,
        conf: dict[str, Any] | None = None,
    ) -> Celery:
        """A producer app for this test (closed at cleanup); with ``plugin``, celery-claims is
        installed on it (so it journals what it publishes) with ``conf`` added."""
        app = client_app(broker, backend, queue, plugin=plugin, conf=conf)
        self._apps.append(app)
        return app

    def claims(self, url: str) -> RedisClaimManager:
        """A view of a claim store (closed at cleanup)."""
        manager = RedisClaimManager(url=url)
        self._clients.append(manager.client)
        return manager

    def redis(self, url: str) -> redis.Redis:
        """A plain Redis client (closed at cleanup)."""
        client = redis.Redis.from_url(url)
        self._clients.append(client)
        return client

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.output()[-4000:]}" for p in self.procs)

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.kill_group(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        for app in self._apps:
            close_app(app)
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        if os.environ.get("CLAIMS_TEST_KEEP_FLEET") == "1":
            print(f"fleet logs kept in {self.dir}", file=sys.stderr)
            return
        # the logs went into any failure's message (``logs()``); nothing is left in /tmp
        shutil.rmtree(self.dir, ignore_errors=True)


def client_app(
    broker: str,
    backend: str,
    queue: str,
    *,
    plugin: bool = False,
    conf: dict[str, Any] | None = None,
) -> Celery:
    """The test's producer: sends the fleet's tasks by name and reads their results.

    With ``plugin`` it is a claims-aware producer (``install(app)``): it journals every message
    it publishes, so a message lost between the broker and a worker is re-published.
    """
    app = Celery("fleet-client", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        broker_transport_options=dict(FAST_REDELIVERY),
        task_default_queue=queue,
        result_expires=None,
    )
    app.conf.update(conf or {})
    if plugin:
        install(app)
    return app


def executions(backend: str, queue: str) -> list[dict[str, Any]]:
    """The execution log the fleet's tasks write (see ``apps/fleet.py``; ``backend`` is the
    Redis the log is on)."""
    with contextlib.closing(redis.Redis.from_url(backend)) as client:
        return [json.loads(raw) for raw in client.lrange(f"executions:{queue}", 0, -1)]


def events_of(log: list[dict[str, Any]], event: str, task_id: str) -> list[dict[str, Any]]:
    """The ``event`` entries ("start", "end") of ``task_id`` in an execution log."""
    return [e for e in log if e["event"] == event and e["id"] == task_id]


def pool_children(proc: Proc) -> list[int]:
    """The pids of a worker's pool processes (the children of its main process)."""
    return [child.pid for child in psutil.Process(proc.popen.pid).children()]


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the ``with`` block (a frozen process); SIGCONT at its end, always."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def unacked_task_ids(client: redis.Redis) -> list[str]:
    """The task ids of the deliveries in a Redis broker's ``unacked`` hash (kombu's key name)."""
    ids = []
    for raw in client.hvals(RedisChannel.unacked_key):
        message = json.loads(raw)[0]
        ids.append(message["headers"]["id"])
    return ids


@contextlib.contextmanager
def plain_restore_sweep(url: str) -> Iterator[None]:
    """Restore a plain fleet's stale unacked messages at ``FAST_REDELIVERY``'s cadence where
    kombu does not (kombu before 5.7); nothing on kombu 5.7, whose plain workers do it.

    A plain Celery worker on kombu 5.3 to 5.6 restores only every ~100 s, whatever the
    transport options say, so a control fleet without claims shows no redelivery within a
    test's wait. This runs kombu's own scan, every second, from a consumer of an empty queue
    in the test process: what a plain worker on kombu 5.7 does with these options.
    """
    conn = Connection(url, transport_options=dict(FAST_REDELIVERY))
    cadence = restore_cadence(conn)
    if cadence is None or cadence.kombu_loop_sweeps:
        conn.release()
        yield
        return
    stop = threading.Event()

    def sweep() -> None:
        consumer = Consumer(conn.channel(), [Queue(unique("sweeper"))], no_ack=True)
        consumer.consume()
        while not stop.wait(cadence.interval_s):
            restore_visible(conn)

    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        conn.release()
