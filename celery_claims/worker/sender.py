"""Script calls sent on a connection of their own, without waiting for their replies.

Two writes of the package must leave a process at once but need not hold it up for the
store's answer: a prefork pool process's completion record, sent ahead of the worker's ack
(``guard.py``), and a producer's publish journal entry, sent once the broker took the message
(``journal.py``). Both go through a :class:`ScriptSender`: the command is written to the
socket (into the kernel's send buffer, which is delivered even if the process exits right
after) and the replies are read later, as they come, before each later send or by
:meth:`ScriptSender.drain`. Each reply is handed to the sender's ``on_reply``: the script's
raw reply, or the error it ended with.

Standalone stores only (:meth:`ScriptSender.usable`): a Sentinel or Cluster client chooses
its server per command, so the callers write on their own there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from celery_claims.claims.redis import ScriptCall
from celery_claims.errors import BackendUnavailable, InvalidArgument

__all__ = ["ScriptSender"]


#: ``on_reply(reply, error)``: the script's raw reply and None, or None and the error.
OnReply = Callable[[Any, BaseException | None], object]


def _ignore(reply: Any, error: BaseException | None) -> None:
    return None


#: Every sender of this process, reset in a forked child (``os.register_at_fork``).
_SENDERS: weakref.WeakSet[ScriptSender] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sender in list(_SENDERS):
        sender._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ScriptSender:
    """One connection for script calls whose replies are read later (module docstring).

    Safe to share between threads (one lock) and across fork (a child never writes on its
    parent's socket: it opens its own).

    Args:
        on_reply: called with each call's reply as it is read, ``(reply, None)``, or with
            ``(None, error)`` for a call that ended in an error (also for the replies a
            dropped connection took with it).
        max_unread: replies left unread after which the connection is dropped (a store that
            went silent).
    """

    def __init__(
        self,
        on_reply: OnReply = _ignore,
        *,
        max_unread: int = 64,
    ) -> None:
        self.on_reply = on_reply
        self.max_unread = max_unread
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pool: Any = None  # the pool self._conn was made from
        self._pid = os.getpid()
        # what each reply still to come answers: a call's on_reply, or None for a SCRIPT LOAD
        self._waiting: deque[OnReply | None] = deque()
        # scripts loaded on this connection: a fresh or restarted store knows none, and a
        # NOSCRIPT reply would only come after the write was needed
        self._loaded: set[str] = set()
        _SENDERS.add(self)

    def _forked(self) -> None:
        """In a forked child: a lock another thread of the parent held, and the parent's
        socket, are dropped (the socket is never written, nor closed, from here)."""
        self._lock = threading.Lock()
        self._conn, self._pid = None, os.getpid()
        self._waiting.clear()
        self._loaded.clear()

    @staticmethod
    def usable(client: Any) -> bool:
        """True if ``client``'s server can be written this way (a standalone client)."""
        return type(getattr(client, "connection_pool", None)) is redis.ConnectionPool

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
                conn = self._connection(client)
                self._read_arrived(conn)
                commands: list[tuple[Any, ...]] = []
                sha = call.script.sha
                if sha not in self._loaded:
                    # loaded in the same write, ahead of its first use (idempotent)
                    commands.append(("SCRIPT", "LOAD", call.script.script))
                    self._loaded.add(sha)
                commands.append(("EVALSHA", sha, len(call.keys), *call.keys, *call.args))
                conn.send_packed_command(conn.pack_commands(commands))
                self._waiting.extend([None] * (len(commands) - 1) + [on_reply or self.on_reply])
                if len(self._waiting) > self.max_unread:
                    self._reset(BackendUnavailable("the claim store did not answer in time"))
            except (redis.RedisError, OSError) as exc:
                self._reset(exc)
                raise BackendUnavailable(f"could not send to the claim store: {exc!r}") from exc

    def drain(self, timeout_s: float) -> int:
        """Read the replies still to come, waiting up to ``timeout_s``; returns those left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            conn = self._conn if self._pid == os.getpid() else None
            try:
                while conn is not None and self._waiting:
                    left = deadline - time.monotonic()
                    if left <= 0 or not conn.can_read(timeout=left):
                        break
                    self._read_one(conn)
            except (redis.RedisError, OSError) as exc:
                self._reset(exc)
            return len(self._waiting)

    def close(self) -> None:
        """Drop the connection (replies not read yet are reported as errors)."""
        with self._lock:
            self._reset(BackendUnavailable("the sender was closed before the reply came"))

    def _connection(self, client: Any) -> Any:
        if self._pid != os.getpid():
            self._forked()  # forked without the hook (os.fork is not the only way)
        pool = client.connection_pool
        if self._conn is not None and self._pool is not pool:
            self._reset(BackendUnavailable("the store's client was replaced"))
        if self._conn is None:
            self._conn, self._pool = pool.make_connection(), pool
        return self._conn

    def _read_arrived(self, conn: Any) -> None:
        while self._waiting and conn.can_read(timeout=0):
            self._read_one(conn)

    def _read_one(self, conn: Any) -> None:
        on_reply = self._waiting.popleft()
        try:
            reply = conn.read_response()
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
        conn, self._conn = self._conn, None
        waiting = [on_reply for on_reply in self._waiting if on_reply is not None]
        self._waiting.clear()
        self._loaded.clear()
        for on_reply in waiting:
            on_reply(None, why)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()
