"""The replies of the package's kept connections, read from their sockets (``transport/resp.py``).

Every value is checked against what redis-py's own ``read_response`` reads for the same
command on a second connection of the same server, in both protocols redis-py speaks (RESP2,
and RESP3, redis-py 8's default) and with ``decode_responses`` on and off; then what redis-py
does on a failure: an error reply raised at the top and returned inside an array, a
``ConnectionError`` error raised and the connection dropped, a timeout, a server that closed
the connection, a reply split over many reads, push messages between replies, TLS; and when a
reply is there to read (``held``, ``wait``, ``there``), which redis-py's ``can_read`` would
answer by reading it into a buffer of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.exceptions as redis_errors

from celery_claims.connection import socket_of
from celery_claims.worker.transport.resp import Replies
from tests.servers import RedisServer, TlsRedisServer, redis_server

#: Lua replies of every kind a script of the package can give, and then some.
SCRIPTS = [
    "return 1",
    "return -42",
    "return 'word'",
    "return ''",
    "return nil",
    "return false",
    "return true",
    "return {}",
    "return {1, 'two', {3, {'four'}}, false}",
    "return {1, nil, 3}",
    "return redis.status_reply('FINE')",
    "return {redis.status_reply('OK'), redis.error_reply('ERR inside an array'), 7}",
    "return 3.99",
    "return string.rep('x', 200000)",
    "local t = {} for i = 1, 20000 do t[i] = tostring(i) .. 'é' end return t",
]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as started:
        yield started


def pair(server: RedisServer, **options: Any) -> tuple[Any, Any]:
    """Two connected connections of one pool: one read by :class:`Replies`, one by redis-py."""
    pool = redis.ConnectionPool(host="127.0.0.1", port=server.port, **options)
    ours, theirs = pool.make_connection(), pool.make_connection()
    ours.connect()
    theirs.connect()
    return ours, theirs


def both(ours: Any, theirs: Any, *command: Any) -> tuple[Any, Any]:
    """``command``'s reply on each connection: read by :class:`Replies`, and by redis-py
    (an error reply as its exception, from both)."""
    replies = Replies(ours)
    ours.send_command(*keyed(command, "resp-ours:"))
    theirs.send_command(*keyed(command, "resp-theirs:"))
    mine = replies.read_any()
    try:
        expected = theirs.read_response()
    except redis.ResponseError as exc:
        expected = exc
    return mine, expected


def keyed(command: tuple[Any, ...], prefix: str) -> tuple[Any, ...]:
    """``command`` on keys of its own (each connection changes its own keys)."""
    return tuple(a.replace("resp:", prefix) if isinstance(a, str) else a for a in command)


def same(mine: Any, expected: Any) -> None:
    """Equal values of equal types, and errors of the same class and message (a RESP3 set:
    a list here, a set from redis-py 5, a list from redis-py 8)."""
    if isinstance(expected, set):
        assert isinstance(mine, list)
        assert sorted(mine) == sorted(expected)
        return
    if isinstance(expected, BaseException):
        assert type(mine) is type(expected)
        assert str(mine) == str(expected)
        return
    assert type(mine) is type(expected)
    if isinstance(expected, list):
        assert len(mine) == len(expected)
        for a, b in zip(mine, expected, strict=True):
            same(a, b)
    elif isinstance(expected, dict):
        assert list(mine) == list(expected)
        for key in expected:
            same(mine[key], expected[key])
    else:
        assert mine == expected


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
@pytest.mark.parametrize("protocol", [2, 3])
def test_every_reply_is_read_as_redis_py_reads_it(
    server: RedisServer, protocol: int, decode: bool
) -> None:
    ours, theirs = pair(server, protocol=protocol, decode_responses=decode)
    try:
        commands: list[tuple[Any, ...]] = [("EVAL", source, 0) for source in SCRIPTS]
        commands += [
            ("PING",),
            ("SET", "resp:s", "välue"),
            ("GET", "resp:s"),
            ("GET", "resp:missing"),
            ("DEL", "resp:h", "resp:set"),
            ("HSET", "resp:h", "a", "1", "b", "2"),
            ("HGETALL", "resp:h"),
            ("SADD", "resp:set", "x", "y"),
            ("SMEMBERS", "resp:set"),
            ("INCRBYFLOAT", "resp:f", "1.5"),
            ("NOSUCHCOMMAND",),
            ("EVALSHA", "0" * 40, 0),
            ("HGET", "resp:s", "a"),  # WRONGTYPE
            ("CONFIG", "GET", "maxmemory"),
        ]
        for command in commands:
            mine, expected = both(ours, theirs, *command)
            same(mine, expected)
        # a transaction: QUEUED replies, and an error inside EXEC's array
        for command in [("MULTI",), ("INCR", "resp:s"), ("PING",), ("EXEC",)]:
            mine, expected = both(ours, theirs, *command)
            same(mine, expected)
        assert isinstance(mine, list)
        assert isinstance(mine[0], redis.ResponseError)
    finally:
        ours.disconnect()
        theirs.disconnect()


def test_an_error_reply_is_raised_by_read_and_the_connection_stays_in_step(
    server: RedisServer,
) -> None:
    ours, _ = pair(server)
    replies = Replies(ours)
    ours.send_command("EVALSHA", "0" * 40, 0)
    ours.send_command("PING")
    with pytest.raises(redis_errors.NoScriptError):
        replies.read()
    assert replies.read() in (b"PONG", True)
    assert socket_of(ours) is not None
    ours.disconnect()


def test_a_connection_error_reply_is_raised_and_drops_the_connection(server: RedisServer) -> None:
    """``LOADING`` (a store loading its data after a restart) is a ``ConnectionError`` to
    redis-py: raised at once, the connection dropped, as redis-py does."""
    ours, _ = pair(server)
    replies = Replies(ours)
    ours.send_command("EVAL", "return redis.error_reply('LOADING Redis is loading')", 0)
    with pytest.raises(redis_errors.BusyLoadingError):
        replies.read()
    assert socket_of(ours) is None
    assert not replies.held()


def test_a_reply_that_does_not_come_in_time_raises_a_timeout_and_drops_the_connection(
    server: RedisServer,
) -> None:
    ours, _ = pair(server, socket_timeout=0.2)
    replies = Replies(ours)
    ours.send_command("BLPOP", "resp:never", 2)
    with pytest.raises(redis.TimeoutError):
        replies.read()
    assert socket_of(ours) is None
    # connected again, the old socket's late reply is not read as the next call's
    ours.connect()
    ours.send_command("PING")
    assert replies.read() in (b"PONG", True)
    ours.disconnect()


def test_a_connection_the_server_closed_raises_a_connection_error(server: RedisServer) -> None:
    ours, _ = pair(server)
    replies = Replies(ours)
    ours.send_command("CLIENT", "ID")
    client_id = replies.read()
    server.client().client_kill_filter(_id=client_id)
    ours.send_command("PING")
    with pytest.raises(redis.ConnectionError):
        replies.read()
    assert socket_of(ours) is None


def test_wait_sees_a_reply_held_or_in_the_socket_and_the_stores_close(server: RedisServer) -> None:
    ours, _ = pair(server)
    replies = Replies(ours)
    assert not replies.wait(0.05)  # nothing asked
    ours.send_packed_command(ours.pack_commands([("ECHO", "a"), ("ECHO", "b")]))
    assert replies.wait(2.0)
    assert replies.read() == b"a"
    assert replies.wait(0.0)  # held, or still in the socket
    assert replies.read() == b"b"
    assert not replies.there(None, probe=True, waiting=True)
    ours.send_command("CLIENT", "ID")
    client_id = replies.read()
    server.client().client_kill_filter(_id=client_id)
    assert replies.wait(2.0)  # the close is there to read: the read ends it
    with pytest.raises(redis.ConnectionError):
        replies.read()
    assert not replies.wait(0.0)  # disconnected


def test_bytes_held_from_a_socket_dropped_by_another_hand_are_never_read_as_a_reply(
    server: RedisServer,
) -> None:
    """A pipe's timer or a health check may drop and reconnect the connection while a reply
    of the old socket is held here: nothing is held for the new socket, and its first reply
    is read as its own."""
    ours, _ = pair(server)
    replies = Replies(ours)
    ours.send_packed_command(ours.pack_commands([("ECHO", "old-1"), ("ECHO", "old-2")]))
    assert replies.read() == b"old-1"
    assert replies.held()  # "old-2" came in the same segment
    ours.disconnect()
    ours.connect()
    assert not replies.held()
    ours.send_command("ECHO", "new")
    assert replies.read() == b"new"
    ours.disconnect()


def test_replies_that_came_together_are_held_and_read_without_the_socket(
    server: RedisServer,
) -> None:
    """A write of three commands: one ``recv`` takes every reply, the rest are held here
    (a socket ``poll`` no longer sees them, ``held`` does)."""
    ours, _ = pair(server)
    replies = Replies(ours)
    ours.send_packed_command(ours.pack_commands([("PING",), ("ECHO", "a"), ("ECHO", "b")]))
    first = replies.read()
    assert first in (b"PONG", True)
    # the replies came in one segment on loopback; wait until all are in, then read one
    assert replies.held()
    assert replies.read() == b"a"
    assert replies.read() == b"b"
    assert not replies.held()
    ours.disconnect()


def test_push_messages_between_replies_are_handed_to_the_parser_and_skipped(
    server: RedisServer,
) -> None:
    """RESP3 client tracking: an invalidation push comes before the next reply; it goes to
    the connection's push handler and the reply is read on."""
    ours, _ = pair(server, protocol=3)
    pushed: list[Any] = []
    ours._parser.handle_push_response = pushed.append  # what the reader hands pushes to
    replies = Replies(ours)
    ours.send_command("CLIENT", "TRACKING", "ON")
    assert replies.read() in (b"OK", "OK")
    ours.send_command("GET", "resp:tracked")
    replies.read()
    server.client().set("resp:tracked", "changed")
    ours.send_command("ECHO", "after")
    assert replies.read() == b"after"
    assert pushed
    assert pushed[0][0] in (b"invalidate", "invalidate")
    ours.disconnect()


def test_replies_over_tls_are_read_as_on_tcp() -> None:
    tls = TlsRedisServer()
    try:
        tls.start()
        pool = redis.ConnectionPool(
            connection_class=redis.SSLConnection,
            host="127.0.0.1",
            port=tls.port,
            ssl_ca_certs=str(tls.certs["ca"]),
        )
        ours = pool.make_connection()
        ours.connect()
        try:
            replies = Replies(ours)
            big = "y" * 100000
            ours.send_packed_command(
                ours.pack_commands([("SET", "resp:tls", big), ("GET", "resp:tls"), ("PING",)])
            )
            assert replies.read() in (b"OK", True)
            assert replies.read() == big.encode()
            assert replies.read() in (b"PONG", True)
            assert not replies.held()
        finally:
            ours.disconnect()
    finally:
        tls.cleanup()


def test_bytes_that_are_no_reply_raise_invalid_response_and_drop_the_connection(
    server: RedisServer,
) -> None:
    """The parser meets a kind byte RESP does not have: a connection out of step is dropped.
    (The bytes come from the server: ``ECHO`` of a RESP-looking text read as a reply after
    its own bulk header was consumed.)"""
    ours, _ = pair(server, protocol=2)
    replies = Replies(ours)
    ours.send_command("ECHO", "?garbage")
    sock = socket_of(ours)
    assert sock is not None
    header = b""
    while not header.endswith(b"\r\n"):
        header += sock.recv(1)  # "$8\r\n": what is left is "?garbage\r\n"
    with pytest.raises(redis_errors.InvalidResponse):
        replies.read()
    assert socket_of(ours) is None


def test_a_read_puts_off_the_health_check_as_redis_pys_read_does(server: RedisServer) -> None:
    """A connection in use is not PINGed: after a reply is read here, redis-py's health
    check (due after ``health_check_interval``) finds nothing due, on every redis-py
    version's clock. (A PING to a store that stalls would fail a call that could wait.)"""
    ours, _ = pair(server, health_check_interval=30)
    replies = Replies(ours)
    ours.next_health_check = 0  # due
    ours.send_command("ECHO", "x", check_health=False)
    assert replies.read() == b"x"
    observer = server.client()
    pings = observer.info("commandstats").get("cmdstat_ping", {}).get("calls", 0)
    ours.check_health()
    assert observer.info("commandstats").get("cmdstat_ping", {}).get("calls", 0) == pings
    ours.disconnect()
