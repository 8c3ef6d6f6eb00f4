"""The ``claims_*`` settings, declared once: one :class:`Setting` row each in :data:`SETTINGS`.

A row says how its setting is validated, what it defaults to (a constant, or a value derived
from the settings the user did give), how the reference documents it, and whether it is also a
``celery worker`` option. Everything else is made from the table:

- the worker's frozen settings object
  (:func:`celery_claims.worker.settings.load_settings`, one attribute per row: the key without
  ``claims_``) and its ``--claims-*`` options;
- the reading of the lease in the unsafe-settings check (:mod:`celery_claims.safety`) and of
  the cleanup period in the beat schedule;
- the reference table of ``docs/settings.md`` (:func:`reference`; a test checks that the file
  matches it; ``python -m celery_claims.config docs/settings.md`` rewrites it).

A setting the user did not give follows those they did: the renew interval is derived from the
lease, the start timeout is never shorter than the lease, the retry ceiling never below the
first retry. A value the user gave that cannot work is refused with an error naming that
setting. Adding a setting is adding a row (and the attribute to ``ClaimsSettings``).

Settings are read with ``conf.get(key, ...)`` (not ``app.add_defaults``, which would shadow
Django-style ``CELERY_CLAIMS_*`` values). This module imports neither Celery nor click.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from celery_claims.claims.keys import DEFAULT_PREFIX, require_prefix
from celery_claims.connection import SCHEMES, describe
from celery_claims.errors import InvalidArgument
from celery_claims.rates.model import Rate, parse_rate

__all__ = [
    "DEFAULT_CLEANUP_INTERVAL_S",
    "DEFAULT_CLEANUP_LIMIT",
    "DEFAULT_DONE_TTL_MS",
    "DEFAULT_HELD_RECHECK_MS",
    "DEFAULT_JOURNAL_MAX_REPUBLISH",
    "DEFAULT_JOURNAL_RECOVER_AFTER_MS",
    "DEFAULT_JOURNAL_SCAN_INTERVAL_MS",
    "DEFAULT_LANE_RECHECK_MS",
    "DEFAULT_LEASE_MS",
    "DEFAULT_MAX_TAKEOVERS",
    "DEFAULT_METRICS_PORTS",
    "DEFAULT_RENEW_INTERVAL_MS",
    "DEFAULT_SOCKET_TIMEOUT_MS",
    "DEFAULT_START_TIMEOUT_MS",
    "DEFAULT_UNAVAILABLE_RETRY_MAX_MS",
    "DEFAULT_UNAVAILABLE_RETRY_MS",
    "MIN_RENEW_INTERVAL_MS",
    "RENEWALS_PER_LEASE",
    "SETTINGS",
    "LaneSpec",
    "Setting",
    "LANE_KEYS",
    "NAMESPACE",
    "broker_url",
    "closest",
    "derived_renew_interval_ms",
    "parse_lanes",
    "parse_ports",
    "reference",
    "resolve",
    "setting",
    "write_reference",
]

#: Lease of a claim: how long a crashed worker's task stays held before another takes it over.
DEFAULT_LEASE_MS = 60_000
#: Longest period of the lease keeper (one round trip per queue) when the lease allows it.
DEFAULT_RENEW_INTERVAL_MS = 15_000
#: How long a completion record is kept, so later copies of a finished task are acked unrun.
DEFAULT_DONE_TTL_MS = 24 * 3600 * 1000
#: How often a copy held because another worker's lease is live is checked again.
DEFAULT_HELD_RECHECK_MS = 5_000
#: First retry delay for a copy held because the claim store is unreachable (then doubled).
DEFAULT_UNAVAILABLE_RETRY_MS = 1_000
#: Ceiling of that retry delay (raised to the first delay when that is set higher).
DEFAULT_UNAVAILABLE_RETRY_MAX_MS = 30_000
#: Socket connect/read timeout of the claim store client (the gate runs in the event loop).
DEFAULT_SOCKET_TIMEOUT_MS = 5_000
#: How often a worker re-checks a lane that is full while it holds messages waiting for it.
DEFAULT_LANE_RECHECK_MS = 1_000
#: Longest a claimed copy may wait in the pool without starting (raised to the lease).
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
#: How long after its publish (or its ETA) a journaled message may be re-published if its
#: task is neither done nor claimed: far above the lease and the visibility timeout.
DEFAULT_JOURNAL_RECOVER_AFTER_MS = 600_000
#: How often a worker looks for journaled messages to recover (each queue it consumes).
DEFAULT_JOURNAL_SCAN_INTERVAL_MS = 30_000
#: Re-publishes of one journaled message before recovery gives it up (and says so).
DEFAULT_JOURNAL_MAX_REPUBLISH = 3

#: Renewals per lease when the renew interval is derived from it: the remaining lease of a
#: running task stays above ``lease - 2 x interval``, half the lease with 4.
RENEWALS_PER_LEASE = 4
#: Smallest renew interval: anything shorter would hammer the claim store.
MIN_RENEW_INTERVAL_MS = 50

#: Upper bound of every millisecond setting (about 24 days), far above any sane lease.
_MAX_MS = 2**31 - 1
#: Broker URL schemes whose server can be the default claim store (kombu's Redis transports).
_BROKER_SCHEMES = ("redis://", "rediss://", "unix://", "redis+socket://", "sentinel://")
#: Longest lane name: it becomes a Redis hash tag and a lane kind, which the store caps.
_MAX_LANE_NAME = 200

_UNSET: Any = object()

#: ``(given value, settings resolved so far)`` -> a refusal message, or None when it is fine.
Check = Callable[[Any, Mapping[str, Any]], "str | None"]
#: ``(resolved settings so far, conf)`` -> the default of a setting the user did not give.
Derive = Callable[[Mapping[str, Any], Any], Any]


@dataclass(frozen=True)
class Setting:
    """One ``claims_*`` setting: how it is read, defaulted, documented and offered.

    Attributes:
        key: the configuration key (``claims_lease_ms``); the settings object's attribute is
            the key without ``claims_``.
        parse: validates a given value: ``parse(key, value)`` returns the value to use or
            raises :class:`InvalidArgument` naming ``key``.
        default: the value when the setting is not given (``derive`` may adjust it).
        meaning: the reference's description (Markdown).
        unit: the reference's unit column (``ms``, ``s``, ``bool``...).
        default_doc: the reference's default column, when ``default`` alone does not say it.
        needs: settings read by ``derive`` or ``check``; they are resolved first.
        derive: computes the default from the settings resolved before it.
        check: refuses a given value that conflicts with the settings resolved before it.
        option: the type of its ``celery worker`` option (``str``, ``int``, ``bool``), or None
            when it is read from the configuration only.
        option_help: the option's ``--help`` text.
        nullable: ``None`` is a value of this setting (handed to ``parse``); elsewhere a
            ``None`` value counts as not given.
    """

    key: str
    parse: Callable[[str, Any], Any]
    default: Any
    meaning: str
    unit: str = ""
    default_doc: str = ""
    needs: tuple[str, ...] = ()
    derive: Derive | None = None
    check: Check | None = None
    option: type | None = None
    option_help: str = ""
    nullable: bool = False

    @property
    def attr(self) -> str:
        """The settings object's attribute: the key without ``claims_``."""
        return self.key.removeprefix("claims_")

    @property
    def flag(self) -> str:
        """The ``celery worker`` option (``--claims-lease-ms``)."""
        return "--" + self.key.replace("_", "-")


# --- parsers: (key, value) -> value, or InvalidArgument naming the key ---------------------


def _ms(minimum: int) -> Callable[[str, Any], int]:
    def parse(key: str, value: Any) -> int:
        # bool is an int subclass: ``claims_lease_ms = True`` is a mistake, not one millisecond
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(key, f"must be an int number of milliseconds, got {value!r:.80}")
        if not minimum <= value <= _MAX_MS:
            raise InvalidArgument(key, f"must be between {minimum} and {_MAX_MS} ms, got {value}")
        return value

    return parse


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(key, f"must be a bool, got {value!r:.80}")
    return value


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(key, f"must be a positive int, got {value!r:.80}")
    return value


def _positive_seconds(key: str, value: Any) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(key, f"must be a positive number of seconds, got {value!r:.80}")
    return float(value)


#: The conflict policies of keyed claims (``claims_key_conflict``).
KEY_CONFLICTS = ("wait", "skip", "reschedule")
#: Most reschedules ``claims_key_reschedule_max`` may allow.
_MAX_KEY_RESCHEDULES = 1000
#: Longest countdown of a rescheduled keyed copy, in seconds.
_MAX_KEY_RESCHEDULE_S = 24 * 3600


def _key_conflict(key: str, value: Any) -> str:
    if value not in KEY_CONFLICTS:
        raise InvalidArgument(key, f"must be one of {KEY_CONFLICTS}, got {value!r:.80}")
    return str(value)


def _key_reschedule_max(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(key, f"must be an int, got {value!r:.80}")
    if not 0 <= value <= _MAX_KEY_RESCHEDULES:
        raise InvalidArgument(key, f"must be between 0 and {_MAX_KEY_RESCHEDULES}, got {value}")
    return value


def _key_reschedule_s(key: str, value: Any) -> float:
    seconds = _positive_seconds(key, value)
    if seconds > _MAX_KEY_RESCHEDULE_S:
        raise InvalidArgument(key, f"must be at most {_MAX_KEY_RESCHEDULE_S} s, got {value!r}")
    return seconds


def _redis_url(key: str, value: Any) -> str:
    # the URL's own parts (host, TLS options, Sentinels) are checked with the client options
    # by celery_claims.connection.parse, once every setting is read
    if not isinstance(value, str) or not value.startswith(SCHEMES):
        raise InvalidArgument(
            key, f"must be a URL starting with one of {', '.join(SCHEMES)}; got {describe(value)}"
        )
    return value


def _redis_options(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgument(key, f"must be a dict, got {value!r:.80}")
    return MappingProxyType(dict(value))


def _prefix(key: str, value: Any) -> str:
    try:
        return require_prefix(value)
    except InvalidArgument as exc:
        raise InvalidArgument(key, str(exc).split(": ", 1)[-1]) from None


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


def _ports(key: str, value: Any) -> tuple[int, int]:
    return parse_ports(value, key=key)


def _max_takeovers(key: str, value: Any) -> int | None:
    if value is None or (type(value) is int and value == -1):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            key, f"must be None, -1 (never give up) or a non-negative int, got {value!r:.80}"
        )
    return value


# --- the broker, as Celery resolves it ------------------------------------------------------


def _first_url(value: object) -> object:
    # a failover list, "redis://a;redis://b" or ["redis://a", "redis://b"]: the first one
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if isinstance(value, str):
        return value.split(";")[0].strip()
    return value


def broker_url(conf: Any) -> str | None:
    """The URL of the broker a worker of ``conf`` consumes from, as Celery resolves it.

    On a Celery ``app.conf`` that is its ``broker_read_url``: ``CELERY_BROKER_READ_URL``,
    ``broker_read_url``, then ``broker_url`` as Celery reads it (``CELERY_BROKER_URL`` from
    the environment, which ``celery -b`` sets, before the configured one). A plain mapping
    gives its ``broker_url``. Of a failover list, the first URL.

    Returns:
        The URL, or None when no broker is configured (Celery then uses its AMQP default).
    """
    resolved = getattr(conf, "broker_read_url", None)
    if resolved is None:
        resolved = conf.get("broker_url", None)
    if isinstance(resolved, str) and resolved.startswith("sentinel://"):
        return resolved  # a list of Sentinels, "sentinel://a;sentinel://b", names one master
    first = _first_url(resolved)
    return first if isinstance(first, str) and first else None


def _store_from_broker(values: Mapping[str, Any], conf: Any) -> str:
    broker = broker_url(conf)
    if broker is not None and broker.startswith(_BROKER_SCHEMES):
        return broker
    raise InvalidArgument(
        "claims_redis_url",
        f"is required when the broker is not Redis (the broker is {describe(broker)}); "
        "set it in the configuration or pass --claims-redis-url",
    )


# --- settings that follow others -------------------------------------------------------------


def derived_renew_interval_ms(lease_ms: int) -> int:
    """The renew interval of a lease given alone: a quarter of it, at most the default.

    The result may be below :data:`MIN_RENEW_INTERVAL_MS` for a lease too short to renew;
    callers refuse such a lease.
    """
    return min(DEFAULT_RENEW_INTERVAL_MS, lease_ms // RENEWALS_PER_LEASE)


#: Shortest lease whose derived renew interval is still allowed.
_MIN_DERIVED_LEASE_MS = MIN_RENEW_INTERVAL_MS * RENEWALS_PER_LEASE


def _derived_renew(values: Mapping[str, Any], conf: Any) -> int:
    lease = values["claims_lease_ms"]
    if lease < _MIN_DERIVED_LEASE_MS:
        raise InvalidArgument(
            "claims_lease_ms",
            f"{lease} ms is too short to renew: the lease keeper renews every "
            f"lease / {RENEWALS_PER_LEASE} and at most every {MIN_RENEW_INTERVAL_MS} ms; use at "
            f"least {_MIN_DERIVED_LEASE_MS} ms (or set claims_renew_interval_ms below half of it)",
        )
    return derived_renew_interval_ms(lease)


def _renew_fits_lease(renew: int, values: Mapping[str, Any]) -> str | None:
    # a lease must survive one late or failed renewal: the keeper guarantees
    # remaining >= lease - 2 * interval, which must stay positive
    lease = values["claims_lease_ms"]
    if 2 * renew >= lease:
        return f"{renew} ms must be less than half of claims_lease_ms ({lease} ms)"
    return None


def _at_least_lease(value: int, values: Mapping[str, Any]) -> str | None:
    # the pool process checks its claim with the store only once the lease handed to it may
    # have run out: a copy given up sooner could still start unchecked
    lease = values["claims_lease_ms"]
    if value < lease:
        return f"{value} ms must be at least claims_lease_ms ({lease} ms)"
    return None


def _below_done_ttl(value: int, values: Mapping[str, Any]) -> str | None:
    # recovery tells a done task from a lost one by its completion record: an entry must be
    # looked at while that record is still kept
    ttl = values["claims_done_ttl_ms"]
    if value >= ttl:
        return f"{value} ms must be less than claims_done_ttl_ms ({ttl} ms)"
    return None


def _at_least_first_retry(value: int, values: Mapping[str, Any]) -> str | None:
    first = values["claims_unavailable_retry_ms"]
    if value < first:
        return f"{value} ms is less than claims_unavailable_retry_ms ({first} ms)"
    return None


def _needs_journal(value: bool, values: Mapping[str, Any]) -> str | None:
    # acked at claim, the message lives on only as its publish journal entry
    if value and not values["claims_journal"]:
        return (
            "needs claims_journal = True: once a message is acked at claim, its publish "
            "journal entry is its only durable copy"
        )
    return None


# --- keys ------------------------------------------------------------------------------------

#: A callable making a key value from a message's ``(args, kwargs)``.
KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], object]


def parse_key_declaration(where: str, raw: object) -> tuple[tuple[str, ...], KeyFunction | None]:
    """Validate the shape of a key declaration (``claims_key``, a keyed lane's ``key``).

    Returns:
        ``(names, None)`` for an argument name or a tuple of them, ``((), fn)`` for a callable
        of ``(args, kwargs)``.

    Raises:
        InvalidArgument: ``raw`` is none of these (``name`` is ``where``).
    """
    if isinstance(raw, str):
        names: tuple[str, ...] = (raw,)
    elif isinstance(raw, (tuple, list)) and raw and all(isinstance(n, str) for n in raw):
        names = tuple(raw)
        if len(set(names)) != len(names):
            raise InvalidArgument(where, f"names an argument twice: {raw!r:.80}")
    elif callable(raw) and not isinstance(raw, type):
        return (), raw
    else:
        raise InvalidArgument(
            where,
            f"must be an argument name, a tuple of argument names, or a callable of "
            f"(args, kwargs); got {raw!r:.80}",
        )
    for arg in names:
        if not arg.isidentifier():
            raise InvalidArgument(where, f"{arg!r:.80} is not an argument name")
    return names, None


# --- names -----------------------------------------------------------------------------------

#: The namespace of every setting and task attribute of this package (``claims`` alone is a
#: task attribute too).
NAMESPACE = "claims_"


def closest(word: str, known: Iterable[str]) -> str | None:
    """The name of ``known`` that ``word`` most resembles (:mod:`difflib`), or None.

    Names are compared without the ``claims_`` they all share: with it, any two would look
    alike.
    """
    bare = {name.removeprefix(NAMESPACE): name for name in known}
    found = difflib.get_close_matches(word.removeprefix(NAMESPACE), list(bare), n=1)
    return bare[found[0]] if found else None


# --- lanes -----------------------------------------------------------------------------------

#: The keys of one lane's dict in ``claims_lanes`` (a keyed lane has ``key`` and
#: ``limit_per_key`` too; a rated lane ``rate``, beside or instead of ``limit``).
LANE_KEYS = ("queues", "limit", "kinds", "key", "limit_per_key", "rate")


@dataclass(frozen=True)
class LaneSpec:
    """One lane of ``claims_lanes``: a fleet-wide limit on tasks of some Celery queues.

    Attributes:
        name: the lane's name (its key in ``claims_lanes``; names its keys in the store).
        queues: the queues whose messages are in the lane.
        limit: how many of the lane's tasks may run at once across the fleet (0 pauses it;
            None: no such limit, the lane has a ``rate`` only).
        kinds: the task names in the lane, or ``None`` for every task of ``queues``.
        key_names: the arguments a keyed lane's key is made of (empty with ``key_fn``).
        key_fn: the callable ``(args, kwargs) -> key value`` of a keyed lane, or None.
        limit_per_key: how many of the lane's tasks with one key may run at once across the
            fleet (0: no per-key limit).
        rate: at most this many of the lane's tasks start per period across the fleet (per
            key of ``key``, when the lane has one), or None.
    """

    name: str
    queues: tuple[str, ...]
    limit: int | None
    kinds: frozenset[str] | None = None
    key_names: tuple[str, ...] = ()
    key_fn: KeyFunction | None = None
    limit_per_key: int = 0
    rate: Rate | None = None

    @property
    def limited(self) -> bool:
        """Whether the lane limits how many of its tasks run at once (a ``limit``)."""
        return self.limit is not None

    @property
    def rate_keyed(self) -> bool:
        """Whether the lane's rate is per key (its ``key``)."""
        return self.rate is not None and (bool(self.key_names) or self.key_fn is not None)

    @property
    def keyed(self) -> bool:
        """Whether the lane has a per-key limit (``key`` and ``limit_per_key``)."""
        return self.limit_per_key > 0

    def covers(self, queue: str, task_name: str) -> bool:
        """Whether a message of ``task_name`` delivered from ``queue`` is in this lane."""
        return queue in self.queues and (self.kinds is None or task_name in self.kinds)


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
    lanes = [_lane(name, spec) for name, spec in raw.items()]
    _refuse_shared_queues(lanes)
    return tuple(lanes)


def _lane(name: object, spec: object) -> LaneSpec:
    """One lane of ``claims_lanes``, checked (see :func:`parse_lanes`)."""
    if not isinstance(name, str) or not name or len(name) > _MAX_LANE_NAME or "\x00" in name:
        raise InvalidArgument(
            "claims_lanes",
            f"lane names must be non-empty strings of at most {_MAX_LANE_NAME} "
            f"characters, got {name!r:.80}",
        )
    if not isinstance(spec, Mapping):
        raise InvalidArgument("claims_lanes", f"lane {name!r} must be a dict, got {spec!r:.80}")
    _refuse_unknown_lane_keys(name, spec)
    if "queues" not in spec or ("limit" not in spec and "rate" not in spec):
        raise InvalidArgument(
            "claims_lanes", f"lane {name!r} needs 'queues' and 'limit' or 'rate' (or both)"
        )
    queues = _names(f"lane {name!r} queues", spec["queues"])
    limit = spec.get("limit")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= 1_000_000
    ):
        raise InvalidArgument(
            "claims_lanes",
            f"lane {name!r} limit must be an int from 0 to 1000000, got {limit!r:.80}",
        )
    rate = None
    if "rate" in spec:
        try:
            rate = parse_rate(spec["rate"], name="claims_lanes")
        except InvalidArgument as exc:
            said = str(exc).removeprefix("claims_lanes: ")
            raise InvalidArgument("claims_lanes", f"lane {name!r} rate {said}") from None
    kinds = spec.get("kinds")
    key_names, key_fn, limit_per_key = _lane_key(name, spec, limit)
    return LaneSpec(
        name,
        queues,
        limit,
        None if kinds is None else frozenset(_names(f"lane {name!r} kinds", kinds)),
        key_names=key_names,
        key_fn=key_fn,
        limit_per_key=limit_per_key,
        rate=rate,
    )


def _refuse_shared_queues(lanes: Sequence[LaneSpec]) -> None:
    """A message may be in one lane only: two lanes sharing a queue must list disjoint kinds."""
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


def _refuse_unknown_lane_keys(name: str, spec: Mapping[Any, Any]) -> None:
    """Refuse a key of lane ``name`` that is not in :data:`LANE_KEYS`, naming the one it
    resembles (a misspelt ``limit`` would otherwise leave the lane without one)."""
    unknown = sorted((key for key in spec if key not in LANE_KEYS), key=repr)
    if not unknown:
        return
    said = []
    for key in unknown:
        like = closest(key, LANE_KEYS) if isinstance(key, str) else None
        said.append(f"{key!r:.80}" + (f" (did you mean {like}?)" if like else ""))
    raise InvalidArgument(
        "claims_lanes",
        f"lane {name!r} has unknown key{'s' if len(said) > 1 else ''} {', '.join(said)}; a "
        f"lane takes queues, limit, kinds, key, limit_per_key and rate",
    )


def _lane_key(
    name: str, spec: Mapping[str, Any], limit: int | None
) -> tuple[tuple[str, ...], KeyFunction | None, int]:
    """The key declaration and per-key limit of lane ``name``: a key goes with a per-key
    limit (which needs the lane's ``limit``), a per-key rate (``rate``), or both."""
    if "limit_per_key" in spec and ("key" not in spec or limit is None):
        raise InvalidArgument(
            "claims_lanes", f"lane {name!r}: 'limit_per_key' goes with 'key' and 'limit'"
        )
    if "key" in spec and "limit_per_key" not in spec and "rate" not in spec:
        raise InvalidArgument(
            "claims_lanes",
            f"lane {name!r}: 'key' goes with 'limit_per_key' (a per-key limit), 'rate' (a "
            f"per-key rate), or both",
        )
    if "key" not in spec:
        return (), None, 0
    names, fn = parse_key_declaration(f"claims_lanes: lane {name!r} key", spec["key"])
    if "limit_per_key" not in spec:
        return names, fn, 0
    assert limit is not None
    per_key = spec["limit_per_key"]
    if (
        isinstance(per_key, bool)
        or not isinstance(per_key, int)
        or not 1 <= per_key <= max(limit, 1)
    ):
        raise InvalidArgument(
            "claims_lanes",
            f"lane {name!r} limit_per_key must be an int from 1 to its limit ({limit}), "
            f"got {per_key!r:.80}",
        )
    return names, fn, per_key


def _lanes(key: str, value: Any) -> tuple[LaneSpec, ...]:
    return parse_lanes(value)


# --- the table -------------------------------------------------------------------------------

#: Every ``claims_*`` setting, in the order they are resolved (a row after those it needs).
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "claims_redis_url",
        _redis_url,
        None,
        "The claim store. A separate Redis from the broker is fine (and is what the outage "
        "test uses). The default is the broker the worker consumes from, as Celery resolves "
        "it: `CELERY_BROKER_URL` in the environment (which `celery -b` sets) wins over "
        "`broker_url` in code, and `broker_read_url` over both. Error messages never echo "
        "the URL's credentials.",
        unit="URL",
        default_doc="the broker URL (as Celery resolves it) when it is `redis://`, "
        "`rediss://`, `unix://`, `redis+socket://` or `sentinel://` (a Sentinel broker's "
        "`master_name`, `sentinel_kwargs` and `min_other_sentinels` come from "
        "`broker_transport_options`, a `rediss://` broker's `broker_use_ssl` TLS options "
        "too); otherwise **required**",
        derive=_store_from_broker,
        option=str,
        option_help="URL of the claim store (default: the broker URL if Redis).",
    ),
    Setting(
        "claims_redis_options",
        _redis_options,
        MappingProxyType({}),
        "Client options that do not fit in the URL: `master_name`, `sentinel_kwargs`, "
        "`min_other_sentinels`, `ssl` (TLS to a Sentinel's master) for `sentinel://`; "
        "`username`, `password`; `ssl_cert_reqs`, `ssl_ca_certs`, `ssl_certfile`, "
        "`ssl_keyfile`, `ssl_check_hostname` for TLS. Unknown keys, values of the wrong type "
        "and options that do not apply to the URL's form are refused at start, naming "
        "`claims_redis_options`.",
        unit="dict",
        default_doc="none",
    ),
    Setting(
        "claims_redis_cluster",
        _bool,
        False,
        "The `redis://`/`rediss://` URL names a Redis Cluster node (the same as writing "
        "`redis+cluster://`).",
        unit="bool",
        option=bool,
        option_help="The claim store is a Redis Cluster.",
    ),
    Setting(
        "claims_prefix",
        _prefix,
        DEFAULT_PREFIX,
        "First part of every claim key. Must not contain `{` or `}`. Fleets sharing one "
        "Redis must agree on it.",
        option=str,
        option_help="Prefix of every claim key.",
    ),
    Setting(
        "claims_lease_ms",
        _ms(1),
        DEFAULT_LEASE_MS,
        "Lease of a claim. A crashed worker's task is taken over at most this long after the "
        "last renewal. Set alone, it sets the renew interval too (a quarter of it, at most "
        "15000): at least 200 ms then.",
        unit="ms",
        option=int,
        option_help="Lease of a claim in ms.",
    ),
    Setting(
        "claims_renew_interval_ms",
        _ms(MIN_RENEW_INTERVAL_MS),
        DEFAULT_RENEW_INTERVAL_MS,
        "Period of the lease keeper. Must be at least 50 and less than half of the lease: "
        "the remaining lease of a running task stays above `lease - 2 x interval`. A task "
        "whose own `claims_lease_ms` is not above twice the interval is renewed every quarter "
        "of its lease instead. "
        "With the Redis broker it must also be well below `visibility_timeout`, because the "
        "keeper refreshes the delivery's `unacked_index` score on the same beat.",
        unit="ms",
        default_doc="`claims_lease_ms / 4`, at most `15000`",
        needs=("claims_lease_ms",),
        derive=_derived_renew,
        check=_renew_fits_lease,
        option=int,
        option_help="Lease keeper period in ms (default: a quarter of the lease, at most 15000).",
    ),
    Setting(
        "claims_done_ttl_ms",
        _ms(1),
        DEFAULT_DONE_TTL_MS,
        "How long a completion record is kept. A copy of a finished attempt that arrives "
        "within this time is acked without running; after it, the copy runs again. Keep it "
        "above the longest redelivery delay you expect (`visibility_timeout`, RabbitMQ "
        "`consumer_timeout`, ETA/countdown).",
        unit="ms",
        default_doc="`86400000` (1 day)",
        option=int,
        option_help="Retention of completion records in ms.",
    ),
    Setting(
        "claims_held_recheck_ms",
        _ms(10),
        DEFAULT_HELD_RECHECK_MS,
        "Period at which a copy held because another worker's lease is live is checked again.",
        unit="ms",
        option=int,
        option_help="Re-check period of a copy held by another lease, ms.",
    ),
    Setting(
        "claims_unavailable_retry_ms",
        _ms(1),
        DEFAULT_UNAVAILABLE_RETRY_MS,
        "First retry delay of a copy held because the claim store was unreachable; doubled "
        "on every failure.",
        unit="ms",
        option=int,
        option_help="First retry delay while the claim store is down, ms.",
    ),
    Setting(
        "claims_unavailable_retry_max_ms",
        _ms(1),
        DEFAULT_UNAVAILABLE_RETRY_MAX_MS,
        "Ceiling of that delay (at least `claims_unavailable_retry_ms`).",
        unit="ms",
        default_doc="`30000`, or `claims_unavailable_retry_ms` when higher",
        needs=("claims_unavailable_retry_ms",),
        derive=lambda values, conf: max(
            DEFAULT_UNAVAILABLE_RETRY_MAX_MS, values["claims_unavailable_retry_ms"]
        ),
        check=_at_least_first_retry,
        option=int,
        option_help="Ceiling of that retry delay, ms.",
    ),
    Setting(
        "claims_socket_timeout_ms",
        _ms(10),
        DEFAULT_SOCKET_TIMEOUT_MS,
        "Connect and read timeout of the claim store client, and of the consumer's own "
        "connection: a reply later than this drops that connection and fails the calls "
        "waiting on it (see docs/celery.md). The gate runs in the worker's event loop, so "
        "keep it short.",
        unit="ms",
        option=int,
        option_help="Claim store socket timeouts in ms.",
    ),
    Setting(
        "claims_refresh_unacked",
        _bool,
        True,
        "With the Redis broker, refresh the `unacked_index` score of every claimed or held "
        "delivery on each keeper beat, so kombu does not restore (and redeliver) a message "
        "whose holder is alive.",
        unit="bool",
    ),
    Setting(
        "claims_cleanup_interval_s",
        _positive_seconds,
        DEFAULT_CLEANUP_INTERVAL_S,
        "Period of the `celery_claims.cleanup_expired` beat entry (also its messages' "
        "`expires`). Read when the app is finalized; a bad value leaves the entry out and "
        "stops the worker.",
        unit="s",
        default_doc="`300`",
    ),
    Setting(
        "claims_cleanup_limit",
        _positive_int,
        DEFAULT_CLEANUP_LIMIT,
        "Most expired claims one cleanup run removes (bounds the run's time).",
        unit="claims",
    ),
    Setting(
        "claims_lanes",
        _lanes,
        (),
        'Fleet-wide lanes: `{"video": {"queues": ["video"], "limit": 2, "kinds": '
        '["app.render"]}}`. Each lane caps how many claimed tasks delivered from its `queues` '
        "(only the task names in `kinds`, when given) run at once across every worker that "
        "has the same setting. `limit` 0 pauses the lane. Checked at worker start: unknown "
        "keys (each named with the key it resembles: `'limt' (did you mean limit?)`), an "
        "empty or non-list `queues`/`kinds`, a negative or non-int `limit`, and two "
        "lanes that could both cover a message (same queue, overlapping or missing `kinds`) "
        "are refused with an error naming `claims_lanes` and the lane. A lane that matches "
        "nothing (none of its `queues` is declared in `task_queues`, `task_routes`, "
        "`task_default_queue` or the worker's `-Q`, or none of its `kinds` is a registered "
        "task) gets a warning naming the queue or task it could have meant; an error under "
        "`claims_strict_settings`. All workers of a lane "
        'must agree on its limit. A **keyed lane** adds `"key"` (an argument name, a tuple '
        "of them, or a callable of `(args, kwargs)`, as for `claims_key`) and "
        '`"limit_per_key"` (an int from 1 to `limit`): at most that many of its tasks with one '
        'key run at once, fleet-wide, within `limit` (e.g. `{"queues": ["exports"], '
        '"limit": 20, "key": "tenant_id", "limit_per_key": 2}`); a message whose key cannot be '
        'made is refused (recorded as failed with `KeyRefused`). A lane may have a `"rate"` '
        '(`"100/m"`) beside or instead of its `limit`: at most that many of its tasks start '
        "per period across the fleet (per key with `key`; see docs/rates.md). See "
        "`docs/celery.md`, *Lanes*, and `docs/lanes.md`, *Keyed lanes*.",
        default_doc="none",
    ),
    Setting(
        "claims_lane_recheck_ms",
        _ms(10),
        DEFAULT_LANE_RECHECK_MS,
        "Period at which a worker re-checks a full lane while it holds messages waiting for "
        "it (one round trip per lane per period, whatever the number of held messages). A "
        "slot freed by the same worker wakes its lane at once.",
        unit="ms",
        option=int,
        option_help="Re-check period of a full lane, ms.",
    ),
    Setting(
        "claims_strict_settings",
        _bool,
        False,
        "At worker start the unsafe-settings check (`celery claims check`) runs and logs each "
        "finding (and each lane that matches nothing) as a warning with its fix. With `True` "
        "the worker refuses to start instead (error naming `claims_strict_settings` and "
        "listing every finding, non-zero exit). It does not soften anything else: an unknown "
        "`claims_*` name or a bad value stops the worker either way.",
        unit="bool",
        option=bool,
        option_help="Refuse to start on an unsafe Celery setting.",
    ),
    Setting(
        "claims_start_timeout_ms",
        _ms(1),
        DEFAULT_START_TIMEOUT_MS,
        "A claimed copy handed to the pool that has not started within this is given up: its "
        "claim is released and its message handed back to the broker for another worker (a "
        "stuck pool must not hold a task for ever). Also how long a pool process waits for "
        "an unreachable claim store before it fails closed. At least `claims_lease_ms`.",
        unit="ms",
        default_doc="`300000` (5 min), or `claims_lease_ms` when longer",
        needs=("claims_lease_ms",),
        derive=lambda values, conf: max(DEFAULT_START_TIMEOUT_MS, values["claims_lease_ms"]),
        check=_at_least_lease,
        option=int,
        option_help="Give up a claimed copy the pool has not started, ms.",
    ),
    Setting(
        "claims_max_takeovers",
        _max_takeovers,
        DEFAULT_MAX_TAKEOVERS,
        "Takeovers of one attempt (its holder died with the lease) before the task is given "
        "up as poison: the next copy is acked without running and `celery claims inspect` "
        "shows it as given up. Counted are the holders that may have died of the task: the "
        "first one, and a takeover's holder once its pool process marked the start; one that "
        "died with the task still waiting in its prefetch is not. `None` (or `-1` on the "
        "command line) never gives up. With the Redis broker, the beat cleanup removing a "
        "dead holder's expired claim before the message comes back resets the count "
        "(docs/semantics.md).",
        nullable=True,
        option=int,
        option_help="Takeovers of one attempt before it is given up (-1: never).",
    ),
    Setting(
        "claims_key_conflict",
        _key_conflict,
        "wait",
        "What a message of a keyed task (`claims_key`) does while another task holds its key: "
        "`wait` (held unacked and re-checked every `claims_held_recheck_ms`), `skip` (acked "
        "without running, journaled as skipped with the holder's task id) or `reschedule` "
        "(published again with a `claims_key_reschedule_s` countdown, at most "
        "`claims_key_reschedule_max` times, then `wait`). A copy of the holder's own task id "
        "always waits. The default of the task attribute of the same name (docs/celery.md, "
        "*Keyed claims*).",
        unit="`wait`, `skip` or `reschedule`",
        default_doc="`wait`",
        option=str,
        option_help="Default conflict policy of keyed tasks: wait, skip or reschedule.",
    ),
    Setting(
        "claims_key_reschedule_max",
        _key_reschedule_max,
        3,
        "Most times one message of a keyed task with the `reschedule` policy is published "
        "again while its key is held; after that it waits. Default of the task attribute.",
        unit="count",
    ),
    Setting(
        "claims_key_reschedule_s",
        _key_reschedule_s,
        5.0,
        "Countdown of a keyed message published again because its key is held "
        "(`reschedule` policy). Default of the task attribute.",
        unit="s",
    ),
    Setting(
        "claims_rate_limit_fleetwide",
        _bool,
        False,
        "Make Celery's own `rate_limit` task attribute a fleet-wide rate: at most that many "
        "starts per period across every worker, counted in the claim store like "
        "`claims_rate` (which wins where both are set), and the worker no longer sleeps on "
        "it (Celery's per-worker token bucket is turned off for those tasks). Its value must "
        "then be a rate `claims_rate` takes (`'10/s'`, `'10/m'`, `'10/h'`; not `0.5/s` nor "
        "a bare number): a refused one stops the worker naming `<task>.rate_limit`. See "
        "docs/rates.md.",
        unit="bool",
    ),
    Setting(
        "claims_metrics_port",
        _ports,
        DEFAULT_METRICS_PORTS,
        "Where the worker's Prometheus exporter listens, when "
        "`celery_claims.metrics.install_metrics(app)` is installed: one port, a range from which "
        "each worker of a host takes the first free port (so several workers per host each "
        "export on their own), or `0` for any free port. The port taken is logged; see "
        "docs/operations.md, *Prometheus*.",
        unit='port, `"first-last"`, or `0`',
        default_doc='`"9808-9817"`',
        option=str,
        option_help="Metrics exporter port, FIRST-LAST range, or 0 (any free).",
    ),
    Setting(
        "claims_journal",
        _bool,
        True,
        "Journal every published message in the claim store until its task is settled, so "
        "a message lost between the broker and a worker (a worker killed after Redis' `BRPOP` "
        "took it off the queue and before kombu recorded it in `unacked`) is re-published. "
        "Producers journal (one write per publish, sent without waiting for the reply; "
        "`install(app)` in the producer process); workers clear entries of acked messages and "
        "recover the rest. Set it the same on producers and workers. See docs/semantics.md, "
        "*The publish journal*.",
        unit="bool",
        option=bool,
        option_help="Journal published messages and recover lost ones.",
    ),
    Setting(
        "claims_journal_recover_after_ms",
        _ms(1),
        DEFAULT_JOURNAL_RECOVER_AFTER_MS,
        "How long after its publish (or its ETA) a journaled message whose task is neither "
        "done nor claimed is re-published. Keep it above the lease, the visibility timeout "
        "and the longest a message waits in the queue (a copy re-published too early is a "
        "duplicate: harmless, the claim gate skips or holds it, but it costs a delivery). "
        "Less than `claims_done_ttl_ms`. Read by producers (the first recover time) and "
        "workers (the next one).",
        unit="ms",
        default_doc="`600000` (10 min)",
        needs=("claims_done_ttl_ms",),
        check=_below_done_ttl,
        option=int,
        option_help="Re-publish a journaled message not done nor claimed after this, ms.",
    ),
    Setting(
        "claims_journal_scan_interval_ms",
        _ms(10),
        DEFAULT_JOURNAL_SCAN_INTERVAL_MS,
        "How often a worker looks for journaled messages to recover, in each queue it "
        "consumes (a short per-queue lock makes it one worker per queue per period, whatever "
        "the fleet's size; at most 100 messages per queue per look).",
        unit="ms",
        option=int,
        option_help="Period of the journal recovery scan, ms.",
    ),
    Setting(
        "claims_journal_max_republish",
        _positive_int,
        DEFAULT_JOURNAL_MAX_REPUBLISH,
        "Re-publishes of one journaled message before recovery drops it with a warning (a "
        "revoked or expired message Celery keeps dropping, a task no worker can decode).",
        unit="times",
        option=int,
        option_help="Re-publishes of one journaled message before it is dropped.",
    ),
    Setting(
        "claims_ack_on_claim",
        _bool,
        False,
        "Acknowledge each claimed message to the broker when the pool starts it (or when it "
        "starts waiting outside the pool for a rate, a lane or its turn), not when it ends: "
        "for tasks that may run longer than the broker lets a delivery stay unacked "
        "(RabbitMQ's `consumer_timeout`, SQS's visibility timeout). The worker first makes "
        "sure the message's publish journal entry is in the claim store: from then on the "
        "claim and that entry are the task's durable copy, and a holder that dies is taken "
        "over when journal recovery publishes the entry again. Also a task attribute, which "
        "wins for its task. Needs `claims_journal` and a claim store that persists (AOF or "
        "RDB); not for keyed tasks (`claims_key`). See docs/semantics.md, *Acknowledging at "
        "claim*.",
        unit="bool",
        needs=("claims_journal",),
        check=_needs_journal,
        option=bool,
        option_help="Acknowledge messages once claimed (tasks longer than the broker's timeout).",
    ),
)

_BY_KEY: dict[str, Setting] = {row.key: row for row in SETTINGS}


def setting(key: str) -> Setting:
    """The row of ``key``.

    Raises:
        InvalidArgument: no setting has that key.
    """
    try:
        return _BY_KEY[key]
    except KeyError:
        raise InvalidArgument("key", f"unknown claims setting {key!r:.80}") from None


def _needed(keys: Iterable[str]) -> set[str]:
    wanted: set[str] = set()
    pending = list(keys)
    while pending:
        key = pending.pop()
        if key not in wanted:
            wanted.add(key)
            pending.extend(_BY_KEY[key].needs)
    return wanted


def resolve(
    conf: Any, overrides: Mapping[str, Any] | None = None, keys: Iterable[str] | None = None
) -> dict[str, Any]:
    """Read and validate the ``claims_*`` settings of ``conf``.

    Args:
        conf: a Celery ``app.conf`` or any mapping (read with ``get``).
        overrides: values from the worker command line (``None`` values are ignored); they
            win over ``conf``.
        keys: only these settings (and those they need); default: every row.

    Returns:
        Each resolved setting's value by key.

    Raises:
        InvalidArgument: a setting is invalid; ``name`` is the setting the user gave (a
            setting derived from it is never blamed).
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    asked = None if keys is None else tuple(keys)
    unknown = sorted(set(asked or ()) - set(_BY_KEY))
    if unknown:
        raise InvalidArgument("keys", f"unknown claims settings {unknown}")
    wanted = _needed(asked) if asked is not None else set(_BY_KEY)
    values: dict[str, Any] = {}
    for row in SETTINGS:
        if row.key not in wanted:
            continue
        raw = given[row.key] if row.key in given else conf.get(row.key, _UNSET)
        if raw is _UNSET or (raw is None and not row.nullable):
            values[row.key] = row.derive(values, conf) if row.derive else row.default
            continue
        value = row.parse(row.key, raw)
        refusal = row.check(value, values) if row.check else None
        if refusal is not None:
            raise InvalidArgument(row.key, refusal)
        values[row.key] = value
    return values


# --- the reference in docs/settings.md -------------------------------------------------------

_BEGIN = "<!-- settings-table:begin (made from celery_claims/config.py; do not edit) -->"
_END = "<!-- settings-table:end -->"


def _default_cell(row: Setting) -> str:
    if row.default_doc:
        return row.default_doc
    if isinstance(row.default, bool):
        return f"`{row.default}`"
    return f"`{row.default:g}`" if isinstance(row.default, float) else f"`{row.default}`"


def _option_cell(row: Setting) -> str:
    if row.option is None:
        return ""
    return f"`{row.flag} true`" if row.option is bool else f"`{row.flag}`"


def reference() -> str:
    """The Markdown reference table of every setting, between its begin and end markers."""
    lines = [
        _BEGIN,
        "| Key | Worker option | Default | Unit | Meaning |",
        "|---|---|---|---|---|",
    ]
    for row in SETTINGS:
        cells = (f"`{row.key}`", _option_cell(row), _default_cell(row), row.unit, row.meaning)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(_END)
    return "\n".join(lines)


def write_reference(path: Path) -> bool:
    """Replace the reference table in the Markdown file ``path``; True if it changed.

    Raises:
        InvalidArgument: the file has no begin/end markers.
    """
    text = path.read_text()
    pattern = re.compile(re.escape(_BEGIN) + r".*?" + re.escape(_END), re.DOTALL)
    if not pattern.search(text):
        raise InvalidArgument("path", f"{path} has no settings-table markers")
    new = pattern.sub(lambda _: reference(), text)
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    for name in sys.argv[1:] or ["docs/settings.md"]:
        print(f"{name}: {'updated' if write_reference(Path(name)) else 'up to date'}")
