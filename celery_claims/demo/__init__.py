"""``celery-claims demo``: a real two-worker fleet, with and without claims, side by side.

:mod:`celery_claims.demo.app` is the Celery app the demo's ``celery worker`` processes run
(configured from ``CLAIMS_DEMO_*`` environment variables); :mod:`celery_claims.demo.runner`
starts Redis and the fleets, runs the workload, and reports.
"""
