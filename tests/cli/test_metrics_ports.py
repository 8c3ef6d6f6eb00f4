"""Several workers on one host export their metrics, each on a port of its own."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_claims.errors import InvalidArgument
from celery_claims.worker.settings import DEFAULT_METRICS_PORTS, parse_ports
from tests.cli.conftest import demo_env
from tests.cli.test_metrics import scrape
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import wait_for

pytestmark = pytest.mark.slow

_SERVING = re.compile(r"celery-claims metrics of worker (\S+) on http://127\.0\.0\.1:(\d+)/metrics")


def free_range(size: int) -> tuple[int, int]:
    """``size`` consecutive ports nothing listens on right now."""
    for _ in range(200):
        first = random.randint(20_000, 60_000)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + size):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first, first + size - 1
    raise AssertionError("no free port range")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as found:
        yield found


@contextlib.contextmanager
def _workers(
    url: str, ns: str, names: list[str], args: list[str], env: dict[str, str]
) -> Iterator[list[Path]]:
    workdir = Path(tempfile.mkdtemp(prefix="claims-metrics-"))
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for name in names:
            log = workdir / f"{name}.log"
            logs.append(log)
            command = [
                sys.executable, "-m", "celery", "-A", "celery_claims.demo.app", "worker",
                "-P", "solo", "-n", f"{name}@test", "-l", "INFO",
                "--without-mingle", "--without-gossip", "--without-heartbeat", *args,
            ]  # fmt: skip
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        command,
                        env=demo_env(url, ns, **env),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield logs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


def _serving(log: Path) -> tuple[str, int] | None:
    found = _SERVING.search(log.read_text(errors="replace"))
    return (found.group(1), int(found.group(2))) if found else None


def test_two_workers_on_one_host_each_export_on_their_own_port_of_the_range(
    server: RedisServer,
) -> None:
    # Given two workers of one host with the same claims_metrics_port range
    first, last = free_range(3)
    ns = f"t{uuid.uuid4().hex[:10]}"
    names = ["m1", "m2"]
    env = {"CLAIMS_DEMO_METRICS_PORT": f"{first}-{last}"}
    with _workers(server.url, ns, names, [], env) as logs:
        # When both are up
        serving = [
            wait_for(lambda log=log: _serving(log), timeout=30, what=f"exporter in {log.name}")
            for log in logs
        ]

        # Then each listens on a port of the range of its own, and logged which one
        ports = [port for _, port in serving]
        assert len(set(ports)) == 2, serving
        assert all(first <= port <= last for port in ports), (serving, first, last)
        for (worker, port), name in zip(serving, names, strict=True):
            samples = scrape(port)
            # its own counters under its own worker label
            workers = {
                dict(labels)["worker"]
                for (metric, labels) in samples
                if metric == "celery_claims_worker_live_claims"
            }
            assert workers == {f"{name}@test"} == {worker}
            # and the lane limit, as `celery claims metrics` exports it
            assert samples[("celery_claims_lane_limit", (("lane", "video"),))] == 2


def test_a_worker_told_its_own_port_on_the_command_line_exports_there(
    server: RedisServer,
) -> None:
    # Given a port nothing listens on
    port, _ = free_range(1)
    ns = f"t{uuid.uuid4().hex[:10]}"

    # When a worker starts with --claims-metrics-port
    args = ["--claims-metrics-port", str(port)]
    with _workers(server.url, ns, ["m3"], args, {"CLAIMS_DEMO_METRICS_PORT": "0"}) as logs:
        # Then it exports on that port (the command line wins over the configuration)
        assert wait_for(lambda: _serving(logs[0]), timeout=30, what="the exporter") == (
            "m3@test",
            port,
        )
        assert ("celery_claims_store_up", ()) in scrape(port)


def test_the_metrics_port_setting_takes_a_port_a_range_or_0_and_refuses_the_rest() -> None:
    # Given the forms a user writes
    assert parse_ports(9900) == (9900, 9900)
    assert parse_ports("9900") == (9900, 9900)
    assert parse_ports("9900-9903") == (9900, 9903)
    assert parse_ports((9900, 9903)) == (9900, 9903)
    assert parse_ports(0) == (0, 0)
    assert DEFAULT_METRICS_PORTS == (9808, 9817)
    # When they are malformed, Then the error names the setting
    for bad in ("9903-9900", "a-b", -1, 70000, True, "0-5", (1,), None):
        with pytest.raises(InvalidArgument, match="claims_metrics_port"):
            parse_ports(bad)
