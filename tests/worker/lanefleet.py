"""Helpers of the lane and stale-copy tests: workers of ``tests.worker.apps.lanes_app``."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import redis

from tests.worker.helpers import HELD_RECHECK_MS, LEASE_MS, RENEW_INTERVAL_MS
from tests.worker.processes import Fleet, Proc


def lanes_worker(
    fleet: Fleet,
    name: str,
    *,
    broker: str,
    backend: str,
    queue: str,
    lanes: dict[str, Any] | None = None,
    pool: str = "prefork",
    concurrency: int = 2,
    lane_recheck_ms: int = 500,
    env: dict[str, str] | None = None,
    journal_recover_after_ms: int | None = None,
) -> Proc:
    """Start ``celery worker`` on ``tests.worker.apps.lanes_app`` for ``queue`` and its
    ``-other`` queue, with the short leases of the worker tests (``journal_recover_after_ms``:
    recover the publish journal that soon, scanning every half second)."""
    args = [
        "-A", "tests.worker.apps.lanes_app", "worker",
        "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-l", "INFO",
        "-Q", f"{queue},{queue}-other",
        "--without-mingle", "--without-gossip", "--without-heartbeat",
        "--claims-lease-ms", str(LEASE_MS),
        "--claims-renew-interval-ms", str(RENEW_INTERVAL_MS),
        "--claims-held-recheck-ms", str(HELD_RECHECK_MS),
        "--claims-lane-recheck-ms", str(lane_recheck_ms),
        "--claims-socket-timeout-ms", "1000",
    ]  # fmt: skip
    if journal_recover_after_ms is not None:
        args += [
            "--claims-journal-recover-after-ms", str(journal_recover_after_ms),
            "--claims-journal-scan-interval-ms", "500",
        ]  # fmt: skip
    environ = {
        "CLAIMS_TEST_BROKER": broker,
        "CLAIMS_TEST_BACKEND": backend,
        "CLAIMS_TEST_QUEUE": queue,
        "CLAIMS_TEST_LANES": json.dumps(lanes or {}),
        **(env or {}),
    }
    return fleet._spawn(name, args, environ)


def events(backend: str, queue: str) -> list[dict[str, Any]]:
    """Everything the lane app's tasks and workers logged for ``queue``."""
    with contextlib.closing(redis.Redis.from_url(backend)) as client:
        return [json.loads(raw) for raw in client.lrange(f"intervals:{queue}", 0, -1)]


def counters(backend: str, queue: str) -> dict[str, dict[str, int]]:
    """The last counters each worker published: node name -> counters."""
    with contextlib.closing(redis.Redis.from_url(backend)) as client:
        found = {}
        for key in client.scan_iter(match=f"counters:{queue}:*"):
            name = key.decode().rsplit(":", 1)[1]
            found[name] = json.loads(client.get(key) or b"{}")
        return found


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals that overlap at one instant."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in edges:  # at equal times an end (-1) sorts before a start (+1)
        running += step
        peak = max(peak, running)
    return peak
