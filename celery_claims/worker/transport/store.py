"""The worker's claim store: one client factory for every part of it, checked at start.

Every part of a worker reaches the claim store through :func:`new_manager`: the claim gate
and the lease keeper in the main process, the lanes, and the guard in each pool process (a
prefork child builds its own, never sharing the parent's sockets across fork). The client
comes from :func:`celery_claims.connect`, so every URL form and option it takes
(TLS, Unix sockets, Sentinel, Cluster) works the same everywhere, with one policy: socket
connect and read timeouts of ``claims_socket_timeout_ms``, one immediate retry, no backoff.

:func:`check_store` runs while the worker starts, before it reports ready: a store that
cannot be used as configured (TLS handshake or certificate, credentials, database, a Cluster
that is not one, an unknown Sentinel master) stops the worker with one line naming the
problem. A store that is only unreachable does not: tasks wait for it (held, retried), as
they do when it goes down later.
"""

from __future__ import annotations

from typing import Any

import click
import redis
from celery.utils.log import get_logger

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import RedisClient, StoreUnusable, connect, describe, verify
from celery_claims.connection import close as close_client
from celery_claims.errors import BackendUnavailable
from celery_claims.worker.settings import ClaimsSettings

__all__ = ["StoreRefused", "check_durable", "check_store", "new_client", "new_manager"]

logger = get_logger("celery_claims.worker")


class StoreRefused(StoreUnusable, click.ClickException):
    """The worker cannot use its claim store: it stops at start with this one line.

    A ``click.ClickException`` too, so ``celery worker`` prints ``Error: <message>`` and
    exits with status 1 instead of a traceback.
    """

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, f"celery-claims: {message}")


def new_client(settings: ClaimsSettings) -> RedisClient:
    """A client of the claim store of ``settings`` (see the module docstring).

    Raises:
        InvalidArgument: the URL or options are invalid.
        BackendUnavailable: a Cluster store could not be reached (its client reads the slot
            map when it is made).
        StoreUnusable: a Cluster node refused the client.
    """
    return connect(
        settings.redis_url,
        settings.redis_options,
        cluster=settings.redis_cluster,
        timeout_s=settings.socket_timeout_ms / 1000,
        url_name="claims_redis_url",
        options_name="claims_redis_options",
    )


def new_manager(settings: ClaimsSettings) -> RedisClaimManager:
    """A claim manager on :func:`new_client` (close it with ``close_client(m.client)``)."""
    return RedisClaimManager(client=new_client(settings), prefix=settings.prefix)


def check_store(settings: ClaimsSettings) -> RedisClaimManager:
    """The worker's claim manager, once the store is known to be usable (module docstring).

    Args:
        settings: the worker's settings.

    Raises:
        StoreRefused: the store cannot be used as configured, or a Cluster store is
            unreachable at start.
    """
    where = describe(settings.redis_url)
    try:
        manager = new_manager(settings)
    except BackendUnavailable as exc:
        raise StoreRefused(
            f"the claim store at {where} must be reachable when the worker starts: {exc}"
        ) from exc
    except StoreUnusable as exc:
        raise StoreRefused(str(exc)) from exc
    try:
        verify(manager.client, settings.redis_url)
    except BackendUnavailable as exc:
        logger.warning(
            "celery-claims: the claim store at %s is unreachable at start (%s); tasks wait for it",
            where,
            exc,
        )
    except StoreUnusable as exc:
        close_client(manager.client)
        raise StoreRefused(str(exc)) from exc
    return manager


def check_durable(client: Any, settings: ClaimsSettings, where: str = "") -> str | None:
    """Refuse a claim store that keeps nothing across a restart, for messages acked at claim.

    A message acknowledged at claim (``claims_ack_on_claim``) lives on only as its claim and
    its publish journal entry: a store without AOF and without RDB snapshots loses both when it
    restarts, and the task with them. Read with ``CONFIG GET`` (one round trip).

    Returns:
        A warning to report where the store does not say (``CONFIG`` refused, as some managed
        services do), else None.

    Raises:
        StoreRefused: the store persists nothing.
    """
    try:
        aof = str(_config(client, "appendonly")).lower()
        rdb = str(_config(client, "save")).strip()
    except redis.ResponseError as exc:
        return (
            f"claims_ack_on_claim: cannot tell whether the claim store persists ({exc}); "
            f"messages acked at claim live on only there: make sure it has AOF or RDB"
        )
    if aof != "yes" and not rdb:
        raise StoreRefused(
            f"claims_ack_on_claim: the claim store{' at ' + where if where else ''} keeps "
            f'nothing across a restart (appendonly no, save ""): a message acked at claim '
            f"lives on only there. Give it AOF (appendonly yes, appendfsync everysec or "
            f"always) or RDB snapshots, or leave claims_ack_on_claim off"
        )
    return None


def _config(client: Any, name: str) -> Any:
    """One ``CONFIG GET`` value (a Cluster asks one node: they are set alike)."""
    reply = client.config_get(name)
    if isinstance(reply, dict) and name not in reply and reply:
        reply = next(iter(reply.values()))  # RedisCluster: {node: {name: value}}
    return reply.get(name, "") if isinstance(reply, dict) else ""
