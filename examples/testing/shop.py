"""The application under test: a task that must not charge an order twice."""

from __future__ import annotations

import threading

from celery import shared_task

#: Orders charged, in order (the in-process worker runs in the test's own process).
CHARGED: list[str] = []
_lock = threading.Lock()


@shared_task(name="shop.charge")
def charge(order_id: str) -> str:
    """Charge an order (here: remember that it was charged)."""
    with _lock:
        CHARGED.append(order_id)
    return f"charged {order_id}"
