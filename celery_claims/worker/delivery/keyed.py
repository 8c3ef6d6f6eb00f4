"""Keyed claims: a task claimed on a business key made from its arguments.

A task that declares ``claims_key`` (an argument name, a tuple of names, or a callable of
``(args, kwargs)``) is claimed on that key instead of its task id: at most one of its
messages with a given key runs at once, fleet-wide, with the lease, renewal, takeover and
fencing number of any claim. The key's claim is taken in the message's queue, scoped by the
task's name, or in ``claims_key_namespace``, a claim queue of its own that several tasks
share; its field is ``<scope>[<key>]``.

The owner of a keyed claim names the attempt that holds the key
(:func:`~celery_claims.claims.keys.keyed_owner`), so that:

- the claim store writes the completion record under the attempt's own task key: a later copy
  of that attempt is skipped as done, while the key is free for the next task at once;
- with ``claims_key_done_ttl``, a second record is written under the key: any task id with
  that key is then skipped for that long (an idempotency key, like a payment id);
- the gate tells a redelivered copy of the holder itself (held, whatever the policy) from
  another task with the same key, which meets the task's conflict policy
  (``claims_key_conflict``): ``wait`` (held unacked and re-checked, like any held copy),
  ``skip`` (acked without running, recorded as skipped with the holder's id) or
  ``reschedule`` (published again with a countdown, at most ``claims_key_reschedule_max``
  times, then ``wait``).

A key that cannot be made from a message (a missing argument, a value that is not a str, int,
float, bool, None, UUID or a tuple/list of them, or one over :data:`MAX_KEY_CHARS`) refuses
that message: it is recorded as failed with a :class:`~celery_claims.errors.KeyRefused` and
acknowledged, never run unkeyed (:meth:`Lifecycle.refuse`). Bad declarations stop the worker
at start (:func:`key_spec`, called by :func:`~celery_claims.worker.policy.check_task_policies`).
"""

from __future__ import annotations

import inspect
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery_claims.claims.keys import keyed_owner, owner_task_key
from celery_claims.config import KEY_CONFLICTS, KeyFunction, parse_key_declaration, setting
from celery_claims.errors import InvalidArgument, KeyRefused
from celery_claims.validation import MAX_ID_BYTES
from celery_claims.worker.compat import request_fields
from celery_claims.worker.settings import ClaimsSettings

__all__ = [
    "CONFLICTS",
    "MAX_KEY_CHARS",
    "RESCHEDULES_HEADER",
    "KeySpec",
    "KeySpecs",
    "KeyedClaim",
    "signature_of",
    "check_key_arguments",
    "key_spec",
    "key_text",
    "task_id_of",
]

#: The conflict policies of a keyed task (``claims_key_conflict``).
CONFLICTS = KEY_CONFLICTS
#: The longest key text (after ``repr``) a message may have; a longer one is refused.
MAX_KEY_CHARS = 200
#: The longest ``claims_key_namespace``.
MAX_NAMESPACE_CHARS = 100
#: The longest ``claims_key_done_ttl`` (seconds): the longest retention a record may have.
MAX_KEY_DONE_TTL_S = 30 * 24 * 3600
#: The message header counting how often a copy was rescheduled for a held key.
RESCHEDULES_HEADER = "claims_key_reschedules"
#: Nesting a key value may have (tuples of tuples...).
_MAX_DEPTH = 4

#: The per-task attributes of keyed claims, besides ``claims_key`` itself.
_KEY_ATTRIBUTES = (
    "claims_key_namespace",
    "claims_key_conflict",
    "claims_key_reschedule_max",
    "claims_key_reschedule_s",
    "claims_key_done_ttl",
)


def task_id_of(task_key: str) -> str:
    """The Celery task id of a claim's task key ``<task id>:<retries>:<nesting>``."""
    return task_key.rsplit(":", 2)[0]


@dataclass(frozen=True)
class KeySpec:
    """The keyed-claim declaration of one task, validated.

    Attributes:
        task_name: the task.
        names: the argument names the key is made of (empty with ``fn``).
        fn: the callable ``(args, kwargs) -> key value``, or None.
        signature: the task's signature, to bind a message's arguments (None if unknown).
        namespace: the shared claim queue, or None for the message's queue.
        conflict: ``"wait"``, ``"skip"`` or ``"reschedule"``.
        reschedule_max: most reschedules of one message before it waits.
        reschedule_s: the countdown of a rescheduled copy.
        done_ttl_ms: how long a completed key skips any task id (0: not at all).
    """

    task_name: str
    names: tuple[str, ...]
    fn: KeyFunction | None
    signature: inspect.Signature | None
    namespace: str | None
    conflict: str
    reschedule_max: int
    reschedule_s: float
    done_ttl_ms: int

    @property
    def scope(self) -> str:
        """What the key is unique within: the namespace, else the task."""
        return self.namespace if self.namespace is not None else self.task_name

    def field(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The claim's field for a message's arguments: ``<scope>[<key>]``.

        Raises:
            KeyRefused: the key cannot be made from these arguments.
        """
        text = key_text(self.task_name, self.names, self.fn, self.signature, args, kwargs)
        return f"{self.scope}[{text}]"


def key_text(
    task_name: str,
    names: Sequence[str],
    fn: KeyFunction | None,
    signature: inspect.Signature | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> str:
    """The key text of a message of ``task_name``: from the arguments ``names`` (bound with
    ``signature`` when known), or what ``fn(args, kwargs)`` returns; at most
    :data:`MAX_KEY_CHARS` characters.

    Raises:
        KeyRefused: the key cannot be made from these arguments.
    """
    value = _value(task_name, names, fn, signature, tuple(args or ()), dict(kwargs or {}))
    text = _text(value, task_name, 0)
    if len(text) > MAX_KEY_CHARS:
        raise KeyRefused(
            task_name, f"the key is {len(text)} characters long; at most {MAX_KEY_CHARS}"
        )
    return text


def _value(
    task_name: str,
    names: Sequence[str],
    fn: KeyFunction | None,
    signature: inspect.Signature | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> object:
    if fn is not None:
        try:
            return fn(args, kwargs)
        except Exception as exc:
            raise KeyRefused(
                task_name, f"the claims_key callable raised {type(exc).__name__}: {exc}"
            ) from exc
    arguments: Mapping[str, Any] = kwargs
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise KeyRefused(task_name, f"the arguments do not bind: {exc}") from None
        bound.apply_defaults()
        arguments = {**kwargs, **bound.arguments}
    values = []
    for name in names:
        if name not in arguments:
            raise KeyRefused(task_name, f"the message has no argument {name!r}")
        values.append(arguments[name])
    return values[0] if len(values) == 1 else tuple(values)


def _text(value: object, task_name: str, depth: int) -> str:
    """The key text of a value: ``repr`` for scalars, ``(a, b)`` for tuples and lists (a tuple
    sent as JSON arrives as a list: both make one key)."""
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise KeyRefused(task_name, f"a key value must be finite, got {value!r}")
        return repr(value)
    if isinstance(value, uuid.UUID):
        value = str(value)
    if isinstance(value, str):
        if len(value) > MAX_KEY_CHARS:
            raise KeyRefused(
                task_name, f"a key value is {len(value)} characters long; at most {MAX_KEY_CHARS}"
            )
        return repr(value)
    if isinstance(value, (tuple, list)) and depth < _MAX_DEPTH:
        if len(value) > MAX_KEY_CHARS:
            raise KeyRefused(task_name, f"a key value has {len(value)} items")
        return "(" + ", ".join(_text(v, task_name, depth + 1) for v in value) + ")"
    raise KeyRefused(
        task_name,
        f"a {type(value).__name__} value cannot be a claim key (use str, int, float, bool, "
        f"None, UUID, or tuples of them; a claims_key callable can make one)",
    )


@dataclass(frozen=True)
class KeyedClaim:
    """One message's keyed claim (``Copy.key``).

    Attributes:
        spec: its task's declaration.
        queue: the queue the message came from (its lane is looked up by it).
        claim_queue: where the key's claim is taken (the namespace, else ``queue``).
        field: the key's field (``<scope>[<key>]``).
        task_key: the attempt of the message (``<task id>:<retries>:<nesting>``).
        reschedules: how often this message was rescheduled for a held key already.
    """

    spec: KeySpec
    queue: str
    claim_queue: str
    field: str
    task_key: str
    reschedules: int

    def owner(self, plain_owner: str) -> str:
        """The claim's owner for a delivery whose plain owner is ``plain_owner``."""
        return keyed_owner(plain_owner, self.task_key, self.spec.done_ttl_ms)

    def is_own(self, owner: str) -> bool:
        """True if ``owner`` (of a claim or record) is an attempt of this message's task id."""
        held_by = owner_task_key(owner)
        return held_by is None or task_id_of(held_by) == task_id_of(self.task_key)

    def policy(self, holder: str) -> str:
        """What to do while ``holder`` holds the key: ``wait``, ``skip`` or ``reschedule``.

        A copy of the holder's own task id (a redelivery, or its retry published before the
        attempt ended) always waits: it is the same work, not another task on the key.
        """
        if self.is_own(holder):
            return "wait"
        if self.spec.conflict == "reschedule" and self.reschedules >= self.spec.reschedule_max:
            return "wait"
        return self.spec.conflict


class KeySpecs:
    """The keyed-claim declarations of a worker's tasks, made once per task name.

    Args:
        settings: the worker's settings (the defaults of the per-task attributes).
    """

    def __init__(self, settings: ClaimsSettings) -> None:
        self.settings = settings
        self._specs: dict[str, KeySpec | InvalidArgument | None] = {}

    def of(self, task: Any, name: str) -> KeySpec | None:
        """The declaration of ``task`` (None when it is not keyed).

        Raises:
            KeyRefused: its declaration is invalid (a task registered after the worker
                started, so never checked): its messages are refused, never run unkeyed.
        """
        spec = self._specs.get(name, _MISSING)
        if spec is _MISSING:
            try:
                spec = key_spec(task, name, self.settings)
            except InvalidArgument as exc:
                spec = exc
            self._specs[name] = spec
        if isinstance(spec, InvalidArgument):
            raise KeyRefused(name, f"invalid declaration: {spec}")
        assert spec is None or isinstance(spec, KeySpec)
        return spec

    def claim(
        self, spec: KeySpec, request: Any, queue: str, task_key: str, owner_len: int
    ) -> KeyedClaim:
        """The keyed claim of ``request`` (from ``queue``, attempt ``task_key``).

        Raises:
            KeyRefused: its key cannot be made from its arguments.
        """
        field = spec.field(request.args, request.kwargs)
        if len(task_key.encode("utf-8")) * 3 + owner_len + 32 > MAX_ID_BYTES:
            # the owner carries the task key: a huge task id cannot be named in it
            raise KeyRefused(spec.task_name, "the task id is too long for a keyed claim")
        reschedules = request_fields(request).get(RESCHEDULES_HEADER) or 0
        return KeyedClaim(
            spec=spec,
            queue=queue,
            claim_queue=spec.namespace if spec.namespace is not None else queue,
            field=field,
            task_key=task_key,
            reschedules=reschedules if isinstance(reschedules, int) else 0,
        )


_MISSING: Any = object()


def key_spec(task: Any, name: str, settings: ClaimsSettings) -> KeySpec | None:
    """Validate the keyed-claim attributes of ``task`` (None when it declares no key).

    Raises:
        InvalidArgument: an attribute has the wrong type or value, names an argument the
            task does not take, or is given without ``claims_key``.
    """
    raw = getattr(task, "claims_key", None)
    if raw is None:
        for attr in _KEY_ATTRIBUTES:
            if getattr(task, attr, None) is not None:
                raise InvalidArgument(f"{name}.{attr}", "is set but claims_key is not")
        return None
    if inspect.ismethod(raw) and raw.__self__ is task:
        # a function given to @app.task(claims_key=...) is a class attribute of the task,
        # so reading it from the task binds it: the user's function is the unbound one
        raw = raw.__func__
    where = f"{name}.claims_key"
    if getattr(task, "claims", True) is False:
        raise InvalidArgument(where, "is set on a task with claims = False")
    signature = signature_of(task)
    names, fn = parse_key_declaration(where, raw)
    check_key_arguments(where, name, names, signature)
    return KeySpec(
        task_name=name,
        names=names,
        fn=fn,
        signature=signature,
        namespace=_namespace(name, getattr(task, "claims_key_namespace", None)),
        conflict=_conflict(name, getattr(task, "claims_key_conflict", None), settings),
        reschedule_max=_reschedule_max(
            name, getattr(task, "claims_key_reschedule_max", None), settings
        ),
        reschedule_s=_reschedule_s(name, getattr(task, "claims_key_reschedule_s", None), settings),
        done_ttl_ms=_done_ttl_ms(name, getattr(task, "claims_key_done_ttl", None)),
    )


def check_key_arguments(
    where: str, name: str, names: Sequence[str], signature: inspect.Signature | None
) -> None:
    """Check that task ``name`` takes every argument a key is made of.

    Raises:
        InvalidArgument: it takes no argument of one of ``names`` (``name`` is ``where``).
    """
    for arg in names:
        if signature is not None and not _takes(signature, arg):
            raise InvalidArgument(where, f"{name} takes no argument {arg!r}")


def signature_of(task: Any) -> inspect.Signature | None:
    """The signature of ``task``'s ``run`` (without ``self``), or None if unknown."""
    run = getattr(task, "run", None)
    try:
        # a bound task's run is a bound method: `self` is not a parameter
        return inspect.signature(run) if run is not None else None
    except (TypeError, ValueError):
        return None


def _takes(signature: inspect.Signature, arg: str) -> bool:
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return True
    param = signature.parameters.get(arg)
    return param is not None and param.kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.POSITIONAL_ONLY,
    )


def _namespace(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_NAMESPACE_CHARS:
        raise InvalidArgument(
            f"{name}.claims_key_namespace",
            f"must be a non-empty str of at most {MAX_NAMESPACE_CHARS} characters, "
            f"got {value!r:.80}",
        )
    return value


def _conflict(name: str, value: object, settings: ClaimsSettings) -> str:
    if value is None:
        return settings.key_conflict
    if value not in CONFLICTS:
        raise InvalidArgument(
            f"{name}.claims_key_conflict", f"must be one of {CONFLICTS}, got {value!r:.80}"
        )
    return str(value)


def _reschedule_max(name: str, value: object, settings: ClaimsSettings) -> int:
    if value is None:
        return settings.key_reschedule_max
    parsed: int = setting("claims_key_reschedule_max").parse(
        f"{name}.claims_key_reschedule_max", value
    )
    return parsed


def _reschedule_s(name: str, value: object, settings: ClaimsSettings) -> float:
    if value is None:
        return settings.key_reschedule_s
    parsed: float = setting("claims_key_reschedule_s").parse(
        f"{name}.claims_key_reschedule_s", value
    )
    return parsed


def _done_ttl_ms(name: str, value: object) -> int:
    if value is None:
        return 0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_KEY_DONE_TTL_S
    ):
        raise InvalidArgument(
            f"{name}.claims_key_done_ttl",
            f"must be a number of seconds in (0, {MAX_KEY_DONE_TTL_S}], got {value!r:.80}",
        )
    return max(int(value * 1000), 1)
