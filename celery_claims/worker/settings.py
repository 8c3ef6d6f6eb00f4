"""The ``claims_*`` settings of a worker: read once at start into a frozen dataclass, validated.

The settings are declared in one table, :data:`celery_claims.config.SETTINGS`: how each is
validated, defaulted (a setting the user did not give follows those they did) and documented.
This module makes the worker's view of it: :class:`ClaimsSettings` (one attribute per row),
:func:`load_settings`, and the ``celery worker`` options (``--claims-lease-ms 30000``; a
command-line value wins over the configuration). ``docs/settings.md`` documents each key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import click

from celery_claims.claims.keys import DEFAULT_PREFIX
from celery_claims.config import (
    DEFAULT_CLEANUP_INTERVAL_S,
    DEFAULT_CLEANUP_LIMIT,
    DEFAULT_DONE_TTL_MS,
    DEFAULT_HELD_RECHECK_MS,
    DEFAULT_JOURNAL_MAX_REPUBLISH,
    DEFAULT_JOURNAL_RECOVER_AFTER_MS,
    DEFAULT_JOURNAL_SCAN_INTERVAL_MS,
    DEFAULT_LANE_RECHECK_MS,
    DEFAULT_LEASE_MS,
    DEFAULT_MAX_TAKEOVERS,
    DEFAULT_METRICS_PORTS,
    DEFAULT_RENEW_INTERVAL_MS,
    DEFAULT_SOCKET_TIMEOUT_MS,
    DEFAULT_START_TIMEOUT_MS,
    DEFAULT_UNAVAILABLE_RETRY_MAX_MS,
    DEFAULT_UNAVAILABLE_RETRY_MS,
    MIN_RENEW_INTERVAL_MS,
    RENEWALS_PER_LEASE,
    SETTINGS,
    LaneSpec,
    parse_lanes,
    parse_ports,
    resolve,
    setting,
)
from celery_claims.connection import OPTIONS as CLIENT_OPTIONS
from celery_claims.connection import parse as parse_store
from celery_claims.errors import InvalidArgument

__all__ = [
    "DEFAULT_CLEANUP_INTERVAL_S",
    "DEFAULT_CLEANUP_LIMIT",
    "DEFAULT_DONE_TTL_MS",
    "DEFAULT_HELD_RECHECK_MS",
    "DEFAULT_LANE_RECHECK_MS",
    "DEFAULT_LEASE_MS",
    "DEFAULT_RENEW_INTERVAL_MS",
    "DEFAULT_SOCKET_TIMEOUT_MS",
    "DEFAULT_UNAVAILABLE_RETRY_MAX_MS",
    "DEFAULT_UNAVAILABLE_RETRY_MS",
    "WORKER_OPTION_NAMES",
    "ClaimsSettings",
    "LaneSpec",
    "SettingRefused",
    "add_worker_options",
    "load_settings",
    "parse_lanes",
    "parse_ports",
]


@dataclass(frozen=True)
class ClaimsSettings:
    """The validated ``claims_*`` settings of one worker (or one beat/cleanup run).

    Attributes:
        redis_url: URL of the claim store (``claims_redis_url``).
        redis_options: client options of the claim store (``claims_redis_options``; see
            :mod:`celery_claims.connection`).
        redis_cluster: the claim store is a Redis Cluster (``claims_redis_cluster``).
        prefix: first part of every claim key (``claims_prefix``).
        lease_ms: lease of a claim (``claims_lease_ms``).
        renew_interval_ms: lease keeper period (``claims_renew_interval_ms``; derived from the
            lease when not given).
        done_ttl_ms: retention of completion records (``claims_done_ttl_ms``).
        held_recheck_ms: re-check period of a copy held by another lease
            (``claims_held_recheck_ms``).
        unavailable_retry_ms: first retry delay while the store is down
            (``claims_unavailable_retry_ms``).
        unavailable_retry_max_ms: ceiling of that delay (``claims_unavailable_retry_max_ms``).
        socket_timeout_ms: claim store socket timeouts (``claims_socket_timeout_ms``).
        refresh_unacked: refresh kombu's ``unacked_index`` scores of claimed and held Redis
            deliveries (``claims_refresh_unacked``).
        cleanup_interval_s: beat period of ``celery_claims.cleanup_expired``
            (``claims_cleanup_interval_s``).
        cleanup_limit: most claims one cleanup run removes (``claims_cleanup_limit``).
        lanes: the fleet-wide lanes (``claims_lanes``).
        lane_recheck_ms: re-check period of a full lane (``claims_lane_recheck_ms``).
        strict_settings: refuse to start when the unsafe-settings check finds anything
            (``claims_strict_settings``).
        start_timeout_ms: a claimed copy the pool has not started within this is given up:
            its claim is released and its message handed back to the broker
            (``claims_start_timeout_ms``; at least ``claims_lease_ms``).
        max_takeovers: takeovers of one attempt before it is given up as poison
            (``claims_max_takeovers``; ``None``: never).
        metrics_port: (first, last) ports the worker's metrics exporter tries in turn,
            taking the first free one (``claims_metrics_port``: a port, ``"first-last"``, or
            0 for any free port); read by :func:`celery_claims.metrics.install_metrics`.
        journal: journal published messages and recover lost ones (``claims_journal``).
        journal_recover_after_ms: when a journaled message not done nor claimed is
            re-published (``claims_journal_recover_after_ms``).
        journal_scan_interval_ms: period of the recovery scan
            (``claims_journal_scan_interval_ms``).
        journal_max_republish: re-publishes of one message before it is dropped
            (``claims_journal_max_republish``).
        ack_on_claim: acknowledge each message once its claim is taken, its publish journal
            entry then its durable copy (``claims_ack_on_claim``; a task attribute wins).
        key_conflict: what a keyed task's message does while its key is held
            (``claims_key_conflict``: ``wait``, ``skip`` or ``reschedule``).
        key_reschedule_max: most reschedules of one keyed message (``reschedule`` policy).
        key_reschedule_s: countdown of a rescheduled keyed message.
        rate_limit_fleetwide: Celery's ``rate_limit`` is a fleet-wide rate, not the worker's
            token bucket (``claims_rate_limit_fleetwide``).
    """

    redis_url: str
    redis_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    redis_cluster: bool = False
    prefix: str = DEFAULT_PREFIX
    lease_ms: int = DEFAULT_LEASE_MS
    renew_interval_ms: int = DEFAULT_RENEW_INTERVAL_MS
    done_ttl_ms: int = DEFAULT_DONE_TTL_MS
    held_recheck_ms: int = DEFAULT_HELD_RECHECK_MS
    unavailable_retry_ms: int = DEFAULT_UNAVAILABLE_RETRY_MS
    unavailable_retry_max_ms: int = DEFAULT_UNAVAILABLE_RETRY_MAX_MS
    socket_timeout_ms: int = DEFAULT_SOCKET_TIMEOUT_MS
    refresh_unacked: bool = True
    cleanup_interval_s: float = DEFAULT_CLEANUP_INTERVAL_S
    cleanup_limit: int = DEFAULT_CLEANUP_LIMIT
    lanes: tuple[LaneSpec, ...] = ()
    lane_recheck_ms: int = DEFAULT_LANE_RECHECK_MS
    strict_settings: bool = False
    start_timeout_ms: int = DEFAULT_START_TIMEOUT_MS
    max_takeovers: int | None = DEFAULT_MAX_TAKEOVERS
    metrics_port: tuple[int, int] = DEFAULT_METRICS_PORTS
    journal: bool = True
    journal_recover_after_ms: int = DEFAULT_JOURNAL_RECOVER_AFTER_MS
    journal_scan_interval_ms: int = DEFAULT_JOURNAL_SCAN_INTERVAL_MS
    journal_max_republish: int = DEFAULT_JOURNAL_MAX_REPUBLISH
    ack_on_claim: bool = False
    key_conflict: str = "wait"
    key_reschedule_max: int = 3
    key_reschedule_s: float = 5.0
    rate_limit_fleetwide: bool = False

    def renew_interval_for(self, lease_ms: int) -> int:
        """How often a claim of ``lease_ms`` is renewed, in ms.

        The keeper's period when the lease survives two of them (as ``claims_lease_ms``
        must); otherwise, for a shorter per-task ``claims_lease_ms``, a quarter of the lease.
        """
        if 2 * self.renew_interval_ms < lease_ms:
            return self.renew_interval_ms
        return lease_ms // RENEWALS_PER_LEASE

    def check_task_lease(self, task_name: str, lease_ms: object) -> int:
        """Validate a per-task ``claims_lease_ms`` attribute.

        Any lease the keeper can renew in time is accepted: a claim whose lease is not above
        two keeper periods is renewed every quarter of its lease (:meth:`renew_interval_for`).

        Raises:
            InvalidArgument: the lease is not an int in range, or too short to renew.
        """
        key = f"{task_name}.claims_lease_ms"
        value: int = setting("claims_lease_ms").parse(key, lease_ms)
        if self.renew_interval_for(value) < MIN_RENEW_INTERVAL_MS:
            raise InvalidArgument(
                key,
                f"{value} ms is too short to renew: its claim is renewed every lease / "
                f"{RENEWALS_PER_LEASE} and at most every {MIN_RENEW_INTERVAL_MS} ms; use at "
                f"least {MIN_RENEW_INTERVAL_MS * RENEWALS_PER_LEASE} ms",
            )
        return value


class SettingRefused(InvalidArgument, click.ClickException):
    """A ``claims_*`` setting that stops a worker from starting.

    An :class:`InvalidArgument` (``name`` is the setting) that ``celery worker`` prints as one
    line, ``Error: claims_lease_ms: ...``, and exits 1, instead of a traceback: click shows
    its own exceptions that way.
    """

    def __init__(self, name: str, message: str) -> None:
        InvalidArgument.__init__(self, name, message)
        # click's half (its __init__ would reset args through the shared Exception base)
        self.message = f"{name}: {message}"
        self.show_color = None

    @classmethod
    def of(cls, error: InvalidArgument) -> SettingRefused:
        """The refusal for ``error`` (same name and message)."""
        return cls(error.name, str(error).removeprefix(f"{error.name}: "))


#: Names of the settings a worker command-line option can override.
WORKER_OPTION_NAMES = frozenset(row.key for row in SETTINGS if row.option is not None)


def add_worker_options(app: Any) -> None:
    """Add ``--claims-*`` options to ``celery worker`` (their values reach the bootsteps).

    Idempotent: an option whose name is already registered is not added again.
    """
    existing = {getattr(opt, "name", None) for opt in app.user_options["worker"]}
    for row in SETTINGS:
        if row.option is None or row.key in existing:
            continue
        app.user_options["worker"].add(
            click.Option([row.flag, row.key], type=row.option, default=None, help=row.option_help)
        )


def load_settings(app: Any, overrides: Mapping[str, Any] | None = None) -> ClaimsSettings:
    """Read and validate the ``claims_*`` settings of ``app`` (see :mod:`celery_claims.config`).

    Args:
        app: the Celery app.
        overrides: values from the worker command line (``None`` values are ignored).

    Returns:
        The frozen settings.

    Raises:
        InvalidArgument: a setting is missing or invalid; ``name`` is the setting's key (the
            one the user gave, never one derived from it).
    """
    conf = app.conf
    values = resolve(conf, overrides)
    url = values["claims_redis_url"]
    options = dict(values["claims_redis_options"])
    given_url = (overrides or {}).get("claims_redis_url") or conf.get("claims_redis_url")
    if given_url is None:
        _broker_options(conf, url, options)
    # the URL and the client options together, checked here at worker start, never on the
    # first task
    parse_store(
        url,
        options,
        cluster=values["claims_redis_cluster"],
        url_name="claims_redis_url",
        options_name="claims_redis_options",
    )
    values["claims_redis_options"] = MappingProxyType(options)
    return ClaimsSettings(**{row.attr: values[row.key] for row in SETTINGS})


#: Keys of ``broker_transport_options`` a default Sentinel store takes over from the broker.
_BROKER_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")


def _broker_options(conf: Any, url: str, options: dict[str, Any]) -> None:
    """Complete a default store's options from the broker's own (Sentinel master, TLS)."""
    if url.startswith("sentinel://"):
        transport = conf.get("broker_transport_options") or {}
        for key in _BROKER_OPTIONS:
            if key in transport:
                options.setdefault(key, transport[key])
    use_ssl = conf.get("broker_use_ssl")
    if url.startswith("rediss://") and isinstance(use_ssl, Mapping):
        for key, value in use_ssl.items():
            if key in CLIENT_OPTIONS and key.startswith("ssl_"):
                options.setdefault(key, value)
