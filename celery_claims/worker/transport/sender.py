"""Script calls on connections the package keeps itself, outside redis-py's client.

:class:`ScriptSender` sends calls without waiting for their replies; :class:`ScriptCaller`
waits for each reply, on a connection kept for it (redis-py's ``Script.__call__`` through its
client costs about three times the CPU of the same call on a kept ``Connection``, see
docs/benchmarks.md).

Two writes of the package must leave a process at once but need not hold it up for the
store's answer: a prefork pool process's completion record, sent ahead of the worker's ack
(``guard.py``), and a producer's publish journal entry, sent once the broker took the message
(``journal.py``). Both go through a :class:`ScriptSender`: the command is written to the
socket (into the kernel's send buffer, which is delivered even if the process exits right
after) and the replies are read later, as they come: before a later send (before every send,
or once ``read_every`` of them wait: a producer publishing in a loop reads a batch of replies
with one ``poll(2)`` and one ``recv(2)``) or by :meth:`ScriptSender.drain`; past
``max_unread`` of them, a send waits for the store to catch up (a store that stalls slows its
senders down and loses none of their writes). Each reply is handed to the sender's
``on_reply``: the script's raw reply, or the error it ended with.

Standalone stores only (:func:`usable`): a Sentinel or Cluster client chooses its server per
command, so the callers go through the client there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import redis
from celery.utils.log import get_logger

from celery_claims.claims.calls import ScriptCall
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import socket_of
from celery_claims.errors import BackendUnavailable, InvalidArgument
from celery_claims.worker.transport.resp import Replies

logger = get_logger("celery_claims.worker")

__all__ = [
    "ScriptCaller",
    "ScriptSender",
    "keep_calls",
    "pack_call",
    "pack_commands",
    "usable",
]


#: ``select.poll``, or None where the process has none: eventlet's monkey patching deletes it
#: from the ``select`` module (a kept connection then probes with redis-py's ``can_read``).
_POLL: Callable[[], Any] | None = getattr(select, "poll", None)

#: How long a send waits for a backlog of replies on a connection without a socket timeout.
CATCH_UP_TIMEOUT_S = 5.0

#: A send after this long without one reads the replies that came first, however few: its
#: failures are known, and its connection can be health-checked (a PING needs no reply waiting).
IDLE_S = 1.0

#: ``on_reply(reply, error)``: the script's raw reply and None, or None and the error.
OnReply = Callable[[Any, BaseException | None], object]


def _ignore(reply: Any, error: BaseException | None) -> None:
    return None


class _Forkable(Protocol):
    def _forked(self) -> None: ...


#: Every sender and caller of this process, reset in a forked child (``os.register_at_fork``).
_KEPT: weakref.WeakSet[_Forkable] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for kept in list(_KEPT):
        kept._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def usable(client: Any) -> bool:
    """True if ``client``'s server can be written on a kept connection (a standalone client)."""
    return type(getattr(client, "connection_pool", None)) is redis.ConnectionPool


def keep_calls(manager: RedisClaimManager, caller: ScriptCaller) -> None:
    """Send ``manager``'s single calls on connections ``caller`` keeps, where they can go
    there: a standalone client, and writes that do not wait for replicas (``WAIT`` counts
    the writes of the connection it is sent on, the client's). Elsewhere they stay on the
    client."""
    if usable(manager.client) and not manager.waits_for_replicas:
        pool = getattr(manager.client, "connection_pool", None)
        manager.send_calls_with(functools.partial(caller.call, pool))


def _commands(call: ScriptCall[Any], loaded: set[str]) -> list[tuple[Any, ...]]:
    """The commands of ``call`` on a connection that has the scripts ``loaded``: its
    ``EVALSHA``, after a ``SCRIPT LOAD`` of it in the same write the first time (a fresh or
    restarted store knows no script, and loading is idempotent)."""
    sha = call.script.sha
    evalsha = ("EVALSHA", sha, len(call.keys), *call.keys, *call.args)
    if sha in loaded:
        return [evalsha]
    loaded.add(sha)
    return [("SCRIPT", "LOAD", call.script.script), evalsha]


def _script_commands(call: ScriptCall[Any], loaded: set[str], conn: Any) -> list[bytes]:
    """:func:`_commands`, packed: ``call``'s ``EVALSHA`` (:func:`pack_call`), after a
    ``SCRIPT LOAD`` of it the first time on the connection."""
    sha = call.script.sha
    if sha in loaded:
        return [pack_call(call, conn)]
    loaded.add(sha)
    return [*pack_commands([("SCRIPT", "LOAD", call.script.script)], conn), pack_call(call, conn)]


#: Encodings in which ASCII text is its own bytes (:func:`pack_call` packs such words as text).
_ASCII_SAFE = frozenset({"utf-8", "utf8", "ascii", "us-ascii", "latin-1", "latin1", "iso-8859-1"})

#: The packed ``EVALSHA``, SHA, key count and keys of each script and keys seen (a worker
#: sends a few per queue); dropped whole when full.
_HEADS: dict[tuple[str, ...], bytes] = {}
_HEADS_KEPT = 1024


def _ascii_words(words: list[Any]) -> bytes | None:
    """``words`` (exact ``str`` and ``int``, all ASCII) as RESP bulk strings, or None."""
    text = ""
    for word in words:
        if type(word) is not str:
            if type(word) is not int:
                return None
            word = str(word)  # redis-py's encoder: repr(int)
        text += f"${len(word)}\r\n{word}\r\n"
    # one check for all: an ASCII word's length in characters is its length in bytes
    return text.encode() if text.isascii() else None


def pack_call(call: ScriptCall[Any], conn: Any) -> bytes:
    """``call``'s ``EVALSHA`` in RESP for ``conn``, byte for byte as :func:`pack_commands`
    (and redis-py) pack it.

    The words of a script call are short ASCII text and ints nearly always, and its script
    and keys repeat for every call of a queue: those are packed once (:data:`_HEADS`), the
    arguments as one text, encoded once. Anything else goes to :func:`pack_commands`.
    """
    keys, args = call.keys, call.args
    if conn.encoder.encoding in _ASCII_SAFE:
        head_key = (call.script.sha, *keys)
        head = _HEADS.get(head_key)
        if head is None:
            head = _ascii_words(["EVALSHA", call.script.sha, len(keys), *keys])
            if head is not None:
                if len(_HEADS) >= _HEADS_KEPT:
                    _HEADS.clear()
                _HEADS[head_key] = head
        words = _ascii_words(args) if head is not None else None
        if words is not None:
            return b"*%d\r\n%s%s" % (3 + len(keys) + len(args), head, words)
    return pack_commands([("EVALSHA", call.script.sha, len(keys), *keys, *args)], conn)[0]


def pack_commands(commands: list[tuple[Any, ...]], conn: Any) -> list[bytes]:
    """``commands`` in RESP for ``conn.send_packed_command``, as redis-py's
    ``pack_commands`` writes them, in a third of its time, for the arguments a script call
    has (str, bytes, int); anything else is left to redis-py (which refuses what Redis
    cannot take)."""
    out: list[bytes] = []
    encoding, errors = conn.encoder.encoding, conn.encoder.encoding_errors
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            kind = type(arg)  # exact types first: half the time of isinstance's chain
            if kind is str:
                data = arg.encode(encoding, errors)
            elif kind is int:
                data = b"%d" % arg
            elif kind is bytes:
                data = arg
            elif isinstance(arg, str):
                data = arg.encode(encoding, errors)
            elif isinstance(arg, bytes):
                data = arg
            else:
                return list(conn.pack_commands(commands))
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return [b"".join(out)]


class ScriptSender:
    """One connection for script calls whose replies are read later (module docstring).

    Safe to share between threads (one lock) and across fork (a child never writes on its
    parent's socket: it opens its own).

    Args:
        on_reply: called with each call's reply as it is read, ``(reply, None)``, or with
            ``(None, error)`` for a call that ended in an error (also for the replies a
            dropped connection took with it).
        max_unread: replies left unread after which a send waits for the store to catch up
            (back to half of it), for as long as the connection's socket timeout; a store
            that does not answer in that time went silent, and the connection is dropped.
        read_every: replies waiting before a send reads those that came (1: before every
            send); a send after :data:`IDLE_S` without one reads them however few wait.
    """

    def __init__(
        self,
        on_reply: OnReply = _ignore,
        *,
        max_unread: int = 64,
        read_every: int = 1,
    ) -> None:
        self.on_reply = on_reply
        self.max_unread = max_unread
        self.read_every = read_every
        self._sent_at = 0.0  # time.monotonic() of the last send
        # a poll object with the connection's socket registered, and that socket (weakly)
        self._poll: Any = None
        self._polled: weakref.ref[socket.socket] | None = None
        self._lock = threading.Lock()
        # the connection (its ``connection``), and the reader of its replies
        self._replies: Replies | None = None
        self._pool: Any = None  # the pool the connection was made from
        self._pid = os.getpid()
        # what each reply still to come answers: a call's on_reply, or None for a SCRIPT LOAD
        self._waiting: deque[OnReply | None] = deque()
        # scripts loaded on this connection: a fresh or restarted store knows none, and a
        # NOSCRIPT reply would only come after the write was needed
        self._loaded: set[str] = set()
        _KEPT.add(self)

    def _forked(self) -> None:
        """In a forked child: a lock another thread of the parent held, and the parent's
        socket, are dropped (the socket is never written, nor closed, from here)."""
        self._lock = threading.Lock()
        self._replies, self._pid = None, os.getpid()
        self._poll = self._polled = None
        self._waiting.clear()
        self._loaded.clear()

    usable = staticmethod(usable)

    def send(self, client: Any, call: ScriptCall[Any], on_reply: OnReply | None = None) -> None:
        """Write ``call`` on the connection (made from ``client``'s pool on first use); its
        reply goes to ``on_reply``, or to the sender's.

        Raises:
            BackendUnavailable: the call could not be written (nothing is retried).
            InvalidArgument: ``client`` is not :meth:`usable`.
        """
        if not self.usable(client):
            raise InvalidArgument("client", "a standalone redis.Redis client is needed")
        with self._lock:
            try:
                replies = self._connection(client)
                conn = replies.connection
                now = time.monotonic()
                if len(self._waiting) >= self.read_every or now - self._sent_at > IDLE_S:
                    self._read_arrived(replies)
                self._sent_at = now
                commands = _script_commands(call, self._loaded, conn)
                # redis-py's health check (a PING on a connection idle for a while) would
                # read a waiting call's reply as the PING's
                conn.send_packed_command([b"".join(commands)], check_health=not self._waiting)
                self._waiting.extend([None] * (len(commands) - 1) + [on_reply or self.on_reply])
                if len(self._waiting) > self.max_unread:
                    self._catch_up(replies)
            except (redis.RedisError, OSError) as exc:
                self._reset(exc)
                raise BackendUnavailable(f"could not send to the claim store: {exc!r}") from exc

    def drain(self, timeout_s: float) -> int:
        """Read the replies still to come, waiting up to ``timeout_s``; returns those left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            replies = self._replies if self._pid == os.getpid() else None
            try:
                while replies is not None and self._waiting:
                    left = deadline - time.monotonic()
                    if left <= 0 or not replies.wait(left):
                        break
                    self._read_one(replies)
            except (redis.RedisError, OSError) as exc:
                self._reset(exc)
            return len(self._waiting)

    def close(self) -> None:
        """Drop the connection (replies not read yet are reported as errors)."""
        with self._lock:
            self._reset(BackendUnavailable("the sender was closed before the reply came"))

    def _connection(self, client: Any) -> Replies:
        """The reader of the connection's replies (the connection its ``connection``)."""
        if self._pid != os.getpid():
            self._forked()  # forked without the hook (os.fork is not the only way)
        pool = client.connection_pool
        if self._replies is not None and self._pool is not pool:
            self._reset(BackendUnavailable("the store's client was replaced"))
        if self._replies is None:
            self._replies, self._pool = Replies(pool.make_connection()), pool
        return self._replies

    def _catch_up(self, replies: Replies) -> None:
        """Wait for replies until half of ``max_unread`` are left: a store that stalls for a
        moment (a fork, a slow fsync) slows the sender down, and loses none of its writes."""
        timeout_s = replies.connection.socket_timeout or CATCH_UP_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        while len(self._waiting) > self.max_unread // 2:
            left = deadline - time.monotonic()
            if left <= 0 or not replies.wait(left):
                self._reset(BackendUnavailable("the claim store did not answer in time"))
                return
            self._read_one(replies)

    def _read_arrived(self, replies: Replies) -> None:
        """Read the replies that came, without waiting: one ``poll(2)``, then those its
        reader holds after the first read."""
        sock = socket_of(replies.connection)
        probe = True
        while self._waiting and sock is not None:
            if not replies.there(self._poll_of(sock), probe=probe, waiting=True):
                return
            self._read_one(replies)
            probe = False

    def _poll_of(self, sock: socket.socket) -> Any:
        """A poll object with ``sock`` registered (None without ``select.poll``)."""
        polled = self._polled
        if _POLL is not None and (polled is None or polled() is not sock):
            # one of its own per socket: a closed socket cannot be unregistered, and its
            # number may be reused by another file
            self._poll = _POLL()
            self._poll.register(sock, select.POLLIN)
            self._polled = weakref.ref(sock)
        return self._poll

    def _read_one(self, replies: Replies) -> None:
        on_reply = self._waiting.popleft()
        try:
            reply = replies.read()
        except redis.ResponseError as exc:
            if isinstance(exc, redis.exceptions.NoScriptError):
                # the store lost its scripts (SCRIPT FLUSH, a restart): load them again
                self._loaded.clear()
            if on_reply is not None:
                on_reply(None, exc)
        else:
            if on_reply is not None:
                on_reply(reply, None)

    def _reset(self, why: BaseException) -> None:
        replies, self._replies = self._replies, None
        self._poll = self._polled = None
        waiting = [on_reply for on_reply in self._waiting if on_reply is not None]
        self._waiting.clear()
        self._loaded.clear()
        for on_reply in waiting:
            on_reply(None, why)
        if replies is not None:
            with contextlib.suppress(Exception):
                replies.connection.disconnect()


class ScriptCaller:
    """Script calls waited for, each on a connection this process keeps for them: alone
    (:meth:`call`) or at the end of a ``MULTI``/``EXEC`` (:meth:`transaction`, kombu's
    append with the claim in it); kombu's own transactions too, waited for (:meth:`commands`)
    or not (:meth:`send_commands`, kombu's ack: its replies read before the connection's
    next use).

    The connections are made from the client's pool but never go back to it: taking one is a
    ``list.pop``, where redis-py's pool takes a lock, checks and counts. Each remembers the
    scripts loaded on it. Before a call, a kept connection the server closed meanwhile (a
    restart, an idle timeout) is found and connected again, as redis-py's pool does; once a
    call is written, nothing is sent again (the caller decides, as after any lost reply).
    Safe across threads (each call takes a connection of its own) and across fork (a child
    never touches its parent's).
    """

    def __init__(self) -> None:
        self._free: list[_Kept] = []
        self._pid = os.getpid()
        _KEPT.add(self)

    def _forked(self) -> None:
        # the parent's sockets stay the parent's: dropped, not closed (redis-py's disconnect
        # shuts a socket down only in the process that opened it)
        self._free, self._pid = [], os.getpid()

    usable = staticmethod(usable)

    def call(self, pool: Any, call: ScriptCall[Any]) -> Any:
        """Send ``call`` to the server of ``pool`` (a client's ``connection_pool``), wait
        for its reply and return it (raw).

        Raises:
            redis.ConnectionError, redis.TimeoutError: the call may or may not have run; the
                connection is dropped.
            redis.ResponseError: the script's error (the connection is kept).
            InvalidArgument: ``pool`` is not a standalone server's (:func:`usable`).
        """
        return self._on_kept(pool, _Kept.call, call)

    def transaction(self, pool: Any, commands: list[tuple[Any, ...]], call: ScriptCall[Any]) -> Any:
        """Send ``commands`` and then ``call`` in one ``MULTI``/``EXEC`` to the server of
        ``pool``, wait, and return ``EXEC``'s replies in order (a command's error reply as
        its ``redis.ResponseError``, not raised; a ``NoScriptError`` as the last reply where
        the store's scripts were flushed since they were loaded here).

        Raises:
            redis.ConnectionError, redis.TimeoutError: the transaction may or may not have
                run; the connection is dropped.
            redis.ResponseError: the transaction was refused (``EXECABORT``: a command was
                refused when queued), nothing ran (the connection is kept).
            InvalidArgument: ``pool`` is not a standalone server's (:func:`usable`).
        """
        return self._on_kept(pool, _Kept.transaction, commands, call)

    def commands(self, pool: Any, commands: list[tuple[Any, ...]]) -> Any:
        """Send ``commands`` in one ``MULTI``/``EXEC`` to the server of ``pool``, wait, and
        return ``EXEC``'s replies in order (a command's error reply as its
        ``redis.ResponseError``, not raised): kombu's own transactions, without a script.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the transaction may or may not have
                run; the connection is dropped.
            redis.ResponseError: the transaction was refused (``EXECABORT``), nothing ran.
            InvalidArgument: ``pool`` is not a standalone server's (:func:`usable`).
        """
        return self._on_kept(pool, _Kept.commands, commands)

    def send_commands(
        self,
        pool: Any,
        commands: list[tuple[Any, ...]],
        what: str,
        on_lost: Callable[[], object],
    ) -> None:
        """Send ``commands`` in one ``MULTI``/``EXEC`` to the server of ``pool`` without
        waiting for the replies: they are read before the connection's next use, and an
        error among them is logged there, naming ``what``. Where the connection is found
        lost before they were read (whether the commands ran is not known), ``on_lost()``
        runs then: the same writes sent again another way (they must be idempotent).

        Raises:
            redis.ConnectionError, redis.TimeoutError: the transaction was not written in
                full (it may or may not run); the connection is dropped.
            InvalidArgument: ``pool`` is not a standalone server's (:func:`usable`).
        """
        self._on_kept(pool, _Kept.send_commands, commands, what, on_lost)

    def _on_kept(self, pool: Any, use: Callable[..., Any], *args: Any) -> Any:
        """``use(kept, *args)`` on a kept connection of ``pool``'s server, taken for the
        call."""
        if type(pool) is not redis.ConnectionPool:
            raise InvalidArgument("pool", "a standalone redis.ConnectionPool is needed")
        if self._pid != os.getpid():
            self._forked()  # forked without the hook (os.fork is not the only way)
        try:
            kept = self._free.pop()
        except IndexError:
            kept = _Kept(pool)
        else:
            if kept.pool is not pool:  # the client was replaced
                kept.close()
                kept = _Kept(pool)
        try:
            reply = use(kept, *args)
        except redis.ResponseError:
            self._free.append(kept)
            raise
        except BaseException:
            kept.close()
            raise
        self._free.append(kept)
        return reply

    def close(self) -> None:
        """Close the kept connections (a later call makes a new one)."""
        free, self._free = self._free, []
        for kept in free:
            kept.close()


class _Kept:
    """One connection of a :class:`ScriptCaller`, and the scripts loaded on it."""

    __slots__ = ("_poll", "_polled", "conn", "loaded", "owed", "pool", "replies")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.conn = pool.make_connection()
        self.replies = Replies(self.conn)
        self.loaded: set[str] = set()
        #: transactions sent without waiting (:meth:`send_commands`): their reply count, what
        #: each was and what sends it again, read before the connection's next use
        self.owed: list[tuple[int, str, Callable[[], object]]] = []
        self._poll: Any = None  # a poll object with the connection's socket registered
        # that socket, weakly: a strong reference changed the order in which a cycle's
        # finalizers ran, and the socket's own could warn "unclosed" before the connection's
        # __del__ closed it (seen in the suite's gc.collect() of an in-process worker)
        self._polled: weakref.ref[socket.socket] | None = None

    def call(self, call: ScriptCall[Any]) -> Any:
        self._ready()
        reply = self._send(call)
        if isinstance(reply, redis.exceptions.NoScriptError):
            # the store lost its scripts since they were loaded here (SCRIPT FLUSH)
            self.loaded.clear()
            reply = self._send(call)
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def transaction(self, commands: list[tuple[Any, ...]], call: ScriptCall[Any]) -> Any:
        self._ready()
        conn = self.conn
        script = _script_commands(call, self.loaded, conn)  # [SCRIPT LOAD,] EVALSHA
        queued = pack_commands([("MULTI",), *commands], conn)
        sent = [*script[:-1], *queued, script[-1], *pack_commands([("EXEC",)], conn)]
        conn.send_packed_command([b"".join(sent)])
        replies = self._read(len(script) + len(commands) + 2)
        if len(script) == 2 and isinstance(replies[0], redis.ResponseError):
            self.loaded.discard(call.script.sha)  # not loaded after all
        result = replies[-1]
        if isinstance(result, redis.ResponseError):
            raise result
        if result and isinstance(result[-1], redis.exceptions.NoScriptError):
            self.loaded.clear()  # flushed since it was loaded here: loaded again next time
        return result

    def commands(self, commands: list[tuple[Any, ...]]) -> Any:
        self._ready()
        conn = self.conn
        packed = pack_commands([("MULTI",), *commands, ("EXEC",)], conn)
        conn.send_packed_command([b"".join(packed)])
        result = self._read(len(commands) + 2)[-1]
        if isinstance(result, redis.ResponseError):
            raise result
        return result

    def send_commands(
        self, commands: list[tuple[Any, ...]], what: str, on_lost: Callable[[], object]
    ) -> None:
        self._ready()
        conn = self.conn
        packed = pack_commands([("MULTI",), *commands, ("EXEC",)], conn)
        conn.send_packed_command([b"".join(packed)])
        self.owed.append((len(commands) + 2, what, on_lost))

    def _read_owed(self) -> None:
        """Read the replies of the transactions sent without waiting, logging their errors.
        A connection that cannot give them is dropped, and each transaction whose replies
        were not all read is sent again by its ``on_lost`` (whether it ran is not known)."""
        owed, self.owed = self.owed, []
        read = self.replies.read_any
        done = 0  # the transactions whose replies were all read
        try:
            for count, what, _ in owed:
                replies = [read() for _ in range(count)]
                done += 1
                # a command refused as it was queued (READONLY), then EXEC's refusal
                # (EXECABORT) or the errors of the commands it ran
                errors = [r for r in replies if isinstance(r, Exception)]
                result = replies[-1]
                if isinstance(result, list):
                    errors += [r for r in result if isinstance(r, Exception)]
                for error in errors:
                    logger.warning("%s failed: %s", what, error)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self.conn.disconnect()
            self.loaded.clear()
            for _, what, on_lost in owed[done:]:
                logger.warning("%s: no reply (%r); sent again", what, exc)
                try:
                    on_lost()
                except Exception as again:
                    logger.warning("%s: not sent again: %r", what, again)

    def _ready(self) -> None:
        """Connect, or find that the server closed the connection meanwhile and connect
        again: nothing was sent, so connecting again is safe."""
        if self.owed:
            self._read_owed()
        conn = self.conn
        sock = socket_of(conn)
        polled = self._polled
        held = self.replies.held()
        if (
            sock is not None
            and polled is not None
            and polled() is sock
            and not held
            and not self._poll.poll(0)
        ):
            # connected and nothing to read: neither closed by the server (EOF) nor holding a
            # reply nobody asked for. One poll(2); redis-py's can_read below costs three system
            # calls and about 13 µs more a call. A complete call leaves nothing in its reader's
            # buffer either: every call reads exactly its replies, and a call that fails to
            # (a timeout, a dropped connection) drops the connection with them.
            return
        try:
            # (can_read connects first where disconnected; what it reads is dropped with
            # the connection, never read as a reply)
            if held or conn.can_read(timeout=0):
                raise redis.ConnectionError("unexpected data on a kept connection")
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            conn.disconnect()
            self.loaded.clear()
            conn.connect()
        sock = socket_of(conn)
        polled = self._polled
        if _POLL is not None and (polled is None or polled() is not sock):
            # a poll object of its own per socket: a closed socket's descriptor cannot be
            # unregistered (its fileno is -1), and its number may be reused by another file
            self._poll, self._polled = None, None
            if sock is not None:
                self._poll = _POLL()
                self._poll.register(sock, select.POLLIN)
                self._polled = weakref.ref(sock)

    def _read(self, n: int) -> list[Any]:
        """The next ``n`` replies, errors too (the connection stays in step)."""
        read = self.replies.read_any
        return [read() for _ in range(n)]

    def _send(self, call: ScriptCall[Any]) -> Any:
        """Write ``call`` and read every reply it gets; returns the script's reply, or the
        first error."""
        conn = self.conn
        commands = _script_commands(call, self.loaded, conn)
        conn.send_packed_command([b"".join(commands)])
        replies = self._read(len(commands))
        if len(replies) == 2 and isinstance(replies[0], redis.ResponseError):
            self.loaded.discard(call.script.sha)  # not loaded after all
            return replies[0]
        return replies[-1]

    def close(self) -> None:
        self.owed = []
        with contextlib.suppress(Exception):
            self.conn.disconnect()
