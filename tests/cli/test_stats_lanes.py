"""``claims stats`` and the store's Prometheus exporter show every configured lane, idle ones
as 0 of their limit, and count as waiting only the messages waiting for a slot (issue 30, item
5), on a real prefork worker whose lane ``video`` (limit 1) runs jobs, and whose lane ``idle``
never ran one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.metrics import StoreCollector
from tests.servers import redis_server
from tests.worker.helpers import wait_for
from tests.worker.processes import Fleet

pytestmark = pytest.mark.slow

APP = "tests.cli.lanes_app"
QUEUE = "video-jobs"


@dataclass
class LaneFleet:
    url: str
    fleet: Fleet
    client: Celery

    def stats(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``celery -A tests.cli.lanes_app claims stats ARGS...`` (the app names the lanes)."""
        env = {**os.environ, "CLAIMS_TEST_BROKER": self.url, "CLAIMS_TEST_QUEUE": QUEUE}
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "claims", "stats", *args],
            capture_output=True, text=True, timeout=60, check=False, env=env,
        )  # fmt: skip

    def lanes(self) -> dict[str, dict[str, Any]]:
        result = self.stats("--json")
        assert result.returncode == 0, result.stderr
        return {lane["lane"]: lane for lane in json.loads(result.stdout)["lanes"]}

    def exported(self) -> dict[str, dict[str, float]]:
        """The store exporter's lane gauges: lane -> {active, waiting, limit} (the app's
        limits, as ``claims serve-metrics`` and a worker's exporter pass them)."""
        manager = RedisClaimManager(url=self.url)
        try:
            families = list(StoreCollector(manager, lane_limits={"video": 1, "idle": 3}).collect())
        finally:
            manager.client.close()
        lanes: dict[str, dict[str, float]] = {}
        for family in families:
            what = family.name.removeprefix("celery_claims_lane_")
            if what in ("active", "waiting", "limit"):
                for sample in family.samples:
                    lanes.setdefault(sample.labels["lane"], {})[what] = sample.value
        return lanes

    def video(self) -> dict[str, Any]:
        """Lane ``video`` as ``stats --json`` shows it (nothing known: active -1)."""
        return self.lanes().get("video", {"active": -1, "waiting": 0})


@pytest.fixture
def lane_fleet() -> Iterator[LaneFleet]:
    """A prefork worker (-c 2) of the two-lane app on a private Redis."""
    fleet = Fleet()
    try:
        with redis_server() as server:
            fleet.worker("a", broker=server.url, backend=server.url, queue=QUEUE, app=APP)
            fleet.procs[0].wait_ready()
            yield LaneFleet(server.url, fleet, fleet.client(server.url, server.url, QUEUE))
    finally:
        fleet.cleanup()


def test_stats_shows_every_configured_lane_an_idle_one_as_0_of_its_limit(
    lane_fleet: LaneFleet,
) -> None:
    # Given a worker whose lanes never ran a task
    # When the operator asks for stats
    lanes = lane_fleet.lanes()
    table = lane_fleet.stats()

    # Then both configured lanes are listed, nothing running of their limit, nothing waiting
    assert {
        name: (lane["active"], lane["limit"], lane["waiting"]) for name, lane in lanes.items()
    } == {
        "idle": (0, 3, 0),
        "video": (0, 1, 0),
    }
    rows = [line.split() for line in table.stdout.splitlines()]
    assert ["idle", "idle", "0/3", "0"] in [row[:4] for row in rows], table.stdout
    assert ["video", "video", "0/1", "0"] in [row[:4] for row in rows], table.stdout


def test_stats_counts_as_waiting_only_the_messages_waiting_for_a_slot(
    lane_fleet: LaneFleet,
) -> None:
    # Given two short jobs and then a long one in a lane with a limit of 1
    short = [lane_fleet.client.send_task("lanes.job", (1.0,)) for _ in range(2)]
    long = lane_fleet.client.send_task("lanes.job", (8.0,))

    # When the operator asks for stats while the first runs
    busy = wait_for(
        lambda: (lane := lane_fleet.video())["active"] == 1 and lane["waiting"] and lane,
        timeout=20,
        what="a job running and others waiting",
    )

    # Then one runs and the others wait for the slot (claimed, held for the lane)
    assert 1 <= busy["waiting"] <= 2

    # And while the long one runs, the short ones done, nothing is waiting: the tickets the
    # short ones used and gave back are idle, not waiting messages
    assert [r.get(timeout=30) for r in short] == [1.0, 1.0]
    running = lane_fleet.video()
    assert not long.ready()
    assert (running["active"], running["waiting"], running["limit"]) == (1, 0, 1)

    # And once it is done too, the lane is still listed, idle: 0 of 1, nothing waiting
    assert long.get(timeout=30) == 8.0
    idle = wait_for(
        lambda: (lane := lane_fleet.video())["active"] == 0 and lane,
        timeout=10,
        what="the lane to be idle",
    )
    assert (idle["active"], idle["waiting"], idle["limit"]) == (0, 0, 1)


def test_the_exporter_counts_lanes_as_stats_does(lane_fleet: LaneFleet) -> None:
    # Given a lane of limit 1 that ran two short jobs and now runs a long one, and a lane
    # that never ran a job
    short = [lane_fleet.client.send_task("lanes.job", (0.5,)) for _ in range(2)]
    assert [r.get(timeout=30) for r in short] == [0.5, 0.5]
    long = lane_fleet.client.send_task("lanes.job", (6.0,))
    wait_for(lambda: lane_fleet.video()["active"] == 1, timeout=20, what="the long job running")

    # When Prometheus scrapes the store's exporter
    exported = lane_fleet.exported()

    # Then it tells what stats tells: one running of 1, nothing waiting (the tickets the short
    # jobs gave back are idle, not waiting messages), the idle lane at 0 of 3
    assert not long.ready()
    assert exported == {
        "video": {"active": 1.0, "waiting": 0.0, "limit": 1.0},
        "idle": {"active": 0.0, "waiting": 0.0, "limit": 3.0},
    }
    assert long.get(timeout=30) == 6.0
