"""The publish journal, Celery side: producers journal what they publish, workers recover it.

The store's side (entries, scripts) is :mod:`celery_claims.claims.journal`.
"""
