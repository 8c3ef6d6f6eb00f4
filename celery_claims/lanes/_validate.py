"""Argument checks of the lane algorithm and the shipped stores: the lanes' own (ids, tokens,
candidates, lane registries) over the generic ones of :mod:`celery_claims.validation`.

Every public entry point calls these before it reads or writes anything, so a bad argument
raises :class:`~celery_claims.errors.InvalidValueError` and leaves the store untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Generic

from celery_claims.errors import InvalidValueError
from celery_claims.lanes.model import (
    MAX_PROCESSING_TOKEN,
    MAX_TASK_ID,
    Kind,
    Lane,
    TaskClaimCandidate,
    TaskLaneConfig,
    TaskRecord,
    TaskStatus,
)
from celery_claims.validation import require_int, require_sequence, require_text, require_utc

#: A clock: the current time as a timezone-aware datetime (see ``lanes.dispatch.Clock``).
Clock = Callable[[], datetime]

#: Longest kind or lane key the shipped stores accept (the SQL column width).
MAX_NAME_LENGTH = 255


def utc(name: str, value: object) -> datetime:
    """Check that ``value`` is a timezone-aware datetime and return it in UTC."""
    return require_utc(name, value, error=InvalidValueError)


def non_negative_int(name: str, value: object, maximum: int = MAX_PROCESSING_TOKEN) -> int:
    """Check an ``int`` in ``[0, maximum]``."""
    return require_int(name, value, maximum, error=InvalidValueError)


def task_id(value: object, name: str = "task_id") -> int:
    """Check a task id: an ``int`` in ``[0, MAX_TASK_ID]``."""
    return non_negative_int(name, value, MAX_TASK_ID)


def token(value: object, name: str = "processing_token") -> int:
    """Check a processing token: an ``int`` in ``[0, MAX_PROCESSING_TOKEN]``."""
    return non_negative_int(name, value, MAX_PROCESSING_TOKEN)


def attempt(task: object, processing_token: object) -> None:
    """Check the task id and token naming one processing attempt."""
    task_id(task)
    token(processing_token)


def text(what: str, value: object) -> str:
    """Check text every store can keep (see :func:`~celery_claims.validation.require_text`)."""
    return require_text(what, value, empty=True, error=InvalidValueError)


def kinds(value: object) -> tuple[Any, ...]:
    """Check a non-empty sequence of hashable kinds (a bare string is refused)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, frozenset, set)):
        raise InvalidValueError(f"kinds must be a sequence of kinds, got {value!r}")
    result = tuple(value)
    if not result:
        raise InvalidValueError("kinds must not be empty")
    for kind in result:
        if not isinstance(kind, Hashable):
            raise InvalidValueError(f"kind must be hashable, got {kind!r}")
    return result


def name(what: str, value: object) -> str:
    """Check a name stored by the Redis or SQL store: a non-empty ``str`` of bounded length."""
    if not isinstance(value, str) or not value:
        raise InvalidValueError.about(what, f"must be a non-empty str, got {value!r:.80}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidValueError.about(what, f"must be at most {MAX_NAME_LENGTH} characters")
    return text(what, value)


def candidates(value: object) -> tuple[TaskClaimCandidate, ...]:
    """Check claim candidates: ids, indices and tokens in range, each ``next > expected``."""
    result = require_sequence("candidates", value, "candidates", error=InvalidValueError)
    for candidate in result:
        if not isinstance(candidate, TaskClaimCandidate):
            raise InvalidValueError(f"not a TaskClaimCandidate: {candidate!r}")
        non_negative_int("candidate index", candidate.index)
        task_id(candidate.task_id, "candidate task_id")
        expected = token(candidate.expected_processing_token, "expected_processing_token")
        following = token(candidate.next_processing_token, "next_processing_token")
        # Tokens only grow: a claim that kept or lowered the token would let a stale attempt
        # pass for the new one.
        if following <= expected:
            raise InvalidValueError(
                f"candidate for task {candidate.task_id}: next_processing_token {following} "
                f"must be greater than expected_processing_token {expected}"
            )
    return result


def candidate_keys(keys: object, count: int, limit_per_key: object, limit: int) -> tuple[str, ...]:
    """Check the keys of a keyed claim pass: one name per candidate, with a per-key limit
    from 1 to the lane's limit; no keys (``None``) needs ``limit_per_key`` 0. Returns the key
    of each candidate (``""`` for an unkeyed pass)."""
    per_key = non_negative_int("limit_per_key", limit_per_key)
    if keys is None:
        if per_key != 0:
            raise InvalidValueError("limit_per_key needs keys, one per candidate")
        return ("",) * count
    given = require_sequence("keys", keys, "str", error=InvalidValueError)
    result = tuple(name("candidate key", key) for key in given)
    if len(result) != count:
        raise InvalidValueError(f"{len(result)} keys for {count} candidates: give one each")
    if not 1 <= per_key <= max(limit, 1):
        raise InvalidValueError(
            f"limit_per_key must be from 1 to the lane's limit ({limit}), got {per_key}"
        )
    return result


def claim_window(
    stale_before: object, claimed_at: object, lease_expires_at: object
) -> tuple[datetime, datetime, datetime]:
    """Check the three times of ``claim_candidates_for_lane`` and their order."""
    stale = utc("stale_before", stale_before)
    claimed = utc("claimed_at", claimed_at)
    lease = utc("lease_expires_at", lease_expires_at)
    if stale > claimed:
        raise InvalidValueError("stale_before must not be after claimed_at")
    # A lease that is already over would make the claimed task claimable again at once.
    if lease <= claimed:
        raise InvalidValueError("lease_expires_at must be after claimed_at")
    return stale, claimed, lease


def listing_times(now: object, stale_before: object) -> tuple[datetime, datetime]:
    """Check the ``now`` and ``stale_before`` of a listing."""
    current = utc("now", now)
    stale = utc("stale_before", stale_before)
    if stale > current:
        raise InvalidValueError("stale_before must not be after now")
    return current, stale


def lane_config(value: object) -> TaskLaneConfig[Any, Any]:
    """Check that ``value`` is a :class:`TaskLaneConfig` (its fields check themselves)."""
    if not isinstance(value, TaskLaneConfig):
        raise InvalidValueError(f"lane_config must be a TaskLaneConfig, got {value!r}")
    return value


class LaneRegistry(Generic[Kind, Lane]):
    """The lanes a store serves: which lane each kind belongs to.

    Stores are built with their lanes so they can keep a lane's tasks together (one Redis hash
    tag, one SQL lock row) and refuse kinds and lane configs they do not know.
    """

    def __init__(self, lanes: Iterable[TaskLaneConfig[Kind, Lane]], *, str_kinds: bool) -> None:
        if isinstance(lanes, (str, bytes, Mapping)) or not isinstance(lanes, Iterable):
            raise InvalidValueError(f"lanes must be an iterable of TaskLaneConfig, got {lanes!r}")
        self.by_key: dict[str, TaskLaneConfig[Kind, Lane]] = {}
        self.lane_of_kind: dict[Kind, TaskLaneConfig[Kind, Lane]] = {}
        for config in lanes:
            lane_config(config)
            key = name("lane key", config.lane_key)
            if key in self.by_key:
                raise InvalidValueError(f"two lanes share the lane key {key!r}")
            for kind in config.kinds:
                if str_kinds:
                    name("kind", kind)
                if kind in self.lane_of_kind:
                    # A kind counted by two lanes would let each lane fill up independently.
                    raise InvalidValueError(f"kind {kind!r} belongs to two lanes")
                self.lane_of_kind[kind] = config
            self.by_key[key] = config
        if not self.by_key:
            raise InvalidValueError("a store needs at least one lane")

    def lane_for_kind(self, kind: object) -> TaskLaneConfig[Kind, Lane]:
        """The registered lane of ``kind``."""
        try:
            # Any object may arrive here; an unhashable one raises TypeError, handled below.
            return self.lane_of_kind[kind]  # type: ignore[index]
        except (KeyError, TypeError):
            raise InvalidValueError(f"kind {kind!r} belongs to no lane of this store") from None

    def new_task(
        self, task: object, kind: Kind, next_run_at: object, payload: object, clock: Clock
    ) -> tuple[TaskLaneConfig[Kind, Lane], TaskRecord[Kind]]:
        """Check an ``enqueue``: the new task's lane and its pending record (due at
        ``clock()`` when ``next_run_at`` is None)."""
        checked = task_id(task)
        lane = self.lane_for_kind(kind)
        due = utc("next_run_at", clock() if next_run_at is None else next_run_at)
        text("payload", payload)
        return lane, TaskRecord(checked, kind, TaskStatus.PENDING, 0, due, payload=str(payload))

    def check_kinds(self, value: object) -> tuple[Kind, ...]:
        """Check a kinds argument: non-empty, every kind registered."""
        result = kinds(value)
        for kind in result:
            self.lane_for_kind(kind)
        return result

    def registered(self, config: object) -> TaskLaneConfig[Kind, Lane]:
        """The registered lane matching ``config`` (same lane, key and kinds; any limit)."""
        checked = lane_config(config)
        known = self.by_key.get(checked.lane_key)
        if known is None or known.lane != checked.lane or set(known.kinds) != set(checked.kinds):
            raise InvalidValueError(
                f"lane {checked.lane!r} with kinds {checked.kinds!r} is not a lane of this store"
            )
        return known
