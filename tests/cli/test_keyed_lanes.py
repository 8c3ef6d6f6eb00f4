"""Per-key occupancy of a keyed lane in ``claims stats`` and the store exporter: the busiest
keys only (top N), read from live leases."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from celery_claims import RedisClaimManager
from celery_claims.lanes import TaskClaimCandidate, TaskLaneConfig
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.metrics import StoreCollector
from tests.cli.conftest import json_of, run_cli
from tests.servers import RedisServer

EXPORTS = TaskLaneConfig(lane="exports", kinds=("exports",), limit=20)


def _busy_lane(url: str, prefix: str) -> RedisTaskClaimStore:
    """Lane ``exports`` with live keyed slots: acme 3, beta 2, then 12 keys of 1."""
    store = RedisTaskClaimStore(url=url, lanes=[EXPORTS], prefix=prefix)
    now = datetime.now(timezone.utc)
    keys = ["'acme'"] * 3 + ["'beta'"] * 2 + [f"'k{i:02d}'" for i in range(12)]
    for ticket in range(1, len(keys) + 2):
        store.enqueue(ticket, "exports", next_run_at=now - timedelta(seconds=1))
    candidates = [TaskClaimCandidate(i, i + 1, 0, 1) for i in range(len(keys))]
    claimed = store.claim_candidates_for_lane(
        EXPORTS, candidates, now, now, now + timedelta(minutes=5), keys=keys, limit_per_key=3
    )
    assert len(claimed) == len(keys)
    return store


def test_stats_shows_the_busiest_keys_of_a_keyed_lane(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given a keyed lane with 17 live slots over 14 keys
    store = _busy_lane(redis_server.url, key_prefix)
    try:
        # When the operator asks for stats with the top 3 keys, as JSON and as a table
        base = ("--redis-url", redis_server.url, "--prefix", key_prefix, "stats", "--top-keys")
        data = json_of(run_cli(*base, "3", "--json"))
        table = run_cli(*base, "2")
    finally:
        store.close()

    # Then the lane's per-key occupancy lists the busiest keys, most first
    (lane,) = data["lanes"]
    assert (lane["lane"], lane["active"], lane["waiting"]) == ("exports", 17, 1)
    assert lane["keys"] == [["'acme'", 3], ["'beta'", 2], ["'k00'", 1]]
    assert table.returncode == 0, table.stderr
    assert "TOP KEYS (RUNNING)" in table.stdout
    assert "'acme'=3, 'beta'=2" in table.stdout
    assert "'k00'" not in table.stdout


def test_the_exporter_labels_only_the_busiest_keys(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given the same lane, and a store exporter on it
    store = _busy_lane(redis_server.url, key_prefix)
    manager = RedisClaimManager(url=redis_server.url, prefix=key_prefix)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(manager))

    # When it is scraped
    try:
        text = generate_latest(registry).decode()
    finally:
        store.close()
        manager.client.close()

    # Then per-key gauges exist for the 10 busiest keys only (bounded label cardinality)
    per_key = [line for line in text.splitlines() if line.startswith("celery_claims_lane_key")]
    assert len(per_key) == 10
    assert 'celery_claims_lane_key_active{key="\'acme\'",lane="exports"} 3.0' in per_key
    assert 'celery_claims_lane_active{kind="exports",lane="exports"} 17.0' in text
