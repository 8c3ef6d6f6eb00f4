"""Keyed-claim declarations are checked when the worker starts: a bad one stops it with one
line naming the task's attribute (issue 13)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_claims import InvalidArgument
from celery_claims.errors import KeyRefused
from celery_claims.worker import install, load_settings
from celery_claims.worker.delivery.keyed import KeySpecs, key_spec
from celery_claims.worker.policy import check_task_policies
from tests.servers import RedisServer
from tests.worker.helpers import unique
from tests.worker.processes import Fleet

WORKER_ARGS = [
    "worker", "-P", "solo", "-l", "INFO",
    "--without-mingle", "--without-gossip", "--without-heartbeat",
]  # fmt: skip


def _app(**conf: Any) -> Celery:
    app = Celery(unique("keyed"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(conf)
    install(app)
    return app


KEYED = {"claims_key": "customer_id"}


@pytest.mark.parametrize(
    ("options", "named", "says"),
    [
        ({"claims_key": "nope"}, "claims_key", "takes no argument 'nope'"),
        ({"claims_key": ("customer_id", "customer_id")}, "claims_key", "names an argument twice"),
        ({"claims_key": 42}, "claims_key", "must be an argument name"),
        ({"claims_key": ()}, "claims_key", "must be an argument name"),
        ({**KEYED, "claims": False}, "claims_key", "claims = False"),
        ({"claims_key_conflict": "skip"}, "claims_key_conflict", "claims_key is not"),
        ({**KEYED, "claims_key_conflict": "drop"}, "claims_key_conflict", "one of"),
        ({**KEYED, "claims_key_done_ttl": "60"}, "claims_key_done_ttl", "seconds"),
        ({**KEYED, "claims_key_done_ttl": -1}, "claims_key_done_ttl", "seconds"),
        ({**KEYED, "claims_key_reschedule_max": 1.5}, "claims_key_reschedule_max", "int"),
        ({**KEYED, "claims_key_reschedule_s": 0}, "claims_key_reschedule_s", "positive"),
        ({**KEYED, "claims_key_namespace": ""}, "claims_key_namespace", "non-empty"),
    ],
)
def test_a_bad_keyed_declaration_is_refused_at_worker_start_naming_the_attribute(
    options: dict[str, Any], named: str, says: str
) -> None:
    # Given a task with a bad keyed-claim declaration
    app = _app()

    @app.task(shared=False, name="t.sync", **options)
    def sync(customer_id: str) -> None:
        pass

    # When the worker checks its tasks at start
    # Then it is refused, naming the task's attribute and what is wrong
    with pytest.raises(InvalidArgument, match=says) as raised:
        check_task_policies(app, load_settings(app))
    assert raised.value.name == f"t.sync.{named}"


def test_good_declarations_pass_and_bad_settings_are_refused() -> None:
    # Given tasks keyed by a name, by names of a bound task, by a callable, and via **kwargs
    app = _app(claims_key_conflict="skip")

    @app.task(shared=False, name="t.one", claims_key="customer_id")
    def one(customer_id: str) -> None:
        pass

    @app.task(shared=False, bind=True, name="t.two", claims_key=("tenant", "kind"))
    def two(self: Any, tenant: str, kind: str = "csv") -> None:
        pass

    @app.task(shared=False, name="t.three", claims_key=lambda args, kwargs: args[0]["id"])
    def three(order: dict[str, Any]) -> None:
        pass

    @app.task(shared=False, name="t.four", claims_key="anything")
    def four(**kwargs: Any) -> None:
        pass

    # When the worker checks them
    settings = load_settings(app)
    check_task_policies(app, settings)

    # Then they pass, and take the app's default policy
    spec = key_spec(app.tasks["t.two"], "t.two", settings)
    assert spec is not None
    assert spec.conflict == "skip"
    assert spec.names == ("tenant", "kind")
    assert spec.field(("acme",), {}) == "t.two[('acme', 'csv')]"
    three_spec = key_spec(app.tasks["t.three"], "t.three", settings)
    assert three_spec is not None
    assert three_spec.field(({"id": 7},), {}) == "t.three[7]"
    # and a bad app-wide default is refused like any setting
    with pytest.raises(InvalidArgument, match="claims_key_conflict"):
        load_settings(_app(claims_key_conflict="later"))
    with pytest.raises(InvalidArgument, match="claims_key_reschedule_max"):
        load_settings(_app(claims_key_reschedule_max=-1))


def test_a_task_registered_after_start_with_a_bad_declaration_refuses_its_messages() -> None:
    # Given a worker's key declarations, and a task it never checked at start
    app = _app()
    specs = KeySpecs(load_settings(app))

    @app.task(shared=False, name="t.late", claims_key=["missing"])
    def late(customer_id: str) -> None:
        pass

    # When its messages come
    # Then each is refused (recorded failed by the worker), never run unkeyed
    with pytest.raises(KeyRefused, match="takes no argument 'missing'"):
        specs.of(app.tasks["t.late"], "t.late")


@pytest.mark.slow
def test_celery_worker_with_a_task_keyed_on_an_argument_it_lacks_refuses_to_start(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given the real `celery worker` command on an app with a task keyed on a missing argument
    env = {
        "CLAIMS_TEST_BROKER": private_redis.url,
        "CLAIMS_TEST_BACKEND": private_redis.url,
        "CLAIMS_TEST_QUEUE": "keyed-bad-start",
        "CLAIMS_TEST_BAD_KEY": "1",
    }
    args = ["-A", "tests.worker.apps.keyed_app", *WORKER_ARGS, "-n", "bad@%h"]

    # When it starts
    worker = fleet.celery("bad-key-worker", args, env)

    # Then it stops with one line naming the task's attribute, no traceback
    assert worker.popen.wait(timeout=60) != 0
    output = worker.output()
    assert "Traceback" not in output
    [line] = [line for line in output.splitlines() if "claims_key" in line]
    assert line == "Error: keyed.bad.claims_key: keyed.bad takes no argument 'nope'"
