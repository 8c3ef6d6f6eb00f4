"""``claims_lanes``, ``claims_lane_recheck_ms`` and ``claims_strict_settings`` validation."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_claims import InvalidArgument
from celery_claims.worker import install, load_settings
from celery_claims.worker.policy import check_task_policies
from celery_claims.worker.settings import LaneSpec
from tests.worker.helpers import unique


def _settings(**conf: Any) -> Any:
    app = Celery(unique("lanes"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(conf)
    install(app)
    return load_settings(app)


def test_a_lane_maps_its_queues_and_optional_kinds_to_a_spec() -> None:
    # Given two lanes, one on a whole queue and one on some task names of another queue
    lanes = {
        "video": {"queues": ["video"], "limit": 2},
        "reports": {"queues": ["default"], "limit": 1, "kinds": ["app.report"]},
    }

    # When the settings are read
    settings = _settings(claims_lanes=lanes, claims_lane_recheck_ms=250)

    # Then each lane covers what it names, and nothing else
    video, reports = settings.lanes
    assert video == LaneSpec("video", ("video",), 2, None)
    assert video.covers("video", "any.task")
    assert not video.covers("default", "any.task")
    assert reports.covers("default", "app.report")
    assert not reports.covers("default", "app.other")
    assert settings.lane_recheck_ms == 250
    assert settings.strict_settings is False


@pytest.mark.parametrize(
    ("lanes", "message"),
    [
        (["video"], "must be a dict of lane name"),
        ({"": {"queues": ["q"], "limit": 1}}, "lane names must be non-empty"),
        ({"v": ["q"]}, "lane 'v' must be a dict"),
        ({"v": {"queues": ["q"]}}, "needs 'queues' and 'limit' or 'rate'"),
        ({"v": {"queues": ["q"], "limit": 1, "max": 2}}, "unknown key 'max'; a lane takes queues"),
        ({"v": {"queues": ["q"], "limt": 1}}, "unknown key 'limt' \\(did you mean limit\\?\\)"),
        (
            {"v": {"queues": ["q"], "limit": 2, "key": "k", "per_key": 1, "kind": ["t"]}},
            "unknown keys 'kind' \\(did you mean kinds\\?\\), 'per_key' \\(did you mean "
            "limit_per_key\\?\\)",
        ),
        ({"v": {"queues": "q", "limit": 1}}, "queues must be a list of names"),
        ({"v": {"queues": [], "limit": 1}}, "queues must not be empty"),
        ({"v": {"queues": [""], "limit": 1}}, "must hold non-empty names"),
        ({"v": {"queues": ["q"], "limit": -1}}, "limit must be an int from 0"),
        ({"v": {"queues": ["q"], "limit": True}}, "limit must be an int from 0"),
        ({"v": {"queues": ["q"], "limit": 1, "kinds": []}}, "kinds must not be empty"),
        (
            {"a": {"queues": ["q"], "limit": 1}, "b": {"queues": ["q"], "limit": 1}},
            "lanes 'a' and 'b' both cover queue 'q'",
        ),
        (
            {
                "a": {"queues": ["q"], "limit": 1, "kinds": ["t1", "t2"]},
                "b": {"queues": ["q", "r"], "limit": 1, "kinds": ["t2"]},
            },
            "lanes 'a' and 'b' both cover queue 'q'",
        ),
    ],
)
def test_an_invalid_lane_setting_is_refused_naming_the_key_and_the_lane(
    lanes: Any, message: str
) -> None:
    # Given a malformed claims_lanes, When the settings are read, Then the error says what
    with pytest.raises(InvalidArgument, match=f"claims_lanes.*{message}"):
        _settings(claims_lanes=lanes)


def test_lanes_sharing_a_queue_with_disjoint_kinds_are_accepted() -> None:
    # Given two lanes on one queue that split its task names
    lanes = {
        "a": {"queues": ["q"], "limit": 1, "kinds": ["t1"]},
        "b": {"queues": ["q"], "limit": 3, "kinds": ["t2"]},
    }

    # When the settings are read, Then both lanes are there
    assert [lane.name for lane in _settings(claims_lanes=lanes).lanes] == ["a", "b"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("claims_lane_recheck_ms", 5), ("claims_lane_recheck_ms", 1.5), ("claims_strict_settings", 1)],
)
def test_an_invalid_lane_recheck_or_strict_flag_is_refused(key: str, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=key):
        _settings(**{key: value})


def _tenant_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    return kwargs["tenant_id"]


@pytest.mark.parametrize(
    ("key", "names", "fn"),
    [
        ("tenant_id", ("tenant_id",), None),
        (("tenant_id", "region"), ("tenant_id", "region"), None),
        (_tenant_key, (), _tenant_key),
    ],
)
def test_a_keyed_lane_reads_its_key_and_per_key_limit(key: Any, names: Any, fn: Any) -> None:
    # Given a keyed lane, When the settings are read
    lanes = {"exports": {"queues": ["exports"], "limit": 20, "key": key, "limit_per_key": 2}}
    (lane,) = _settings(claims_lanes=lanes).lanes

    # Then it carries its key and its per-key limit beside its limit
    assert (lane.limit, lane.key_names, lane.key_fn, lane.limit_per_key) == (20, names, fn, 2)
    assert lane.keyed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"key": "tenant_id"}, "'key' goes with 'limit_per_key' .*, 'rate' .*, or both"),
        ({"limit_per_key": 1}, "'limit_per_key' goes with 'key' and 'limit'"),
        ({"rate": "10/x"}, "rate unit must be s, m or h"),
        ({"rate": "0/s"}, "rate must allow at least 1 start"),
        ({"key": 42, "limit_per_key": 1}, "key.*must be an argument name"),
        ({"key": (), "limit_per_key": 1}, "key.*must be an argument name"),
        ({"key": "not a name", "limit_per_key": 1}, "is not an argument name"),
        ({"key": ("a", "a"), "limit_per_key": 1}, "names an argument twice"),
        ({"key": "t", "limit_per_key": 0}, "limit_per_key must be an int from 1 to its limit"),
        (
            {"key": "t", "limit_per_key": 5},
            r"limit_per_key must be an int from 1 to its limit \(4\)",
        ),
        ({"key": "t", "limit_per_key": 1.0}, "limit_per_key must be an int"),
        ({"key": "t", "limit_per_key": True}, "limit_per_key must be an int"),
        ({"key": "t", "limit_per_key": "2"}, "limit_per_key must be an int"),
    ],
)
def test_a_bad_keyed_lane_is_refused_in_one_line_naming_the_lane(
    extra: dict[str, Any], message: str
) -> None:
    # Given a keyed lane with a bad key or per-key limit
    lanes = {"exports": {"queues": ["exports"], "limit": 4, **extra}}

    # When the settings are read, Then one line names claims_lanes, the lane and what is wrong
    with pytest.raises(InvalidArgument, match=f"claims_lanes.*'exports'.*{message}") as caught:
        _settings(claims_lanes=lanes)
    assert "\n" not in str(caught.value)


def test_a_keyed_lane_whose_listed_task_lacks_the_key_argument_stops_the_worker() -> None:
    # Given a keyed lane listing a task that takes no tenant_id
    lanes = {
        "exports": {
            "queues": ["exports"],
            "limit": 4,
            "kinds": ["t.export"],
            "key": "tenant_id",
            "limit_per_key": 1,
        }
    }
    app = Celery(unique("lanes"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(claims_lanes=lanes)
    install(app)

    @app.task(shared=False, name="t.export")
    def export(customer_id: str) -> None:
        """Takes no tenant_id."""

    # When the worker's start check runs, Then it names the lane and the missing argument
    with pytest.raises(InvalidArgument, match=r"lane 'exports' key.*takes no argument 'tenant_id'"):
        check_task_policies(app, load_settings(app))


def test_a_lane_may_have_a_rate_beside_or_instead_of_its_limit_and_per_key() -> None:
    # Given lanes with a rate: beside a limit, alone, and per key
    lanes = {
        "mail": {"queues": ["mail"], "rate": "100/m"},
        "video": {"queues": ["video"], "limit": 2, "rate": "10/s"},
        "sms": {"queues": ["sms"], "rate": "2/s", "key": "customer"},
    }

    # When the settings are read
    by_name = {lane.name: lane for lane in _settings(claims_lanes=lanes).lanes}

    # Then each carries its rate; the rate-only lanes limit nothing else
    mail, video, sms = by_name["mail"], by_name["video"], by_name["sms"]
    assert (mail.limit, mail.limited, str(mail.rate), mail.rate_keyed) == (
        None,
        False,
        "100/m",
        False,
    )
    assert (video.limit, video.limited, str(video.rate)) == (2, True, "10/s")
    assert (sms.limit, sms.key_names, sms.limit_per_key, sms.rate_keyed) == (
        None,
        ("customer",),
        0,
        True,
    )
    assert not sms.keyed  # no per-key concurrency limit: its key is its rate's
