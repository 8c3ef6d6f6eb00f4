"""Every Celery and kombu internal the worker layer touches, in one place.

Each function here leans on something neither project documents as public: a private
attribute, a transport's class, the shape of an exception wrapper. They were read in Celery
and kombu 5.3 to 5.7 (:data:`TESTED`), and the suite runs on each of those minors (tox.ini,
``celery53`` to ``celery57``); a worker running other versions logs a warning once at
start (:func:`check_versions`), and every function degrades to the safe side when what it
expects is missing (no refresh, no local forget: the broker then redelivers, nothing is lost).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import celery
import kombu
import redis
from celery import signals as celery_signals
from celery.utils.log import get_logger
from celery.utils.saferepr import saferepr
from kombu.asynchronous import get_event_loop, set_event_loop
from kombu.connection import Connection
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils import json

from celery_claims.claims.redis import ScriptCall
from celery_claims.connection import server_of
from celery_claims.safety import KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S
from celery_claims.worker.sender import ScriptCaller

__all__ = [
    "TESTED",
    "Delivery",
    "LoopWaker",
    "check_versions",
    "fail_unrun",
    "forget_delivery",
    "forget_hub_when_closed",
    "pool_name",
    "refresh_unacked",
    "republish",
    "revoke_unrun",
    "RestoreCadence",
    "restore_cadence",
    "restore_visible",
    "restore_mutex_expire",
    "message_state",
    "requeued",
    "before_gone",
    "result_ready",
    "shares_delivery_tags",
    "store_is_broker",
    "unwrap_exception",
    "close_result_backend",
    "close_with",
    "wrap_send_task",
]

logger = get_logger("celery_claims.worker")

#: (first, last) major.minor of Celery and kombu whose internals this module was checked on,
#: each run by tox (celery53: Celery 5.3.6, kombu 5.3.7 ... celery57: Celery 5.7.0, kombu 5.7.0).
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


class LoopWaker:
    """Runs a callback on the consumer's event loop soon, from any thread.

    ``consumer.call_soon`` puts the callback in kombu's hub, which runs it at the top of its
    next turn. kombu 5.7's hub also wakes its poll when another thread adds one (a socket
    pair of its own, ``Hub._waker``); kombu 5.3 to 5.6's does not, so a callback added from
    the lease keeper or a thread pool's thread waits for the loop's next I/O event or timer:
    up to 10 s (Celery's worker gives the hub's timer ``max_interval=10.0``) while nothing
    arrives, for instance while the prefetch window is full. Where the hub has no waker of
    its own this one adds a socket pair as a reader of the hub (``hub.add_reader``, as
    kombu's transports register theirs) and writes a byte to it after each callback. Attach
    it from the loop's thread each time the consumer (re)starts: kombu's loop resets the
    hub, dropping every reader, when it ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._hub: Any = None

    @staticmethod
    def needed(hub: Any) -> bool:
        """True if ``hub`` is a kombu hub that does not wake itself (kombu before 5.7)."""
        return (
            hub is not None
            and not hasattr(hub, "_waker")
            and callable(getattr(hub, "add_reader", None))
            and isinstance(getattr(hub, "readers", None), dict)
        )

    def attach(self, consumer: Any) -> None:
        """Make the consumer's hub poll the waker (on the loop's thread; idempotent)."""
        hub: Any = getattr(consumer, "hub", None)
        if not self.needed(hub):
            return
        with self._lock:
            if self._pair is None:
                pair = socket.socketpair()
                for end in pair:
                    end.setblocking(False)
                self._pair = pair
            reader = self._pair[0]
        if hub.readers.get(reader.fileno()) is None:
            hub.add_reader(reader.fileno(), self._drain, reader)
        self._hub = hub

    def call_soon(self, consumer: Any, fn: Callable[..., object], *args: Any) -> None:
        """``consumer.call_soon(fn, *args)``, then wake the loop if it sleeps in poll."""
        consumer.call_soon(fn, *args)
        pair = self._pair
        if pair is not None:
            # a full socket buffer already has a wake-up pending; a closed one, no loop
            with contextlib.suppress(OSError):
                pair[1].send(b"\0")

    @staticmethod
    def _drain(reader: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while reader.recv(4096):
                pass

    def close(self) -> None:
        """Let go of the socket pair (reentrant, no logging: the consumer is stopping)."""
        with self._lock:
            pair, self._pair = self._pair, None
            hub, self._hub = self._hub, None
        if pair is None:
            return
        with contextlib.suppress(Exception):
            if hub is not None and pair[0].fileno() in hub.readers:
                hub.remove_reader(pair[0].fileno())
        for end in pair:
            end.close()


def forget_hub_when_closed(hub: Any) -> None:
    """Stop ``hub`` being the process's event loop once it is closed, as kombu 5.6 does.

    Celery's worker takes the process's event loop (``kombu.asynchronous.get_event_loop``)
    if there is one, and makes one with its own timer otherwise; its ``Hub.close`` at shutdown
    left the closed hub in place before kombu 5.6. A second worker started in the same
    process (each in-process worker of a test session) then runs on the first one's hub,
    which fires the first worker's timer, not its own: none of its timers fire (Celery's ETA
    tasks, the re-checks of held copies; found with tox celery53 to celery55). The callback
    goes in ``hub.on_close``, which ``Hub.close`` calls on every kombu from 5.3.
    """
    on_close = getattr(hub, "on_close", None)
    if isinstance(on_close, set):
        on_close.add(_forget_event_loop)


def _forget_event_loop(hub: Any) -> None:
    if get_event_loop() is hub:
        set_event_loop(None)


#: Celery's pool modules (``celery.concurrency.<module>``) by the names ``-P`` takes.
_POOL_MODULES = {
    "prefork": "prefork",
    "thread": "threads",
    "solo": "solo",
    "gevent": "gevent",
    "eventlet": "eventlet",
}


def pool_name(pool_cls: Any) -> str:
    """Celery's name of a worker's pool class (``w.pool_cls``): ``"prefork"``, ``"threads"``,
    ``"solo"``, ``"gevent"``, ``"eventlet"``; ``""`` for any other (a custom pool)."""
    module = str(getattr(pool_cls, "__module__", "") or "")
    package, _, leaf = module.rpartition(".")
    if package != "celery.concurrency":
        return ""
    return _POOL_MODULES.get(leaf, "")


#: kombu's own restore cadence before 5.7, whatever the transport options say: its event loop
#: calls the sweep every 10 s (``register_with_event_loop``) and ``QoS.restore_visible``
#: scans on every 10th call only (its ``interval=10`` default; kombu 5.3 to 5.6).
_KOMBU_FIXED_CADENCE = (10.0, 10)


@dataclass(frozen=True)
class RestoreCadence:
    """How often a worker restores dead consumers' unacked Redis messages, and who does it.

    Attributes:
        interval_s: seconds between two sweeps (the transport option
            ``unacked_restore_interval``, kombu's default 10).
        throttle: only every ``throttle``-th sweep scans ``unacked_index`` (the transport
            option ``unacked_restore_throttle``, kombu's default 10).
        kombu_loop_sweeps: True where kombu's event loop runs the sweep at this cadence
            itself: kombu 5.7 reads both options; kombu 5.3 to 5.6 read neither and sweep at
            their fixed cadence (every 10 s, scanning every 10th time: every ~100 s).
    """

    interval_s: float
    throttle: int
    kombu_loop_sweeps: bool


def restore_cadence(connection: Any) -> RestoreCadence | None:
    """The restore cadence of a Redis broker connection's transport options; None for another
    transport.

    kombu's Redis transport restores the unacked messages of dead consumers (score older than
    ``visibility_timeout`` in ``unacked_index``) from its event loop. kombu 5.7 calls
    ``MultiChannelPoller.maybe_restore_messages`` every ``unacked_restore_interval`` seconds
    and ``QoS.restore_visible`` scans on every ``unacked_restore_throttle``-th call. kombu 5.3
    to 5.6 have neither option (``Channel.from_transport_options`` drops them): their loop
    calls it every 10 s and it scans every 10th time, so a dead worker's message comes back up
    to ~100 s after its ``visibility_timeout``. A consumer without the event loop (Celery's
    ``synloop``: the gevent and eventlet pools) only tries after a poll that saw nothing,
    which never happens while ``BRPOP`` answers every ``brpop_timeout``: there the sweep never
    runs (kombu 5.3 to 5.7). Invalid values fall back as kombu 5.7's do: a non-positive
    interval to the default, a throttle of 0 to 1 (read in kombu 5.3 to 5.7).
    """
    transport = getattr(connection, "transport", None)
    if getattr(transport, "driver_type", None) != "redis":
        return None
    channel_cls = getattr(transport, "Channel", None)
    options = getattr(connection, "transport_options", None) or {}
    default_interval = getattr(channel_cls, "unacked_restore_interval", _KOMBU_FIXED_CADENCE[0])
    interval = options.get("unacked_restore_interval", default_interval)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        interval = default_interval  # as kombu 5.7 does for a non-positive interval
    default_throttle = getattr(channel_cls, "unacked_restore_throttle", _KOMBU_FIXED_CADENCE[1])
    throttle = options.get("unacked_restore_throttle", default_throttle)
    if isinstance(throttle, bool) or not isinstance(throttle, (int, float)) or throttle < 0:
        throttle = default_throttle
    # kombu 5.7 scans on every call for a throttle of 0 (``interval or 1``)
    throttle = max(int(throttle), 1)
    # the options exist (and kombu's loop honours them) where the channel class declares them
    reads_options = hasattr(channel_cls, "unacked_restore_throttle")
    cadence = (float(interval), throttle)
    return RestoreCadence(
        interval_s=cadence[0],
        throttle=cadence[1],
        kombu_loop_sweeps=reads_options or cadence == _KOMBU_FIXED_CADENCE,
    )


def restore_visible(connection: Any) -> bool:
    """Scan ``unacked_index`` once now and restore what a dead consumer left (kombu's sweep,
    without its throttle); False (nothing done) where the connection has no consuming Redis
    channel yet.

    The sweep kombu's ``maybe_restore_messages`` makes: ``QoS.restore_visible`` of the first
    channel that consumes (the keys are not per channel), under kombu's cross-worker mutex
    (``unacked_mutex_key``: two workers never restore the same message twice), restoring at
    most ``unacked_restore_limit`` deliveries whose score is older than
    ``visibility_timeout``; ``interval=1`` makes it scan on this call. Touches the poller's
    ``_channels`` (read in kombu 5.3 to 5.7, where ``restore_visible(start, num, interval)``
    has the same signature).

    Raises:
        Exception: whatever the broker client raises (the caller logs it).
    """
    cycle = getattr(getattr(connection, "transport", None), "cycle", None)
    channels = getattr(cycle, "_channels", None)
    if not isinstance(channels, (set, list, tuple)):
        return False
    for channel in list(channels):
        scan: Any = getattr(getattr(channel, "qos", None), "restore_visible", None)
        if getattr(channel, "active_queues", None) and callable(scan):
            scan(num=getattr(channel, "unacked_restore_limit", None), interval=1)
            return True
    return False


#: kombu's ``unacked_mutex_expire`` (seconds): the restore sweep's cross-worker lock (5.3-5.7).
KOMBU_RESTORE_MUTEX_EXPIRE_S = 300.0


def restore_mutex_expire(url: str, options: Mapping[str, Any]) -> float | None:
    """The expiry to give the Redis broker's restore lock, or None to leave it as it is.

    kombu's restore sweep runs under a lock in the broker (``unacked_mutex``) that expires
    after ``unacked_mutex_expire``, 300 s by default. A worker killed while it holds it (in a
    sweep that restores many messages, or by a poison task that kills its process group) never
    releases it, and for the next 300 s no worker restores anything: no crashed holder's task
    is taken over, however short the visibility timeout. Bounded by the visibility timeout
    (at least 1 s, at most kombu's 300 s), a dead sweeper delays a takeover by at most one
    more visibility timeout. A sweep that outlives the lock is harmless: kombu restores each
    message in a transaction that watches ``unacked``, so two sweeps never restore one message
    twice. None where the user set the option, or the broker is not kombu's Redis transport.
    """
    if "unacked_mutex_expire" in options or not url:
        return None
    try:
        # not connected: the transport's class only
        with Connection(url) as conn:  # type: ignore[no-untyped-call]  # kombu is untyped
            driver = getattr(conn.transport, "driver_type", None)
    except Exception:  # not a URL kombu knows: the consumer itself will say so
        return None
    if driver != "redis":
        return None
    raw = options.get("visibility_timeout", KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None  # refused by the startup check, which names it
    return float(min(KOMBU_RESTORE_MUTEX_EXPIRE_S, max(1.0, raw)))


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


#: (host, port, unix path, database) of a standalone client; None for Cluster and Sentinel.
_server_of = server_of


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
    store = _server_of(store_client)
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
    (:meth:`~celery_claims.worker.sender.ScriptCaller.transaction`), where the pool is a
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
        server = _server_of(getattr(channel, "client", None))
        if (
            not hasattr(channel, "unacked_index_key")
            or server is None
            or server != _server_of(store_client)
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
        index_key, unacked_key = qos.unacked_index_key, qos.unacked_key
        channel = qos.channel
        caller = ScriptCaller()
        close_with(channel, caller.close)  # its connections go with the channel's

        def append(message: Any, delivery_tag: Any) -> None:
            call = claim_for(message)
            if call is None:
                kombu_append(qos, message, delivery_tag)
                return
            # kombu's append (kombu/transport/redis.py, QoS.append), and the claim
            delivery = message.delivery_info
            dumps: Any = json.dumps
            raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
            score = repr(time.time())  # as redis-py writes a float
            replies = None
            pool = channel.pool
            if type(pool) is redis.ConnectionPool:
                # on a connection kept for it, made from the channel's own pool (kombu's
                # settings): a third of the CPU of kombu's pipeline, which builds a client
                # per call (docs/benchmarks.md)
                commands = [("ZADD", index_key, score, delivery_tag)]
                commands.append(("HSET", unacked_key, delivery_tag, raw))
                try:
                    replies = caller.transaction(pool, commands, call)
                except (redis.ConnectionError, redis.TimeoutError):
                    # run or not: kombu's own transaction, with redis-py's retries (every
                    # write in it may run twice: the claim's owner claims again)
                    replies = None
            if replies is None:
                with qos.pipe_or_acquire() as pipe:
                    pipe.zadd(index_key, {delivery_tag: float(score)})
                    pipe.hset(unacked_key, delivery_tag, raw)
                    pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                    replies = pipe.execute(raise_on_error=False)
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


def message_state(request: Any) -> str | None:
    """kombu's state of the request's message once it was acked or rejected (``ACK``,
    ``REJECTED``, ``REQUEUED``); None before (still ``RECEIVED``), or unknown."""
    state = getattr(getattr(request, "message", None), "_state", None)
    return state if state in ("ACK", "REJECTED", "REQUEUED") else None


def before_gone(request: Any, fn: Callable[[], object]) -> bool:
    """Run ``fn()`` once, just before Celery acks the request's message or rejects it for
    good (not when it requeues it); False where the request cannot be hooked (nothing done).

    Wraps the request's ``_on_ack`` and ``_on_reject``, the callables ``Request.acknowledge``
    and ``Request.reject`` call (``message.ack_log_error`` / ``reject_log_error``, through
    ``consumer.call_soon_ack`` in Celery 5.7); read in Celery 5.3 to 5.7. Celery's own call
    always follows, whatever ``fn`` raises.
    """
    on_ack = getattr(request, "_on_ack", None)
    on_reject = getattr(request, "_on_reject", None)
    if not callable(on_ack) or not callable(on_reject):
        return False
    pending = [fn]

    def run_once() -> None:
        if pending:
            try:
                pending.pop()()
            except Exception:
                logger.exception("celery-claims: a callback before the ack failed")

    def ack(*args: Any, **kwargs: Any) -> Any:
        run_once()
        return on_ack(*args, **kwargs)

    def reject(logger_: Any, errors: Any, requeue: bool = False, *args: Any, **kw: Any) -> Any:
        if not requeue:
            run_once()
        return on_reject(logger_, errors, requeue, *args, **kw)

    try:
        request._on_ack = ack
        request._on_reject = reject
    except AttributeError:
        return False
    return True


def requeued(request: Any) -> bool:
    """True if Celery's handler handed the request's message back to the broker
    (``reject(requeue=True)``): kombu's ``Message._state`` is ``REQUEUED`` then (``ACK`` or
    ``REJECTED`` when the message is gone for good). Unknown means requeued: the journal entry
    is then kept, which costs only its memory."""
    return message_state(request) not in ("ACK", "REJECTED")


def wrap_send_task(app: Any, around: Callable[..., Any]) -> None:
    """Route ``app.send_task`` through ``around(send_task, name, args, kwargs)`` (idempotent).

    ``Celery.send_task`` is the one path every publish of an app takes (``apply_async``,
    ``retry``, ``replace``, canvas, beat, ``celery call``), and ``Task.apply_async`` looks
    it up on the app instance at call time, so an instance attribute catches them all. It
    knows the app, which Celery's ``before_task_publish`` signal does not say. Read in
    Celery 5.3 to 5.7 (``celery/app/base.py``, ``celery/app/task.py``).
    """
    if getattr(app.send_task, "_celery_claims_wrapped", False):
        return
    original = app.send_task

    def send_task(*args: Any, **kwargs: Any) -> Any:
        return around(original, args, kwargs)

    send_task._celery_claims_wrapped = True  # type: ignore[attr-defined]
    send_task.__doc__ = original.__doc__
    app.send_task = send_task


#: ``ride(queue, list_key, payload)``: the journal write to send with a publish to ``queue``'s
#: list ``list_key`` of ``payload`` (kombu's serialized message), or None (kombu publishes it
#: alone); ``rode()`` is told once such a call was taken.
PublishRideFn = Callable[[str, str, str], "ScriptCall[Any] | None"]


def wrap_task_sender(app: Any, on_producer: Callable[[Any], object]) -> None:
    """Call ``on_producer(producer)`` before each task message ``app`` sends (idempotent).

    Celery's ``app.amqp.send_task_message(producer, name, message, ...)`` is the one call of
    ``send_task`` that holds the producer; it is a ``cached_property`` of ``app.amqp``, built
    from the configuration when first read, so this wraps it on the first publish (once the
    app is configured). Read in Celery 5.3 to 5.7 (``celery/app/amqp.py``, ``base.py``).
    """
    amqp = app.amqp
    inner = amqp.send_task_message
    if getattr(inner, "_celery_claims_wrapped", False):
        return

    def send_task_message(producer: Any, *args: Any, **kwargs: Any) -> Any:
        on_producer(producer)
        return inner(producer, *args, **kwargs)

    send_task_message._celery_claims_wrapped = True  # type: ignore[attr-defined]
    amqp.send_task_message = send_task_message


class PublishRide:
    """The publish journal's write riding kombu's own ``LPUSH`` on the Redis broker.

    Where the claim store is the broker's server and database, a producer channel's
    ``_put`` (kombu's Redis ``Channel._put``: one ``LPUSH`` of the serialized message to the
    queue's list, by priority) is replaced, on the channel's instance, by one script that
    pushes the same payload to the same list and writes the journal entry
    (``journal_put.lua`` with the list key): the journal costs no write and no round trip of
    its own, and the message is never in the queue unjournaled. What kombu's ``_put`` does
    besides (kombu 5.7's publish batches, queues with an expiry) and a channel whose
    transport prefixes keys get kombu's own ``_put``, and the journal writes on its own. The
    script goes on a connection the ride keeps, made from the channel's pool (``pool``).
    Read in kombu 5.3 to 5.7 (``kombu/transport/redis.py``).
    """

    #: Attribute of a channel caching its ride: (store client, hooked or not).
    CACHED = "_celery_claims_publish_ride"

    @classmethod
    def hook(
        cls,
        channel: Any,
        store_client: Any,
        ride: PublishRideFn,
        rode: Callable[[], object],
    ) -> bool:
        """Replace ``channel._put`` (idempotent per channel and store client); False where
        the channel cannot carry the journal (not kombu's Redis channel, another server,
        prefixed keys)."""
        cached = getattr(channel, cls.CACHED, None)
        if cached is not None and cached[0] is store_client:
            return bool(cached[1])
        hooked = cls._hook(channel, store_client, ride, rode)
        with contextlib.suppress(AttributeError):
            setattr(channel, cls.CACHED, (store_client, hooked))
        return hooked

    @staticmethod
    def _hook(
        channel: Any, store_client: Any, ride: PublishRideFn, rode: Callable[[], object]
    ) -> bool:
        kombu_put = getattr(type(channel), "_put", None)
        if (
            kombu_put is None
            or bool(getattr(channel, "global_keyprefix", None))
            or not all(
                callable(getattr(channel, name, None))
                for name in ("_q_for_pri", "_get_message_priority", "conn_or_acquire")
            )
        ):
            return False
        try:
            server = _server_of(channel.client)
        except Exception:  # not a Redis channel after all
            return False
        if server is None or server != _server_of(store_client):
            return False

        caller = ScriptCaller()
        close_with(channel, caller.close)  # its connections go with the channel's

        def _put(queue: Any, message: Any, **kwargs: Any) -> Any:
            expires = getattr(channel, "_expires", None)
            if kwargs.get("_publish_batch") is None and not (expires and queue in expires):
                priority = channel._get_message_priority(message, reverse=False)
                list_key = channel._q_for_pri(queue, priority)
                dumps: Any = json.dumps
                payload = dumps(message)
                call = ride(str(queue), str(list_key), payload)
                if call is not None:
                    # kombu's _put, and the journal entry, in one script: on a connection
                    # made from the channel's own pool (kombu's settings), kept for the
                    # ride, where the pool is a standalone server's (the CPU of a call
                    # through a client is 3 times a kept connection's, docs/benchmarks.md);
                    # a connection error is redis-py's, for kombu's publish retry
                    pool = channel.pool
                    if type(pool) is redis.ConnectionPool:
                        caller.call(pool, call)
                    else:
                        with channel.conn_or_acquire() as client:
                            call.script(keys=call.keys, args=call.args, client=client)
                    rode()
                    return None
            return kombu_put(channel, queue, message, **kwargs)

        channel._put = _put  # an instance attribute: exchanges call channel._put
        return True


def close_with(owner: Any, close: Callable[[], object]) -> None:
    """Call ``close()`` when ``owner.close()`` is called (before the owner's own close): a
    Celery app or a kombu channel.

    Celery has no signal for an app's close (``Celery.close`` only releases its broker
    pool), kombu none for a channel's (a connection's ``release`` calls each channel's
    ``close``); an instance attribute is looked up first, as for :func:`wrap_send_task`.
    Read in Celery 5.3 to 5.7 and kombu 5.3 to 5.7.
    """
    original = owner.close

    def closing(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            close()
        return original(*args, **kwargs)

    closing.__doc__ = original.__doc__
    owner.close = closing


def _nothing_to_cancel(task_id: str) -> None:
    """The ``cancel_for`` of a closed result consumer: it follows nothing any more."""


def close_result_backend(backend: Any) -> None:
    """Close a result backend's pub/sub consumer and its connections.

    Celery leaves these to the garbage collector. The consumer also lets go of its pub/sub:
    an ``AsyncResult`` deleted later unsubscribes through it, and Celery 5.3 to 5.6's Redis
    consumer sends that even for a task it no longer follows, reconnecting for it (to a
    server that may be gone by then); 5.7 skips it. A later wait subscribes afresh. Read in
    Celery 5.3 to 5.7.
    """
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        with contextlib.suppress(Exception):
            consumer.stop()
        if getattr(consumer, "_pubsub", None) is not None:
            consumer._pubsub = None
        # a result the collector frees later (one in a reference cycle) unsubscribes from
        # nothing: through the stopped consumer it reconnected for 20 s to a server that may
        # be gone by then, and raised in its finaliser
        with contextlib.suppress(Exception):
            consumer.cancel_for = _nothing_to_cancel
    client = getattr(backend, "client", None)
    if client is not None:
        with contextlib.suppress(Exception):
            client.connection_pool.disconnect()


def fail_unrun(request: Any, exc: BaseException) -> None:
    """Record a request that is never run as failed with ``exc``, as Celery records a task
    that rejects its message without requeueing (``Request.on_failure`` for ``Reject``): the
    FAILURE result, the ``task_failure`` signal and the ``task-failed`` event. The caller acks.

    Touches ``Request._context`` (the task's request context, built lazily by Celery) and
    ``Request.store_errors``.
    """
    task = request.task
    context = getattr(request, "_context", None)
    task.backend.mark_as_failure(
        request.id, exc, request=context, store_result=getattr(request, "store_errors", True)
    )
    celery_signals.task_failure.send(
        sender=task,
        task_id=request.id,
        exception=exc,
        args=request.args,
        kwargs=request.kwargs,
        traceback=None,
        einfo=None,
    )
    with contextlib.suppress(Exception):
        request.send_event("task-failed", exception=saferepr(exc), traceback="")


def republish(request: Any, countdown_s: float, headers: dict[str, Any]) -> None:
    """Publish ``request``'s message again (same task id, arguments, links, routing) with a
    countdown and extra ``headers``, as ``Task.retry`` does from the task's own context
    (``Task.signature_from_request`` with ``Request._context``), but without counting a retry.

    Raises:
        Exception: whatever the producer raises (nothing was published then).
    """
    task = request.task
    context = request._context
    merged = {**(context.headers or {}), **headers}
    signature = task.signature_from_request(
        context, request.args, request.kwargs, countdown=countdown_s, headers=merged
    )
    signature.apply_async()


def revoke_unrun(request: Any, reason: str) -> None:
    """Store a REVOKED result with ``reason`` for a request that is acked without running
    (another task held its key), so ``AsyncResult.get()`` raises ``TaskRevokedError`` instead
    of waiting on a PENDING task for ever. Touches ``Request._context`` and ``store_errors``.
    """
    request.task.backend.mark_as_revoked(
        request.id,
        reason,
        request=getattr(request, "_context", None),
        store_result=getattr(request, "store_errors", True),
    )
