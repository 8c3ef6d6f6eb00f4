"""The one way celery-claims reaches Redis: every URL form, its options, one retry policy.

Every client the package makes (the claim manager and lane store built from ``url=``, the
worker's gate, keeper and pool processes, the ``claims`` command) comes from :func:`connect`.
It takes the URL forms Celery's own Redis transport and result backend take:

- ``redis://[user:password@]host[:port][/db]`` and ``unix:///path/redis.sock?db=N``;
- ``rediss://...`` (TLS) with Celery's query parameters ``ssl_cert_reqs``, ``ssl_ca_certs``,
  ``ssl_certfile`` and ``ssl_keyfile``; ``ssl_cert_reqs`` may be spelled as Celery spells it
  (``CERT_REQUIRED``, ``CERT_OPTIONAL``, ``CERT_NONE``) or as redis-py does (``required``,
  ``optional``, ``none``);
- ``redis+socket:///path/redis.sock?virtual_host=N`` (kombu's broker form) and
  ``socket:///path`` (Celery's result backend form);
- ``sentinel://h1:26379;sentinel://h2:26380/0`` (Celery's Sentinel form; ``master_name`` in
  the options);
- Redis Cluster: ``redis+cluster://host:port`` / ``rediss+cluster://...``, or any
  ``redis://``/``rediss://`` URL with ``cluster=True``.

Client options that do not fit a URL come in one mapping (``claims_redis_options`` in a
worker): ``master_name``, ``sentinel_kwargs``, ``min_other_sentinels``, ``username``,
``password``, ``ssl`` (TLS to a Sentinel's master) and the ``ssl_*`` options above plus
``ssl_check_hostname``. Everything is validated when the client is made, never on the first
command: a wrong value raises :class:`~celery_claims.errors.InvalidArgument` naming it.

The policy, the same for every client: connect and read timeouts of ``timeout_s``
(:data:`DEFAULT_TIMEOUT_S` unless the caller passes its own, as a worker does with
``claims_socket_timeout_ms``), :data:`RETRIES` immediate retry of a command whose connection
failed (a dropped idle connection, a Sentinel master that became a replica), no backoff, and
a health check of a connection idle for :data:`HEALTH_CHECK_INTERVAL_S`. redis-py's default
(several retries with growing backoff) would block a worker's event loop or a running task for
seconds on a dead store; every caller has its own, slower retry instead.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.exceptions as redis_errors
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedSSLConnection,
)

from celery_claims.errors import BackendError, BackendUnavailable, InvalidArgument

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEALTH_CHECK_INTERVAL_S",
    "OPTIONS",
    "RETRIES",
    "SCHEMES",
    "RedisClient",
    "StoreSpec",
    "StoreUnusable",
    "close",
    "connect",
    "describe",
    "parse",
    "role_at",
    "sentinel_down_after_ms",
    "sentinel_master",
    "server_of",
    "socket_of",
    "verify",
]

#: A standalone (or Sentinel-managed) or cluster redis-py client.
RedisClient: TypeAlias = "redis.Redis | redis.RedisCluster"

#: Connect and read timeout of every client unless the caller passes its own.
DEFAULT_TIMEOUT_S = 5.0
#: Immediate retries of a command whose connection failed; no backoff (see the module doc).
RETRIES = 1
#: Seconds a pooled connection may sit idle before it is checked with a PING before use.
HEALTH_CHECK_INTERVAL_S = 30

#: The URL schemes :func:`parse` takes.
SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+socket://",
    "socket://",
    "sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
)

#: Keys of the options mapping (``claims_redis_options``).
OPTIONS = frozenset(
    {
        "master_name",
        "sentinel_kwargs",
        "min_other_sentinels",
        "username",
        "password",
        "ssl",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_check_hostname",
    }
)

#: Both spellings of ``ssl_cert_reqs``: Celery's (``CERT_REQUIRED``) and redis-py's.
_CERT_REQS = {
    "cert_required": ssl.CERT_REQUIRED,
    "cert_optional": ssl.CERT_OPTIONAL,
    "cert_none": ssl.CERT_NONE,
    "required": ssl.CERT_REQUIRED,
    "optional": ssl.CERT_OPTIONAL,
    "none": ssl.CERT_NONE,
}
_SSL_PATHS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_SENTINEL_ONLY = ("master_name", "sentinel_kwargs", "min_other_sentinels", "ssl")
#: Query parameters a URL may carry (besides the TLS ones).
_QUERY = frozenset({"db", "virtual_host", "password", "username"})


class StoreUnusable(BackendError):
    """The store answered, but cannot be used as configured (TLS, credentials, mode, name).

    Unlike :class:`~celery_claims.errors.BackendUnavailable` (down or unreachable: retry
    later), waiting will not help: the configuration must change.
    """


@dataclass(frozen=True)
class StoreSpec:
    """A parsed, validated store address with its client options.

    Attributes:
        kind: ``"standalone"``, ``"sentinel"`` or ``"cluster"``.
        kwargs: the redis-py connection arguments of the server (of the master, for Sentinel;
            of the startup node, for Cluster), without the timeout policy.
        sentinels: ``(host, port)`` of each Sentinel (``kind == "sentinel"``).
        master_name: the Sentinel service name.
        sentinel_kwargs: connection arguments of the Sentinels themselves.
        min_other_sentinels: passed to :class:`redis.sentinel.Sentinel`.
    """

    kind: Literal["standalone", "sentinel", "cluster"]
    kwargs: Mapping[str, Any]
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str | None = None
    sentinel_kwargs: Mapping[str, Any] = field(default_factory=dict)
    min_other_sentinels: int = 0


def describe(url: object) -> str:
    """``url`` for messages and logs, its password masked by kombu's own sanitiser.

    Each part of a Sentinel list is masked on its own (as Celery's Sentinel backend does in
    ``as_uri``); kombu leaves out the query string, where redis-py also takes a password. A
    URL kombu cannot parse is shown by its scheme only: never as given.
    """
    if not isinstance(url, str):
        return repr(url)[:80]
    # imported here, not at the top: the claim core imports neither Celery nor kombu, and
    # only a message about a URL needs the sanitiser
    from kombu.utils.url import maybe_sanitize_url

    parts = []
    for chunk in url.split(";"):
        scheme, sep, _ = chunk.partition("://")
        if not sep:
            # not a URL to kombu (left as it is): whatever precedes an "@" may be a password
            parts.append(f"...@{chunk.rpartition('@')[2]}" if "@" in chunk else chunk)
            continue
        try:
            parts.append(str(maybe_sanitize_url(chunk)))
        except ValueError:
            parts.append(f"{scheme}://...")
    return ";".join(parts)


def _cert_reqs(name: str, value: object) -> ssl.VerifyMode:
    if isinstance(value, ssl.VerifyMode):
        return value
    if isinstance(value, str) and value.strip().lower() in _CERT_REQS:
        return _CERT_REQS[value.strip().lower()]
    raise InvalidArgument(
        name,
        f"ssl_cert_reqs must be CERT_REQUIRED, CERT_OPTIONAL or CERT_NONE (or required, "
        f"optional, none), got {value!r:.80}",
    )


def _int(name: str, what: str, value: object) -> int:
    try:
        number = int(str(value).strip("/") or 0)
    except ValueError:
        raise InvalidArgument(name, f"{what} must be a number, got {value!r:.80}") from None
    if number < 0:
        raise InvalidArgument(name, f"{what} must not be negative, got {number}")
    return number


def _query(url_name: str, query: str, *, tls: bool) -> dict[str, Any]:
    given = {key: values[-1] for key, values in parse_qs(query, keep_blank_values=True).items()}
    tls_keys = {"ssl_cert_reqs", "ssl_check_hostname", *_SSL_PATHS}
    unknown = sorted(set(given) - _QUERY - tls_keys)
    if unknown:
        raise InvalidArgument(
            url_name,
            f"unknown URL parameter(s) {unknown}; known: "
            f"{sorted(_QUERY | tls_keys)} (other client options go in claims_redis_options)",
        )
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key in tls_keys and not tls:
            raise InvalidArgument(url_name, f"{key} needs a rediss:// URL (TLS)")
        if key == "ssl_cert_reqs":
            out[key] = _cert_reqs(url_name, value)
        elif key == "ssl_check_hostname":
            out[key] = value.lower() in {"1", "true", "yes", "on"}
        elif key in ("db", "virtual_host"):
            out["db"] = _int(url_name, key, value)
        else:
            out[key] = value
    return out


def _userinfo(parts: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if parts.username:
        out["username"] = unquote(parts.username)
    if parts.password:
        out["password"] = unquote(parts.password)
    return out


def _host_port(url_name: str, parts: Any, default_port: int) -> tuple[str, int]:
    try:
        port = parts.port or default_port
    except ValueError:
        raise InvalidArgument(url_name, "has an invalid port") from None
    return (parts.hostname or "127.0.0.1"), int(port)


def _options(options_name: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidArgument(options_name, f"must be a dict, got {options!r:.80}")
    unknown = sorted(str(key) for key in set(options) - OPTIONS)
    if unknown:
        raise InvalidArgument(
            options_name, f"unknown option(s) {unknown}; known: {sorted(OPTIONS)}"
        )
    out = dict(options)
    for key in ("master_name", "username", "password", *_SSL_PATHS):
        if key in out and out[key] is not None and not isinstance(out[key], str):
            raise InvalidArgument(options_name, f"{key} must be a str, got {out[key]!r:.80}")
    if "ssl_cert_reqs" in out:
        out["ssl_cert_reqs"] = _cert_reqs(options_name, out["ssl_cert_reqs"])
    for key in ("ssl", "ssl_check_hostname"):
        if key in out and not isinstance(out[key], bool):
            raise InvalidArgument(options_name, f"{key} must be a bool, got {out[key]!r:.80}")
    if "sentinel_kwargs" in out and not isinstance(out["sentinel_kwargs"], Mapping):
        raise InvalidArgument(options_name, "sentinel_kwargs must be a dict")
    if "min_other_sentinels" in out:
        value = out["min_other_sentinels"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(options_name, "min_other_sentinels must be an int >= 0")
    return out


def parse(
    url: object,
    options: Mapping[str, Any] | None = None,
    *,
    cluster: bool = False,
    url_name: str = "url",
    options_name: str = "options",
) -> StoreSpec:
    """Check ``url`` and ``options`` and say how to connect (see the module docstring).

    Args:
        url: the store's URL, in one of :data:`SCHEMES`.
        options: client options (keys in :data:`OPTIONS`).
        cluster: a ``redis://``/``rediss://`` URL names a Redis Cluster node.
        url_name: the name errors about the URL carry (``claims_redis_url`` in a worker).
        options_name: the name errors about the options carry.

    Raises:
        InvalidArgument: an unknown scheme, parameter or option, or a value of the wrong
            kind; the message never shows a password.
    """
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        raise InvalidArgument(
            url_name,
            f"must be a URL starting with one of {', '.join(SCHEMES)}; got {describe(url)}",
        )
    opts = _options(options_name, options)
    if url.startswith("sentinel://"):
        return _sentinel(url, opts, url_name, options_name)
    misplaced = [key for key in _SENTINEL_ONLY if key in opts]
    if misplaced:
        raise InvalidArgument(options_name, f"{misplaced} apply to sentinel:// URLs only")
    scheme, _, rest = url.partition("://")
    if scheme.endswith("+cluster"):
        cluster, scheme = True, scheme.removesuffix("+cluster")
    if ";" in url:
        raise InvalidArgument(url_name, "a list of URLs is only taken for sentinel://")
    tls = scheme == "rediss"
    parts = urlsplit(f"{scheme}://{rest}")
    query = _query(url_name, parts.query, tls=tls)
    kwargs: dict[str, Any] = {
        **_userinfo(parts),
        **_address(url_name, scheme, parts, cluster=cluster, tls=tls),
        **query,
    }
    ssl_opts = {k: v for k, v in opts.items() if k.startswith("ssl_")}
    if ssl_opts and not tls:
        raise InvalidArgument(options_name, f"{sorted(ssl_opts)} need a rediss:// URL (TLS)")
    kwargs.update(opts)
    if cluster:
        return _cluster(url_name, kwargs, tls=tls)
    return StoreSpec("standalone", kwargs)


def _address(url_name: str, scheme: str, parts: Any, *, cluster: bool, tls: bool) -> dict[str, Any]:
    """Where a ``redis://``/``rediss://``/socket URL points: a socket path, or host, port, db."""
    if scheme in ("unix", "redis+socket", "socket"):
        if cluster:
            raise InvalidArgument(url_name, "a Redis Cluster is reached over TCP, not a socket")
        path = unquote(parts.path)
        if not path:
            raise InvalidArgument(url_name, "names no socket path")
        return {"path": path, "connection_class": redis.UnixDomainSocketConnection}
    host, port = _host_port(url_name, parts, 6379)
    out: dict[str, Any] = {"host": host, "port": port}
    if parts.path.strip("/"):
        out["db"] = _int(url_name, "the database", parts.path)
    if tls:
        out.update(connection_class=redis.SSLConnection, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


def _cluster(url_name: str, kwargs: dict[str, Any], *, tls: bool) -> StoreSpec:
    """A Redis Cluster's spec: database 0 only, TLS as redis-py's ``ssl=True``."""
    if kwargs.get("db"):
        raise InvalidArgument(url_name, "a Redis Cluster has database 0 only")
    kwargs.pop("db", None)
    if tls:
        kwargs.pop("connection_class")
        kwargs["ssl"] = True
    return StoreSpec("cluster", kwargs)


def _sentinel(url: str, opts: dict[str, Any], url_name: str, options_name: str) -> StoreSpec:
    master_name = opts.pop("master_name", None)
    if not master_name:
        raise InvalidArgument(
            options_name, "a sentinel:// URL needs master_name (the Sentinel service name)"
        )
    sentinels: list[tuple[str, int]] = []
    kwargs: dict[str, Any] = {}
    for i, chunk in enumerate(url.split(";")):
        chunk = chunk.strip()
        if not chunk.startswith("sentinel://"):
            raise InvalidArgument(url_name, f"every part of a Sentinel list must be sentinel://, "
                                  f"got {describe(chunk)}")  # fmt: skip
        parts = urlsplit(chunk)
        sentinels.append(_host_port(url_name, parts, 26379))
        query = _query(url_name, parts.query, tls=False)
        # as Celery's Sentinel backend: database and credentials come from the first part
        if i == 0:
            kwargs.update(_userinfo(parts))
            if parts.path.strip("/"):
                kwargs["db"] = _int(url_name, "the database", parts.path)
            kwargs.update(query)
    sentinel_kwargs = dict(opts.pop("sentinel_kwargs", None) or {})
    min_other = int(opts.pop("min_other_sentinels", 0))
    if opts.get("ssl") is False:
        opts.pop("ssl")
    if any(key.startswith("ssl_") for key in opts) and not opts.get("ssl"):
        raise InvalidArgument(options_name, "ssl_* options of a Sentinel master need ssl=True")
    kwargs.update(opts)
    return StoreSpec(
        "sentinel",
        kwargs,
        sentinels=tuple(sentinels),
        master_name=str(master_name),
        sentinel_kwargs=sentinel_kwargs,
        min_other_sentinels=min_other,
    )


def _policy(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), RETRIES),
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }


def _handshake(connection: Any) -> None:
    """redis-py's connect-time handshake (``on_connect``), its health check off meanwhile.

    redis-py 5.0 to 5.2 health-check the handshake's own commands: where the server answers
    something that is not Redis's protocol, each failed ``PING`` reconnects from inside the
    handshake, without end, and each level leaves a socket unclosed (redis-py issue #2866).
    The handshake's first reply then fails it once, and redis-py closes its socket; the
    health check resumes with the next command. (A Cluster client has a handshake of its own.)
    """
    interval = connection.health_check_interval
    connection.health_check_interval = 0
    try:
        connection.on_connect()
    finally:
        connection.health_check_interval = interval


def connect(
    url: str,
    options: Mapping[str, Any] | None = None,
    *,
    cluster: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    url_name: str = "url",
    options_name: str = "options",
) -> RedisClient:
    """A redis-py client for ``url`` with the package's one timeout and retry policy.

    Standalone and Sentinel clients connect lazily (the first command connects); a Cluster
    client reads the slot map now, so a Cluster must be reachable when it is made. Use
    :func:`verify` to find out at once whether the store can be used, and :func:`close` to
    close every connection (a Sentinel client's connections to the Sentinels too).

    Raises:
        InvalidArgument: see :func:`parse`; also a timeout that is not a positive number.
        BackendUnavailable: a Cluster could not be reached.
        StoreUnusable: a Cluster node refused the client (not in cluster mode, credentials).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise InvalidArgument("timeout_s", f"must be a positive number, got {timeout_s!r:.80}")
    spec = parse(url, options, cluster=cluster, url_name=url_name, options_name=options_name)
    policy = _policy(float(timeout_s))
    if spec.kind != "cluster":
        policy["redis_connect_func"] = _handshake
    if spec.kind == "sentinel":
        sentinel_kwargs = {
            "socket_timeout": policy["socket_timeout"],
            "socket_connect_timeout": policy["socket_connect_timeout"],
            **spec.sentinel_kwargs,
        }
        new_sentinel: Any = Sentinel  # untyped in redis-py
        manager = new_sentinel(
            list(spec.sentinels),
            min_other_sentinels=spec.min_other_sentinels,
            sentinel_kwargs=sentinel_kwargs,
        )
        assert spec.master_name is not None
        client: redis.Redis = manager.master_for(spec.master_name, **{**policy, **spec.kwargs})
        return client
    if spec.kind == "cluster":
        try:
            return redis.RedisCluster(**{**policy, **spec.kwargs})
        except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
            raise _classified(url, exc) from exc
    kwargs = {**policy, **spec.kwargs}
    if kwargs.get("connection_class") is redis.UnixDomainSocketConnection:
        kwargs.pop("socket_connect_timeout")  # a Unix socket connects at once or fails
        path = kwargs.pop("path")
        kwargs.pop("connection_class")
        return redis.Redis(unix_socket_path=path, **kwargs)
    if kwargs.pop("connection_class", None) is redis.SSLConnection:
        kwargs["ssl"] = True
    return redis.Redis(**kwargs)


def close(client: Any) -> None:
    """Close ``client``'s connections, those to a Sentinel-managed master's Sentinels too."""
    pool = getattr(client, "connection_pool", None)
    manager = getattr(pool, "sentinel_manager", None)
    with contextlib.suppress(Exception):
        client.close()
    if isinstance(manager, Sentinel):
        with contextlib.suppress(Exception):
            manager.close()


def server_of(client: Any) -> tuple[Any, ...] | None:
    """``(host, port, unix path, db)`` of a standalone client's server, else None.

    None for a Cluster client (many servers) and a Sentinel-managed one (its server is known
    only once it asks the Sentinels, and may change).
    """
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        return None
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return None
    host, path = kwargs.get("host"), kwargs.get("path")
    if host is None and path is None:
        return None
    port = kwargs.get("port") if path is None else None
    return (host if path is None else None, port, path, int(kwargs.get("db") or 0))


def socket_of(connection: Any) -> socket.socket | None:
    """The connected socket of a redis-py ``Connection``, or None while it is disconnected.

    redis-py keeps it in ``_sock`` (checked on redis-py 5.0 to 8.2); kombu's Redis transport
    reads ``client.connection._sock`` the same way to register it on its event loop.
    """
    sock = getattr(connection, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def sentinel_master(client: Any) -> tuple[str, int] | None:
    """Ask the Sentinels where a Sentinel-managed client's master is now, and follow it.

    One round trip to a Sentinel. When the answer is not the address the client's pool used
    so far, the pool (redis-py's ``SentinelConnectionPool``) drops its idle connections and
    closes its busy ones as they come back, so every later command goes to the new master.
    Without this, a connection to the old master stays there as long as that server answers
    as a master, which after ``SENTINEL FAILOVER`` is several seconds of writes it later
    discards.

    Returns:
        ``(host, port)`` of the master, or None for a client that is not Sentinel-managed.

    Raises:
        BackendUnavailable: no Sentinel could be reached, or none names a master.
    """
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool):
        return None
    ask: Any = pool.get_master_address  # untyped in redis-py
    try:
        host, port = ask()
    except (redis_errors.RedisError, OSError) as exc:
        raise BackendUnavailable(f"the Sentinels name no master now: {exc}") from exc
    return str(host), int(port)


def sentinel_down_after_ms(client: Any) -> int | None:
    """The Sentinels' ``down-after-milliseconds`` for a Sentinel-managed client's master.

    None for another client, or when no Sentinel answers (the caller assumes its own bound).
    """
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool):
        return None
    for sentinel in pool.sentinel_manager.sentinels:
        try:
            state = _sentinel_master_state(sentinel, pool.service_name)
            return int(state["down-after-milliseconds"])
        except (redis_errors.RedisError, OSError, KeyError, TypeError, ValueError):
            continue
    return None


def _sentinel_master_state(sentinel: Any, service: str) -> dict[str, str]:
    """``SENTINEL MASTER <service>`` of one Sentinel, as strings.

    Sent as a plain command: redis-py 6.4's ``sentinel_master()`` passes its reply parser an
    argument the parser does not take (TypeError). The reply is a flat list of names and
    values (RESP2) or a map (RESP3).
    """
    reply = sentinel.execute_command("SENTINEL", "MASTER", service)
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {_text(name): _text(value) for name, value in pairs}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: Connection options of a Sentinel-managed pool that a direct connection to one of its
#: servers takes too (credentials, database, TLS, timeouts).
_DIRECT = ("username", "password", "credential_provider", "db", "socket_timeout",
           "socket_connect_timeout", "client_name")  # fmt: skip


def role_at(client: Any, address: tuple[str, int]) -> str | None:
    """``ROLE`` of the server at ``address``, reached with ``client``'s connection options.

    For a Sentinel-managed client, to find out whether a former master still takes writes.

    Returns:
        ``"master"``, ``"slave"`` (Redis' word), ``"sentinel"``, or None if the server could
        not be reached or asked.
    """
    pool = getattr(client, "connection_pool", None)
    given = getattr(pool, "connection_kwargs", {})
    kwargs: dict[str, Any] = {k: given[k] for k in _DIRECT if k in given}
    if isinstance(pool, SentinelConnectionPool) and issubclass(
        pool.connection_class, SentinelManagedSSLConnection
    ):
        kwargs["ssl"] = True
        kwargs.update({k: v for k, v in given.items() if k.startswith("ssl_")})
    direct: Any = redis.Redis(
        host=address[0], port=address[1], retry=Retry(NoBackoff(), 0), **kwargs
    )
    try:
        reply = direct.execute_command("ROLE")
    except (redis_errors.RedisError, OSError):
        return None
    finally:
        direct.close()
    role = reply[0] if isinstance(reply, (list, tuple)) and reply else None
    return role.decode() if isinstance(role, bytes) else str(role) if role is not None else None


def _classified(where: str, exc: BaseException) -> BackendError:
    """``exc`` as :class:`BackendUnavailable` (may heal) or :class:`StoreUnusable` (won't)."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ssl.SSLError) or isinstance(exc, ssl.SSLError):
        return StoreUnusable(f"TLS with the claim store at {describe(where)} failed: {text}")
    if isinstance(exc, redis_errors.AuthenticationError | redis_errors.AuthorizationError):
        return StoreUnusable(
            f"the claim store at {describe(where)} refused the credentials: {text}"
        )
    if isinstance(exc, redis_errors.ResponseError | redis_errors.DataError):
        return StoreUnusable(f"the claim store at {describe(where)} refused the client: {text}")
    if isinstance(exc, redis_errors.RedisClusterException) and "cluster mode" in str(exc).lower():
        return StoreUnusable(f"the claim store at {describe(where)} is not a Cluster: {text}")
    if isinstance(
        exc,
        redis_errors.ConnectionError
        | redis_errors.TimeoutError
        | redis_errors.ClusterError
        | redis_errors.RedisClusterException
        | OSError,
    ):
        if "invalid database" in str(exc).lower() or "protocol" in str(exc).lower():
            return StoreUnusable(f"the claim store at {describe(where)} refused the client: {text}")
        return BackendUnavailable(f"claim store at {describe(where)} unavailable: {text}")
    return StoreUnusable(f"the claim store at {describe(where)} cannot be used: {text}")


def verify(client: RedisClient, where: str) -> None:
    """Check at once that the store can be used: one ``PING`` (Sentinel: finds the master).

    Args:
        client: a client from :func:`connect`.
        where: the store's URL, for messages (masked).

    Raises:
        StoreUnusable: the store cannot be used as configured (TLS handshake or certificate,
            credentials, database, not a Cluster, unknown Sentinel service).
        BackendUnavailable: the store (or every Sentinel) could not be reached; it may be
            starting.
    """
    pool = getattr(client, "connection_pool", None)
    try:
        client.ping()
    except MasterNotFoundError as exc:
        raise _master_missing(where, pool, exc) from exc
    except (redis_errors.RedisError, OSError) as exc:
        raise _classified(where, exc) from exc
    except RecursionError as exc:
        # redis-py 5.0 to 5.2 reconnects from the health check of its connect-time handshake,
        # without end, while the server answers something that is not Redis's protocol
        # (_handshake prevents it but for a Cluster client's nodes, which have their own)
        raise BackendUnavailable(
            f"claim store at {describe(where)} unavailable: its answers are not Redis's "
            "protocol (a TLS port reached without rediss://?)"
        ) from exc


def _master_missing(where: str, pool: Any, exc: BaseException) -> BackendError:
    manager, service = getattr(pool, "sentinel_manager", None), getattr(pool, "service_name", "")
    answered = 0
    for sentinel in getattr(manager, "sentinels", []):
        try:
            masters = sentinel.sentinel_masters()
        except redis_errors.RedisError:
            continue
        answered += 1
        if masters:
            known = ", ".join(sorted(str(name) for name in masters))
            return StoreUnusable(
                f"no Sentinel at {describe(where)} knows the master {service!r} "
                f"({exc}); they monitor: {known}"
            )
    if answered:
        return StoreUnusable(f"the Sentinels at {describe(where)} monitor no master ({exc})")
    return BackendUnavailable(f"no Sentinel at {describe(where)} could be reached: {exc}")
