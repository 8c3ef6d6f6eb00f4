"""Load the celery-claims pytest plugin (in your top-level conftest.py)."""

pytest_plugins = ["celery_claims.testing"]
