"""``check_settings``: each unsafe combination gives one finding that says the fix."""

from __future__ import annotations

from typing import Any

import pytest

from celery_claims import InvalidArgument
from celery_claims.safety import Finding, Severity, check_settings

#: A configuration with nothing unsafe: the baseline each test changes one thing of.
SAFE: dict[str, Any] = {
    "broker_url": "redis://localhost:6379/0",
    "broker_transport_options": {"visibility_timeout": 180},
    "task_acks_late": True,
    "task_time_limit": 600,
    "task_soft_time_limit": 540,
    "worker_prefetch_multiplier": 1,
    "claims_lease_ms": 60_000,
    "claims_renew_interval_ms": 15_000,
}


def findings(**changes: Any) -> list[Finding]:
    conf = {**SAFE, **changes}
    return check_settings({k: v for k, v in conf.items() if v is not None})


def test_the_safe_baseline_has_no_finding() -> None:
    assert findings() == []


@pytest.mark.parametrize(
    ("changes", "key", "severity", "fix"),
    [
        ({"task_acks_late": False}, "task_acks_late", Severity.ERROR, "Set task_acks_late = True"),
        (
            {"broker_transport_options": None},
            "broker_transport_options.visibility_timeout",
            Severity.WARNING,
            "Set broker_transport_options['visibility_timeout'] to 2-5x the lease (e.g. 180)",
        ),
        (
            {"claims_renew_interval_ms": 100_000, "claims_lease_ms": 300_000},
            "claims_renew_interval_ms",
            Severity.WARNING,
            "Set claims_renew_interval_ms below 90000 ms",
        ),
        (
            {"broker_transport_options": {"visibility_timeout": 180, "unacked_mutex_expire": 300}},
            "broker_transport_options.unacked_mutex_expire",
            Severity.WARNING,
            "Leave it unset (celery-claims bounds it by the visibility timeout) or set it to at "
            "most 180",
        ),
        (
            {"claims_refresh_unacked": False},
            "claims_refresh_unacked",
            Severity.WARNING,
            "Leave claims_refresh_unacked = True",
        ),
        ({"task_time_limit": None, "task_soft_time_limit": None}, "task_time_limit",
         Severity.WARNING, "Set task_time_limit"),
        ({"task_soft_time_limit": 600}, "task_soft_time_limit", Severity.WARNING,
         "Set the soft limit below the hard one"),
        ({"worker_prefetch_multiplier": None}, "worker_prefetch_multiplier", Severity.WARNING,
         "Set worker_prefetch_multiplier = 1"),
        ({"worker_prefetch_multiplier": 0}, "worker_prefetch_multiplier", Severity.WARNING,
         "unlimited (0)"),
        (
            {"result_backend": "redis://localhost:6379/1"},
            "result_backend_always_retry",
            Severity.WARNING,
            "Set result_backend_always_retry = True",
        ),
        (
            {"claims_journal_recover_after_ms": 60_000},
            "claims_journal_recover_after_ms",
            Severity.WARNING,
            "is not above claims_lease_ms (60000 ms)",
        ),
        (
            {"claims_journal_recover_after_ms": 120_000},
            "claims_journal_recover_after_ms",
            Severity.WARNING,
            "is not above visibility_timeout (180 s)",
        ),
        (
            {"worker_cancel_long_running_tasks_on_connection_loss": True},
            "worker_cancel_long_running_tasks_on_connection_loss",
            Severity.WARNING,
            "Set it to False",
        ),
    ],
)  # fmt: skip
def test_each_unsafe_setting_gives_exactly_one_finding_with_its_fix(
    changes: dict[str, Any], key: str, severity: Severity, fix: str
) -> None:
    [finding] = findings(**changes)

    assert finding.key == key
    assert finding.severity == severity
    assert fix in finding.message
    assert finding.as_dict() == {"key": key, "severity": severity.value, "message": finding.message}


def test_visibility_checks_apply_to_the_redis_broker_only() -> None:
    amqp = findings(broker_url="amqp://guest@localhost//", broker_transport_options=None,
                    claims_refresh_unacked=False)  # fmt: skip

    assert amqp == []


def test_a_result_backend_on_another_server_or_retrying_needs_no_retry_advice() -> None:
    assert findings(result_backend="redis://other-host:6379/0") == []
    assert findings(result_backend="redis://localhost:6380/0") == []
    assert findings(result_backend="db+postgresql://localhost/test") == []
    assert (
        findings(result_backend="redis://localhost:6379/1", result_backend_always_retry=True) == []
    )


def test_errors_come_before_warnings() -> None:
    result = findings(task_acks_late=False, task_time_limit=None, task_soft_time_limit=None)

    assert [f.severity for f in result] == [Severity.ERROR, Severity.WARNING]


def test_a_celery_app_conf_is_accepted_as_is() -> None:
    from celery import Celery

    app = Celery("check", broker="redis://localhost:6379/0", set_as_current=False)
    app.conf.update(SAFE)

    assert check_settings(app.conf) == []
    app.close()


@pytest.mark.parametrize(
    ("conf", "name"),
    [
        (None, "conf"),
        ({"claims_lease_ms": "60s"}, "claims_lease_ms"),
        ({"task_time_limit": True}, "task_time_limit"),
        ({"broker_url": "redis://x", "broker_transport_options": ["x"]},
         "broker_transport_options"),
        ({"broker_url": "redis://x", "broker_transport_options": {"visibility_timeout": "1h"}},
         "broker_transport_options"),
    ],
)  # fmt: skip
def test_a_malformed_configuration_raises_invalid_argument(conf: Any, name: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_settings(conf)

    assert caught.value.name == name


def test_the_check_reads_a_lease_given_alone_as_the_worker_does() -> None:
    # Given only a 20 s lease (the worker then renews every 5 s), on Redis brokers whose
    # visibility timeouts are 12 s and 8 s
    alone = {"claims_lease_ms": 20_000, "claims_renew_interval_ms": None}
    roomy = findings(**alone, broker_transport_options={"visibility_timeout": 12})
    tight = findings(**alone, broker_transport_options={"visibility_timeout": 8})

    # Then the check judges the worker's renew interval, not the default one
    assert "claims_renew_interval_ms" not in {f.key for f in roomy}
    [renew] = [f for f in tight if f.key == "claims_renew_interval_ms"]
    assert "(5000 ms)" in renew.message


@pytest.mark.parametrize("pool", ["threads", "solo", "eventlet", "gevent"])
def test_a_pool_that_does_not_stop_a_hung_task_gets_a_notice_saying_what_claims_do_instead(
    pool: str,
) -> None:
    # Given a safe configuration, When the workers run a pool that does not enforce limits
    result = check_settings(SAFE, pool=pool)
    from_conf = check_settings({**SAFE, "worker_pool": pool})

    # Then one notice says so, and that the claim is no longer renewed past the limit
    assert result == from_conf
    assert [(f.key, f.severity) for f in result] == [("worker_pool", Severity.NOTICE)]
    assert "stops renewing a task's claim once its time limit has passed" in result[0].message
    assert "600 s" in result[0].message


def test_prefork_enforces_time_limits_itself_and_gets_no_notice() -> None:
    assert check_settings(SAFE, pool="prefork") == []
    assert check_settings({**SAFE, "worker_pool": "prefork"}) == []


def test_notices_come_after_warnings() -> None:
    result = check_settings({**SAFE, "task_acks_late": False, "task_time_limit": None}, pool="solo")

    assert [f.severity for f in result] == [Severity.ERROR, Severity.WARNING, Severity.NOTICE]
