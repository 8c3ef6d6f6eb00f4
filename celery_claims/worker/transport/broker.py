"""The Redis broker's deliveries, and the claim store's writes riding kombu's round trips.

Every kombu Redis transport internal the delivery path touches is here: a delivery's tag and
its record in ``unacked``/``unacked_index`` (:class:`Delivery`, :func:`refresh_unacked`), the
local forget of a stale copy (:func:`forget_delivery`), :class:`BrokerRide`, which
replaces the QoS's ``append`` and ``ack`` on a channel's instance with transactions that carry
the claim store's writes, and :func:`keep_writes`, which sends kombu's own ``append`` and
``ack`` on a kept connection where nothing rides them (a store apart). Read in kombu 5.3 to 5.7
(:data:`celery_claims.worker.compat.TESTED`); each degrades to the safe side when what it
expects is missing (no refresh, no local forget: the broker then redelivers).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from celery.utils.log import get_logger
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils import json

from celery_claims.claims.calls import ScriptCall
from celery_claims.connection import server_of
from celery_claims.safety import KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S
from celery_claims.worker.compat import close_with
from celery_claims.worker.transport.sender import ScriptCaller

__all__ = [
    "BrokerRide",
    "Delivery",
    "forget_delivery",
    "keep_writes",
    "refresh_unacked",
    "shares_delivery_tags",
    "store_is_broker",
]

logger = get_logger("celery_claims.worker")


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


def _broker_server(conn: Any) -> tuple[Any, ...] | None:
    """(host, port, unix path, database) of a kombu Redis connection, read from its URL."""
    if conn.transport_cls not in ("redis", "rediss"):
        return None  # Sentinel (its master moves), or not Redis at all
    host = str(conn.hostname or "")
    if "://" in host:
        # redis+socket:///path?virtual_host=N: kombu keeps "socket:///path?..." as the host
        parts = urlsplit(host)
        query = parse_qs(parts.query)
        db = (query.get("virtual_host") or query.get("db") or ["0"])[-1]
        return (None, None, unquote(parts.path), int(db.strip("/") or 0))
    vhost = str(conn.virtual_host or "").strip("/") or "0"
    return (host or "127.0.0.1", conn.port or 6379, None, int(vhost))


def store_is_broker(app: Any, store_client: Any) -> bool:
    """True if ``app``'s broker is kombu's Redis transport on the claim store's server and db.

    Read from the broker URL, without connecting; :meth:`BrokerRide.of` checks each channel
    again (a False here only costs speed: the record is then written on its own).
    """
    store = server_of(store_client)
    if store is None:
        return False
    try:
        broker = _broker_server(app.connection_for_write())
    except Exception:  # an unreadable broker URL: Celery reports it, not this check
        return False
    return broker == store


@dataclass(eq=False)
class BrokerRide:
    """The claim store's writes riding kombu's own round trips on the Redis broker.

    Where the claim store is the broker's server and database, kombu's Redis ``QoS`` writes
    each delivery to ``unacked``/``unacked_index`` when it delivers the message (``append``,
    one MULTI/EXEC) and removes it when the message is acked (``ack``, another). The claim is
    sent in the first transaction and the completion record replaces the second (one script
    that removes the delivery only when the record is the copy's own), so claims cost no
    round trip of their own. The QoS methods are replaced on the channel's instance only
    (checked on kombu 5.3 to 5.7, whose ``append`` and ``ack`` are written the same way).
    The append transaction goes on a connection kept for it, made from the channel's pool
    (:meth:`~celery_claims.worker.transport.sender.ScriptCaller.transaction`), where the pool is a
    standalone server's; after a timeout or a dropped connection, and on other pools, it goes
    through kombu's pipeline, with redis-py's retries.

    Attributes:
        qos: the channel's kombu Redis ``QoS``.
        keys: kombu's ``unacked_index`` and ``unacked`` keys, with the transport's
            ``global_keyprefix``.
        prefixed: the transport prefixes keys (``global_keyprefix``): kombu's pipeline would
            prefix a script's first key only, so claims cannot ride its ``append``.
    """

    qos: Any
    keys: tuple[str, str]
    prefixed: bool

    #: Attributes of a QoS whose ``ack`` / ``append`` consult a hook.
    ACK_HOOK = "_celery_claims_ack_hook"
    #: Attribute of a channel caching its ride: (store client, ride or None).
    CACHED = "_celery_claims_ride"
    APPEND_HOOK = "_celery_claims_append_hook"

    @classmethod
    def of_consumer(cls, consumer: Any, store_client: Any) -> BrokerRide | None:
        """The ride of a Celery consumer's task channel (``consumer.task_consumer.channel``)."""
        channel = getattr(getattr(consumer, "task_consumer", None), "channel", None)
        return cls.of(channel, store_client)

    @classmethod
    def of(cls, channel: Any, store_client: Any) -> BrokerRide | None:
        """The ride on ``channel``, if its deliveries can be written by the claim store's
        scripts: kombu's Redis transport, a client of the same server and database as
        ``store_client``, and the QoS this module knows. None otherwise (claims and
        completions are then sent on their own)."""
        cached = getattr(channel, cls.CACHED, None)
        if cached is not None and cached[0] is store_client:
            return cached[1]  # type: ignore[no-any-return]
        ride = cls._of(channel, store_client)
        with contextlib.suppress(AttributeError):
            setattr(channel, cls.CACHED, (store_client, ride))
        return ride

    @classmethod
    def _of(cls, channel: Any, store_client: Any) -> BrokerRide | None:
        qos = getattr(channel, "qos", None)
        server = server_of(getattr(channel, "client", None))
        if (
            not hasattr(channel, "unacked_index_key")
            or server is None
            or server != server_of(store_client)
            or not isinstance(qos, VirtualQoS)
            or not callable(getattr(type(qos), "_remove_from_indices", None))
            or not callable(getattr(qos, "pipe_or_acquire", None))
        ):
            return None
        prefix = str(getattr(channel, "global_keyprefix", "") or "")
        keys = (prefix + channel.unacked_index_key, prefix + channel.unacked_key)
        return cls(qos, keys, bool(prefix))

    def hook_ack(self, take: Callable[[Any], bool]) -> None:
        """Route the QoS's acks through ``take(tag)`` (idempotent, per channel).

        ``take`` returns True when it settled the delivery itself (its script removed it, or
        it chose to leave it); False lets kombu's own ack run.
        """
        qos = self.qos
        if getattr(qos, self.ACK_HOOK, None) == take:
            return
        kombu_ack = type(qos).ack

        def ack(delivery_tag: Any) -> None:
            if not take(delivery_tag):
                kombu_ack(qos, delivery_tag)

        qos.ack = ack  # an instance attribute: kombu's Channel.basic_ack calls self.qos.ack
        setattr(qos, self.ACK_HOOK, take)

    def hook_append(
        self,
        claim_for: Callable[[Any], ScriptCall[Any] | None],
        claimed: Callable[[Any, Any], None],
    ) -> bool:
        """Send ``claim_for(message)``'s call in kombu's append transaction (per channel).

        ``claimed(message, reply)`` gets the script's raw reply, or the error it ended with,
        before kombu hands the message on; a None call sends kombu's append as it is. False
        (nothing hooked) where the transport prefixes keys.
        """
        qos = self.qos
        if self.prefixed:
            return False
        if getattr(qos, self.APPEND_HOOK, None) == claim_for:
            return True
        kombu_append = type(qos).append
        caller = ScriptCaller()
        close_with(qos.channel, caller.close)  # its connections go with the channel's

        def append(message: Any, delivery_tag: Any) -> None:
            call = claim_for(message)
            if call is None:
                kombu_append(qos, message, delivery_tag)
                return
            replies = _append_and_claim(qos, caller, message, delivery_tag, call)
            for reply in replies[:2]:
                if isinstance(reply, Exception):
                    raise reply  # kombu's own write failed: as kombu's append would
            local_append: Any = VirtualQoS.append
            local_append(qos, message, delivery_tag)
            claimed(message, replies[2])

        qos.append = append
        setattr(qos, self.APPEND_HOOK, claim_for)
        return True

    def forget(self, tag: Any) -> None:
        """Drop ``tag`` from the channel's in-memory QoS only (its record is gone already)."""
        local_ack: Any = VirtualQoS.ack
        local_ack(self.qos, tag)

    def ack(self, tag: Any) -> None:
        """kombu's own ack of ``tag`` (removes its record, then forgets it)."""
        kombu_ack: Any = type(self.qos).ack
        kombu_ack(self.qos, tag)


def _append_commands(qos: Any, message: Any, delivery_tag: Any) -> list[tuple[Any, ...]]:
    """kombu's append of ``message`` (``kombu/transport/redis.py``, ``QoS.append``: the
    delivery into the unacked index and hash), as the commands of its transaction."""
    delivery = message.delivery_info
    dumps: Any = json.dumps
    raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
    score = repr(time.time())  # as redis-py writes a float
    return [
        ("ZADD", qos.unacked_index_key, score, delivery_tag),
        ("HSET", qos.unacked_key, delivery_tag, raw),
    ]


def _append_and_claim(
    qos: Any, caller: ScriptCaller, message: Any, delivery_tag: Any, call: ScriptCall[Any]
) -> list[Any]:
    """kombu's append of ``message`` and ``call``, in one transaction; their three replies,
    each the error it ended with where one failed."""
    commands = _append_commands(qos, message, delivery_tag)
    pool = qos.channel.pool
    if type(pool) is redis.ConnectionPool:
        # on a connection kept for it, made from the channel's own pool (kombu's settings):
        # a third of the CPU of kombu's pipeline, which builds a client per call
        # (docs/benchmarks.md)
        try:
            replies: list[Any] = caller.transaction(pool, commands, call)
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            # run or not: kombu's own transaction, with redis-py's retries (every write in
            # it may run twice: the claim's owner claims again)
            pass
    (_, index_key, score, _), (_, unacked_key, _, raw) = commands
    with qos.pipe_or_acquire() as pipe:
        pipe.zadd(index_key, {delivery_tag: float(score)})
        pipe.hset(unacked_key, delivery_tag, raw)
        pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        result: list[Any] = pipe.execute(raise_on_error=False)
        return result


def _remove_again(qos: Any, delivery_tag: Any, sent_at: float) -> None:
    """kombu's removal of ``delivery_tag`` from its unacked set, through its own pipeline
    (an ack whose replies the kept connection lost, sent at ``sent_at``, monotonic);
    kombu's memory already forgot it.

    Only within half the visibility timeout of the ack: later, the delivery may have been
    restored and delivered again, and on the Redis broker that copy keeps the same tag, so
    its record in ``unacked`` is this one: removing it would leave a live copy with nothing
    to restore it from. Left, the delivery is restored and redelivered instead (its copy
    acked unrun if recorded done).
    """
    late = time.monotonic() - sent_at
    timeout_s = getattr(qos.channel, "visibility_timeout", KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S)
    if late > float(timeout_s) / 2:
        logger.warning(
            "kombu's ack of %s: not sent again %.0f s after it (half the visibility timeout "
            "has passed: the delivery may be another copy's now); it may be redelivered",
            delivery_tag,
            late,
        )
        return
    qos._remove_from_indices(delivery_tag).execute()


#: Attribute of a QoS whose ``append`` and ``ack`` go on a kept connection (:func:`keep_writes`).
_KEPT_HOOK = "_celery_claims_kept_writes"


def keep_writes(channel: Any) -> bool:
    """Send kombu's ``append`` and ``ack`` transactions of ``channel``'s Redis QoS on a
    connection kept for them, where no claim rides them (the claim store is not the broker's
    server); True if hooked (idempotent, per channel).

    The same commands in the same ``MULTI``/``EXEC`` as kombu's (``ZADD`` and ``HSET`` of the
    delivery into ``unacked_index`` and ``unacked``; ``ZREM`` and ``HDEL`` at the ack), then
    the same forget in kombu's memory, sent by the package's packer and read by its reader
    (:meth:`~celery_claims.worker.transport.sender.ScriptCaller.commands`): a third of the
    CPU of kombu's pipeline, which builds a client per call. Where the channel's pool is not a
    standalone server's (Sentinel), the transport prefixes keys (``global_keyprefix``), or
    the kept connection times out or drops, kombu's own method runs (every command in them
    may run twice: each is idempotent). False (nothing hooked) where the channel is not
    kombu's Redis transport with the QoS this module knows.
    """
    qos = getattr(channel, "qos", None)
    if (
        not hasattr(channel, "unacked_index_key")
        or not isinstance(qos, VirtualQoS)
        or str(getattr(channel, "global_keyprefix", "") or "")
        or not callable(getattr(type(qos), "_remove_from_indices", None))
    ):
        return False
    if getattr(qos, _KEPT_HOOK, None) is None:
        writes = _KeptWrites(qos)
        close_with(qos.channel, writes.caller.close)  # its connections go with the channel's
        # instance attributes: kombu's Channel calls self.qos.append and self.qos.ack
        hooked: Any = qos
        hooked.append, hooked.ack = writes.append, writes.ack
        setattr(qos, _KEPT_HOOK, writes)
    return True


class _KeptWrites:
    """kombu's ``append`` and ``ack`` of one Redis QoS, on a kept connection
    (:func:`keep_writes`)."""

    def __init__(self, qos: Any) -> None:
        self.qos = qos
        self.caller = ScriptCaller()
        self.kombu_append, self.kombu_ack = type(qos).append, type(qos).ack

    def append(self, message: Any, delivery_tag: Any) -> None:
        qos = self.qos
        if self._ran(_append_commands(qos, message, delivery_tag)):
            local_append: Any = VirtualQoS.append
            local_append(qos, message, delivery_tag)
        else:
            self.kombu_append(qos, message, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        """kombu's ack, its replies not waited for: read before the kept connection's next
        write (an error among them logged there). Where the connection is found lost before
        they were read (the broker restarted), the removal is sent again through kombu's own
        pipeline, with redis-py's retries (both commands are idempotent), as kombu's ack
        would have been, unless half the visibility timeout has passed since
        (:func:`_remove_again`). Every ack comes after the copy's record (or is of a task whose
        record is not the worker's to write): one lost all the same (the worker idle until
        the visibility timeout) only leaves the delivery in ``unacked``, restored and
        redelivered, its copy acked unrun if recorded done."""
        qos = self.qos
        pool = qos.channel.pool
        removal = [
            ("ZREM", qos.unacked_index_key, delivery_tag),
            ("HDEL", qos.unacked_key, delivery_tag),
        ]
        if type(pool) is redis.ConnectionPool:
            try:
                self.caller.send_commands(
                    pool,
                    removal,
                    f"kombu's ack of {delivery_tag}",
                    functools.partial(_remove_again, qos, delivery_tag, time.monotonic()),
                )
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # not written in full: kombu's own, with redis-py's retries
            else:
                local_ack: Any = VirtualQoS.ack
                local_ack(qos, delivery_tag)
                return
        self.kombu_ack(qos, delivery_tag)

    def _ran(self, commands: list[tuple[Any, ...]]) -> bool:
        """Run ``commands`` in one transaction on the kept connection: True once they ran,
        False to leave them to kombu (nothing known to have run)."""
        pool = self.qos.channel.pool
        if type(pool) is not redis.ConnectionPool:
            return False
        try:
            replies = self.caller.commands(pool, commands)
        except (redis.ConnectionError, redis.TimeoutError):
            return False  # run or not: kombu's own, with redis-py's retries
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply  # as kombu's pipeline raises a command's error
        return True
