"""Settings: defaults, validation with errors naming the key, command-line options."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery

from celery_claims import InvalidArgument
from celery_claims.worker import install, load_settings
from celery_claims.worker.settings import DEFAULT_LEASE_MS
from tests.servers import RedisServer
from tests.worker.helpers import in_process_worker, make_app, unique
from tests.worker.processes import ROOT


def _app(broker: str = "redis://127.0.0.1:1/3", **conf: Any) -> Celery:
    app = Celery(unique("settings"), broker=broker, set_as_current=False)
    app.conf.update(conf)
    install(app)
    return app


def test_defaults_take_the_claim_store_from_a_redis_broker() -> None:
    # Given an app on a Redis broker with no claims_* settings
    app = _app("redis://127.0.0.1:1/3")

    # When the settings are read
    settings = load_settings(app)

    # Then the claim store is the broker and the documented defaults apply
    assert settings.redis_url == "redis://127.0.0.1:1/3"
    assert settings.lease_ms == DEFAULT_LEASE_MS
    assert 2 * settings.renew_interval_ms < settings.lease_ms


def test_a_non_redis_broker_requires_claims_redis_url_without_echoing_credentials() -> None:
    # Given an AMQP broker with credentials and no claims_redis_url
    app = _app("amqp://user:secret@127.0.0.1:5672//")

    # When the settings are read, Then the error names the key and hides the password
    with pytest.raises(InvalidArgument, match="claims_redis_url") as info:
        load_settings(app)
    assert "secret" not in str(info.value)
    assert info.value.name == "claims_redis_url"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("claims_lease_ms", 0),
        ("claims_lease_ms", "60000"),
        ("claims_lease_ms", True),
        ("claims_renew_interval_ms", 40_000),
        ("claims_renew_interval_ms", 10),
        ("claims_done_ttl_ms", -1),
        ("claims_held_recheck_ms", 1.5),
        ("claims_unavailable_retry_max_ms", 10),
        ("claims_prefix", "a{b}"),
        ("claims_redis_url", "http://127.0.0.1"),
        ("claims_refresh_unacked", "yes"),
        ("claims_cleanup_interval_s", 0),
        ("claims_cleanup_limit", 0),
    ],
)
def test_an_invalid_setting_is_refused_with_an_error_naming_its_key(key: str, value: Any) -> None:
    # Given an app with one bad claims_* value
    app = _app(**{key: value})

    # When the settings are read, Then the error names that key
    with pytest.raises(InvalidArgument) as info:
        load_settings(app)
    assert info.value.name == key


def test_a_command_line_option_overrides_the_configuration() -> None:
    # Given a configured lease and a worker option for another
    app = _app(claims_lease_ms=40_000)

    # When the settings are read with the option, Then the option wins and None is ignored
    settings = load_settings(app, {"claims_lease_ms": 50_000, "claims_prefix": None})
    assert settings.lease_ms == 50_000
    assert settings.prefix == "claims"


def test_install_adds_worker_options_once_and_is_idempotent() -> None:
    # Given an app on which install ran twice
    app = _app()
    install(app)

    # Then each --claims-* option and each bootstep is there exactly once
    names = [opt.name for opt in app.user_options["worker"]]
    assert names.count("claims_lease_ms") == 1
    assert "claims_redis_url" in names
    # the lease keeper, and the task history's writer stopped at shutdown
    assert sorted(step.__name__ for step in app.steps["worker"]) == ["History", "LeaseKeeper"]
    # the gate, and the restore sweep of pools without an event loop
    assert sorted(step.__name__ for step in app.steps["consumer"]) == ["Gate", "Sweep"]


def test_worker_refuses_to_start_with_an_invalid_setting(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given an app whose renew interval is too long for its lease
    app = make_app(
        redis_server.url,
        queue=unique("q"),
        claims_prefix=key_prefix,
        claims_renew_interval_ms=2_000,
    )

    # When a worker starts, Then it fails with an error naming the key
    with pytest.raises(InvalidArgument, match="claims_renew_interval_ms"), in_process_worker(app):
        pass


def test_worker_refuses_to_start_with_an_invalid_per_task_lease(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given a task whose own lease is too short to renew (a quarter of it is below 50 ms)
    app = make_app(redis_server.url, queue=unique("q"), claims_prefix=key_prefix)

    @app.task(shared=False, name="t.short_lease", claims_lease_ms=150)
    def short_lease() -> None:
        return None

    # When a worker starts, Then it fails naming the task and the attribute
    with (
        pytest.raises(InvalidArgument, match=r"t\.short_lease\.claims_lease_ms"),
        in_process_worker(app),
    ):
        pass


@pytest.mark.slow
def test_celery_worker_command_refuses_an_invalid_option_and_names_the_key() -> None:
    # Given the real `celery worker` command with a lease too short to renew
    env = {
        **os.environ,
        "CLAIMS_TEST_BROKER": "redis://127.0.0.1:1/0",
        "CLAIMS_TEST_BACKEND": "redis://127.0.0.1:1/0",
        "CLAIMS_TEST_QUEUE": unique("q"),
    }
    args = ["-A", "tests.worker.apps.fleet", "worker", "-P", "solo", "--claims-lease-ms", "100"]

    # When it starts
    done = subprocess.run(
        [sys.executable, "-m", "celery", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Then it exits with one line naming the setting given, before touching the broker
    assert done.returncode != 0
    assert "Error: claims_lease_ms: 100 ms is too short to renew" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
