"""Every Celery and kombu internal the worker layer touches, in one place.

Each function here leans on something neither project documents as public: a private
attribute, a transport's class, the shape of an exception wrapper. They were read in Celery
and kombu 5.3 to 5.7 (:data:`TESTED`); a worker running other versions logs a warning once at
start (:func:`check_versions`), and every function degrades to the safe side when what it
expects is missing (no refresh, no local forget: the broker then redelivers, nothing is lost).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import celery
import kombu
from celery.utils.log import get_logger
from kombu.transport.virtual import QoS as VirtualQoS

__all__ = [
    "TESTED",
    "Delivery",
    "check_versions",
    "forget_delivery",
    "refresh_unacked",
    "result_ready",
    "shares_delivery_tags",
    "unwrap_exception",
]

logger = get_logger("celery_claims.worker")

#: (first, last) major.minor of Celery and kombu whose internals this module was checked on.
TESTED = {"celery": ((5, 3), (5, 7)), "kombu": ((5, 3), (5, 7))}


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_versions() -> list[str]:
    """Warn about a Celery or kombu outside :data:`TESTED`; returns the warnings."""
    found = {"celery": celery.__version__, "kombu": kombu.__version__}
    warnings = []
    for name, version in found.items():
        first, last = TESTED[name]
        if not first <= _major_minor(version) <= last:
            warnings.append(
                f"{name} {version} is outside the versions celery-claims was checked on "
                f"({first[0]}.{first[1]} to {last[0]}.{last[1]})"
            )
    for text in warnings:
        logger.warning("celery-claims: %s", text)
    return warnings


@dataclass(eq=False)
class Delivery:
    """A Redis broker delivery whose ``unacked_index`` score the keeper refreshes.

    Attributes:
        channel: the kombu Redis channel the message was delivered on.
        tag: the delivery tag (the member of ``unacked_index``).
    """

    channel: Any
    tag: str

    @classmethod
    def of(cls, message: Any) -> Delivery | None:
        """The delivery of ``message`` if it came from kombu's Redis transport, else None."""
        if not shares_delivery_tags(message):
            return None
        return cls(message.channel, str(message.delivery_tag))


def shares_delivery_tags(message: Any) -> bool:
    """True if ``message`` came from kombu's Redis transport.

    There a restored message keeps its delivery tag, and every worker's copy of it is one
    record in ``unacked``/``unacked_index``: acking any copy deletes the record of all of
    them. AMQP channels number their own deliveries instead.
    """
    channel = getattr(message, "channel", None)
    # duck-typed: kombu's Redis channel is the one with an unacked index and a client factory
    return (
        getattr(message, "delivery_tag", None) is not None
        and hasattr(channel, "unacked_index_key")
        and callable(getattr(channel, "conn_or_acquire", None))
    )


def refresh_unacked(deliveries: Iterable[Delivery]) -> int:
    """Set the ``unacked_index`` score of each delivery to now; returns how many were sent.

    ``ZADD ... XX`` never re-adds a delivery that was acked or restored meanwhile.

    Raises:
        Exception: whatever the broker client raises (the caller logs it).
    """
    by_channel: dict[int, tuple[Any, list[str]]] = {}
    for delivery in deliveries:
        by_channel.setdefault(id(delivery.channel), (delivery.channel, []))[1].append(delivery.tag)
    now = time.time()
    sent = 0
    for channel, tags in by_channel.values():
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for tag in tags:
                pipe.zadd(channel.unacked_index_key, {tag: now}, xx=True)
            pipe.execute()
        sent += len(tags)
    return sent


def forget_delivery(request: Any) -> bool:
    """Let a Redis delivery go in this worker only, leaving the broker's record alone.

    For a stale copy on the Redis broker: its record in ``unacked`` is the same record as the
    live owner's copy (same delivery tag), so acking it would delete the live one. This drops
    the message from the channel's in-memory QoS (its prefetch slot frees, and it is not
    restored at shutdown) and marks it settled for Celery and kombu, without a command to
    Redis. Returns False (and changes nothing) where the message is not a Redis delivery.
    """
    message: Any = getattr(request, "message", None)
    if not shares_delivery_tags(message):
        return False
    qos = getattr(message.channel, "qos", None)
    if isinstance(qos, VirtualQoS):
        # the base class's ack only forgets the tag locally; the Redis QoS's own ack would
        # also remove it from unacked/unacked_index, which is exactly what must not happen
        local_ack: Any = VirtualQoS.ack
        local_ack(qos, message.delivery_tag)
    with contextlib.suppress(AttributeError):
        message._state = "ACK"
    request.acknowledged = True
    return True


def result_ready(request: Any) -> bool:
    """True if the pool already has the request's outcome (prefork ``ApplyResult``)."""
    ref = getattr(request, "_apply_result", None)
    result = ref() if callable(ref) else None
    ready = getattr(result, "ready", None)
    return bool(ready()) if callable(ready) else False


def unwrap_exception(exc: BaseException | None) -> BaseException | None:
    """The exception a pool reported, unwrapped from prefork's pickling wrapper."""
    inner = getattr(exc, "exc", None)
    if type(exc).__name__ == "ExceptionWithTraceback" and isinstance(inner, BaseException):
        return inner
    return exc
