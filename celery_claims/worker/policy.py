"""Which tasks the gate claims, and the per-task claim attributes, checked at worker start."""

from __future__ import annotations

from typing import Any

from celery_claims.errors import InvalidArgument
from celery_claims.worker.delivery.keyed import check_key_arguments, key_spec, signature_of
from celery_claims.worker.delivery.rates import rate_spec
from celery_claims.worker.settings import ClaimsSettings

__all__ = [
    "EXEMPT_PREFIXES",
    "acks_on_claim",
    "any_acks_on_claim",
    "check_task_policies",
    "is_exempt",
    "time_limit_of",
]

#: Task name prefixes the gate never claims: Celery's own tasks and this package's.
EXEMPT_PREFIXES = ("celery.", "celery_claims.")


def is_exempt(task: Any, name: str) -> bool:
    """True if the gate lets ``task`` through unclaimed (Celery's tasks, ours, opt-outs)."""
    if name.startswith(EXEMPT_PREFIXES):
        return True
    return getattr(task, "claims", True) is False


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return float(value)


def time_limit_of(
    request: Any, task: Any, worker_limits: tuple[float | None, float | None]
) -> float | None:
    """The time limit a request runs under, in seconds, as Celery resolves it; or None.

    Each limit is the message's (``apply_async(time_limit=...)``), else the task's
    (``time_limit`` / ``soft_time_limit``, which ``celery control time_limit`` changes), else
    the worker's (``task_time_limit`` / ``--time-limit``). The hard limit counts when there is
    one; otherwise the soft limit (a task with only a soft limit is expected to end at it).

    Args:
        request: the worker's ``Request`` (``time_limits`` is ``(soft, hard)``).
        task: its task.
        worker_limits: the worker's ``(soft, hard)`` defaults.
    """
    limits = getattr(request, "time_limits", None) or (None, None)
    try:
        soft_msg, hard_msg = limits
    except (TypeError, ValueError):
        soft_msg, hard_msg = None, None
    soft_default, hard_default = worker_limits
    hard = _first_seconds(hard_msg, getattr(task, "time_limit", None), hard_default)
    if hard is not None:
        return hard  # the soft limit is read only where there is no hard one
    return _first_seconds(soft_msg, getattr(task, "soft_time_limit", None), soft_default)


def _first_seconds(message: object, task: object, worker: object) -> float | None:
    """The first of the three limits that is one, in seconds (``None`` is none: most are)."""
    if message is not None and (seconds := _seconds(message)) is not None:
        return seconds
    if task is not None and (seconds := _seconds(task)) is not None:
        return seconds
    return None if worker is None else _seconds(worker)


def acks_on_claim(task: Any, settings: ClaimsSettings) -> bool:
    """True if ``task``'s messages are acknowledged once claimed (its ``claims_ack_on_claim``
    attribute, else the ``claims_ack_on_claim`` setting)."""
    flag = getattr(task, "claims_ack_on_claim", None)
    if getattr(task, "claims_key", None) is not None:
        return False  # refused at start when asked for by the task (see _check_ack_on_claim)
    return settings.ack_on_claim if flag is None else bool(flag)


def any_acks_on_claim(app: Any, settings: ClaimsSettings) -> bool:
    """True if any task of ``app`` is acknowledged at claim (the claim store must persist)."""
    if settings.ack_on_claim:
        return True
    return any(getattr(task, "claims_ack_on_claim", None) is True for task in app.tasks.values())


def _check_ack_on_claim(name: str, task: Any, settings: ClaimsSettings, *, keyed: bool) -> None:
    flag = getattr(task, "claims_ack_on_claim", None)
    where = f"{name}.claims_ack_on_claim"
    if flag is not None and not isinstance(flag, bool):
        raise InvalidArgument(where, f"must be True, False or None, got {flag!r:.80}")
    if not (settings.ack_on_claim if flag is None else flag):
        return
    if not settings.journal:
        raise InvalidArgument(
            where if flag else "claims_ack_on_claim",
            f"{name}: needs claims_journal = True: once a message is acked at claim, its "
            f"publish journal entry is its only durable copy",
        )
    if keyed and flag:
        # a keyed task's claim is its key's, which journal recovery does not look at: it
        # would publish the entry again while the task runs (the setting leaves it out)
        raise InvalidArgument(
            where if flag else "claims_ack_on_claim",
            f"{name}: a keyed task (claims_key) cannot be acknowledged at claim",
        )


def check_task_policies(app: Any, settings: ClaimsSettings) -> None:
    """Validate the per-task ``claims``, ``claims_lease_ms``, rate (``claims_rate``,
    ``claims_rate_key``, :func:`~celery_claims.worker.delivery.rates.rate_spec`) and
    keyed-claim attributes (``claims_key`` and its ``claims_key_*``,
    :func:`~celery_claims.worker.delivery.keyed.key_spec`) of every task, and that the
    tasks a keyed lane lists under ``kinds`` take its key's arguments.

    Raises:
        InvalidArgument: an attribute has the wrong type or an unusable value.
    """
    for name, task in sorted(app.tasks.items()):
        flag = getattr(task, "claims", True)
        if not isinstance(flag, bool):
            raise InvalidArgument(f"{name}.claims", f"must be True or False, got {flag!r:.80}")
        lease = getattr(task, "claims_lease_ms", None)
        if lease is not None:
            settings.check_task_lease(name, lease)
        if not name.startswith(EXEMPT_PREFIXES):
            keyed = key_spec(task, name, settings) is not None
            _check_ack_on_claim(name, task, settings, keyed=keyed)
            rate_spec(task, name, fleetwide=settings.rate_limit_fleetwide)
    for lane in settings.lanes:
        # a keyed lane's tasks are known when it lists its kinds; the others' messages are
        # checked as they arrive (a message whose key cannot be made is refused)
        for name in sorted(lane.kinds or ()):
            task = app.tasks.get(name)
            if task is not None:
                check_key_arguments(
                    f"claims_lanes: lane {lane.name!r} key",
                    name,
                    lane.key_names,
                    signature_of(task),
                )
