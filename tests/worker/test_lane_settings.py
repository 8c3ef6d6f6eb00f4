"""``claims_lanes``, ``claims_lane_recheck_ms`` and ``claims_strict_settings`` validation."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_claims import InvalidArgument
from celery_claims.worker import install, load_settings
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
        ({"v": {"queues": ["q"]}}, "needs 'queues' and 'limit'"),
        ({"v": {"queues": ["q"], "limit": 1, "max": 2}}, "unknown keys \\['max'\\]"),
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
