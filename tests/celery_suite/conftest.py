"""Celery's own integration suite runs only when asked for by name (``-m celery_suite``).

It takes tens of minutes and downloads Celery's sdist, so it is deselected from every run
whose ``-m`` does not name the marker, including the README's ``-m "not slow and not soak"``
and ``-m "slow and not soak"`` (which replace the default ``-m 'not soak'`` of addopts).
"""

from __future__ import annotations

import pytest

MARKER = "celery_suite"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect this directory's tests unless the marker expression names the marker."""
    if MARKER in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker(MARKER) is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
