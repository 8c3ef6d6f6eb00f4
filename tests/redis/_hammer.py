"""A process that hammers a few tasks with short leases and records every grant it got.

Lives in its own importable module so ``multiprocessing``'s spawn context can run it.
"""

from __future__ import annotations

import random
import time

from celery_claims import ClaimToken, RedisClaimManager, TookOver
from celery_claims.errors import ClaimTokenError

#: One recorded grant: task, instance, owner, how it was won, created_at, final expires_at,
#: and whether this owner released it (which may end it before expires_at).
Grant = tuple[str, int, str, str, int, int, bool]


def hammer(url: str, prefix: str, owner: str, tasks: int, seconds: float, seed: int) -> list[Grant]:
    with RedisClaimManager(url=url, prefix=prefix) as manager:
        return _hammer(manager, owner, tasks, seconds, seed)


def _hammer(
    manager: RedisClaimManager, owner: str, tasks: int, seconds: float, seed: int
) -> list[Grant]:
    rng = random.Random(seed)
    grants: dict[tuple[str, int], list[object]] = {}
    held: dict[str, ClaimToken] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        task_id = f"task-{rng.randrange(tasks)}"
        action = rng.random()
        token = held.get(task_id)
        if token is not None and action < 0.3:
            try:
                token = manager.extend("hammer", token, rng.randint(1, 15))
            except ClaimTokenError:
                del held[task_id]
                continue
            held[task_id] = token
            grants[(task_id, token.instance)][5] = token.expires_at
        elif token is not None and action < 0.5:
            del held[task_id]
            try:
                manager.release(token)
            except ClaimTokenError:
                continue
            grants[(task_id, token.instance)][6] = True
        else:
            result = manager.claim("hammer", task_id, owner, rng.randint(1, 20))
            if result.token is None:
                continue
            t = result.token
            how = "took-over" if isinstance(result, TookOver) else "success"
            grants[(task_id, t.instance)] = [
                task_id, t.instance, owner, how, t.created_at, t.expires_at, False
            ]  # fmt: skip
            held[task_id] = t
    return [tuple(g) for g in grants.values()]  # type: ignore[misc]
