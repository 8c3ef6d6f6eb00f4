"""Replies read straight from a kept connection's socket, as redis-py reads them.

A waited script call costs its caller two system calls and the store's work; redis-py's
``Connection.read_response`` adds about 10 µs of Python a reply on top (its socket buffer
sets the socket's timeout, seeks and copies, and each reply passes through its error
handling), more than the rest of the call's Python (docs/benchmarks.md). The connections the
package keeps for its own calls (:mod:`~celery_claims.worker.transport.sender`,
:mod:`~celery_claims.worker.transport.pipe`) read their replies with a :class:`Replies`
instead: one ``recv(2)`` for every reply that came together, and a parser of RESP2 and RESP3
(redis-py 8 speaks RESP3 by default) that builds the values redis-py's own parser builds, for
the same bytes:

- an integer (or RESP3's big number) as ``int``; a bulk, verbatim or simple string as
  ``bytes`` (``str``, decoded as redis-py's encoder would, where the client has
  ``decode_responses``); a nil as ``None``; an array as a ``list``; a map as a ``dict``; a
  boolean and a double as ``bool`` and ``float``; a set as a ``list``, as redis-py 8 makes
  it (redis-py 5 made a ``set``; no reply the package reads is a set);
- an error reply as the exception redis-py's parser of that connection makes of it
  (``parse_error``: ``NoScriptError``, ``MovedError`` and so on): a ``ResponseError`` is
  returned inside an array and raised at the top, as redis-py does; a ``ConnectionError``
  (``LOADING``, for example) is raised at once and the connection dropped;
- a push message (RESP3) is handed to the connection's parser's push handler once the reply
  it came with is read, and the reply is read on;
- a socket timeout raises ``redis.TimeoutError``, a closed or failed socket
  ``redis.ConnectionError``, bytes that are no reply ``redis.InvalidResponse``; each drops the
  connection, as redis-py's ``read_response`` does.

Once a connection's replies are read here, redis-py's own reader must not read that
connection again: bytes the one holds the other never sees. Its ``connect()`` (with its
handshake) is still redis-py's, and a reconnected socket starts with an empty buffer here.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.connection
import redis.exceptions as redis_errors

from celery_claims.connection import socket_of

__all__ = ["Replies"]

#: Most bytes one ``recv(2)`` takes (replies of a batch of script calls fit in far less).
READ_SIZE = 65536
#: What redis-py says when the store closed the connection.
CLOSED = "Connection closed by server."


#: ``select.poll``, or None where the process has none (eventlet's monkey patching deletes it).
_POLL: Callable[[], Any] | None = getattr(select, "poll", None)


def _health_clock() -> Callable[[], float]:
    found: Any = getattr(redis.connection, "time", None)
    return found if callable(found) else time.monotonic


#: The clock of redis-py's health checks: ``time.time`` up to redis-py 5 (its ``connection``
#: module imports the function), ``time.monotonic`` since (it imports the module).
_HEALTH_CLOCK = _health_clock()


class _More(Exception):
    """The buffer ends inside a reply: read more and parse it again from its start."""


_MORE = _More()


class Replies:
    """The replies of one redis-py ``Connection``, read from its socket (module docstring).

    Not thread-safe: its owner reads for one thread at a time, as it writes.
    """

    __slots__ = ("_buf", "_decode", "_sock", "connection")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self._sock: socket.socket | None = None
        self._buf = b""
        encoder = connection.encoder
        self._decode = encoder.decode if encoder.decode_responses else None

    def held(self) -> bool:
        """True if bytes of a reply came and are held here, not yet handed out (a socket
        ``poll`` no longer sees them): a reply, or its first part, is there to read."""
        sock = self._sock
        if sock is not socket_of(self.connection):
            # dropped or connected again by another hand (a timer, a health check): what
            # the old socket left here is no reply of the new one
            self._sock, self._buf = None, b""
            return False
        if self._buf:
            return True
        return isinstance(sock, ssl.SSLSocket) and bool(sock.pending())

    def there(self, poll: Any, *, probe: bool, waiting: bool) -> bool:
        """True if a reply (or the store's close) is there to read: held here (or by TLS),
        or, if ``probe``, in the socket: one ``poll(0)`` of ``poll`` (the socket registered
        in it, or None) where calls wait for replies (``waiting``), else :meth:`wait` of 0."""
        polled = probe and waiting and poll is not None
        if polled and poll.poll(0):
            return True  # one poll(2); a store's close, too, ends in the read
        if self.held():
            return True
        if polled or not probe:
            return False
        return self.wait(0.0)

    def wait(self, timeout_s: float) -> bool:
        """True once a reply (or the store's close) is there to read, waiting up to
        ``timeout_s``; False at once while disconnected. (redis-py's ``can_read`` would read
        the bytes into its own buffer, where they are lost to this reader.)"""
        if self.held():
            return True
        sock = socket_of(self.connection)
        if sock is None:
            return False
        timeout_s = max(timeout_s, 0.0)
        if _POLL is not None:
            poll = _POLL()
            poll.register(sock, select.POLLIN)
            return bool(poll.poll(timeout_s * 1000.0))
        readable, _, _ = select.select([sock], [], [], timeout_s)
        return bool(readable)

    def read(self) -> Any:
        """The next reply, waiting for it as long as the socket's timeout allows.

        Raises:
            redis.ResponseError: the reply is an error (the connection stays in step).
            redis.ConnectionError, redis.TimeoutError, redis.InvalidResponse: the connection
                failed, or the reply cannot be read; the connection is dropped.
        """
        reply = self.read_any()
        if isinstance(reply, redis_errors.ResponseError):
            raise reply
        return reply

    def read_any(self) -> Any:
        """The next reply, an error reply returned as its ``ResponseError`` (not raised);
        otherwise as :meth:`read`."""
        conn = self.connection
        sock = socket_of(conn)
        if sock is not self._sock:
            self._sock, self._buf = sock, b""  # connected again: nothing of the old socket
        if sock is None:
            raise redis.ConnectionError(f"not connected to {_host(conn)}")
        buf = self._buf
        pushes: list[list[Any]] = []
        try:
            while True:
                if buf:
                    try:
                        reply, end = self._parse(buf, 0, pushes)
                    except _More:
                        pushes.clear()  # parsed again, with more bytes
                    else:
                        self._buf = buf[end:]
                        break
                chunk = sock.recv(READ_SIZE)
                if not chunk:
                    raise redis.ConnectionError(CLOSED)
                buf += chunk
        except TimeoutError as exc:  # socket.timeout
            self._drop()
            raise redis.TimeoutError(f"Timeout reading from {_host(conn)}") from exc
        except OSError as exc:
            self._drop()
            raise redis.ConnectionError(
                f"Error while reading from {_host(conn)} : {exc.args}"
            ) from exc
        except BaseException:
            self._drop()  # a ConnectionError reply, bytes that are no RESP reply
            raise
        if pushes:
            self._pushed(pushes)
        interval = getattr(conn, "health_check_interval", 0)
        if interval:
            # as read_response does: a connection in use is not PINGed (a PING to a store
            # that stalls would fail a call that could wait for it)
            conn.next_health_check = _HEALTH_CLOCK() + interval
        return reply

    def _pushed(self, pushes: list[list[Any]]) -> None:
        """Hand push messages (RESP3: a maintenance notice, a tracking invalidation) to the
        connection's parser, as redis-py's reader does before the reply they came with."""
        handle = getattr(getattr(self.connection, "_parser", None), "handle_push_response", None)
        if handle is None:
            return
        for push in pushes:
            handle(push)
        if socket_of(self.connection) is not self._sock:
            self._buf, self._sock = b"", None  # a handler dropped the connection

    def _drop(self) -> None:
        self._buf, self._sock = b"", None
        self.connection.disconnect()

    def _parse(self, buf: bytes, pos: int, pushes: list[list[Any]]) -> tuple[Any, int]:
        """The reply starting at ``pos`` and the position after it, as redis-py's parser of
        the connection's protocol builds it; push messages met on the way are put in
        ``pushes`` and skipped. Raises :class:`_More` where ``buf`` ends inside it."""
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                raise _MORE
            kind = buf[pos]
            if kind == 58 or kind == 40:  # ":" an integer, "(" a big one
                return _int(buf, pos, end), end + 2
            if kind == 36 or kind == 61:  # "$" a bulk string, "=" a verbatim one
                size = _int(buf, pos, end)
                if size < 0:
                    return None, end + 2
                start = end + 2
                stop = start + size
                if len(buf) < stop + 2:
                    raise _MORE
                value = buf[start + 4 if kind == 61 else start : stop]
                return (value if self._decode is None else self._decode(value)), stop + 2
            if kind == 42 or kind == 126 or kind == 62:  # "*" an array, "~" a set, ">" a push
                count = _int(buf, pos, end)
                if count < 0:
                    return None, end + 2
                items: list[Any] = []
                pos = end + 2
                for _ in range(count):
                    item, pos = self._parse(buf, pos, pushes)
                    items.append(item)
                if kind != 62:
                    return items, pos
                pushes.append(items)  # handled once the reply is read; the reply goes on
                continue
            if kind == 43:  # "+" a simple string
                value = buf[pos + 1 : end]
                return (value if self._decode is None else self._decode(value)), end + 2
            if kind == 95:  # "_" a nil (RESP3)
                return None, end + 2
            if kind == 45 or kind == 33:  # "-" an error, "!" a long one
                return self._error(buf, pos, end)
            if kind == 35:  # "#" a boolean
                return buf[pos + 1 : end] == b"t", end + 2
            if kind == 44:  # "," a double
                return _float(buf, pos, end), end + 2
            if kind == 37:  # "%" a map
                found: dict[Any, Any] = {}
                after = end + 2
                for _ in range(_int(buf, pos, end)):
                    key, after = self._parse(buf, after, pushes)
                    found[key], after = self._parse(buf, after, pushes)
                return found, after
            raise _invalid(buf, pos, end)

    def _error(self, buf: bytes, pos: int, end: int) -> tuple[Any, int]:
        """An error reply (``-`` or RESP3's ``!``) as redis-py's parser makes it: returned,
        or raised where it is a ``ConnectionError``."""
        if buf[pos] == 45:
            text, after = buf[pos + 1 : end], end + 2
        else:
            start = end + 2
            stop = start + _int(buf, pos, end)
            if len(buf) < stop + 2:
                raise _MORE
            text, after = buf[start:stop], stop + 2
        # the connection's parser as of now knows its error codes (a cluster node's knows
        # MOVED and ASK; redis-py 5 sets it when the node connects); else a ResponseError
        parse = getattr(getattr(self.connection, "_parser", None), "parse_error", None)
        error = (parse or redis.ResponseError)(text.decode("utf-8", errors="replace"))
        if isinstance(error, redis_errors.ConnectionError):
            raise error
        return error, after


def _int(buf: bytes, pos: int, end: int) -> int:
    try:
        return int(buf[pos + 1 : end])
    except ValueError:
        raise _invalid(buf, pos, end) from None


def _float(buf: bytes, pos: int, end: int) -> float:
    try:
        return float(buf[pos + 1 : end])
    except ValueError:
        raise _invalid(buf, pos, end) from None


def _invalid(buf: bytes, pos: int, end: int) -> redis_errors.InvalidResponse:
    return redis_errors.InvalidResponse(f"Protocol Error: {buf[pos : end + 2]!r}")


def _host(connection: Any) -> str:
    try:
        return str(connection._host_error())
    except Exception:  # only a message
        return "the claim store"
