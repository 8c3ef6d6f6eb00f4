"""The public API: what ``celery_claims`` exports, and that the core stays free of Celery."""

from __future__ import annotations

import subprocess
import sys

import pytest

import celery_claims
import celery_claims.lanes
import celery_claims.rates


def test_every_exported_name_resolves() -> None:
    for module in (celery_claims, celery_claims.lanes, celery_claims.rates):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], f"{module.__name__} exports missing names {missing}"


def test_importing_the_core_does_not_import_celery_or_kombu() -> None:
    code = (
        "import sys, celery_claims, celery_claims.lanes, celery_claims.lanes.redis, "
        "celery_claims.rates;"
        "print(sorted(m for m in ('celery', 'kombu') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_install_and_current_claim_are_the_worker_integration_loaded_on_first_use() -> None:
    from celery_claims.worker import current_claim, install

    assert celery_claims.install is install
    assert celery_claims.current_claim is current_claim


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        celery_claims.no_such_name  # noqa: B018
