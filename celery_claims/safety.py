"""The unsafe-settings report: Celery settings that weaken or defeat claims, and their fix.

:func:`check_settings` is a pure function of a configuration (a Celery ``app.conf`` or any
mapping), so the same rules serve ``celery claims check`` and a worker that checks itself when
it starts. Each :class:`Finding` names the setting, says what goes wrong and how to fix it.

This module imports neither Celery nor kombu: the defaults it assumes for unset Celery keys are
spelled here (Celery 5.x values); the ``claims_*`` ones come from :mod:`celery_claims.config`.
The broker is the one Celery resolves (``CELERY_BROKER_URL``, ``celery -b``) on an ``app.conf``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from celery_claims.config import broker_url, resolve
from celery_claims.errors import InvalidArgument

__all__ = [
    "CELERY_DEFAULT_PREFETCH_MULTIPLIER",
    "KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S",
    "POOLS_WITHOUT_TIME_LIMITS",
    "Finding",
    "Severity",
    "check_settings",
]

#: kombu's Redis transport restores an unacked message after this many seconds by default.
KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S = 3600.0
#: Celery's default ``worker_prefetch_multiplier``.
CELERY_DEFAULT_PREFETCH_MULTIPLIER = 4
#: A crash takeover waits for the later of the lease and the visibility timeout; beyond this
#: ratio the lease no longer decides how long a crashed worker's task waits.
TAKEOVER_DELAY_RATIO = 10

#: Celery pools that never stop a task at its time limit (hard or soft): Celery enforces them
#: with signals in prefork pool processes and with ``gevent.Timeout`` (hard limit only) in gevent.
POOLS_WITHOUT_TIME_LIMITS = frozenset({"threads", "solo", "eventlet"})

_REDIS_BROKERS = ("redis://", "rediss://", "sentinel://", "redis+socket://", "socket://")


class Severity(str, enum.Enum):
    """How much a finding matters."""

    #: Claims cannot deliver what they promise with this setting.
    ERROR = "error"
    #: Claims still hold, but work is duplicated, delayed or held needlessly.
    WARNING = "warning"
    #: What the worker's pool does not do, and what celery-claims does instead: nothing to
    #: fix in the settings (strict mode does not refuse to start on it).
    NOTICE = "notice"


@dataclass(frozen=True, slots=True)
class Finding:
    """One unsafe setting.

    Attributes:
        key: the setting (or settings) at fault, as written in the configuration.
        severity: how much it matters.
        message: what goes wrong, then the fix, in one or two sentences.
    """

    key: str
    severity: Severity
    message: str

    def as_dict(self) -> dict[str, str]:
        """A JSON-ready form: ``{"key", "severity", "message"}``."""
        return {"key": self.key, "severity": self.severity.value, "message": self.message}


def _number(conf: Any, key: str, default: float | None) -> float | None:
    value = conf.get(key, None)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(key, f"must be a number, got {value!r:.80}")
    return float(value)


def _broker_url(conf: Any) -> str:
    # the broker the worker really consumes from: CELERY_BROKER_URL and `celery -b` included
    return broker_url(conf) or ""


def check_settings(conf: Mapping[str, Any] | Any, *, pool: str | None = None) -> list[Finding]:
    """Report the settings of ``conf`` that weaken or defeat claims.

    Args:
        conf: a Celery ``app.conf`` or any mapping of lower-case setting names (only ``get``
            is used; unset keys take Celery's and celery-claims' defaults).
        pool: the worker's pool by Celery's name (``"prefork"``, ``"threads"``, ``"solo"``,
            ``"gevent"``, ``"eventlet"``), to report what it does not enforce; default: the
            configuration's ``worker_pool`` (Celery's default, prefork, when unset).

    Returns:
        The findings, errors first; empty when nothing is unsafe.

    Raises:
        InvalidArgument: ``conf`` has no ``get``, or a setting the checks read has the wrong
            type.
    """
    if not callable(getattr(conf, "get", None)):
        raise InvalidArgument("conf", f"must be a mapping or app.conf, got {type(conf).__name__}")
    acks_late = bool(conf.get("task_acks_late", False))
    hard = _number(conf, "task_time_limit", None)
    soft = _number(conf, "task_soft_time_limit", None)
    findings = [
        *_acks_late_findings(acks_late),
        *_lease_findings(conf),
        *_time_limit_findings(hard, soft),
        *_prefetch_findings(conf, acks_late),
        *_result_backend_findings(conf),
        *_pool_findings(pool or conf.get("worker_pool", None) or "prefork", hard, soft),
    ]
    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.NOTICE: 2}
    findings.sort(key=lambda f: order[f.severity])
    return findings


def _acks_late_findings(acks_late: bool) -> list[Finding]:
    if acks_late:
        return []
    return [
        Finding(
            "task_acks_late",
            Severity.ERROR,
            "task_acks_late is off: a message is acknowledged before its task runs, so a "
            "worker that dies mid-task loses it and no other worker can take it over. "
            "Set task_acks_late = True.",
        )
    ]


def _lease_findings(conf: Any) -> list[Finding]:
    """The lease against journal recovery and, on the Redis broker, the visibility timeout."""
    # read as the worker reads them: a renew interval not given follows the lease
    claims = resolve(
        conf,
        keys=(
            "claims_lease_ms",
            "claims_renew_interval_ms",
            "claims_refresh_unacked",
            "claims_journal",
            "claims_journal_recover_after_ms",
        ),
    )
    lease_ms = claims["claims_lease_ms"]
    recover_ms = claims["claims_journal_recover_after_ms"] if claims["claims_journal"] else None
    findings: list[Finding] = []
    if recover_ms is not None and recover_ms <= lease_ms:
        findings.append(_early_recovery(recover_ms, "claims_lease_ms", lease_ms))
    if _broker_url(conf).startswith(_REDIS_BROKERS):
        findings += _redis_broker_findings(
            conf,
            lease_ms=lease_ms,
            renew_ms=claims["claims_renew_interval_ms"],
            refresh=claims["claims_refresh_unacked"],
            recover_ms=recover_ms,
        )
    return findings


def _visibility_timeout_s(options: Mapping[str, Any]) -> float:
    raw = options.get("visibility_timeout", KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise InvalidArgument(
            "broker_transport_options", f"visibility_timeout must be seconds, got {raw!r:.80}"
        )
    return float(raw)


def _redis_broker_findings(
    conf: Any, *, lease_ms: float, renew_ms: float, refresh: bool, recover_ms: float | None
) -> list[Finding]:
    """What kombu's Redis transport's restore sweep does to claims with these settings."""
    options = conf.get("broker_transport_options", None) or {}
    if not isinstance(options, Mapping):
        raise InvalidArgument("broker_transport_options", "must be a dict")
    raw = _visibility_timeout_s(options)
    visibility_ms = raw * 1000
    findings = _restore_lock_findings(options, raw)
    if refresh is False:
        findings.append(
            Finding(
                "claims_refresh_unacked",
                Severity.WARNING,
                f"claims_refresh_unacked is off: every task running longer than "
                f"visibility_timeout ({raw:g} s) is redelivered while it runs, and each "
                f"copy is held unacked until it ends. Leave claims_refresh_unacked = True.",
            )
        )
    elif renew_ms * 2 > visibility_ms:
        findings.append(
            Finding(
                "claims_renew_interval_ms",
                Severity.WARNING,
                f"claims_renew_interval_ms ({renew_ms:g} ms) is more than half of "
                f"visibility_timeout ({raw:g} s): Redis can restore a running task's "
                f"message between two refreshes and deliver a copy. Set "
                f"claims_renew_interval_ms below {visibility_ms / 2:g} ms.",
            )
        )
    long_visibility = visibility_ms > TAKEOVER_DELAY_RATIO * lease_ms
    # a visibility timeout flagged as too long is the one fix: its finding says it
    if recover_ms is not None and lease_ms < recover_ms <= visibility_ms and not long_visibility:
        findings.append(_early_recovery(recover_ms, "visibility_timeout", visibility_ms, unit="s"))
    if long_visibility:
        findings.append(
            Finding(
                "broker_transport_options.visibility_timeout",
                Severity.WARNING,
                f"visibility_timeout ({raw:g} s) is more than {TAKEOVER_DELAY_RATIO}x "
                f"claims_lease_ms ({lease_ms:g} ms): a crashed worker's task waits for "
                f"Redis to restore its message, not for its lease, before another worker "
                f"takes it over. Set broker_transport_options['visibility_timeout'] to "
                f"2-5x the lease (e.g. {max(lease_ms * 3 / 1000, 1):g}).",
            )
        )
    return findings


def _restore_lock_findings(options: Mapping[str, Any], visibility_s: float) -> list[Finding]:
    mutex = options.get("unacked_mutex_expire")
    bound = max(visibility_s, 1.0)
    if isinstance(mutex, bool) or not isinstance(mutex, (int, float)) or mutex <= bound:
        return []
    return [
        Finding(
            "broker_transport_options.unacked_mutex_expire",
            Severity.WARNING,
            f"unacked_mutex_expire ({mutex:g} s) is longer than visibility_timeout "
            f"({visibility_s:g} s): a worker killed in mid-sweep holds kombu's restore lock "
            f"that long, and meanwhile no crashed worker's task is taken over. Leave "
            f"it unset (celery-claims bounds it by the visibility timeout) or set it "
            f"to at most {bound:g}.",
        )
    ]


def _time_limit_findings(hard: float | None, soft: float | None) -> list[Finding]:
    if hard is None:
        return [
            Finding(
                "task_time_limit",
                Severity.WARNING,
                "task_time_limit is not set: a hung task keeps renewing its lease forever, so "
                "its claim is never released and no copy of it can run. Set task_time_limit "
                "(seconds) to the longest a task may run.",
            )
        ]
    if soft is not None and soft >= hard:
        return [
            Finding(
                "task_soft_time_limit",
                Severity.WARNING,
                f"task_soft_time_limit ({soft:g} s) is not below task_time_limit ({hard:g} s): "
                f"the task is killed before it can clean up, and its claim is released "
                f"without a chance to finish. Set the soft limit below the hard one.",
            )
        ]
    return []


def _prefetch_findings(conf: Any, acks_late: bool) -> list[Finding]:
    """What reserving messages and Celery's connection-loss cancel do to late acks."""
    if not acks_late:
        return []
    findings: list[Finding] = []
    prefetch = _number(conf, "worker_prefetch_multiplier", CELERY_DEFAULT_PREFETCH_MULTIPLIER)
    if prefetch is not None and prefetch != 1:
        what = "unlimited (0)" if prefetch == 0 else f"{prefetch:g}"
        findings.append(
            Finding(
                "worker_prefetch_multiplier",
                Severity.WARNING,
                f"worker_prefetch_multiplier is {what}: with task_acks_late each worker "
                f"reserves more messages than it can run, and reserved messages wait unacked "
                f"(on Redis they are restored and delivered again after visibility_timeout). "
                f"Set worker_prefetch_multiplier = 1.",
            )
        )
    if conf.get("worker_cancel_long_running_tasks_on_connection_loss", False):
        findings.append(
            Finding(
                "worker_cancel_long_running_tasks_on_connection_loss",
                Severity.WARNING,
                "worker_cancel_long_running_tasks_on_connection_loss is on: a broker hiccup "
                "kills every running task and runs it again from the start. With claims the "
                "running copy can finish and record completion while the redelivered copy "
                "is held and then acknowledged unrun. Set it to False.",
            )
        )
    return findings


def _result_backend_findings(conf: Any) -> list[Finding]:
    backend = conf.get("result_backend", None)
    if (
        not isinstance(backend, str)
        or _server(backend) is None
        or _server(backend) != _server(_broker_url(conf))
        or conf.get("result_backend_always_retry", False)
    ):
        return []
    return [
        Finding(
            "result_backend_always_retry",
            Severity.WARNING,
            "result_backend_always_retry is off and the result backend is the broker's "
            "server: when that server restarts just as a task ends, storing its result "
            "fails and Celery reports the task as failed although its body ran (the claim "
            "still records it done, so it does not run again, but its result is lost). "
            "Set result_backend_always_retry = True.",
        )
    ]


def _pool_findings(pool: object, hard: float | None, soft: float | None) -> list[Finding]:
    # said even without a global limit: tasks may have their own (time_limit=...)
    if not isinstance(pool, str):
        return []
    limit = (
        f" (task_time_limit {hard:g} s)"
        if hard is not None
        else f" (task_soft_time_limit {soft:g} s)"
        if soft is not None
        else ""
    )
    after = (
        "celery-claims stops renewing a task's claim once its time limit has passed (the "
        "message's, the task's or task_time_limit), so the claim expires within "
        "claims_lease_ms and another copy takes the task over; the hung copy runs on, and "
        "if it ever ends its result is discarded (fenced)."
    )
    if pool in POOLS_WITHOUT_TIME_LIMITS:
        return [
            Finding(
                "worker_pool",
                Severity.NOTICE,
                f"the {pool} pool does not enforce time limits: a task past its limit{limit} "
                f"is not stopped. {after} Use the prefork pool where a hung task "
                f"must be stopped.",
            )
        ]
    if pool == "gevent":
        return [
            Finding(
                "worker_pool",
                Severity.NOTICE,
                f"the gevent pool enforces the hard time limit only while the task yields to "
                f"gevent, and no soft limit: a task blocked past its limit{limit} is not "
                f"stopped. {after}",
            )
        ]
    return []


def _early_recovery(recover_ms: float, what: str, value_ms: float, unit: str = "ms") -> Finding:
    shown = f"{value_ms / 1000:g} s" if unit == "s" else f"{value_ms:g} ms"
    return Finding(
        "claims_journal_recover_after_ms",
        Severity.WARNING,
        f"claims_journal_recover_after_ms ({recover_ms:g} ms) is not above {what} ({shown}): "
        f"journal recovery re-publishes the message of a task whose holder died before the "
        f"broker or the lease brings it back, so most crash takeovers run from a duplicate "
        f"copy (the claim gate holds or skips the other, nothing runs twice, but every copy "
        f"costs a delivery). Set claims_journal_recover_after_ms well above both (and above "
        f"the longest a message waits in the queue), e.g. {max(value_ms * 10, 600_000):g}.",
    )


def _server(url: str) -> tuple[str, int | None] | None:
    """(host, port) of a Redis-like URL, or None when it names no network server."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname, port
