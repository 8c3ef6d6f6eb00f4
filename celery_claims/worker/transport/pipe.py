"""The consumer's own connection to a claim store that is not the broker's server.

Where the claim store is the Redis broker's own server, claims and completions ride kombu's
round trips (:class:`~celery_claims.worker.transport.broker.BrokerRide`). Elsewhere (a RabbitMQ
broker, or a Redis broker with a store of its own) the gate claims each message on this connection,
without blocking the consumer's event loop:

- a claim (or the record before an ack) is deferred (:meth:`StorePipe.defer`) and the gate
  goes on with other work: the next delivery, the pool's results, timers. On an idle
  connection (no reply awaited) the call is written at once, so the store answers while the
  loop finishes its pass (kombu's blocking ack of another message, say) and the reply is
  read at the loop's next poll, ahead of the replies to what the loop sent after it (the
  next delivery's ``BRPOP``, whose handling blocks on kombu's append); while replies to
  calls sent earlier are awaited, deferred calls wait for them, and when the event loop is
  about to poll (the hub's ``on_tick``) with no reply awaited they are written in one
  write, those of one queue in one ``claim_many`` script call (each call gets its own
  reply): under load the claims and records of several passes go together, and an idle
  loop sends each at once. :meth:`StorePipe.submit` sends a call at once (one ``EVALSHA``);
- the socket is registered on the consumer's event loop (``hub.add_reader``, as kombu's
  Redis transport registers its ``BRPOP`` socket), and when it is readable the replies that
  came are read and handed to their calls' callbacks, in the order the calls were sent
  (RESP replies are ordered): a ``poll(2)`` before the first, then those its reader already
  holds (:class:`~celery_claims.worker.transport.resp.Replies`; replies still in the socket
  make it readable again: the hub polls level-triggered); a reply nobody asked for drops the
  connection. Calls are packed by the package's packer
  (:func:`~celery_claims.worker.transport.sender.pack_call`);
- on the solo pool (:class:`InlineStorePipe`) the body runs on the loop, so nothing overlaps
  a round trip: right after a call is sent the pipe waits a moment for its reply and hands it
  over at once, without more passes of the loop; a later reply is the loop's;
- one entry on the hub's timer, due when the oldest call's reply is overdue, fails every
  waiting call with :class:`~celery_claims.errors.BackendUnavailable` and drops the
  connection; the gate holds such copies (fails closed) and claims them again later.

The connection is a redis-py ``Connection`` made by the claim manager's client (which
:func:`celery_claims.connect` made), so it reaches the store exactly as every other part of
the package does: every URL form (``redis://``, ``rediss://`` with its TLS options, Unix
sockets, a Sentinel-managed master, which it looks up again on every reconnect), credentials
and database, the same timeouts (the read timeout is also how long a reply may take). Its
replies are read from its socket by the package's reader
(:mod:`~celery_claims.worker.transport.resp`: the values redis-py's parser makes, for about
half of its CPU). The first call of a
script on a connection goes behind a ``SCRIPT LOAD`` in the same write, and ``NOSCRIPT`` (a
store whose script cache was flushed) loads the script and sends the call again, in one write.

On a Redis Cluster (:class:`ClusterPipe`) each call goes on the connection to its queue's slot
owner (all of a queue's keys are in one slot), one :class:`StorePipe` per node; a ``MOVED``
reply updates the client's slot map and sends the call again to the new owner, an ``ASK``
(a slot being migrated) is answered "unavailable" and the gate tries again later.

Where there is no event loop (gevent or eventlet pools, transports without one: the consumer's
``hub`` is None), :func:`consumer_pipe` returns None and the gate uses the manager's blocking
client, as it does where each write waits for replicas (``WAIT``). A pipe belongs to the
consumer's thread.
"""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as redis_errors
from celery.utils.log import get_logger

from celery_claims.claims.calls import MANY_MAX_CALLS, ScriptCall, many_call
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import DEFAULT_TIMEOUT_S, StoreUnusable, socket_of
from celery_claims.errors import BackendError, BackendUnavailable, ClaimError
from celery_claims.worker.transport.resp import Replies
from celery_claims.worker.transport.sender import pack_call, pack_commands

__all__ = ["ClusterPipe", "InlineStorePipe", "Outcome", "Pipe", "StorePipe", "consumer_pipe"]

logger = get_logger("celery_claims.worker")

#: A call's result, or the error it ended with (never raised into the event loop).
Outcome = Any

#: Takes over a call a Cluster node answered ``MOVED``: the error, the call, its callback.
Redirect = Callable[[redis_errors.MovedError, ScriptCall[Any], Callable[[Outcome], None]], None]

#: ``select.poll``, or None where the process has none (eventlet's monkey patching deletes it):
#: the socket is then looked at with ``select.select`` (``Replies.wait``).
_POLL: Callable[[], Any] | None = getattr(select, "poll", None)

#: Error replies that mean "the store cannot serve this now", not a bug. redis-py maps most of
#: them to classes; ``BUSY`` (a script running too long) keeps its text.
_UNAVAILABLE_REPLIES = (
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
)
_UNAVAILABLE_PREFIXES = ("BUSY ", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")


def _reply_error(exc: redis_errors.ResponseError) -> ClaimError:
    if isinstance(exc, _UNAVAILABLE_REPLIES) or str(exc).startswith(_UNAVAILABLE_PREFIXES):
        return BackendUnavailable(f"claim store unavailable: {exc}")
    return BackendError(f"claim store error: {exc}")


def _refused(exc: BaseException) -> ClaimError:
    """A failed connect or handshake as the package's error: may heal, or will not."""
    if isinstance(exc, redis_errors.AuthenticationError | redis_errors.AuthorizationError):
        return StoreUnusable(f"the claim store refused the connection's credentials: {exc}")
    if isinstance(exc, redis_errors.ResponseError) or isinstance(exc.__context__, ssl.SSLError):
        return StoreUnusable(f"the claim store refused the connection: {exc}")
    # refused, unreachable, timed out, LOADING (redis-py's BusyLoadingError)
    return BackendUnavailable(f"claim store unavailable: {exc}")


def _ignore(outcome: Outcome) -> None:
    pass


def _decoded(call: ScriptCall[Any], reply: Any) -> Outcome:
    """A call's reply as its result, or the package's error it is (never raises)."""
    if isinstance(reply, redis_errors.ResponseError):
        return _reply_error(reply)
    return _result(call, reply)


def _result(call: ScriptCall[Any], reply: Any) -> Outcome:
    """A reply that is not an error reply as its call's result, or the error it decodes to
    (never raises)."""
    try:
        return call.decode(reply)
    except ClaimError as exc:
        return exc
    except Exception as exc:
        return BackendError(f"claim store: unreadable reply {reply!r:.200}: {exc}")


#: A command to send: a script call (its ``EVALSHA``), or another command's words.
_Command = ScriptCall[Any] | tuple[Any, ...]

#: A deferred call and its callback (:meth:`StorePipe.defer`).
_Deferred = tuple[ScriptCall[Any], Callable[[Outcome], None]]


@dataclass(eq=False, slots=True)
class _Pending:
    call: ScriptCall[Any] | None  # None: a SCRIPT LOAD whose reply nobody waits for
    callback: Callable[[Outcome], None]
    sent_at: float
    seq: int
    resent: bool = False
    calls: int = 1  # the calls it carries (several in a claim_many call)


class StorePipe:
    """The consumer thread's connection to the claim store (see the module docstring).

    Args:
        connection: a redis-py connection, not connected yet (see :meth:`for_manager`).
        hub: the consumer's event loop (``consumer.hub``, a kombu ``Hub``): its socket is
            registered there and overdue replies are found by its timer.
        timeout_s: how long a reply may take before the connection is dropped and every
            waiting call ends with :class:`BackendUnavailable`; by default the connection's
            read timeout (the package's one timeout policy).
        redirect: takes over a call answered ``MOVED`` (a Cluster node's pipe): called with
            the error, the call and its callback.
    """

    def __init__(
        self,
        connection: Any,
        hub: Any,
        *,
        timeout_s: float | None = None,
        redirect: Redirect | None = None,
    ) -> None:
        self.connection = connection
        # reads its replies (redis-py's read_response costs ~10 µs of Python a reply more)
        self._replies = Replies(connection)
        self.hub = hub
        self.redirect = redirect
        self.timeout_s = float(
            timeout_s or getattr(connection, "socket_timeout", None) or DEFAULT_TIMEOUT_S
        )
        self._pending: deque[_Pending] = deque()
        self._sock: socket.socket | None = None  # the socket registered on the hub
        self._fd = -1
        self._poll: Any = None  # a poll object with that socket registered
        self._seq = 0  # commands sent on this socket
        self._loaded: dict[str, int] = {}  # sha -> seq of its last SCRIPT LOAD on this socket
        self._deadline: Any = None
        self._deferred: list[_Deferred] = []  # calls to send when the loop is about to poll
        self._tick = self._on_tick  # one bound method: the hub's on_tick is a set

    @classmethod
    def for_manager(cls, manager: RedisClaimManager, hub: Any) -> StorePipe | None:
        """A pipe to ``manager``'s standalone or Sentinel-managed store on ``hub``, or None
        (no hub, writes that wait for replicas, a Cluster: see :func:`consumer_pipe`)."""
        client = manager.client
        if hub is None or manager.waits_for_replicas or not isinstance(client, redis.Redis):
            return None
        # the pool's own factory method: the client's connection class and arguments (TLS,
        # Unix socket, Sentinel-managed master, credentials, database, timeouts)
        return cls(client.connection_pool.make_connection(), hub)

    # --- calls ------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Calls sent or deferred whose reply has not been read yet."""
        sent = sum(item.calls for item in self._pending if item.call is not None)
        return sent + len(self._deferred)

    @property
    def address(self) -> tuple[str, int] | str:
        """The store's Unix socket path, or ``(host, port)`` (of the master, once connected,
        for a Sentinel-managed store)."""
        path = getattr(self.connection, "path", None)
        if path:
            return str(path)
        return (str(self.connection.host), int(self.connection.port))

    def submit(
        self,
        call: ScriptCall[Any],
        callback: Callable[[Outcome], None],
        *,
        redirected: bool = False,
    ) -> None:
        """Send ``call`` now; ``callback`` gets its decoded result or error once the reply is
        read (from the event loop, or by :meth:`call` / :meth:`drain`).

        An exception the callback raises is logged, never raised to whoever read the reply.
        A call that could be sent but not answered (the connection dropped, the reply overdue)
        ends with :class:`BackendUnavailable`, through the callback. ``redirected``: the call
        was answered ``MOVED`` elsewhere already (it is not redirected again).

        Raises:
            BackendUnavailable: the store could not be connected to (nothing was sent, the
                callback will not be called).
            StoreUnusable: the store refused the handshake (credentials, database, TLS).
        """
        self._connect()
        commands = self._take_deferred()  # sent first: the store runs calls in the order given
        item = _Pending(call, callback, time.monotonic(), 0, resent=redirected)
        self._send(commands + self._enqueue(item, load=call.script.sha not in self._loaded))
        self._arm()

    def defer(self, call: ScriptCall[Any], callback: Callable[[Outcome], None]) -> None:
        """Send ``call`` now if the connection is idle, else with the calls that wait as it
        does; ``callback`` gets its outcome as with :meth:`submit`.

        On an idle connection (no reply awaited, nothing waiting) the call goes at once, as
        :meth:`submit` sends it: the store answers while the event loop finishes its pass
        (kombu's blocking ack or delivery of other messages, the loop's own turn), and its
        reply is there to read at the next poll, ahead of replies to what the loop sends
        after it. While replies to calls sent earlier are awaited, calls wait for them (up
        to :data:`MANY_MAX_CALLS`), and when the event loop is about to poll (the hub's
        ``on_tick``) with no reply awaited any more they go in one write, those of one queue
        that can (claims and records: ``call.many``) in one ``claim_many`` script call, each
        reply handed to its own call's callback: under load the calls of several passes go
        together, an idle loop sends each call at once.

        Raises:
            BackendUnavailable: see :meth:`submit` (nothing was deferred).
            StoreUnusable: see :meth:`submit`.
        """
        if call.many is None or not (self._pending or self._deferred):
            self.submit(call, callback)
            return
        self._connect()
        self._deferred.append((call, callback))
        on_tick = self.hub.on_tick
        if self._tick not in on_tick:
            on_tick.add(self._tick)  # (again after a hub reset cleared it)

    def call(self, call: ScriptCall[Any]) -> Outcome:
        """Send ``call`` and wait for its reply (replies to earlier calls are delivered first).

        Returns the decoded result or the error it decodes to, never raises for the store: a
        store that cannot be reached gives :class:`BackendUnavailable`, a refused handshake
        :class:`~celery_claims.connection.StoreUnusable`.
        """
        box: list[Outcome] = []
        try:
            self.submit(call, box.append)
        except ClaimError as exc:
            return exc
        self._wait_until(lambda: bool(box))
        # a dropped connection fails every waiting call, this one included
        return box[0] if box else BackendUnavailable("claim store connection lost")

    def drain(self) -> None:
        """Send the deferred calls, wait for every outstanding reply (each up to the timeout)
        and deliver them."""
        self._flush()
        self._wait_until(lambda: not self._pending)

    def close(self) -> None:
        """Drop the connection; calls still waiting end with :class:`BackendUnavailable`."""
        with contextlib.suppress(Exception):
            self.hub.on_tick.discard(self._tick)
        self._broken(ConnectionError("closed"))

    # --- connection -------------------------------------------------------------------------

    def _connect(self) -> None:
        connection = self.connection
        if self._sock is not None:
            if not self._pending:
                # an idle connection is PINGed first, as every client of the package does
                # (health_check_interval): a store restarted meanwhile is found before the
                # claim is sent into a dead socket; nothing waits on the socket, so the PING's
                # reply cannot be confused with a claim's
                try:
                    connection.check_health()
                except (redis_errors.RedisError, OSError) as exc:
                    self._broken(exc)
                    raise BackendUnavailable(f"claim store unavailable: {exc}") from exc
            if socket_of(connection) is self._sock:
                if self.hub.readers.get(self._fd) is None:
                    # the hub was reset (Celery does after a broker connection error)
                    self.hub.add_reader(self._fd, self._on_readable)
                return
            self._broken(ConnectionError("reconnected"))  # by the health check
        try:
            connection.connect()
        except (redis_errors.RedisError, OSError) as exc:
            with contextlib.suppress(Exception):
                connection.disconnect()
            raise _refused(exc) from exc
        sock = socket_of(connection)
        if sock is None:
            raise BackendUnavailable("claim store unavailable: no socket after connecting")
        self._sock, self._fd = sock, sock.fileno()
        self._poll = None
        if _POLL is not None:
            # a poll object of its own per socket: a closed socket cannot be unregistered
            self._poll = _POLL()
            self._poll.register(sock, select.POLLIN)
        self._seq = 0
        self._loaded.clear()
        self.hub.add_reader(self._fd, self._on_readable)

    def _broken(self, error: BaseException) -> None:
        sock, self._sock = self._sock, None
        self._poll = None
        if sock is not None:
            # off the hub before the socket closes: its number may be reused at once
            with contextlib.suppress(Exception):
                self.hub.remove_reader(self._fd)
        with contextlib.suppress(Exception):
            self.connection.disconnect()
        deadline, self._deadline = self._deadline, None
        if deadline is not None:
            with contextlib.suppress(Exception):
                deadline.cancel()
        pending, self._pending = self._pending, deque()
        deferred, self._deferred = self._deferred, []
        callbacks = [item.callback for item in pending if item.call is not None]
        failed = sum(item.calls for item in pending if item.call is not None) + len(deferred)
        if failed:
            logger.warning(
                "Claim store connection of the consumer dropped (%s); %d call(s) failed",
                error,
                failed,
            )
        failure = BackendUnavailable(f"claim store unavailable: {error}")
        for callback in callbacks + [callback for _, callback in deferred]:
            _deliver(callback, failure)

    # --- sending and reading ----------------------------------------------------------------

    def _enqueue(self, item: _Pending, *, load: bool) -> list[_Command]:
        """Queue ``item`` (after a ``SCRIPT LOAD`` of its script if ``load``) and return the
        commands to send; the replies come back in this order."""
        call = item.call
        assert call is not None
        commands: list[_Command] = []
        if load:
            # in the same write, and nobody waits for its reply: the call behind it finds the
            # script whatever the store's cache held
            self._seq += 1
            self._loaded[call.script.sha] = self._seq
            self._pending.append(_Pending(None, _ignore, item.sent_at, self._seq))
            commands.append(("SCRIPT", "LOAD", call.script.script))
        self._seq += 1
        item.seq = self._seq
        self._pending.append(item)
        commands.append(call)
        return commands

    def _on_tick(self) -> None:
        """The hub's ``on_tick`` (just before the loop polls): send the deferred calls, unless
        replies are awaited (they go once those are read). Never raises."""
        try:
            if self._deferred and (not self._pending or len(self._deferred) >= MANY_MAX_CALLS):
                self._flush()
        except Exception as exc:
            logger.exception("Claim store pipe: sending deferred calls failed")
            self._broken(exc)

    def _flush(self) -> None:
        """Send every deferred call now (in one write)."""
        commands = self._take_deferred()
        if commands:
            self._send(commands)
            self._arm()

    def _take_deferred(self) -> list[_Command]:
        """Queue the deferred calls, those of one queue in ``claim_many`` calls, and return
        the commands to send."""
        if not self._deferred:
            return []
        deferred, self._deferred = self._deferred, []
        now = time.monotonic()
        if len(deferred) == 1:
            # the idle loop's case: alone, its own script, as submit sends it
            call, callback = deferred[0]
            item = _Pending(call, callback, now, 0)
            return self._enqueue(item, load=call.script.sha not in self._loaded)
        commands: list[_Command] = []
        for part in _many_parts(deferred):
            if len(part) == 1:
                call, callback = part[0]  # alone: its own script, as submit sends it
            else:
                call = many_call([call for call, _ in part])
                callback = functools.partial(_dispatch_many, part)
            item = _Pending(call, callback, now, 0, calls=len(part))
            commands += self._enqueue(item, load=call.script.sha not in self._loaded)
        return commands

    def _send(self, commands: list[_Command]) -> None:
        """Write ``commands`` in one write (packed by the package's packer, as a pool
        process's calls are)."""
        connection = self.connection
        try:
            packed = _packed(commands, connection)
            # no health check here: a PING's reply would be read as a waiting call's
            connection.send_packed_command([packed], check_health=False)
        except (redis_errors.RedisError, OSError) as exc:
            self._broken(exc)

    def _on_readable(self) -> None:
        """The hub's reader callback: deliver the replies that came. Never raises (an
        exception would stop the consumer's event loop)."""
        try:
            self._read_ready()
        except Exception as exc:
            logger.exception("Claim store pipe: reading replies failed")
            self._broken(exc)

    def _read_ready(self, *, each_time: bool = False) -> None:
        """Deliver every reply already received, without waiting for more.

        The socket is looked at before the first reply only, unless ``each_time``: from the
        event loop, replies still in the socket after the first make it readable again (the
        hub polls level-triggered), and those its reader holds are found without a system
        call. Elsewhere (the overdue check) every reply that came is read now.
        """
        sock = self._sock
        probe = True
        while sock is not None and self._sock is sock:
            try:
                ready = self._replies.there(self._poll, probe=probe, waiting=bool(self._pending))
            except (redis_errors.RedisError, OSError) as exc:
                self._broken(exc)  # closed by the store, or reset
                return
            if not ready:
                return
            if not self._pending:
                self._broken(redis_errors.InvalidResponse("a reply nobody asked for"))
                return
            self._read_one()
            probe = each_time

    def _wait_until(self, done: Callable[[], bool]) -> None:
        while not done() and self._pending and self._sock is not None:
            remaining = self._pending[0].sent_at + self.timeout_s - time.monotonic()
            try:
                ready = remaining > 0 and _reply_within(self._replies, self._poll, remaining)
            except (redis_errors.RedisError, OSError) as exc:
                self._broken(exc)
                return
            if not ready:
                self._broken(TimeoutError(f"no reply in {self.timeout_s:.1f} s"))
                return
            self._read_one()

    def _read_one(self) -> None:
        """Read the next reply (it is there, or on its way) and hand it to its call."""
        sock = self._sock
        try:
            reply: Any = self._replies.read()
        except redis_errors.ResponseError as exc:
            reply = exc  # an error reply: the connection is fine
        except (redis_errors.RedisError, OSError) as exc:
            self._broken(exc)  # redis-py dropped the connection (LOADING included)
            return
        if self._sock is not sock or not self._pending:
            return
        item = self._pending.popleft()
        if item.call is None:
            return  # a SCRIPT LOAD's reply (an error shows in the call sent after it)
        outcome: Outcome
        if not isinstance(reply, redis_errors.ResponseError):
            outcome = _result(item.call, reply)
        elif isinstance(reply, redis_errors.NoScriptError) and not item.resent:
            self._resend(item)
            return
        elif isinstance(reply, redis_errors.MovedError) and self.redirect and not item.resent:
            self.redirect(reply, item.call, item.callback)
            return
        elif isinstance(reply, redis_errors.AskError):
            # MOVED once more, or ASK: the slot is being migrated; tried again later
            outcome = BackendUnavailable(f"claim store unavailable: slot moving ({reply})")
        else:
            outcome = _reply_error(reply)
        _deliver(item.callback, outcome)

    def _resend(self, item: _Pending) -> None:
        """``NOSCRIPT`` (the store's script cache was flushed, or the store restarted): send
        the call again, behind a ``SCRIPT LOAD`` unless one was sent after the call was."""
        assert item.call is not None
        item.sent_at, item.resent = time.monotonic(), True
        load = self._loaded.get(item.call.script.sha, -1) < item.seq
        self._send(self._enqueue(item, load=load))
        self._arm()

    # --- overdue replies --------------------------------------------------------------------

    def _arm(self) -> None:
        """One timer entry, due when the oldest waiting call's reply is overdue."""
        entry = self._deadline
        if (entry is not None and not entry.canceled) or not self._pending:
            return
        due = self._pending[0].sent_at + self.timeout_s - time.monotonic()
        self._deadline = self.hub.call_later(max(due, 0.0), self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        try:
            if self._sock is None or not self._pending:
                return
            # replies that came while the loop was busy (a solo pool's task) are not late
            self._read_ready(each_time=True)
            if self._pending and time.monotonic() - self._pending[0].sent_at >= self.timeout_s:
                self._broken(TimeoutError(f"no reply in {self.timeout_s:.1f} s"))
            else:
                self._arm()
        except Exception as exc:
            logger.exception("Claim store pipe: checking for overdue replies failed")
            self._broken(exc)


class InlineStorePipe(StorePipe):
    """The solo pool's pipe: after a call it sends on an idle connection (no reply awaited), it
    waits up to :attr:`wait_s` for the replies and hands over those that come at once (their
    callbacks, which run the body and send its record, may send and read more: each reply's
    call is popped first; a call sent while replies are awaited leaves them to that reader).

    On the solo pool the body runs on the consumer's loop, so nothing overlaps a store round
    trip, and a reply read by the loop costs it more passes (a poll and kombu's re-registering
    of its sockets each). A reply that has not come within :attr:`wait_s` is the loop's, as
    on the other pools: an unreachable store costs the loop that long per call, not the read
    timeout a blocking client would wait, and the copy is held until its reply or the overdue
    timer says unavailable.
    """

    #: How long to wait for a reply right after its call is sent, in s: a store round trip
    #: on a LAN, with room to spare.
    wait_s = 0.005

    def submit(
        self,
        call: ScriptCall[Any],
        callback: Callable[[Outcome], None],
        *,
        redirected: bool = False,
    ) -> None:
        """:meth:`StorePipe.submit`, then the replies that come within :attr:`wait_s`.

        Raises:
            BackendUnavailable: see :meth:`StorePipe.submit`.
            StoreUnusable: see :meth:`StorePipe.submit`.
        """
        idle = not self._pending
        super().submit(call, callback, redirected=redirected)
        if not idle:
            return  # read by the loop, or by the reader this call was sent from
        sock, deadline = self._sock, time.monotonic() + self.wait_s
        while self._pending and sock is not None and self._sock is sock:
            try:
                ready = _reply_within(self._replies, self._poll, deadline - time.monotonic())
            except (redis_errors.RedisError, OSError) as exc:
                self._broken(exc)
                return
            if not ready:
                return
            self._read_one()


class ClusterPipe:
    """The consumer's pipes to a Redis Cluster: one :class:`StorePipe` per node, each call on
    the pipe of its queue's slot owner (see the module docstring).

    Args:
        client: the claim manager's Cluster client (its slot map and node clients).
        hub: the consumer's event loop.
    """

    def __init__(self, client: redis.RedisCluster, hub: Any) -> None:
        self.client = client
        self.hub = hub
        self.pipes: dict[str, StorePipe] = {}

    @property
    def waiting(self) -> int:
        """Calls sent whose reply has not been read yet, on every node."""
        return sum(pipe.waiting for pipe in self.pipes.values())

    def pipe_of(self, call: ScriptCall[Any]) -> StorePipe:
        """The pipe to the node that owns ``call``'s slot (as the client's slot map has it)."""
        cluster: Any = self.client  # untyped in redis-py
        # the lookup redis-py routes its own commands with (it applies a MOVED it was told of)
        node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(call.keys[0]))
        pipe = self.pipes.get(node.name)
        if pipe is None:
            pool = self.client.get_redis_connection(node).connection_pool
            pipe = StorePipe(pool.make_connection(), self.hub, redirect=self._moved)
            self.pipes[node.name] = pipe
        return pipe

    def submit(
        self,
        call: ScriptCall[Any],
        callback: Callable[[Outcome], None],
        *,
        redirected: bool = False,
    ) -> None:
        """:meth:`StorePipe.submit` on the pipe of ``call``'s slot owner.

        Raises:
            BackendUnavailable: see :meth:`StorePipe.submit`; also a slot no node covers.
            StoreUnusable: see :meth:`StorePipe.submit`.
        """
        try:
            pipe = self.pipe_of(call)
        except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
            raise BackendUnavailable(f"claim store unavailable: {exc}") from exc
        pipe.submit(call, callback, redirected=redirected)

    def defer(self, call: ScriptCall[Any], callback: Callable[[Outcome], None]) -> None:
        """:meth:`StorePipe.defer` on the pipe of ``call``'s slot owner.

        Raises:
            BackendUnavailable: see :meth:`submit`.
            StoreUnusable: see :meth:`submit`.
        """
        try:
            pipe = self.pipe_of(call)
        except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
            raise BackendUnavailable(f"claim store unavailable: {exc}") from exc
        pipe.defer(call, callback)

    def call(self, call: ScriptCall[Any]) -> Outcome:
        """:meth:`StorePipe.call` on the pipe of ``call``'s slot owner (a ``MOVED`` is
        followed to the new owner); waits for every node's replies."""
        box: list[Outcome] = []
        try:
            self.submit(call, box.append)
        except ClaimError as exc:
            return exc
        self.drain()
        return box[0] if box else BackendUnavailable("claim store connection lost")

    def drain(self) -> None:
        """:meth:`StorePipe.drain` on every node's pipe."""
        while any(pipe.waiting for pipe in self.pipes.values()):
            for pipe in list(self.pipes.values()):
                pipe.drain()

    def close(self) -> None:
        """Close every node's pipe (calls still waiting end with :class:`BackendUnavailable`)."""
        for pipe in list(self.pipes.values()):
            pipe.close()

    def _moved(
        self,
        moved: redis_errors.MovedError,
        call: ScriptCall[Any],
        callback: Callable[[Outcome], None],
    ) -> None:
        # the client's own slot map learns it too, as redis-py's cluster client does: at once
        # with redis-py 8's move_slot; 5.0 to 7.x apply update_moved_exception at the next
        # lookup of a slot (pipe_of's, below)
        nodes: Any = self.client.nodes_manager  # untyped in redis-py
        learn = getattr(nodes, "move_slot", None) or nodes.update_moved_exception
        learn(moved)
        try:
            self.submit(call, callback, redirected=True)
        except ClaimError as exc:
            callback(exc)


#: The consumer's pipe: to a standalone (or Sentinel-managed) store, or to a Cluster.
Pipe = StorePipe | ClusterPipe


def consumer_pipe(manager: RedisClaimManager, hub: Any, *, inline: bool = False) -> Pipe | None:
    """The consumer's pipe to ``manager``'s store on ``hub``, or None where only the blocking
    client can go (no hub, writes that wait for replicas). ``inline``: the solo pool's
    (:class:`InlineStorePipe`; a Cluster's pipes leave every reply to the event loop)."""
    if isinstance(manager.client, redis.RedisCluster):
        return None if hub is None else ClusterPipe(manager.client, hub)
    return (InlineStorePipe if inline else StorePipe).for_manager(manager, hub)


def _packed(commands: list[_Command], connection: Any) -> bytes:
    """``commands`` in RESP for ``connection``, in one buffer: a script call's ``EVALSHA``
    by :func:`~celery_claims.worker.transport.sender.pack_call`, other commands' words by
    the package's packer."""
    return b"".join(
        [
            pack_commands([command], connection)[0]
            if isinstance(command, tuple)
            else pack_call(command, connection)
            for command in commands
        ]
    )


def _many_parts(deferred: list[_Deferred]) -> list[list[_Deferred]]:
    """``deferred`` by ``claim_many`` script and queue, in parts of at most
    :data:`MANY_MAX_CALLS` (each part one call, or a call alone)."""
    groups: dict[tuple[str, str], list[_Deferred]] = {}
    for call, callback in deferred:
        assert call.many is not None
        groups.setdefault((call.many.script.sha, call.many.keys[0]), []).append((call, callback))
    return [
        group[start : start + MANY_MAX_CALLS]
        for group in groups.values()
        for start in range(0, len(group), MANY_MAX_CALLS)
    ]


def _dispatch_many(parts: list[_Deferred], outcome: Outcome) -> None:
    """Hand each call of a ``claim_many`` call its own reply (or the call's error)."""
    if isinstance(outcome, list) and len(outcome) == len(parts):
        for (call, callback), reply in zip(parts, outcome, strict=True):
            _deliver(callback, _decoded(call, reply))
        return
    if not isinstance(outcome, BaseException):
        outcome = BackendError(f"claim store: claim_many answered {outcome!r:.200}")
    for _, callback in parts:
        _deliver(callback, outcome)


def _deliver(callback: Callable[[Outcome], None], outcome: Outcome) -> None:
    """Run a call's callback with its outcome; a callback that raises is logged (the
    consumer's event loop must not stop)."""
    try:
        callback(outcome)
    except Exception:
        logger.exception("Claim store pipe: a reply callback failed")


def _reply_within(replies: Replies, poll: Any, timeout_s: float) -> bool:
    """True if a reply is there to read within ``timeout_s``: one ``replies`` holds already,
    or one that comes in the socket (registered in ``poll``, or None) by then."""
    if poll is None or replies.held():
        return replies.wait(timeout_s)
    return bool(poll.poll(max(timeout_s, 0.0) * 1000.0))  # negative: for ever
