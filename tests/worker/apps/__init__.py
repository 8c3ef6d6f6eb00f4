"""Celery apps that real ``celery worker`` / ``celery beat`` subprocesses import by name."""
