"""Configuration the way Celery resolves it (issue 12, items 1-3), on real apps and workers.

- The default claim store is the broker Celery really consumes from: ``CELERY_BROKER_URL`` in
  the environment and ``celery -b`` included, for the worker, ``claims check`` and the CLI.
- A setting the user did not give follows those they did (the renew interval from the lease),
  and a refusal is one line naming the user's own setting; a per-task lease shorter than the
  keeper's period is renewed in time for itself.
- One table declares every setting: the settings object, the worker options and the
  reference in docs/settings.md are made from it or checked against it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_claims import InvalidArgument, RedisClaimManager
from celery_claims.config import SETTINGS, reference
from celery_claims.safety import check_settings
from celery_claims.worker import ClaimsSettings, install, load_settings
from celery_claims.worker.steps import check_unsafe_settings
from celery_claims.worker.tasks import CLEANUP_TASK_NAME
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_done
from tests.worker.processes import ROOT, Fleet

ENV_APP = "tests.worker.apps.env_app"
WORKER_ARGS = [
    "worker", "-P", "solo", "-l", "INFO",
    "--without-mingle", "--without-gossip", "--without-heartbeat",
]  # fmt: skip


def _app(broker: str | None = None, **conf: Any) -> Celery:
    app = Celery(unique("config"), broker=broker, set_as_current=False)
    app.conf.update(conf)
    install(app)
    return app


@pytest.fixture
def no_broker_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The test process's environment without any broker variable of its own."""
    for name in ("CELERY_BROKER_URL", "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def second_redis() -> Iterator[RedisServer]:
    """Another private Redis: the broker written in the code, which Celery does not use."""
    with redis_server() as server:
        yield server


def _celery(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- 1. the broker Celery really uses --------------------------------------------------------


def test_the_claim_store_defaults_to_the_broker_of_the_environment_when_the_code_names_none(
    no_broker_env: pytest.MonkeyPatch,
) -> None:
    # Given an app with no broker in its code and CELERY_BROKER_URL in the environment
    no_broker_env.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/4")
    app = _app()

    # When the settings are read, Then the claim store is the environment's broker
    assert load_settings(app).redis_url == "redis://127.0.0.1:1/4"


def test_the_environments_broker_wins_over_the_codes_for_the_store_and_the_check(
    no_broker_env: pytest.MonkeyPatch,
) -> None:
    # Given a Redis broker in the code and another one in the environment, as Celery reads it
    no_broker_env.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/5")
    app = _app("redis://127.0.0.1:1/6", task_acks_late=True)
    assert app.conf.broker_url == "redis://127.0.0.1:1/5"

    # When the settings are read, Then claims go where Celery consumes from
    assert load_settings(app).redis_url == "redis://127.0.0.1:1/5"

    # And given an AMQP broker in the code and a Redis one in the environment
    amqp = _app("amqp://guest@127.0.0.1//", task_acks_late=True)

    # When the unsafe-settings check runs, Then it checks the Redis broker's visibility timeout
    keys = {finding.key for finding in check_settings(amqp.conf)}
    assert "broker_transport_options.visibility_timeout" in keys

    # And the worker's own startup check (its view with command-line values) sees it too
    with pytest.raises(InvalidArgument, match="visibility_timeout"):
        check_unsafe_settings(amqp.conf, {"claims_lease_ms": 30_000}, strict=True)


@pytest.mark.slow
def test_a_worker_and_the_cli_with_only_celery_broker_url_use_that_redis(
    fleet: Fleet, private_redis: RedisServer, queue: str
) -> None:
    # Given the user's app with no broker in its code, started with CELERY_BROKER_URL only
    env = {"CELERY_BROKER_URL": private_redis.url, "CLAIMS_TEST_QUEUE": queue}
    worker = fleet.celery("env-worker", ["-A", ENV_APP, *WORKER_ARGS, "-n", "env@%h"], env)
    worker.wait_ready()

    # When a task is sent to that broker
    result = fleet.client(private_redis.url, private_redis.url, queue).send_task(
        "env.add", (2, 3), queue=queue
    )

    # Then the worker claims it and records its completion in that Redis
    store = fleet.claims(private_redis.url)
    assert wait_done(store, queue, f"{result.id}:0:0", timeout=20), fleet.logs()

    # And the CLI, run the same way, reads that store and checks that broker
    stats = _celery("-A", ENV_APP, "claims", "stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["queues"][queue]["successes"] >= 1
    check = _celery("-A", ENV_APP, "claims", "check", "--json", env=env)
    keys = {finding["key"] for finding in json.loads(check.stdout)["findings"]}
    assert "broker_transport_options.visibility_timeout" in keys, check.stdout + check.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["CELERY_BROKER_URL", "celery -b"])
def test_claims_follow_the_broker_given_outside_the_code_not_the_one_in_it(
    fleet: Fleet, private_redis: RedisServer, second_redis: RedisServer, queue: str, how: str
) -> None:
    # Given the user's app with one Redis broker in its code and another given from outside
    code_broker, real_broker = second_redis.url, private_redis.url
    env = {"CLAIMS_TEST_CODE_BROKER": code_broker, "CLAIMS_TEST_QUEUE": queue}
    outside = ["-b", real_broker] if how == "celery -b" else []
    if how == "CELERY_BROKER_URL":
        env["CELERY_BROKER_URL"] = real_broker
    worker = fleet.celery("worker", [*outside, "-A", ENV_APP, *WORKER_ARGS, "-n", "w@%h"], env)
    worker.wait_ready()

    # When a task is sent to the broker Celery consumes from
    result = fleet.client(real_broker, real_broker, queue).send_task("env.add", (1, 1))

    # Then its claim and completion are in that broker's Redis, and nothing in the code's
    assert wait_done(fleet.claims(real_broker), queue, f"{result.id}:0:0", timeout=20)
    assert fleet.redis(code_broker).keys("claims*") == [], fleet.logs()

    # And `celery claims` given the broker the same way lists that store's queue
    stats = _celery(*outside, "-A", ENV_APP, "claims", "stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    assert queue in json.loads(stats.stdout)["queues"]


# --- 2. settings that follow the user's --------------------------------------------------------


@pytest.mark.parametrize("lease_ms", [200, 1_000, 20_000, 30_000, 59_999, 600_000])
def test_a_lease_given_alone_brings_the_settings_that_depend_on_it_along(lease_ms: int) -> None:
    # Given only claims_lease_ms
    app = _app("redis://127.0.0.1:1/0", claims_lease_ms=lease_ms)

    # When the settings are read
    settings = load_settings(app)

    # Then the renew interval is a quarter of the lease (at most the default) and the start
    # timeout is never shorter than the lease
    assert settings.lease_ms == lease_ms
    assert settings.renew_interval_ms == min(15_000, lease_ms // 4)
    assert 2 * settings.renew_interval_ms < settings.lease_ms
    assert settings.start_timeout_ms == max(300_000, lease_ms)


def test_a_first_retry_given_alone_raises_the_retry_ceiling_with_it() -> None:
    settings = load_settings(_app("redis://127.0.0.1:1/0", claims_unavailable_retry_ms=45_000))
    assert settings.unavailable_retry_max_ms == 45_000


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"claims_lease_ms": 150}, "claims_lease_ms"),
        ({"claims_renew_interval_ms": 40_000}, "claims_renew_interval_ms"),
        ({"claims_lease_ms": 20_000, "claims_start_timeout_ms": 10_000}, "claims_start_timeout_ms"),
        ({"claims_unavailable_retry_max_ms": 500, "claims_unavailable_retry_ms": 900},
         "claims_unavailable_retry_max_ms"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_setting_the_user_gave(conf: dict[str, int], named: str) -> None:
    # Given settings that cannot work together, Then the error names the one the user gave
    with pytest.raises(InvalidArgument) as info:
        load_settings(_app("redis://127.0.0.1:1/0", **conf))
    assert info.value.name == named
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(("lease", "ready"), [("20000", True), ("100", False)])
def test_celery_worker_given_only_a_lease_starts_or_refuses_in_one_line_naming_it(
    fleet: Fleet, private_redis: RedisServer, queue: str, lease: str, ready: bool
) -> None:
    # Given the real `celery worker` command with only --claims-lease-ms
    env = {"CELERY_BROKER_URL": private_redis.url, "CLAIMS_TEST_QUEUE": queue}
    args = ["-A", ENV_APP, *WORKER_ARGS, "-n", "lease@%h", "--claims-lease-ms", lease]

    # When it starts
    worker = fleet.celery("lease-worker", args, env)

    # Then a lease the keeper can renew starts the worker; a shorter one stops it with one
    # line naming --claims-lease-ms's setting, and no traceback
    if ready:
        worker.wait_ready()
        return
    assert worker.popen.wait(timeout=60) != 0
    output = worker.output()
    assert "Traceback" not in output
    [line] = [line for line in output.splitlines() if "claims_" in line]
    assert line.startswith("Error: claims_lease_ms: 100 ms is too short to renew")


def test_a_claim_whose_lease_survives_two_periods_is_renewed_at_the_period_the_user_set() -> None:
    # Given a user's 60 s lease renewed every 25 s
    settings = ClaimsSettings("redis://127.0.0.1:1/0", lease_ms=60_000, renew_interval_ms=25_000)

    # Then claims of that lease or longer keep that period; only a per-task lease too short
    # for two periods is renewed every quarter of its own lease
    assert settings.renew_interval_for(60_000) == 25_000
    assert settings.renew_interval_for(600_000) == 25_000
    assert settings.renew_interval_for(50_000) == 12_500
    assert settings.renew_interval_for(1_000) == 250


def test_a_per_task_lease_shorter_than_the_renew_interval_is_renewed_in_time(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given a worker renewing every 5 s and a task whose own lease is 1 s, running 2.5 s
    queue = unique("q")
    app = make_app(
        redis_server.url,
        queue=queue,
        claims_prefix=key_prefix,
        claims_lease_ms=20_000,
        claims_renew_interval_ms=5_000,
    )
    started = threading.Event()

    @app.task(shared=False, name="t.short_own_lease", claims_lease_ms=1_000)
    def short_own_lease() -> str:
        started.set()
        time.sleep(2.5)
        return "done"

    manager = RedisClaimManager(url=redis_server.url, prefix=key_prefix)
    try:
        with in_process_worker(app):
            # When it runs
            result = short_own_lease.delay()
            task_key = f"{result.id}:0:0"
            assert started.wait(10)
            lapses = []
            while not result.ready():
                held = manager.is_claimed(queue, task_key)
                if held is None and manager.done_record(queue, task_key) is None:
                    lapses.append(time.monotonic())
                time.sleep(0.05)

            # Then its claim never lapsed while it ran, and it completed as its owner
            assert result.get(timeout=10) == "done"
            assert lapses == []
            assert wait_done(manager, queue, task_key)
    finally:
        manager.client.close()
        # its result's pub/sub closed here: left open, a collection in a later test found the
        # result and, on Celery 5.3 to 5.6, reconnected the pub/sub to unsubscribe it, leaving
        # an unclosed socket to fail whichever test collected it next
        close_app(app)


# --- 3. one table ---------------------------------------------------------------------------


def test_the_settings_reference_in_the_docs_is_the_table() -> None:
    # Given the reference table made from celery_claims.config.SETTINGS
    docs = (Path(ROOT) / "docs" / "settings.md").read_text()

    # Then docs/settings.md holds exactly it
    assert reference() in docs, (
        "docs/settings.md is out of date: run `python -m celery_claims.config docs/settings.md`"
    )


def test_every_row_of_the_table_is_an_attribute_of_the_settings_object_with_its_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(ClaimsSettings)}
    assert sorted(fields) == sorted(row.attr for row in SETTINGS)
    for row in SETTINGS:
        if row.key == "claims_redis_url":  # required: no default in the dataclass
            continue
        f = fields[row.attr]
        # a mapping's default is made by a factory (a dataclass default must be hashable)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert default == row.default, row.key
    # and the defaults, read through the table, are a valid settings object
    assert load_settings(_app("redis://127.0.0.1:1/0")) == ClaimsSettings("redis://127.0.0.1:1/0")


def test_the_worker_options_are_the_rows_that_offer_one() -> None:
    app = _app("redis://127.0.0.1:1/0")
    options = {opt.name: opt for opt in app.user_options["worker"]}
    offered = {row.key: row for row in SETTINGS if row.option is not None}
    assert set(options) == set(offered)
    for key, row in offered.items():
        assert options[key].opts == [row.flag]
        assert options[key].help == row.option_help


def test_the_beat_entry_uses_the_validated_cleanup_interval() -> None:
    # Given a valid period, Then the beat entry runs at it
    app = _app("redis://127.0.0.1:1/0", claims_cleanup_interval_s=2)
    app.finalize()
    entry = app.conf.beat_schedule[CLEANUP_TASK_NAME]
    assert entry["schedule"] == timedelta(seconds=2)

    # Given a period of 0 (a beat that would send the task without pause)
    lazy = _app("redis://127.0.0.1:1/0", claims_cleanup_interval_s=0)

    # When the app is finalized, Then no entry is added and the worker's settings refuse it
    lazy.finalize()
    assert CLEANUP_TASK_NAME not in (lazy.conf.beat_schedule or {})
    with pytest.raises(InvalidArgument) as info:
        load_settings(lazy)
    assert info.value.name == "claims_cleanup_interval_s"

    # And on an app finalized before install, install refuses it and installs nothing
    done = Celery(unique("config"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    done.conf.claims_cleanup_interval_s = "5m"
    done.finalize()
    with pytest.raises(InvalidArgument) as info:
        install(done)
    assert info.value.name == "claims_cleanup_interval_s"
    assert CLEANUP_TASK_NAME not in (done.conf.beat_schedule or {})
    assert len(done.steps["worker"]) == 0


def test_the_cli_takes_redis_url_over_an_app_whose_broker_is_not_redis(
    no_broker_env: pytest.MonkeyPatch, redis_server: RedisServer
) -> None:
    # Given an app on AMQP without claims_redis_url, and --redis-url naming the store
    env = {"CLAIMS_TEST_QUEUE": unique("q"), "CLAIMS_TEST_CODE_BROKER": "amqp://guest@x//"}
    done = _celery(
        "-A", ENV_APP, "claims", "--redis-url", redis_server.url, "stats", "--json", env=env
    )

    # Then the command reads that store instead of refusing for the missing setting
    assert done.returncode == 0, done.stderr
    assert "queues" in json.loads(done.stdout)
