"""8 processes race for 20 tasks with short leases; an independent checker audits every grant."""

from __future__ import annotations

import itertools
import multiprocessing
import uuid
from collections import defaultdict

import pytest

from tests.redis._hammer import Grant, hammer
from tests.servers import RedisServer

PROCESSES = 8
TASKS = 20
SECONDS = 4.0


def audit(grants: list[Grant]) -> list[str]:
    """Every violation of the claim invariants found in ``grants`` (empty: none).

    Per task, grants sorted by instance must have non-decreasing ``created_at`` (instances
    strictly increase in time), and a grant to another owner may start before the previous
    lease ended only if that lease was released and the new grant was a plain success.
    A takeover must start at or after the previous lease's (final, extended) expiry.
    """
    problems = []
    by_task: dict[str, list[Grant]] = defaultdict(list)
    for grant in grants:
        by_task[grant[0]].append(grant)
    for task_id, task_grants in by_task.items():
        task_grants.sort(key=lambda g: g[1])
        instances = [g[1] for g in task_grants]
        if len(set(instances)) != len(instances):
            problems.append(f"{task_id}: an instance was issued twice: {instances}")
        for prev, nxt in itertools.pairwise(task_grants):
            _, p_inst, p_owner, _, p_created, p_expires, p_released = prev
            _, n_inst, n_owner, n_how, n_created, _, _ = nxt
            if n_created < p_created:
                problems.append(f"{task_id}: instance {n_inst} created before {p_inst}")
            if n_owner == p_owner:
                continue
            overlaps = n_created < p_expires
            if overlaps and not (p_released and n_how == "success"):
                problems.append(
                    f"{task_id}: {n_owner} got instance {n_inst} ({n_how}) at {n_created} "
                    f"while {p_owner} held instance {p_inst} until {p_expires}"
                )
            if n_how == "took-over" and overlaps:
                problems.append(f"{task_id}: takeover of a live lease at instance {n_inst}")
    return problems


def test_the_auditor_catches_overlapping_leases() -> None:
    honest = [
        ("t", 1, "a", "success", 0, 10, False),
        ("t", 2, "b", "took-over", 10, 20, False),
        ("t", 3, "c", "success", 15, 30, False),  # b held it until 20 and never released
    ]
    assert len(audit(honest)) == 1
    assert audit(honest[:2]) == []


@pytest.mark.slow
def test_no_two_owners_ever_hold_overlapping_leases_under_contention(
    redis_server: RedisServer,
) -> None:
    prefix = f"hammer-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(PROCESSES) as pool:
        per_process = pool.starmap(
            hammer,
            [(redis_server.url, prefix, f"owner-{i}", TASKS, SECONDS, i) for i in range(PROCESSES)],
        )

    grants = [g for grants in per_process for g in grants]
    assert audit(grants) == []
    # the run really was contended: many grants, many takeovers, every process won some
    assert len(grants) > 500
    assert sum(1 for g in grants if g[3] == "took-over") > 50
    assert all(per_process)
    tasks_seen = {g[0] for g in grants}
    assert len(tasks_seen) == TASKS
