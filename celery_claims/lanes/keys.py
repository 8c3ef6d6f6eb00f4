"""Every Redis key name of the lane store, spelled in one place.

All keys of one lane carry the lane's hash tag ``{<lane key>}``, so a lane's scripts touch a
single Redis Cluster slot. Lane keys and kinds are escaped before they go into a key name, so a
``{``, ``}`` or ``:`` in them can neither move a key to another slot nor collide with another
lane's or kind's key (the claim store's escape, :func:`celery_claims.claims.keys.escape`).

Layout, for prefix ``P`` and lane key ``L``:

- ``P:lane:{L}:tasks``: hash, task member -> task record (JSON, every value a string)
- ``P:lane:{L}:due:<kind>``: sorted set of the kind's pending and retry tasks, scored by
  ``next_run_at`` (epoch microseconds)
- ``P:lane:{L}:processing:<kind>``: sorted set of the kind's processing tasks, scored by
  ``lease_expires_at`` (epoch microseconds)
- ``P:lane-tasks``: hash, task id -> ``[lane key, kind]``, the one key outside the lanes' slots;
  it finds a task's lane from its id and keeps ids unique across lanes.

A task member is the id zero-padded to 19 digits, so the members' byte order is the ids'
numeric order (the listing's tie-break).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from celery_claims.claims.keys import escape

__all__ = ["LaneKeys", "escape", "member", "task_index_key"]

#: Digits of the largest task id (``2**63 - 1``): every member is padded to this width.
MEMBER_DIGITS = 19


def member(task_id: int) -> str:
    """The zero-padded member naming ``task_id`` in a lane's hash and sorted sets."""
    return f"{task_id:0{MEMBER_DIGITS}d}"


def task_index_key(prefix: str) -> str:
    """The hash that maps each task id to its lane key and kind."""
    return f"{prefix}:lane-tasks"


@dataclass(frozen=True)
class LaneKeys:
    """The keys of one lane, all under the lane's hash tag."""

    prefix: str
    lane_key: str

    @property
    def base(self) -> str:
        """The common start of the lane's keys, hash tag included."""
        return f"{self.prefix}:lane:{{{escape(self.lane_key)}}}"

    @property
    def tasks(self) -> str:
        """The hash of the lane's task records."""
        return f"{self.base}:tasks"

    def due(self, kind: str) -> str:
        """The sorted set of ``kind``'s pending and retry tasks, by ``next_run_at``."""
        return f"{self.base}:due:{escape(kind)}"

    def processing(self, kind: str) -> str:
        """The sorted set of ``kind``'s processing tasks, by ``lease_expires_at``."""
        return f"{self.base}:processing:{escape(kind)}"

    def of_kinds(self, kinds: Iterable[str]) -> list[str]:
        """The KEYS of a script over several kinds: the tasks hash, then each kind's due set,
        then each kind's processing set, kinds in the given order."""
        chosen = list(kinds)
        return [
            self.tasks,
            *(self.due(kind) for kind in chosen),
            *(self.processing(kind) for kind in chosen),
        ]
