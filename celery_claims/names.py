"""Every name of the ``claims_`` namespace must mean something.

A ``claims_*`` setting or task attribute the package does not know would be ignored, and the
work it was meant to protect would run unprotected (a misspelt ``claims_key`` is no key lock
at all). So, when a worker starts and in ``celery claims check``:

- :func:`check_names` refuses every unknown ``claims_*`` setting (``app.conf``, Django-style
  ``CELERY_CLAIMS_*``, any source Celery reads) and task attribute (decorator options, Task
  subclass attributes, ``task_annotations``), naming it, where it was found and the known
  name it resembles (a lane's unknown keys are refused so by
  :func:`~celery_claims.config.parse_lanes`);
- :func:`lane_findings` reports a lane whose queues or kinds name nothing the app declares.

Names outside the namespace are never looked at. This module imports neither Celery nor
kombu: it reads a configuration through its keys, ``get`` and the ``prefix`` of Celery's
``Settings`` (``config_from_object(..., namespace=...)``; checked on Celery 5.7).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any

from celery_claims.config import NAMESPACE, SETTINGS, LaneSpec, closest
from celery_claims.errors import InvalidArgument
from celery_claims.safety import Finding, Severity

__all__ = [
    "SETTING_NAMES",
    "TASK_ATTRIBUTES",
    "check_names",
    "declared_queues",
    "lane_findings",
]

#: Every ``claims_*`` setting.
SETTING_NAMES = frozenset(row.key for row in SETTINGS)
#: Every per-task attribute the worker reads (docs/settings.md, *Per-task attributes*).
TASK_ATTRIBUTES = (
    "claims",
    "claims_lease_ms",
    "claims_key",
    "claims_key_namespace",
    "claims_key_conflict",
    "claims_key_reschedule_max",
    "claims_key_reschedule_s",
    "claims_key_done_ttl",
    "claims_ack_on_claim",
    "claims_rate",
    "claims_rate_key",
)
_ALL = sorted(SETTING_NAMES | set(TASK_ATTRIBUTES))


def check_names(conf: Any, tasks: Mapping[str, Any]) -> None:
    """Refuse every unknown ``claims_*`` setting of ``conf`` and attribute of ``tasks``.

    Args:
        conf: a Celery ``app.conf`` (or any mapping).
        tasks: the registered tasks by name (``app.tasks``).

    Raises:
        InvalidArgument: ``name`` is the first unknown name as written (a task attribute as
            ``<task>.<attribute>``); the message says the known name it resembles, and
            names the other unknown ones.
    """
    refusals = [*_unknown_settings(conf), *_unknown_attributes(tasks)]
    if refusals:
        first, *others = refusals
        also = "".join(f"; and {other}" for other in others)
        raise InvalidArgument(first.name, str(first).removeprefix(f"{first.name}: ") + also)


def _written_settings(conf: Any) -> Iterator[tuple[str, str, Callable[[str], str]]]:
    """``(as written, as read, how a setting is written there)`` for each setting of the
    namespace in ``conf``."""
    keys = sorted(key for key in conf if isinstance(key, str))
    # read after the keys: Celery loads its configuration (and sets its prefix) on first use
    prefix = getattr(conf, "prefix", None) or ""
    for written in keys:
        if written.startswith(NAMESPACE):
            yield written, written, str
        elif prefix and written.lower().startswith((prefix + NAMESPACE).lower()):
            # Django-style: Celery reads claims_x as CELERY_CLAIMS_X, in the prefix's case
            yield written, written[len(prefix) :].lower(), partial(_prefixed, prefix)
        elif not prefix and written.lower().startswith(NAMESPACE):
            # CLAIMS_LEASE_MS: Celery reads lower-case names only
            yield written, written.lower(), str


def _prefixed(prefix: str, name: str) -> str:
    # as celery.utils.collections.match_case spells a name under a namespace
    return (prefix + name).upper() if prefix.isupper() else (prefix + name).lower()


def _unknown_settings(conf: Any) -> Iterator[InvalidArgument]:
    for written, read, spell in _written_settings(conf):
        if read in SETTING_NAMES and written == spell(read):
            continue
        if read in TASK_ATTRIBUTES and read not in SETTING_NAMES:
            yield InvalidArgument(
                written,
                f"unknown setting; {read} is a task attribute, not a setting "
                f"(@app.task({read}=...))",
            )
            continue
        like = read if read in SETTING_NAMES else closest(read, _ALL)
        if like is None:
            yield InvalidArgument(written, "unknown setting (docs/settings.md lists them)")
        elif like in SETTING_NAMES:
            spelled = spell(like) if spell(like) == like else f"{spell(like)} ({like})"
            yield InvalidArgument(written, f"unknown setting; did you mean {spelled}?")
        else:
            yield InvalidArgument(
                written,
                f"unknown setting; did you mean {like}? ({like} is a task attribute, not a "
                f"setting)",
            )


def _unknown_attributes(tasks: Mapping[str, Any]) -> Iterator[InvalidArgument]:
    for task_name, task in sorted(tasks.items()):
        # dir() sees what the decorator's options, a Task subclass and task_annotations set
        for attr in dir(task):
            if not attr.startswith(NAMESPACE) or attr in TASK_ATTRIBUTES:
                continue
            where = f"{task_name}.{attr}"
            if attr in SETTING_NAMES:
                yield InvalidArgument(
                    where,
                    f"unknown task attribute; {attr} is a setting, not a task attribute "
                    f"(app.conf.{attr})",
                )
                continue
            like = closest(attr, _ALL)
            if like is None:
                yield InvalidArgument(where, "unknown task attribute (docs/settings.md lists them)")
            elif like in TASK_ATTRIBUTES:
                yield InvalidArgument(where, f"unknown task attribute; did you mean {like}?")
            else:
                yield InvalidArgument(
                    where,
                    f"unknown task attribute; did you mean {like}? ({like} is a setting, not a "
                    f"task attribute)",
                )


# --- lanes that match nothing ---------------------------------------------------------------


def _queue_name(value: object) -> str | None:
    if isinstance(value, str):
        return value
    name = getattr(value, "name", None)  # a kombu Queue
    return name if isinstance(name, str) else None


def declared_queues(conf: Any) -> set[str] | None:
    """The queues ``conf`` declares: ``task_queues``, ``task_default_queue`` and the queues
    of ``task_routes``; None when a router may send a task anywhere (a function, an import
    path, a route without a queue): then no queue can be said to be undeclared."""
    queues = {conf.get("task_default_queue", None) or "celery"}
    declared = conf.get("task_queues", None) or ()
    for queue in declared.keys() if isinstance(declared, Mapping) else declared:
        name = _queue_name(queue)
        if name is not None:
            queues.add(name)
    routes = conf.get("task_routes", None) or ()
    if isinstance(routes, Mapping):
        routes = [routes]
    elif not isinstance(routes, (list, tuple)):
        return None  # one router: a function, or the import path of one
    for router in routes:
        if not isinstance(router, Mapping):
            return None
        for route in router.values():
            target = route.get("queue") if isinstance(route, Mapping) else route
            name = _queue_name(target)
            if name is None:
                return None
            queues.add(name)
    return queues


def lane_findings(
    lanes: Iterable[LaneSpec], conf: Any, tasks: Iterable[str], queues: Iterable[str] = ()
) -> list[Finding]:
    """A warning for each lane no message can be in: none of its queues is declared, or it
    lists ``kinds`` and none of them is a registered task.

    Args:
        lanes: the lanes (``claims_lanes``).
        conf: the configuration declaring the queues (:func:`declared_queues`).
        tasks: the names of the registered tasks.
        queues: more queues known to exist (those a worker consumes, ``-Q``).

    Returns:
        One ``claims_lanes`` warning per such lane, naming it and the declared queue or
        registered task it could have meant.
    """
    declared = declared_queues(conf)
    if declared is not None:
        declared |= set(queues)
    registered = set(tasks)
    findings = []
    for lane in lanes:
        why = []
        if declared is not None and not declared & set(lane.queues):
            why.append(
                f"no queue it names ({_listed(lane.queues)}) is declared (task_queues, "
                f"task_routes, task_default_queue, a worker's -Q){_hint(lane.queues, declared)}"
            )
        if lane.kinds is not None and not registered & lane.kinds:
            kinds = sorted(lane.kinds)
            hint = _hint(kinds, registered)
            why.append(f"no task it lists in kinds ({_listed(kinds)}) is registered{hint}")
        if why:
            findings.append(
                Finding(
                    "claims_lanes",
                    Severity.WARNING,
                    f"lane {lane.name!r} matches nothing: {'; and '.join(why)}",
                )
            )
    return findings


def _listed(names: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in names)


def _hint(names: Iterable[str], known: Iterable[str]) -> str:
    known = sorted(known)
    for name in names:
        like = closest(name, known)
        if like is not None:
            return f"; did you mean {like!r}?"
    return ""
