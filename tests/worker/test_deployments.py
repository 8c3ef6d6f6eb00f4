"""Every deployment the connection layer serves, with real servers and real workers.

On each (a TLS-only Redis that is the broker too, a Redis on a Unix socket that is the broker
too, a 3-master Redis Cluster, a Sentinel-managed master with a replica and three Sentinels),
a fleet of two prefork ``celery worker`` subprocesses runs a task delivered twice once, and
takes over the task of a worker killed with SIGKILL. A store the worker cannot use stops it
before it reports ready, with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_claims import RedisClaimManager
from celery_claims.worker.settings import load_settings
from celery_claims.worker.transport.broker import store_is_broker
from celery_claims.worker.transport.store import new_client
from tests.servers import (
    RedisClusterNodes,
    RedisSentinels,
    RedisServer,
    TlsRedisServer,
    UnixRedisServer,
    make_certificates,
)
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import ROOT, Fleet, executions

pytestmark = pytest.mark.slow


@pytest.fixture
def tls_redis() -> Iterator[TlsRedisServer]:
    server = TlsRedisServer()
    try:
        yield server.start()  # type: ignore[misc]
    finally:
        server.cleanup()


@pytest.fixture
def unix_redis() -> Iterator[UnixRedisServer]:
    server = UnixRedisServer()
    try:
        yield server.start()  # type: ignore[misc]
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def sentinels() -> Iterator[RedisSentinels]:
    group = RedisSentinels()
    try:
        yield group.start()
    finally:
        group.cleanup()


def starts(backend: str, queue: str, task_id: str) -> list[str]:
    """The workers (``a``, ``b``) that started ``task_id``, in order."""
    return [
        str(e["worker"]).split("@")[0]
        for e in executions(backend, queue)
        if e["id"] == task_id and e["event"] == "start"
    ]


def run_once_and_take_over(
    fleet: Fleet,
    *,
    broker: str,
    backend: str,
    broker_client: redis.Redis,
    store: RedisClaimManager,
    extra: tuple[str, ...] = (),
    conf: dict[str, Any] | None = None,
) -> None:
    """The fleet checks every deployment passes (see the module docstring)."""
    queue = unique("q")
    env = {"CLAIMS_TEST_CONF": json.dumps(conf)} if conf else None
    workers = {
        name: fleet.worker(
            name, broker=broker, backend=backend, queue=queue, concurrency=1, extra=extra, env=env
        )
        for name in "ab"
    }
    for worker in workers.values():
        worker.wait_ready()
    client = fleet.client(broker, backend, queue)

    # When a task is delivered twice (two messages, one task id: a redelivered copy)
    first = client.send_task("fleet.sleep", (2,), task_id="twice")
    client.send_task("fleet.sleep", (2,), task_id="twice")

    # Then it runs once, and both copies leave the broker (the second acked unrun)
    assert first.get(timeout=30) == 2, fleet.logs()
    wait_for(
        lambda: broker_client.llen(queue) == 0 and broker_client.hlen("unacked") == 0,
        timeout=20,
        what="both copies to be acked",
    )
    assert len(starts(backend, queue, "twice")) == 1, fleet.logs()
    assert store.done_record(queue, "twice:0:0") is not None

    # When the worker running a task is killed with its pool (SIGKILL)
    result = client.send_task("fleet.sleep", (2,), task_id="crash")
    holder = wait_for(lambda: starts(backend, queue, "crash"), timeout=20, what="the run")[0]
    workers[holder].kill_group()

    # Then the other worker takes it over once the lease ran out, and finishes it
    assert result.get(timeout=40) == 2, fleet.logs()
    other = ({"a", "b"} - {holder}).pop()
    assert starts(backend, queue, "crash") == [holder, other], fleet.logs()
    wait_for(lambda: store.done_record(queue, "crash:0:0"), timeout=10, what="the record")
    assert store.queue_stats()[queue].takeovers == 1
    assert "Traceback" not in workers[other].output(), workers[other].output()[-3000:]


def test_a_fleet_on_a_tls_broker_and_store_with_celerys_cert_reqs_spelling_runs_each_task_once(
    fleet: Fleet, tls_redis: TlsRedisServer, private_redis: RedisServer
) -> None:
    # Given a TLS-only Redis as the broker (hence the default claim store), its URL spelling
    # ssl_cert_reqs=CERT_REQUIRED as Celery does, and a plain Redis for results and the log
    assert "ssl_cert_reqs=CERT_REQUIRED" in tls_redis.url
    with RedisClaimManager(url=tls_redis.url) as store:
        # Then every deployment check passes
        run_once_and_take_over(
            fleet,
            broker=tls_redis.url,
            backend=private_redis.url,
            broker_client=tls_redis.client(),
            store=store,
        )


def test_a_fleet_on_a_unix_socket_broker_uses_it_as_the_default_store(
    fleet: Fleet, unix_redis: UnixRedisServer, private_redis: RedisServer
) -> None:
    # Given a broker on a Unix socket (kombu's redis+socket://), the default claim store
    with RedisClaimManager(url=f"unix://{unix_redis.socket}") as store:
        run_once_and_take_over(
            fleet,
            broker=unix_redis.socket_url,
            backend=private_redis.url,
            broker_client=unix_redis.client(),
            store=store,
        )
    # Then the workers' claims went through the socket: nothing but the test used TCP
    tcp = [c for c in unix_redis.client().client_list() if not c["addr"].startswith("/")]
    assert len(tcp) <= 2, tcp  # this inspection client (and its CLIENT LIST)


def test_a_fleet_on_a_redis_cluster_store_runs_each_task_once(
    fleet: Fleet, redis_cluster: RedisClusterNodes, private_redis: RedisServer
) -> None:
    # Given a claim store on a 3-master Redis Cluster (its URL form) and a plain Redis broker
    url = f"redis+cluster://127.0.0.1:{redis_cluster.servers[0].port}"
    prefix = unique("c")
    with RedisClaimManager(url=url, prefix=prefix) as store:
        run_once_and_take_over(
            fleet,
            broker=private_redis.url,
            backend=private_redis.url,
            broker_client=private_redis.client(),
            store=store,
            extra=("--claims-redis-url", url, "--claims-prefix", prefix),
        )


def test_a_fleet_on_a_sentinel_store_runs_each_task_once(
    fleet: Fleet, sentinels: RedisSentinels, private_redis: RedisServer
) -> None:
    # Given a claim store on a Sentinel-managed master (Celery's sentinel:// URL form, the
    # master's name in claims_redis_options) and a plain Redis broker
    with RedisClaimManager(url=sentinels.url, options=sentinels.options) as store:
        run_once_and_take_over(
            fleet,
            broker=private_redis.url,
            backend=private_redis.url,
            broker_client=private_redis.client(),
            store=store,
            extra=("--claims-redis-url", sentinels.url),
            conf={"claims_redis_options": sentinels.options},
        )


def _start_worker(broker: str, extra: list[str], conf: dict[str, Any] | None = None) -> str:
    env = {
        **os.environ,
        "CLAIMS_TEST_BROKER": broker,
        "CLAIMS_TEST_BACKEND": broker,
        "CLAIMS_TEST_QUEUE": unique("q"),
        "CLAIMS_TEST_CONF": json.dumps(conf or {}),
    }
    args = ["-A", "tests.worker.apps.fleet", "worker", "-P", "solo", "-l", "INFO", *extra]
    done = subprocess.run(
        [sys.executable, "-m", "celery", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_tls_store_whose_certificate_does_not_verify_stops_the_worker_before_ready(
    tls_redis: TlsRedisServer, private_redis: RedisServer, tmp_path: Path
) -> None:
    # Given a TLS claim store whose certificate another CA signed than the one configured
    other_ca = make_certificates(tmp_path, "other")["ca"]
    url = (
        f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_cert_reqs=CERT_REQUIRED&ssl_ca_certs={other_ca}"
    )

    # When a worker starts on it
    output = _start_worker(private_redis.url, ["--claims-redis-url", url])

    # Then it stops before "ready", with one line saying why
    assert " ready." not in output
    lines = [line for line in output.splitlines() if line.startswith("Error: celery-claims:")]
    assert len(lines) == 1, output
    assert "TLS" in lines[0], lines
    assert "CERTIFICATE_VERIFY_FAILED" in lines[0], lines
    assert "Traceback" not in output, output


def test_a_sentinel_store_with_an_unknown_master_name_stops_the_worker_before_ready(
    sentinels: RedisSentinels, private_redis: RedisServer
) -> None:
    # Given a Sentinel claim store whose master name the Sentinels do not know
    conf = {"claims_redis_options": {"master_name": "no-such-master"}}

    # When a worker starts on it
    output = _start_worker(private_redis.url, ["--claims-redis-url", sentinels.url], conf)

    # Then it stops before "ready", naming the master and the ones the Sentinels know
    assert " ready." not in output
    lines = [line for line in output.splitlines() if line.startswith("Error: celery-claims:")]
    assert len(lines) == 1, output
    assert "'no-such-master'" in lines[0], lines
    assert sentinels.MASTER in lines[0], lines


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis+socket:///tmp/claims.sock?virtual_host=2", "unix:///tmp/claims.sock?db=2"),
        (
            "rediss://127.0.0.1:6390/1?ssl_cert_reqs=CERT_NONE",
            "rediss://127.0.0.1:6390/1?ssl_cert_reqs=CERT_NONE",
        ),
    ],
    ids=["redis+socket", "rediss"],
)
def test_the_default_store_of_a_socket_or_tls_broker_is_the_broker_and_claims_ride_it(
    broker: str, expected: str
) -> None:
    # Given an app on a Redis broker reached over a Unix socket or TLS
    app = Celery("deploy", broker=broker, set_as_current=False)
    try:
        # When its claim settings are read and the store's client is made
        settings = load_settings(app)
        client = new_client(settings)
        # Then the store is the broker's own server and database, so claims ride kombu's
        # round trips there
        assert settings.redis_url == broker
        with RedisClaimManager(url=expected) as twin:
            assert (
                client.connection_pool.connection_kwargs["db"]
                == (twin.client.connection_pool.connection_kwargs["db"])
            )
        assert store_is_broker(app, client)
        client.close()
    finally:
        app.close()


def test_the_default_store_of_a_sentinel_broker_takes_the_brokers_master_name() -> None:
    # Given an app on a Sentinel broker, its master named in broker_transport_options
    url = "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380/3"
    app = Celery("deploy", broker=url, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": "mymaster", "visibility_timeout": 5}
    try:
        # When its claim settings are read
        settings = load_settings(app)
    finally:
        app.close()

    # Then the claim store is that master, through the same Sentinels
    assert settings.redis_url == url
    assert dict(settings.redis_options) == {"master_name": "mymaster"}
