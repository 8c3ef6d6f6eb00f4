"""Every name of the ``claims_`` namespace means something (issue 30, items 1 and 3).

The real worker and ``celery claims check`` are run on broken apps in
``tests/cli/test_start_check.py``; these tests go through the one start check in process, on
the configuration sources and declarations a subprocess app would make slow to cover.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from kombu import Queue

from celery_claims import InvalidArgument
from celery_claims.config import SETTINGS
from celery_claims.names import TASK_ATTRIBUTES, check_names, declared_queues, lane_findings
from celery_claims.worker import install, load_settings
from celery_claims.worker.steps import check_start
from tests.worker.helpers import unique

ROOT = Path(__file__).parents[1]
#: A configuration ``celery claims check`` finds nothing unsafe in.
SAFE: dict[str, Any] = {
    "broker_transport_options": {"visibility_timeout": 180},
    "task_acks_late": True,
    "task_time_limit": 600,
    "task_soft_time_limit": 540,
    "worker_prefetch_multiplier": 1,
}


def _app(**conf: Any) -> Celery:
    app = Celery(unique("names"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(SAFE, **conf)
    install(app)
    return app


def _refusal(app: Celery) -> str:
    with pytest.raises(InvalidArgument) as caught:
        check_start(app)
    return str(caught.value)


def test_names_outside_the_namespace_are_never_looked_at() -> None:
    # Given settings and task attributes of the app's own, some with "claims" inside them
    app = _app(myapp_timeout=3, MYAPP_CLAIMS_LEASE=2, reclaims_after=1, claim_lease_ms=5)

    @app.task(name="names.own", myapp_retries=2, claim_key="x", shared=False)
    def own() -> None:
        pass

    # When the start check runs, Then nothing is refused and nothing found
    settings, findings = check_start(app)
    assert findings == []
    assert settings.lease_ms == 60_000


def test_django_style_settings_are_read_and_checked_under_their_namespace() -> None:
    # Given a Django settings module read with namespace="CELERY": a known setting, a typo,
    # and the project's own CLAIMS_* setting, outside Celery's namespace
    class Django:
        CELERY_TASK_ACKS_LATE = True
        CELERY_CLAIMS_LEASE_MS = 30_000
        CELERY_CLAIMS_MAX_TAKEOVER = 5
        CLAIMS_INSURER = "acme"

    app = _app()
    app.config_from_object(Django, namespace="CELERY")

    # When the start check runs, Then the typo is refused as written, with the known name
    # as the user must write it
    assert _refusal(app) == (
        "CELERY_CLAIMS_MAX_TAKEOVER: unknown setting; did you mean CELERY_CLAIMS_MAX_TAKEOVERS "
        "(claims_max_takeovers)?"
    )

    # And without it the known one is read
    del Django.CELERY_CLAIMS_MAX_TAKEOVER
    fixed = _app()
    fixed.config_from_object(Django, namespace="CELERY")
    assert check_start(fixed)[0].lease_ms == 30_000


def test_an_upper_case_setting_celery_does_not_read_is_refused_naming_the_one_it_reads() -> None:
    # Given CLAIMS_LEASE_MS in a configuration without a namespace (Celery reads claims_lease_ms)
    app = _app(CLAIMS_LEASE_MS=30_000)

    # Then it is refused, not ignored
    assert _refusal(app) == "CLAIMS_LEASE_MS: unknown setting; did you mean claims_lease_ms?"


def test_a_name_that_resembles_nothing_is_refused_without_a_guess() -> None:
    app = _app(claims_colour="blue")

    assert _refusal(app) == "claims_colour: unknown setting (docs/settings.md lists them)"


def test_every_unknown_name_is_named_in_one_refusal() -> None:
    # Given a misspelt setting and a misspelt task option
    app = _app(claims_lease_msec=30_000)

    @app.task(name="names.sync", claims_kye="customer", shared=False)
    def sync(customer: str) -> None:
        pass

    # Then one refusal names both, settings first
    assert _refusal(app) == (
        "claims_lease_msec: unknown setting; did you mean claims_lease_ms?; and "
        "names.sync.claims_kye: unknown task attribute; did you mean claims_key?"
    )


def test_task_annotations_and_base_classes_in_the_namespace_are_checked() -> None:
    # Given a claims option given through task_annotations, and one on a base class
    class Base(Task):  # type: ignore[misc]  # celery is untyped
        claims_key_done_tl = 60

    app = _app(task_annotations={"names.annotated": {"claims_lease_msec": 1000}})

    @app.task(name="names.annotated", base=Base, claims_key="customer", shared=False)
    def sync(customer: str) -> None:
        pass

    # Then both are refused on the task they reach
    said = _refusal(app)
    assert "names.annotated.claims_key_done_tl: unknown task attribute; did you mean " in said
    assert "names.annotated.claims_lease_msec: unknown task attribute; did you mean " in said


def test_check_names_needs_only_a_mapping_and_task_names() -> None:
    # Given a plain configuration mapping and a task object
    class Plain:
        claims_kye = "customer"

    # Then the same refusals come from it
    with pytest.raises(InvalidArgument, match="claims_tll: unknown setting"):
        check_names({"claims_tll": 1}, {})
    with pytest.raises(InvalidArgument, match=re.escape("t.claims_kye: unknown task attribute")):
        check_names({}, {"t": Plain()})


# --- lanes that match nothing -----------------------------------------------------------------


def test_the_queues_an_app_declares_come_from_task_queues_routes_and_the_default_queue() -> None:
    conf = {
        "task_default_queue": "main",
        "task_queues": [Queue("video"), Queue("audio")],
        "task_routes": {"a.render": {"queue": "render"}, "a.mail": "mail", "a.*": {
            "queue": Queue("glob")}},
    }  # fmt: skip

    assert declared_queues(conf) == {"main", "video", "audio", "render", "mail", "glob"}
    assert declared_queues({}) == {"celery"}
    assert declared_queues({"task_queues": {"a": {}, "b": {}}}) == {"celery", "a", "b"}


@pytest.mark.parametrize(
    "routes",
    [
        lambda name, args, kwargs, options, task=None, **kw: {"queue": "anywhere"},
        "proj.routers.route_task",
        ({"a.render": {"queue": "render"}}, "proj.routers.route_task"),
        {"a.render": {"exchange": "media", "routing_key": "render"}},
    ],
)
def test_a_router_that_may_send_a_task_anywhere_makes_no_queue_undeclared(routes: Any) -> None:
    # Given a router whose queues cannot be read from the configuration
    conf = {"task_routes": routes}

    # Then no lane is said to match no queue
    assert declared_queues(conf) is None
    [lane] = load_settings(_app(claims_lanes={"v": {"queues": ["nowhere"], "limit": 1}})).lanes
    assert lane_findings([lane], conf, ["a.render"]) == []


def test_a_lane_on_a_routed_or_consumed_queue_matches_something() -> None:
    # Given lanes on a queue only a route names, and on one only a worker consumes (-Q)
    app = _app(
        task_routes={"names.render": {"queue": "render"}},
        claims_lanes={
            "render": {"queues": ["render"], "limit": 1},
            "bulk": {"queues": ["bulk"], "limit": 1},
        },
    )

    # When the worker consuming "bulk" starts, Then nothing is found
    assert check_start(app, queues=["bulk"])[1] == []
    # And check without the worker's -Q warns of the "bulk" lane only
    [finding] = check_start(app)[1]
    assert finding.key == "claims_lanes"
    assert finding.message.startswith("lane 'bulk' matches nothing: no queue it names ('bulk')")


def test_a_lane_whose_kinds_name_no_registered_task_is_a_warning_with_the_closest_task() -> None:
    # Given a lane listing a misspelt task name, and a registered task a letter off
    app = _app(claims_lanes={"v": {"queues": ["celery"], "limit": 1, "kinds": ["names.snyc"]}})

    @app.task(name="names.sync", shared=False)
    def sync() -> None:
        pass

    # When the start check runs, Then the lane gets a warning naming the task it could mean
    [finding] = check_start(app)[1]

    assert finding.severity.value == "warning"
    assert finding.message == (
        "lane 'v' matches nothing: no task it lists in kinds ('names.snyc') is registered; "
        "did you mean 'names.sync'?"
    )


def test_a_lane_that_matches_nothing_stops_a_strict_worker_naming_the_lane() -> None:
    app = _app(
        claims_strict_settings=True,
        claims_lanes={"video": {"queues": ["vidoe"], "limit": 1}},
        task_queues=[Queue("video")],
    )

    said = _refusal(app)

    assert said.startswith("claims_strict_settings: the worker refuses to start with 1 unsafe")
    assert "claims_lanes: lane 'video' matches nothing: no queue it names ('vidoe')" in said
    assert said.endswith("did you mean 'video'?")


# --- one declaration of the task attributes -------------------------------------------------


def test_every_task_attribute_the_worker_reads_is_a_known_one_and_documented() -> None:
    # Given every claims_* attribute the worker reads off a task
    source = "\n".join(p.read_text() for p in (ROOT / "celery_claims").rglob("*.py"))
    read = set(re.findall(r"getattr\(task, \"(claims(?:_\w+)?)\"", source))
    read |= set(re.findall(r"^    \"(claims_key_\w+)\",$", source, flags=re.MULTILINE))
    documented = (ROOT / "docs" / "settings.md").read_text().split("## Per-task attributes")[1]

    # Then the name check knows each of them, and docs/settings.md documents each
    assert read, "the pattern no longer finds the attributes read"
    assert read <= set(TASK_ATTRIBUTES)
    for attr in TASK_ATTRIBUTES:
        assert f"`{attr} = " in documented, attr
    assert all(row.key.startswith("claims_") for row in SETTINGS)
