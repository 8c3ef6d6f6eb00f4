"""A worker's view of its lanes: each lane's waiting messages and free tickets, a running
task's slot."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from celery_claims.lanes.model import TaskLaneConfig
from celery_claims.worker.settings import LaneSpec

__all__ = ["Lane", "LaneSlot", "LaneWaiter", "Ticket"]


@dataclass(eq=False)
class Ticket:
    """A lane-store record this worker claims to hold one slot of a lane.

    Attributes:
        id: the record's id in the lane store.
        token: its current processing token (the next claim expects it).
    """

    id: int
    token: int


@dataclass(eq=False)
class LaneSlot:
    """A slot a running task holds: the lane and the claimed ticket."""

    lane: Lane
    ticket: Ticket
    released: bool = False


@dataclass(eq=False)
class LaneWaiter:
    """A claimed message waiting for a slot of its lane.

    Attributes:
        request: the worker's ``Request``.
        claim: its :class:`~celery_claims.worker.delivery.lifecycle.Copy`.
        since: when it started waiting (``time.monotonic()``).
        held: its prefetch slot was given back (the lane was full on a pass).
        ticket: the ticket it will claim, once it is among the first ``limit`` waiting.
        key: its key in a keyed lane (``""`` in a lane without a key).
    """

    request: Any
    claim: Any
    since: float = field(default_factory=time.monotonic)
    held: bool = False
    ticket: Ticket | None = None
    key: str = ""


class Lane:
    """The state of one lane in one worker."""

    def __init__(self, spec: LaneSpec) -> None:
        assert spec.limit is not None, "a lane with a rate only is not a Lane"
        self.spec = spec
        self.name = spec.name
        self.kind = spec.name
        self.config: TaskLaneConfig[str, str] = TaskLaneConfig(
            lane=spec.name, kinds=(spec.name,), limit=spec.limit
        )
        self.waiting: deque[LaneWaiter] = deque()
        self.free: list[Ticket] = []
        self.timer_entry: Any = None
        self.pass_at: float | None = None
        self.soon = False
        self.delay_ms = 0
