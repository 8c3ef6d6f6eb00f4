"""Private servers for tests: real ``redis-server`` processes on free ports.

Each server is started by a fixture and stopped by its own pid, so a test can restart it, turn
on AOF or build a Cluster without touching the machine's shared Redis on port 6379.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

#: Seconds a server gets to answer PING after it was started.
START_TIMEOUT_S = 10.0


@functools.cache
def _debug_command_args(binary: str) -> tuple[str, ...]:
    """Arguments that let loopback clients use DEBUG (POPULATE, SLEEP) on a private server.

    Redis 7 refuses DEBUG unless ``enable-debug-command`` allows it, and Debian's build leaves
    it off; Redis 6 knows no such option (DEBUG is always allowed there).
    """
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"v=(\d+)\.", out)
    if match is None or int(match.group(1)) < 7:
        return ()
    return ("--enable-debug-command", "local")


def in_ci() -> bool:
    """True when running under CI, where a missing service is a failure, never a skip."""
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def missing_service(what: str) -> None:
    """Fail under CI, skip on a developer machine, when a service the test needs is absent."""
    if in_ci():
        pytest.fail(f"{what} is required in CI but is not available", pytrace=False)
    pytest.skip(f"{what} is not available")


def free_port() -> int:
    """A TCP port that nothing listens on right now (and its +10000 cluster bus port too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    """One private ``redis-server`` process, owned by the test session that started it."""

    def __init__(self, extra_args: Sequence[str] = (), port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            missing_service("redis-server on PATH")
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"claims-redis-{self.port}-"))
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        # every client handed out is closed at cleanup, so no socket is left for the garbage
        # collector to complain about (a ResourceWarning is an error under filterwarnings)
        self._clients: list[redis.Redis] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        client = redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]
        self._clients.append(client)
        return client

    def start(self) -> RedisServer:
        assert self.binary is not None
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            *_debug_command_args(self.binary),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with contextlib.closing(self.client(socket_timeout=1)) as c:
                    if c.ping():
                        return self
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server by its own pid (SIGTERM saves AOF; SIGKILL simulates a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, sig: int = signal.SIGTERM) -> RedisServer:
        self.stop(sig)
        return self.start()

    def cleanup(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command from ``INFO commandstats``; subcommands (``script|exists`` in Redis 7)
    count as their command, as Redis 6 counts them."""
    calls: dict[str, int] = {}
    for name, value in client.info("commandstats").items():
        command = name.removeprefix("cmdstat_").split("|")[0]
        calls[command] = calls.get(command, 0) + int(value["calls"])
    return calls


@contextlib.contextmanager
def redis_server(extra_args: Sequence[str] = ()) -> Iterator[RedisServer]:
    server = RedisServer(extra_args)
    try:
        yield server.start()
    finally:
        server.cleanup()


class RedisClusterNodes:
    """Three private masters joined into a Redis Cluster with ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.servers = [
            RedisServer(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                         "--cluster-config-file", "nodes.conf"])
            for _ in range(masters)
        ]  # fmt: skip
        self._clients: list[redis.RedisCluster] = []

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self) -> RedisClusterNodes:
        for server in self.servers:
            server.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            missing_service("redis-cli on PATH")
        assert cli is not None
        nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while True:
            states = []
            for s in self.servers:
                with contextlib.closing(s.client(decode_responses=True)) as c:
                    states.append(c.execute_command("CLUSTER", "INFO"))
            if all("cluster_state:ok" in str(state) for state in states):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not become ok: {states}")
            time.sleep(0.1)

    def client(self, **kwargs: object) -> redis.RedisCluster:
        client = redis.RedisCluster(  # type: ignore[abstract]
            host="127.0.0.1", port=self.servers[0].port, **kwargs
        )
        self._clients.append(client)
        return client

    def cleanup(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        for server in self.servers:
            server.cleanup()
