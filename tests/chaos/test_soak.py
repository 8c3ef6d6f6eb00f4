"""The chaos soak under pytest: nothing lost, each effect applied once, whatever the faults.

The default suite runs one short seeded run (about two and a half minutes). ``pytest -m soak``
runs the long matrix: 10 seeds on the Redis broker with the claim store on a server of its own,
10 with the claim store on the Redis broker itself (the default deployment), 3 on RabbitMQ
and 3 on RabbitMQ acknowledging at claim (``claims_ack_on_claim``), with celery-claims and,
as the reference, the same seeds on plain Celery; each run's line is appended to the file
named by ``CHAOS_RESULTS`` (default ``chaos-results.txt`` in the working directory).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.chaos.soak import MAX_TAKEOVERS, PG_URL, Report, Soak
from tests.servers import missing_service

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture(autouse=True)
def _postgres() -> None:
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
    except sa.exc.OperationalError:
        missing_service("PostgreSQL at 127.0.0.1:5432 (database test)")
    finally:
        engine.dispose()


def _run(
    seed: int,
    *,
    broker: str = "redis",
    plugin: bool = True,
    duration_s: float,
    ack_on_claim: bool = False,
) -> Report:
    report = Soak(
        seed, duration_s=duration_s, broker=broker, plugin=plugin, ack_on_claim=ack_on_claim
    ).run()
    print(report.line())
    for line in report.details:
        print("  " + line)
    results = Path(os.environ.get("CHAOS_RESULTS", "chaos-results.txt"))
    with results.open("a") as out:
        out.write(report.line() + "\n")
    return report


def _assert_nothing_lost_and_applied_once(report: Report) -> None:
    # nothing lost, and nothing left unfinished either: every task drained
    assert report.unfinished == 0, "\n".join([report.line(), *report.details, *report.actions])
    assert report.double_effect == 0, "\n".join([report.line(), *report.details])
    # the poison task ran once and once per allowed takeover at most, then was given up
    assert 1 <= report.poison_executions <= MAX_TAKEOVERS + 1, report.line()


@pytest.mark.timeout(600)
def test_a_fleet_under_compound_faults_loses_no_task_and_applies_each_effect_once() -> None:
    # Given three workers with claims, 300 tasks and a minute of seeded faults
    # When the fleet is healed and drained
    report = _run(int(os.environ.get("CHAOS_SEED", "11")), duration_s=60)

    # Then every task's effect was applied, and none twice under the exactly-once guard
    _assert_nothing_lost_and_applied_once(report)


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(1, 11))
def test_soak_redis_broker(seed: int) -> None:
    _assert_nothing_lost_and_applied_once(_run(seed, duration_s=120))


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(1, 11))
def test_soak_store_on_the_redis_broker(seed: int) -> None:
    # the default deployment: claims and completions ride kombu's own round trips
    _assert_nothing_lost_and_applied_once(_run(seed, broker="shared", duration_s=120))


@pytest.mark.soak
@pytest.mark.rabbitmq
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(1, 4))
def test_soak_rabbitmq(seed: int) -> None:
    _assert_nothing_lost_and_applied_once(_run(seed, broker="rabbitmq", duration_s=120))


@pytest.mark.soak
@pytest.mark.rabbitmq
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(1, 4))
def test_soak_rabbitmq_acking_at_claim(seed: int) -> None:
    # the workers acknowledge each message once claimed: the claim and the publish journal
    # entry are the durable copy, and a killed holder's task comes back by journal recovery
    _assert_nothing_lost_and_applied_once(
        _run(seed, broker="rabbitmq", duration_s=120, ack_on_claim=True)
    )


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("broker", "seed"), [*(("redis", s) for s in range(1, 11)),
                                              *(("rabbitmq", s) for s in range(1, 4))])  # fmt: skip
def test_soak_plain_celery_reference(broker: str, seed: int) -> None:
    # the reference: the same seeds without celery-claims; what it loses or doubles is recorded
    report = _run(seed, broker=broker, plugin=False, duration_s=120)
    assert report.tasks == 300
