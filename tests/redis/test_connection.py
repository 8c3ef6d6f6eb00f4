"""The one client factory: URL forms, options, the policy, and what it says when it cannot work."""

from __future__ import annotations

import gc
import ssl
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.backoff import NoBackoff

from celery_claims import BackendUnavailable, InvalidArgument, RedisClaimManager
from celery_claims.connection import (
    DEFAULT_TIMEOUT_S,
    RETRIES,
    StoreUnusable,
    close,
    connect,
    role_at,
    sentinel_down_after_ms,
    sentinel_master,
    server_of,
    verify,
)
from tests.servers import (
    RedisSentinels,
    RedisServer,
    TlsRedisServer,
    UnixRedisServer,
    free_port,
    redis_server,
)


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[TlsRedisServer]:
    server = TlsRedisServer()
    try:
        yield server.start()  # type: ignore[misc]
    finally:
        server.cleanup()


@pytest.mark.parametrize("spelling", ["CERT_REQUIRED", "cert_required", "required"])
def test_celerys_and_redis_pys_spellings_of_ssl_cert_reqs_both_reach_a_tls_store(
    tls_redis: TlsRedisServer, spelling: str
) -> None:
    # Given the TLS store's URL with ssl_cert_reqs spelled as Celery or redis-py spells it
    url = tls_redis.url.replace("CERT_REQUIRED", spelling)

    # When a claim manager is made from it and claims, Then the certificate was verified
    with RedisClaimManager(url=url, prefix="spell") as manager:
        assert manager.claim("q", f"t-{spelling}", "me", 1000).acquired
        kwargs = manager.client.connection_pool.connection_kwargs
        assert kwargs["ssl_cert_reqs"] is ssl.CERT_REQUIRED


def test_tls_options_can_come_from_the_options_mapping_instead_of_the_url(
    tls_redis: TlsRedisServer,
) -> None:
    # Given a bare rediss:// URL and the TLS options in the mapping (claims_redis_options)
    url = f"rediss://127.0.0.1:{tls_redis.port}/0"
    options = {"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": str(tls_redis.certs["ca"])}

    # When a client is made and checked, Then it works
    client = connect(url, options)
    try:
        verify(client, url)
        assert client.ping()
    finally:
        close(client)


@pytest.mark.parametrize(
    ("url", "options", "name", "message"),
    [
        ("rediss://h/0?ssl_cert_reqs=CERT_MAYBE", None, "url", "CERT_REQUIRED, CERT_OPTIONAL"),
        ("redis://h/0?ssl_cert_reqs=none", None, "url", "needs a rediss:// URL"),
        ("redis://h/0?socket_timeout=9", None, "url", "unknown URL parameter"),
        ("redis://h/0", {"ssl_ca_certs": "/ca"}, "options", "need a rediss:// URL"),
        ("redis://h/0", {"master_name": "m"}, "options", "sentinel:// URLs only"),
        ("redis://h/0", {"retries": 5}, "options", "unknown option"),
        ("redis://h/0", ["master_name"], "options", "must be a dict"),
        ("sentinel://h:26379", None, "options", "needs master_name"),
        ("sentinel://h:26379;redis://h2", {"master_name": "m"}, "url", "must be sentinel://"),
        ("redis+cluster://h:7000/2", None, "url", "database 0 only"),
        ("redis://a;redis://b", None, "url", "only taken for sentinel://"),
        ("unix://", None, "url", "no socket path"),
        ("http://u:secret@h", None, "url", "must be a URL starting with"),
    ],
)
def test_a_bad_url_or_option_is_refused_when_the_client_is_made_naming_it(
    url: str, options: Any, name: str, message: str
) -> None:
    # When a client is asked for, Then nothing connects and the error names the culprit
    with pytest.raises(InvalidArgument, match=message) as caught:
        connect(url, options)
    assert caught.value.name == name
    assert "secret" not in str(caught.value)


def test_every_client_gets_one_timeout_and_one_immediate_retry(redis_server: RedisServer) -> None:
    # When clients are made for a TCP and a Unix socket store with the default policy
    client = connect(redis_server.url)
    try:
        kwargs = client.connection_pool.connection_kwargs
        retry = kwargs["retry"]
        # Then both timeouts are the policy's, with one retry and no backoff
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == DEFAULT_TIMEOUT_S
        # (``_retries`` as ``_backoff``: redis-py before 5.3 has no ``get_retries``)
        assert retry._retries == RETRIES
        assert isinstance(retry._backoff, NoBackoff)
        assert server_of(client) == ("127.0.0.1", redis_server.port, None, 0)
    finally:
        close(client)


def test_verify_tells_an_unusable_store_from_an_unreachable_one(
    tls_redis: TlsRedisServer,
) -> None:
    # Given a store with a password, one nobody listens on, and a TLS store spoken to in plain
    with redis_server() as guarded:
        guarded.client().config_set("requirepass", "right")
        wrong = connect(f"redis://:wrong@127.0.0.1:{guarded.port}/0")
        nobody = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
        plain = connect(f"redis://127.0.0.1:{tls_redis.port}/0", timeout_s=0.5)
        try:
            # Then a refused login cannot be waited out; a dead port may heal
            with pytest.raises(StoreUnusable, match="refused the credentials") as refused:
                verify(wrong, f"redis://:wrong@127.0.0.1:{guarded.port}/0")
            assert "wrong" not in str(refused.value).replace("refused the credentials", "")
            with pytest.raises(BackendUnavailable):
                verify(nobody, "redis://nobody")
            with pytest.raises(BackendUnavailable):
                verify(plain, "redis://plain-to-tls")
        finally:
            for client in (wrong, nobody, plain):
                close(client)
        # and no socket was left for the garbage collector (an error under filterwarnings)
        gc.collect()


def test_a_cluster_client_on_a_standalone_server_is_refused_as_unusable(
    redis_server: RedisServer,
) -> None:
    # When a Cluster client is asked for on a server that is not in cluster mode
    with pytest.raises(StoreUnusable, match="not a Cluster"):
        connect(redis_server.url, cluster=True)


def test_a_unix_socket_url_in_each_spelling_reaches_the_same_server_and_database() -> None:
    # Given a Redis on a Unix socket with a key in database 2
    server = UnixRedisServer().start()
    try:
        server.client(db=2).set("where", "db2")
        path = server.socket
        # When clients are made from redis-py's, kombu's and Celery's spelling of its URL
        for url in (f"unix://{path}?db=2", f"redis+socket://{path}?virtual_host=2",
                    f"socket://{path}?virtual_host=2"):  # fmt: skip
            client = connect(url)
            try:
                # Then each reads the same database through the socket
                assert client.get("where") == b"db2", url
                assert server_of(client) == (None, None, str(path), 2)
            finally:
                close(client)
    finally:
        server.cleanup()


def test_a_sentinel_client_follows_the_master_the_sentinels_name_before_the_old_one_refuses(
    redis_server: RedisServer,
) -> None:
    # Given a client of a Sentinel-managed master that has written once, and a standalone one
    group = RedisSentinels()
    try:
        group.start()
        client = connect(group.url, group.options)
        old = ("127.0.0.1", group.master.port)
        client.set("before", "1")
        assert sentinel_master(client) == old
        assert sentinel_master(redis_server.client()) is None
        assert sentinel_down_after_ms(client) == 1000

        # When the master fails over
        new_port = group.failover()

        # Then the old master still answers as a master (it would take the client's writes)
        # until the client asks the Sentinels (each learns of the switch in its own time),
        # which moves it to the new master
        assert role_at(client, old) == "master"
        deadline = time.monotonic() + 10
        while sentinel_master(client) != ("127.0.0.1", new_port):
            assert time.monotonic() < deadline, "the Sentinels never named the new master"
            time.sleep(0.1)
        client.set("after", "1")
        new_master = group.replica if new_port == group.replica.port else group.master
        assert new_master.client().get("after") == b"1"
        assert role_at(client, ("127.0.0.1", new_port)) == "master"
        assert role_at(client, ("127.0.0.1", free_port())) is None
        close(client)
    finally:
        group.cleanup()
