"""A live fleet for the CLI and metrics tests: two real workers of the demo app, with claims.

The fleet runs on a private Redis of this package's tests, under its own key namespace. By the
time a test runs, the fleet holds a live claim (``live-1``, running for a minute), has held a
second copy of it, and has skipped a copy of a finished task (``done-1``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery

from celery_claims import RedisClaimManager
from celery_claims.observe import History
from tests.servers import RedisServer, free_port, redis_server
from tests.worker.helpers import wait_for

T = TypeVar("T")

#: The queue the fleet's workers consume.
QUEUE = "cli"


def demo_env(url: str, ns: str, **extra: str) -> dict[str, str]:
    """The environment that points the demo app at ``url`` under namespace ``ns``."""
    return {
        **os.environ,
        "CLAIMS_DEMO_REDIS": url,
        "CLAIMS_DEMO_NS": ns,
        "CLAIMS_DEMO_QUEUE": QUEUE,
        "CLAIMS_DEMO_CLAIMS": "1",
        **extra,
    }


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the standalone ``celery-claims`` command (as ``python -m celery_claims.cli``)."""
    return subprocess.run(
        [sys.executable, "-m", "celery_claims.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def run_celery(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``celery ...`` (the ``claims`` sub-command comes from the entry point)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


@dataclass
class LiveFleet:
    """The running fleet and handles to what it did."""

    server: RedisServer
    ns: str
    metrics_ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``celery-claims --redis-url URL --prefix NS ARGS...``."""
        return run_cli("--redis-url", self.url, "--prefix", self.ns, *args)

    def env(self, **extra: str) -> dict[str, str]:
        return demo_env(self.url, self.ns, **extra)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.logs)


def _producer(url: str, ns: str) -> Celery:
    app = Celery("cli-producer", broker=url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3, "global_keyprefix": f"{ns}:"},
        task_ignore_result=True,
    )
    return app


@pytest.fixture(scope="package")
def live_fleet() -> Iterator[LiveFleet]:
    """Two claim-aware workers with a live claim, a held copy and a skipped copy."""
    workdir = Path(tempfile.mkdtemp(prefix="claims-cli-"))
    with redis_server() as server:
        fleet = LiveFleet(server, f"t{uuid.uuid4().hex[:10]}", [free_port(), free_port()])
        try:
            for letter, port in zip("ab", fleet.metrics_ports, strict=True):
                log = workdir / f"{letter}.log"
                fleet.logs.append(log)
                command = [
                    sys.executable, "-m", "celery", "-A", "celery_claims.demo.app", "worker",
                    "-P", "prefork", "-c", "2", "-n", f"cli-{letter}@test", "-l", "INFO",
                    "--without-mingle", "--without-gossip", "--without-heartbeat",
                ]  # fmt: skip
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        command,
                        env=fleet.env(CLAIMS_DEMO_METRICS_PORT=str(port)),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                fleet.procs.append(proc)
            for log in fleet.logs:
                wait_for(lambda log=log: " ready." in log.read_text(), timeout=30, what="ready")
            _make_history(fleet)
            yield fleet
        finally:
            for proc in fleet.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            for path in workdir.iterdir():
                path.unlink()
            workdir.rmdir()


def _make_history(fleet: LiveFleet) -> None:
    producer = _producer(fleet.url, fleet.ns)
    manager = RedisClaimManager(url=fleet.url, prefix=fleet.ns)
    history = History(manager.client, fleet.ns)
    try:
        # a finished task, then a second copy of it: acked without running (skipped, done)
        producer.send_task("demo.work", (0.1,), task_id="done-1", queue=QUEUE)
        wait_for(lambda: manager.done_record(QUEUE, "done-1:0:0"), timeout=20, what="done-1")
        producer.send_task("demo.work", (0.1,), task_id="done-1", queue=QUEUE)
        wait_for(lambda: history.read("done-1"), timeout=20, what="the skipped copy")
        # a long task, then a second copy while it runs: held unacked by the gate
        producer.send_task("demo.work", (60,), task_id="live-1", queue=QUEUE)
        wait_for(lambda: manager.list_claims(QUEUE), timeout=20, what="live-1's claim")
        producer.send_task("demo.work", (60,), task_id="live-1", queue=QUEUE)
        wait_for(lambda: history.read("live-1"), timeout=20, what="the held copy")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{fleet.output()}") from None
    finally:
        manager.client.close()
        producer.close()


def json_of(result: subprocess.CompletedProcess[str]) -> Any:
    import json

    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
