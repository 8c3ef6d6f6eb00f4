"""A pool report after a request's last one (no pool sends one; a gevent timeout firing after
the success handler could): Celery's own handler still runs, as it did while the hooks kept
the ended copy, except for a fenced copy, whose ack could delete the live owner's message.

The hooks let go of the copy after the last report (so that no reference cycle is left for
the garbage collector: ``test_cyclic_garbage.py``); what a late report needs is kept apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.gate import _Hooks


def _hooks(*, stale_why: str = "") -> _Hooks:
    """The hooks of a copy whose pool reported its last (the lifecycle is not reached)."""
    copy = Copy(
        request=object(),
        owner="w@host/1/abc",
        queue_id="q",
        task_key="t-1:0:0",
        lease_ms=30_000,
        guarded=True,
        stale_why=stale_why,
    )
    life: Any = None
    hooks = _Hooks(copy, life)
    hooks.reported()
    assert hooks.copy is None
    return hooks


REPORTS: dict[str, Callable[[_Hooks, Callable[[], object]], object]] = {
    "success": lambda hooks, handler: hooks.succeeded(handler),
    "failure": lambda hooks, handler: hooks.failed(ValueError("late"), handler),
    "hard time limit": lambda hooks, handler: hooks.timed_out(False, handler),
    "soft time limit": lambda hooks, handler: hooks.timed_out(True, handler),
}


@pytest.mark.parametrize("report", list(REPORTS))
def test_a_late_report_of_an_ended_copy_runs_celerys_handler(report: str) -> None:
    # Given the hooks of a copy that ended (its pool's last report routed)
    hooks = _hooks()
    ran: list[str] = []

    # When the pool reports once more
    REPORTS[report](hooks, lambda: ran.append(report))

    # Then Celery's handler runs, whatever the claim store would say
    assert ran == [report]


@pytest.mark.parametrize("report", ["success", "failure", "hard time limit"])
def test_a_late_report_of_a_fenced_copy_never_runs_celerys_handler(report: str) -> None:
    # Given the hooks of a copy that ended fenced (its lease was lost)
    hooks = _hooks(stale_why="lease lost")
    ran: list[str] = []

    # When the pool reports once more
    REPORTS[report](hooks, lambda: ran.append(report))

    # Then Celery's handler does not run: its ack could delete the live owner's message
    assert ran == []
