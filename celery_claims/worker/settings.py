"""The ``claims_*`` settings: read once at worker start into a frozen dataclass, validated.

Every setting is a lower-case ``claims_*`` key read with ``app.conf.get(key, default)`` (not
``app.add_defaults``, which would shadow Django-style ``CELERY_CLAIMS_*`` values), and most of
them can also be given on the ``celery worker`` command line (``--claims-lease-ms 30000``); a
command-line value wins over the configuration. ``docs/settings.md`` documents each key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click

from celery_claims.claims.keys import DEFAULT_PREFIX, require_prefix
from celery_claims.errors import InvalidArgument

__all__ = [
    "DEFAULT_CLEANUP_INTERVAL_S",
    "DEFAULT_CLEANUP_LIMIT",
    "DEFAULT_DONE_TTL_MS",
    "DEFAULT_HELD_RECHECK_MS",
    "DEFAULT_LANE_RECHECK_MS",
    "DEFAULT_LEASE_MS",
    "DEFAULT_METRICS_PORTS",
    "DEFAULT_RENEW_INTERVAL_MS",
    "DEFAULT_SOCKET_TIMEOUT_MS",
    "DEFAULT_UNAVAILABLE_RETRY_MAX_MS",
    "DEFAULT_UNAVAILABLE_RETRY_MS",
    "ClaimsSettings",
    "LaneSpec",
    "add_worker_options",
    "load_settings",
    "parse_ports",
]

#: Lease of a claim: how long a crashed worker's task stays held before another takes it over.
DEFAULT_LEASE_MS = 60_000
#: How often the lease keeper renews every live claim of the worker (one round trip per queue).
DEFAULT_RENEW_INTERVAL_MS = 15_000
#: How long a completion record is kept, so later copies of a finished task are acked unrun.
DEFAULT_DONE_TTL_MS = 24 * 3600 * 1000
#: How often a copy held because another worker's lease is live is checked again.
DEFAULT_HELD_RECHECK_MS = 5_000
#: First retry delay for a copy held because the claim store is unreachable (then doubled).
DEFAULT_UNAVAILABLE_RETRY_MS = 1_000
#: Ceiling of that retry delay.
DEFAULT_UNAVAILABLE_RETRY_MAX_MS = 30_000
#: Socket connect/read timeout of the claim store client (the gate runs in the event loop).
DEFAULT_SOCKET_TIMEOUT_MS = 5_000
#: How often a worker re-checks a lane that is full while it holds messages waiting for it.
DEFAULT_LANE_RECHECK_MS = 1_000
#: Longest a claimed copy may wait in the pool without starting before it is given up, ms.
DEFAULT_START_TIMEOUT_MS = 300_000
#: Takeovers of one attempt after which it is given up as a poison task (its workers crash).
DEFAULT_MAX_TAKEOVERS = 3
#: Seconds between two ``celery_claims.cleanup_expired`` runs sent by beat.
DEFAULT_CLEANUP_INTERVAL_S = 300.0
#: Most expired claims one ``celery_claims.cleanup_expired`` run removes.
DEFAULT_CLEANUP_LIMIT = 10_000
#: Ports a worker's metrics exporter (``install_metrics``) may listen on: it takes the first
#: free one, so up to ten workers of one host each export on a port of their own.
DEFAULT_METRICS_PORTS = (9808, 9817)

#: Upper bound of every millisecond setting (about 24 days), far above any sane lease.
_MAX_MS = 2**31 - 1
#: Smallest renew interval accepted: anything shorter would hammer the claim store.
_MIN_RENEW_INTERVAL_MS = 50

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

#: Longest lane name: it becomes a Redis hash tag and a lane kind, which the store caps.
_MAX_LANE_NAME = 200


@dataclass(frozen=True)
class LaneSpec:
    """One lane of ``claims_lanes``: a fleet-wide limit on tasks of some Celery queues.

    Attributes:
        name: the lane's name (its key in ``claims_lanes``; names its keys in the store).
        queues: the queues whose messages are in the lane.
        limit: how many of the lane's tasks may run at once across the fleet (0 pauses it).
        kinds: the task names in the lane, or ``None`` for every task of ``queues``.
    """

    name: str
    queues: tuple[str, ...]
    limit: int
    kinds: frozenset[str] | None = None

    def covers(self, queue: str, task_name: str) -> bool:
        """Whether a message of ``task_name`` delivered from ``queue`` is in this lane."""
        return queue in self.queues and (self.kinds is None or task_name in self.kinds)


@dataclass(frozen=True)
class ClaimsSettings:
    """The validated ``claims_*`` settings of one worker (or one beat/cleanup run).

    Attributes:
        redis_url: URL of the claim store (``claims_redis_url``).
        prefix: first part of every claim key (``claims_prefix``).
        lease_ms: lease of a claim (``claims_lease_ms``).
        renew_interval_ms: lease keeper period (``claims_renew_interval_ms``).
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
        metrics_ports: (first, last) ports the worker's metrics exporter tries in turn,
            taking the first free one (``claims_metrics_port``: a port, ``"first-last"``, or
            0 for any free port); read by :func:`celery_claims.metrics.install_metrics`.
    """

    redis_url: str
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
    metrics_ports: tuple[int, int] = DEFAULT_METRICS_PORTS

    def check_task_lease(self, task_name: str, lease_ms: object) -> int:
        """Validate a per-task ``claims_lease_ms`` attribute against the renew interval.

        Raises:
            InvalidArgument: the lease is not an int in range, or not above two renew intervals.
        """
        key = f"{task_name}.claims_lease_ms"
        value = _ms(key, lease_ms, minimum=1)
        if value <= 2 * self.renew_interval_ms:
            raise InvalidArgument(
                key,
                f"{value} ms must be more than twice claims_renew_interval_ms "
                f"({self.renew_interval_ms} ms), or one late renewal would lose the lease",
            )
        return value


#: (setting, CLI type, help) of the settings reachable as ``celery worker`` options.
_WORKER_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("claims_redis_url", str, "URL of the claim store (default: the broker URL if Redis)."),
    ("claims_prefix", str, "Prefix of every claim key."),
    ("claims_lease_ms", int, "Lease of a claim in ms."),
    ("claims_renew_interval_ms", int, "Lease keeper period in ms."),
    ("claims_done_ttl_ms", int, "Retention of completion records in ms."),
    ("claims_held_recheck_ms", int, "Re-check period of a copy held by another lease, ms."),
    ("claims_unavailable_retry_ms", int, "First retry delay while the claim store is down, ms."),
    ("claims_unavailable_retry_max_ms", int, "Ceiling of that retry delay, ms."),
    ("claims_socket_timeout_ms", int, "Claim store socket timeouts in ms."),
    ("claims_lane_recheck_ms", int, "Re-check period of a full lane, ms."),
    ("claims_strict_settings", bool, "Refuse to start on an unsafe Celery setting."),
    ("claims_start_timeout_ms", int, "Give up a claimed copy the pool has not started, ms."),
    ("claims_max_takeovers", int, "Takeovers of one attempt before it is given up (-1: never)."),
    ("claims_metrics_port", str, "Metrics exporter port, FIRST-LAST range, or 0 (any free)."),
)

#: Names of the settings a worker command-line option can override.
WORKER_OPTION_NAMES = frozenset(name for name, _, _ in _WORKER_OPTIONS)


def add_worker_options(app: Any) -> None:
    """Add ``--claims-*`` options to ``celery worker`` (their values reach the bootsteps).

    Idempotent: an option whose name is already registered is not added again.
    """
    existing = {getattr(opt, "name", None) for opt in app.user_options["worker"]}
    for name, type_, help_text in _WORKER_OPTIONS:
        if name in existing:
            continue
        flag = "--" + name.replace("_", "-")
        app.user_options["worker"].add(
            click.Option([flag, name], type=type_, default=None, help=help_text)
        )


def _ms(key: str, value: object, *, minimum: int = 0) -> int:
    # bool is an int subclass: ``claims_lease_ms = True`` is a mistake, not one millisecond
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(key, f"must be an int number of milliseconds, got {value!r:.80}")
    if not minimum <= value <= _MAX_MS:
        raise InvalidArgument(key, f"must be between {minimum} and {_MAX_MS} ms, got {value}")
    return value


def _default_redis_url(conf: Any) -> str:
    broker = conf.get("broker_url")
    if isinstance(broker, str):
        # a failover list "redis://a;redis://b": the claim store is the first one
        first = broker.split(";")[0].strip()
        if first.startswith(_REDIS_SCHEMES):
            return first
    raise InvalidArgument(
        "claims_redis_url",
        f"is required when the broker is not Redis (broker_url is {_scheme(broker)}...); "
        "set it in the configuration or pass --claims-redis-url",
    )


def _scheme(url: object) -> str:
    # never echo credentials from a URL into an error message
    if isinstance(url, str) and "://" in url:
        return url.split("://", 1)[0] + "://"
    return repr(url)


def load_settings(app: Any, overrides: Mapping[str, Any] | None = None) -> ClaimsSettings:
    """Read and validate the ``claims_*`` settings of ``app``.

    Args:
        app: the Celery app.
        overrides: values from the worker command line (``None`` values are ignored).

    Returns:
        The frozen settings.

    Raises:
        InvalidArgument: a setting is missing or invalid; ``name`` is the setting's key.
    """
    conf = app.conf
    given = {k: v for k, v in (overrides or {}).items() if v is not None}

    def get(key: str, default: Any) -> Any:
        return given[key] if key in given else conf.get(key, default)

    url = get("claims_redis_url", None)
    if url is None:
        url = _default_redis_url(conf)
    if not isinstance(url, str) or not url.startswith(_REDIS_SCHEMES):
        raise InvalidArgument(
            "claims_redis_url",
            f"must be a redis://, rediss:// or unix:// URL, got {_scheme(url)}...",
        )
    try:
        prefix = require_prefix(get("claims_prefix", DEFAULT_PREFIX))
    except InvalidArgument as exc:
        raise InvalidArgument("claims_prefix", str(exc).split(": ", 1)[-1]) from None

    lease = _ms("claims_lease_ms", get("claims_lease_ms", DEFAULT_LEASE_MS), minimum=1)
    renew = _ms(
        "claims_renew_interval_ms",
        get("claims_renew_interval_ms", DEFAULT_RENEW_INTERVAL_MS),
        minimum=_MIN_RENEW_INTERVAL_MS,
    )
    # a lease must survive one late or failed renewal: the keeper guarantees
    # remaining >= lease - 2 * interval, which must stay positive
    if 2 * renew >= lease:
        raise InvalidArgument(
            "claims_renew_interval_ms",
            f"{renew} ms must be less than half of claims_lease_ms ({lease} ms)",
        )
    retry = _ms(
        "claims_unavailable_retry_ms",
        get("claims_unavailable_retry_ms", DEFAULT_UNAVAILABLE_RETRY_MS),
        minimum=1,
    )
    retry_max = _ms(
        "claims_unavailable_retry_max_ms",
        get("claims_unavailable_retry_max_ms", DEFAULT_UNAVAILABLE_RETRY_MAX_MS),
        minimum=1,
    )
    if retry_max < retry:
        raise InvalidArgument(
            "claims_unavailable_retry_max_ms",
            f"{retry_max} ms is less than claims_unavailable_retry_ms ({retry} ms)",
        )
    refresh = get("claims_refresh_unacked", True)
    if not isinstance(refresh, bool):
        raise InvalidArgument("claims_refresh_unacked", f"must be a bool, got {refresh!r:.80}")
    interval = get("claims_cleanup_interval_s", DEFAULT_CLEANUP_INTERVAL_S)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        raise InvalidArgument(
            "claims_cleanup_interval_s", f"must be a positive number of seconds, got {interval!r}"
        )
    limit = get("claims_cleanup_limit", DEFAULT_CLEANUP_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument("claims_cleanup_limit", f"must be a positive int, got {limit!r}")

    strict = get("claims_strict_settings", False)
    if not isinstance(strict, bool):
        raise InvalidArgument("claims_strict_settings", f"must be a bool, got {strict!r:.80}")

    start_timeout = _ms(
        "claims_start_timeout_ms",
        get("claims_start_timeout_ms", DEFAULT_START_TIMEOUT_MS),
        minimum=1,
    )
    if start_timeout < lease:
        # the pool process checks its claim with the store only once the lease handed to it
        # may have run out: a copy given up sooner could still start unchecked
        raise InvalidArgument(
            "claims_start_timeout_ms",
            f"{start_timeout} ms must be at least claims_lease_ms ({lease} ms)",
        )
    max_takeovers = get("claims_max_takeovers", DEFAULT_MAX_TAKEOVERS)
    if max_takeovers is not None and (
        isinstance(max_takeovers, bool) or not isinstance(max_takeovers, int) or max_takeovers < -1
    ):
        raise InvalidArgument(
            "claims_max_takeovers",
            f"must be None, -1 (never give up) or a non-negative int, got {max_takeovers!r:.80}",
        )
    if max_takeovers == -1:
        max_takeovers = None

    return ClaimsSettings(
        metrics_ports=parse_ports(get("claims_metrics_port", DEFAULT_METRICS_PORTS)),
        redis_url=url,
        prefix=prefix,
        lease_ms=lease,
        renew_interval_ms=renew,
        done_ttl_ms=_ms(
            "claims_done_ttl_ms", get("claims_done_ttl_ms", DEFAULT_DONE_TTL_MS), minimum=1
        ),
        held_recheck_ms=_ms(
            "claims_held_recheck_ms",
            get("claims_held_recheck_ms", DEFAULT_HELD_RECHECK_MS),
            minimum=10,
        ),
        unavailable_retry_ms=retry,
        unavailable_retry_max_ms=retry_max,
        socket_timeout_ms=_ms(
            "claims_socket_timeout_ms",
            get("claims_socket_timeout_ms", DEFAULT_SOCKET_TIMEOUT_MS),
            minimum=10,
        ),
        refresh_unacked=refresh,
        cleanup_interval_s=float(interval),
        cleanup_limit=limit,
        lanes=parse_lanes(get("claims_lanes", None)),
        lane_recheck_ms=_ms(
            "claims_lane_recheck_ms",
            get("claims_lane_recheck_ms", DEFAULT_LANE_RECHECK_MS),
            minimum=10,
        ),
        strict_settings=strict,
        start_timeout_ms=start_timeout,
        max_takeovers=max_takeovers,
    )


def parse_ports(raw: object, *, key: str = "claims_metrics_port") -> tuple[int, int]:
    """Validate a metrics port setting into ``(first, last)``.

    Accepts a port (``9808``; ``0`` is any free port), a range ``"9808-9817"`` or
    ``(9808, 9817)``, and a port given as text (from the command line).

    Raises:
        InvalidArgument: anything else; ``name`` is ``key``.
    """
    value: object = raw
    if isinstance(value, str):
        text = value.strip()
        first, sep, last = text.partition("-")
        try:
            value = (int(first), int(last)) if sep else int(text)
        except ValueError:
            value = raw
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(p, int) and not isinstance(p, bool) for p in value)
        and 0 <= value[0] <= value[1] <= 65535
        and (value[0] > 0 or value[1] == 0)
    ):
        return int(value[0]), int(value[1])
    raise InvalidArgument(
        key,
        f"must be a port (0 for any free one), or a range 'first-last' of ports from 1 to "
        f"65535, got {raw!r:.80}",
    )


def _names(where: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise InvalidArgument("claims_lanes", f"{where} must be a list of names, got {value!r:.80}")
    names = tuple(value)
    if not names:
        raise InvalidArgument("claims_lanes", f"{where} must not be empty")
    for name in names:
        if not isinstance(name, str) or not name or "\x00" in name:
            raise InvalidArgument(
                "claims_lanes", f"{where} must hold non-empty names, got {name!r:.80}"
            )
    return tuple(dict.fromkeys(names))


def parse_lanes(raw: object) -> tuple[LaneSpec, ...]:
    """Validate ``claims_lanes`` into lane specs.

    The setting maps a lane name to ``{"queues": [...], "limit": n}`` and an optional
    ``"kinds": [task names]``. A message may belong to one lane at most: two lanes that
    share a queue must list disjoint kinds.

    Raises:
        InvalidArgument: the value is malformed; ``name`` is ``claims_lanes`` and the message
            says which lane and which field.
    """
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise InvalidArgument(
            "claims_lanes", f"must be a dict of lane name -> settings, got {raw!r:.80}"
        )
    lanes: list[LaneSpec] = []
    for name, spec in raw.items():
        if not isinstance(name, str) or not name or len(name) > _MAX_LANE_NAME or "\x00" in name:
            raise InvalidArgument(
                "claims_lanes",
                f"lane names must be non-empty strings of at most {_MAX_LANE_NAME} "
                f"characters, got {name!r:.80}",
            )
        if not isinstance(spec, Mapping):
            raise InvalidArgument("claims_lanes", f"lane {name!r} must be a dict, got {spec!r:.80}")
        unknown = sorted(set(spec) - {"queues", "limit", "kinds"})
        if unknown:
            raise InvalidArgument(
                "claims_lanes",
                f"lane {name!r} has unknown keys {unknown}; use queues, limit and kinds",
            )
        if "queues" not in spec or "limit" not in spec:
            raise InvalidArgument("claims_lanes", f"lane {name!r} needs 'queues' and 'limit'")
        queues = _names(f"lane {name!r} queues", spec["queues"])
        limit = spec["limit"]
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= 1_000_000:
            raise InvalidArgument(
                "claims_lanes",
                f"lane {name!r} limit must be an int from 0 to 1000000, got {limit!r:.80}",
            )
        kinds = spec.get("kinds")
        lanes.append(
            LaneSpec(
                name,
                queues,
                limit,
                None if kinds is None else frozenset(_names(f"lane {name!r} kinds", kinds)),
            )
        )
    for i, first in enumerate(lanes):
        for second in lanes[i + 1 :]:
            shared = sorted(set(first.queues) & set(second.queues))
            if not shared:
                continue
            if first.kinds is None or second.kinds is None or first.kinds & second.kinds:
                raise InvalidArgument(
                    "claims_lanes",
                    f"lanes {first.name!r} and {second.name!r} both cover queue "
                    f"{shared[0]!r}: a message may be in one lane only; give them disjoint "
                    f"kinds",
                )
    return tuple(lanes)
