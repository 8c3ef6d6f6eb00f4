"""The claim gate's own connection to the claim store: one round trip per message, no more.

Going through redis-py, each claim store call from the consumer loop costs a full round trip
plus redis-py's per-command work, and the gate made two per message (claim, then completion).
:class:`StorePipe` keeps one plain socket to the store for the consumer's thread:

- the claim is sent and its reply awaited (:meth:`StorePipe.call`): the one round trip a claim
  taken at execution time cannot avoid;
- the completion is written to the socket before Celery acks the message, but its reply is not
  waited for (:meth:`StorePipe.submit`): it is read with the next claim's reply, by a timer
  within a fraction of a second, or by :meth:`StorePipe.drain` when the consumer stops, and
  then handed to the call's callback.

Replies come back in the order the calls were sent (RESP is ordered), so each is matched to its
call. A reply that does not come within the timeout drops the connection and ends every waiting
call with :class:`~celery_claims.errors.BackendUnavailable`, as a failed blocking call would.

It speaks RESP2 over TCP or a Unix socket (the handshake sends ``AUTH`` and ``SELECT`` as the
URL asks). Where it cannot be used (TLS, a credential provider, ``WAIT`` on writes, a Cluster
client) :meth:`StorePipe.for_manager` returns ``None`` and the gate uses the manager's blocking
client. A pipe belongs to one thread (the consumer's).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from celery.utils.log import get_logger
from redis.commands.core import Script

from celery_claims.claims.redis import RedisClaimManager, ScriptCall
from celery_claims.errors import BackendError, BackendUnavailable, ClaimError

__all__ = ["Outcome", "ReplyError", "RespReader", "StorePipe", "encode_command"]

logger = get_logger("celery_claims.worker")

#: A call's result, or the error it ended with (never raised into the event loop).
Outcome = Any

#: Reply error prefixes that mean "the store cannot serve this now", not a bug.
_UNAVAILABLE_ERRORS = ("LOADING", "READONLY", "MASTERDOWN", "BUSY", "TRYAGAIN", "CLUSTERDOWN")

_CRLF = b"\r\n"
_READ_SIZE = 65536


class ReplyError(str):
    """An error reply (``-ERR ...``) as parsed; the text without the leading ``-``."""


class _Incomplete(Exception):
    pass


class RespReader:
    """An incremental RESP2 reply parser: :meth:`feed` bytes, then :meth:`gets` replies.

    Simple strings and bulk strings come back as ``bytes``, integers as ``int``, nulls as
    ``None``, arrays as lists and error replies as :class:`ReplyError`.
    """

    #: returned by :meth:`gets` when no whole reply is buffered
    INCOMPLETE: Any = object()

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        """Append received bytes."""
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def pending(self) -> bool:
        """True if bytes of an unfinished reply are buffered."""
        return self._pos < len(self._buf)

    def gets(self) -> Any:
        """The next whole reply, or :attr:`INCOMPLETE`.

        Raises:
            redis.exceptions.InvalidResponse: the bytes are not RESP2.
        """
        try:
            value, self._pos = self._parse(self._pos)
        except _Incomplete:
            return self.INCOMPLETE
        if self._pos > _READ_SIZE:
            del self._buf[: self._pos]
            self._pos = 0
        return value

    def _parse(self, pos: int) -> tuple[Any, int]:
        # iterative: a reply is parsed in one call, whatever its nesting
        buf = self._buf
        open_arrays: list[tuple[list[Any], int]] = []  # (items so far, items expected)
        while True:
            end = buf.find(_CRLF, pos)
            if end < 0:
                raise _Incomplete
            kind = buf[pos]
            value: Any
            if kind == 0x24:  # $ bulk string
                size = int(buf[pos + 1 : end])
                pos = end + 2
                if size < 0:
                    value = None
                else:
                    if len(buf) < pos + size + 2:
                        raise _Incomplete
                    value = bytes(buf[pos : pos + size])
                    pos += size + 2
            elif kind == 0x3A:  # : integer
                value = int(buf[pos + 1 : end])
                pos = end + 2
            elif kind == 0x2A:  # * array
                count = int(buf[pos + 1 : end])
                pos = end + 2
                if count > 0:
                    open_arrays.append(([], count))
                    continue
                value = None if count < 0 else []
            elif kind == 0x2B:  # + simple string
                value = bytes(buf[pos + 1 : end])
                pos = end + 2
            elif kind == 0x2D:  # - error
                value = ReplyError(bytes(buf[pos + 1 : end]).decode("utf-8", "replace"))
                pos = end + 2
            else:
                raise redis.exceptions.InvalidResponse(f"unexpected reply type {chr(kind)!r}")
            while open_arrays:
                items, expected = open_arrays[-1]
                items.append(value)
                if len(items) < expected:
                    break
                open_arrays.pop()
                value = items
            else:
                return value, pos


def encode_command(parts: Sequence[Any]) -> bytes:
    """One command in RESP2 (an array of bulk strings); ``str`` is sent as UTF-8."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if isinstance(part, bytes):
            data = part
        elif isinstance(part, str):
            data = part.encode("utf-8")
        elif isinstance(part, int):
            data = b"%d" % part
        else:
            raise TypeError(f"cannot send {type(part).__name__} to Redis")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _script_command(call: ScriptCall[Any], *, by_source: bool) -> bytes:
    if by_source:
        return encode_command(["EVAL", call.script.script, len(call.keys), *call.keys, *call.args])
    # EVALSHA, the sha and the keys repeat for every call of a script on a queue
    cache_key = (call.script.sha, *call.keys)
    head = _HEADS.get(cache_key)
    if head is None:
        if len(_HEADS) >= _HEADS_MAX:
            _HEADS.clear()
        head = _HEADS[cache_key] = encode_command(
            ["EVALSHA", call.script.sha, len(call.keys), *call.keys]
        ).partition(_CRLF)[2]
    return b"*%d\r\n%s%s" % (
        3 + len(call.keys) + len(call.args),
        head,
        encode_command(call.args).partition(_CRLF)[2],
    )


#: Encoded ``EVALSHA sha numkeys keys...`` (without the array header), per script and keys.
_HEADS: dict[tuple[str, ...], bytes] = {}
_HEADS_MAX = 1024


def _reply_error(message: str, *, context: str = "") -> ClaimError:
    # the error's own first word decides ("LOADING ..."), not the context put before it
    if message.startswith(_UNAVAILABLE_ERRORS):
        return BackendUnavailable(f"claim store unavailable: {context}{message}")
    return BackendError(f"claim store error: {context}{message}")


def _ignore(outcome: Outcome) -> None:
    pass


@dataclass(eq=False, slots=True)
class _Pending:
    call: ScriptCall[Any] | None
    callback: Callable[[Outcome], None]
    sent_at: float
    by_source: bool = False


class StorePipe:
    """The consumer thread's connection to the claim store (see the module docstring).

    Args:
        timer: the worker's timer (``call_after``), which reads late replies.
        address: ``(host, port)``, or a Unix socket path.
        handshake: commands sent (and checked) right after connecting: ``AUTH``, ``SELECT``.
        scripts: the scripts loaded on each connection (and again when the store answers
            ``NOSCRIPT``), so a call sent without waiting does not wait for a reload either.
        timeout_s: connect timeout, and the longest a reply may take before the connection
            is dropped and every waiting call ends with :class:`BackendUnavailable`.
        poll_s: how soon after a call sent with :meth:`submit` its reply is read at the latest
            (while the worker's timer runs).
    """

    def __init__(
        self,
        timer: Any,
        address: tuple[str, int] | str,
        *,
        handshake: Sequence[Sequence[Any]] = (),
        scripts: Sequence[Script] = (),
        timeout_s: float = 5.0,
        poll_s: float = 0.25,
    ) -> None:
        self.timer = timer
        self.address = address
        self.handshake = [list(command) for command in handshake]
        self.scripts = list(scripts)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._sock: socket.socket | None = None
        self._poller = select.poll()
        self._reader = RespReader()
        self._pending: deque[_Pending] = deque()
        self._timer_entry: Any = None

    @classmethod
    def for_manager(
        cls, manager: RedisClaimManager, timer: Any, *, timeout_s: float
    ) -> StorePipe | None:
        """A pipe to ``manager``'s store, or None where only the blocking client can go."""
        client = manager.client
        if timer is None or manager.waits_for_replicas or not isinstance(client, redis.Redis):
            return None
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        if kwargs.get("credential_provider") is not None:
            return None
        address: tuple[str, int] | str
        if issubclass(pool.connection_class, redis.UnixDomainSocketConnection):
            address = str(kwargs["path"])
        elif pool.connection_class is redis.Connection:
            address = (str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)))
        else:  # TLS and other transports
            return None
        handshake: list[list[Any]] = []
        password = kwargs.get("password")
        if password is not None:
            username = kwargs.get("username")
            user = [] if username is None else [username]
            handshake.append(["AUTH", *user, password])
        db = int(kwargs.get("db") or 0)
        if db:
            handshake.append(["SELECT", db])
        scripts = [manager.scripts["claim"], manager.scripts["release"]]
        return cls(timer, address, handshake=handshake, scripts=scripts, timeout_s=timeout_s)

    # --- calls ------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Calls sent whose reply has not been read yet."""
        return len(self._pending)

    def call(self, call: ScriptCall[Any]) -> Outcome:
        """Send ``call`` and wait for its reply (replies to earlier calls are delivered first).

        One round trip; returns the decoded result or the error it decodes to (a store that
        cannot be reached gives :class:`BackendUnavailable`, a refused ``AUTH`` or ``SELECT``
        :class:`BackendError`).
        """
        box: list[Outcome] = []
        try:
            self.submit(call, box.append)
        except ClaimError as exc:  # could not connect, or the handshake was refused
            return exc
        while not box and self._sock is not None:
            self._read(wait=True)
        # a dropped connection fails every waiting call, this one included
        return box[0] if box else BackendUnavailable("claim store connection lost")

    def submit(self, call: ScriptCall[Any], callback: Callable[[Outcome], None]) -> None:
        """Send ``call`` without waiting; ``callback`` later gets its decoded result or error.

        An exception the callback raises is logged, never raised to whoever read the reply.

        Raises:
            BackendUnavailable: the store could not be connected to (nothing was sent, the
                callback will not be called).
            BackendError: the store refused the handshake (likewise).
        """
        sock = self._connect()
        self._pending.append(_Pending(call, callback, time.monotonic()))
        self._send(sock, _script_command(call, by_source=False))
        if self._timer_entry is None and self._sock is not None:
            self._timer_entry = self.timer.call_after(self.poll_s, self.poll, priority=6)

    def poll(self) -> None:
        """Deliver the replies that have arrived; drop the connection if one is overdue.

        Runs from the worker's timer while calls wait, and may be called at any time.
        """
        self._timer_entry = None
        self._read(wait=False)
        if self._sock is None or not self._pending:
            return
        waited = time.monotonic() - self._pending[0].sent_at
        if waited >= self.timeout_s:
            self._broken(TimeoutError(f"no reply in {self.timeout_s:.1f} s"))
            return
        self._timer_entry = self.timer.call_after(self.poll_s, self.poll, priority=6)

    def drain(self) -> None:
        """Wait for every outstanding reply (up to the timeout) and deliver them."""
        while self._pending and self._sock is not None:
            self._read(wait=True)

    def close(self) -> None:
        """Drop the connection; calls still waiting end with :class:`BackendUnavailable`."""
        self._broken(ConnectionError("closed"))

    # --- connection -------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        try:
            if isinstance(self.address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(self.address)
            else:
                sock = socket.create_connection(self.address, timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise BackendUnavailable(f"claim store unavailable: {exc}") from exc
        try:
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        # non-blocking from here: a socket with a timeout polls before every send and recv
        sock.setblocking(False)
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._sock = sock
        self._reader = RespReader()
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        commands = self.handshake + [["SCRIPT", "LOAD", script.script] for script in self.scripts]
        if not commands:
            return
        reader = RespReader()
        try:
            sock.sendall(b"".join(encode_command(command) for command in commands))
            for command in commands:
                reply = reader.gets()
                while reply is RespReader.INCOMPLETE:
                    data = sock.recv(_READ_SIZE)
                    if not data:
                        raise ConnectionError("connection closed during the handshake")
                    reader.feed(data)
                    reply = reader.gets()
                if isinstance(reply, ReplyError):
                    # LOADING and the like mean "not now", like a refused connection; the
                    # rest (NOAUTH, a wrong password) is a configuration error
                    raise _reply_error(f"{reply:.200}", context=f"{command[0]} refused: ")
        except OSError as exc:
            raise BackendUnavailable(f"claim store unavailable: {exc}") from exc

    def _broken(self, error: BaseException) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._reader = RespReader()
        if self._timer_entry is not None:
            with contextlib.suppress(Exception):
                self._timer_entry.cancel()
            self._timer_entry = None
        pending, self._pending = self._pending, deque()
        if pending:
            logger.warning(
                "Claim store connection of the consumer dropped (%s); %d call(s) failed",
                error,
                len(pending),
            )
        failure = BackendUnavailable(f"claim store unavailable: {error}")
        for item in pending:
            self._deliver(item.callback, failure)

    # --- sending and reading ----------------------------------------------------------------

    def _send(self, sock: socket.socket, data: bytes) -> None:
        try:
            sent = sock.send(data)
            if sent < len(data):
                # the socket buffer is full (a store that stopped reading): wait for room
                self._send_rest(sock, memoryview(data)[sent:])
        except BlockingIOError:
            self._send_rest(sock, memoryview(data))
        except OSError as exc:
            self._broken(exc)

    def _send_rest(self, sock: socket.socket, rest: memoryview) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            writable = select.poll()
            writable.register(sock, select.POLLOUT)
            while rest:
                if not writable.poll(max(deadline - time.monotonic(), 0) * 1000):
                    raise TimeoutError(f"could not send in {self.timeout_s:.1f} s")
                try:
                    rest = rest[sock.send(rest) :]
                except BlockingIOError:
                    continue
        except OSError as exc:
            self._broken(exc)

    def _read(self, *, wait: bool) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            if wait and not self._poller.poll(self.timeout_s * 1000):
                raise TimeoutError(f"no reply in {self.timeout_s:.1f} s")
            try:
                while True:
                    data = sock.recv(_READ_SIZE)
                    if not data:
                        raise ConnectionError("connection closed by the store")
                    self._reader.feed(data)
                    if len(data) < _READ_SIZE:
                        break
            except BlockingIOError:
                pass
        except OSError as exc:  # a timeout included
            self._broken(exc)
            return
        self._dispatch(sock)

    def _dispatch(self, sock: socket.socket) -> None:
        reader = self._reader
        while self._pending and self._sock is sock:
            try:
                reply = reader.gets()
            except redis.exceptions.InvalidResponse as exc:
                self._broken(exc)
                return
            if reply is RespReader.INCOMPLETE:
                return
            item = self._pending.popleft()
            if item.call is None:  # a reload (SCRIPT LOAD): nothing waits for its reply
                continue
            noscript = isinstance(reply, ReplyError) and reply.startswith("NOSCRIPT")
            if noscript and not item.by_source:
                # the script cache was flushed: send this call's source once, and load the
                # other scripts again before anything else is sent without waiting
                item.by_source = True
                item.sent_at = time.monotonic()
                self._pending.append(item)
                self._send(sock, _script_command(item.call, by_source=True))
                self._reload(sock)
                continue
            outcome: Outcome
            if isinstance(reply, ReplyError):
                outcome = _reply_error(reply)
            else:
                try:
                    outcome = item.call.decode(reply)
                except ClaimError as exc:
                    outcome = exc
                except Exception as exc:
                    outcome = BackendError(f"claim store: unreadable reply {reply!r:.200}: {exc}")
            self._deliver(item.callback, outcome)
        if self._sock is sock and not self._pending and reader.pending():
            self._broken(redis.exceptions.InvalidResponse("a reply nobody asked for"))

    def _reload(self, sock: socket.socket) -> None:
        now = time.monotonic()
        loads = []
        for script in self.scripts:
            self._pending.append(_Pending(None, _ignore, now))
            loads.append(encode_command(["SCRIPT", "LOAD", script.script]))
        self._send(sock, b"".join(loads))

    def _deliver(self, callback: Callable[[Outcome], None], outcome: Outcome) -> None:
        try:
            callback(outcome)
        except Exception:
            logger.exception("Claim store pipe: a reply callback failed")
