"""A fleet's own consumer class (``worker_consumer``), with and without the claims mixin."""

from __future__ import annotations

import threading
from typing import Any

from celery.worker.consumer import Consumer

from celery_claims.worker import ClaimsConsumerMixin

#: Task ids every FleetConsumer saw, in order (in-process workers share the test's memory).
SEEN: list[str] = []
_lock = threading.Lock()


class FleetConsumer(ClaimsConsumerMixin, Consumer):  # type: ignore[misc]  # celery is untyped
    """Records each request it is handed, in a wrapper set after the consumer is built (in
    front of the claim gate, as a fleet's tracing or metrics wrapper would be)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        inner = self.on_task_request

        def seen(request: Any) -> Any:
            with _lock:
                SEEN.append(request.id)
            return inner(request)

        self.on_task_request = seen
