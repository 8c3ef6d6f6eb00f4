"""A sender that reads its replies in batches (``ScriptSender(read_every=N)``, the producer's).

Every call still leaves at once; only the reading of replies waits until ``read_every`` of
them wait (or the sender was idle for ``IDLE_S``), and each reply still goes to its own call,
in order, even where redis-py's health check would PING a connection idle for a while.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import redis

from celery_claims.claims.calls import ScriptCall
from celery_claims.connection import socket_of
from celery_claims.worker.transport.sender import IDLE_S, ScriptSender
from tests.servers import RedisServer


def _echo_calls(client: redis.Redis, n: int) -> list[ScriptCall[Any]]:
    """``n`` calls of a script that answers its own argument: whose reply is whose shows."""
    script = client.register_script("return ARGV[1]")
    return [ScriptCall(script, ["k"], [f"c{i}"], lambda reply: reply) for i in range(n)]


def _sent(client: redis.Redis, before: int, n: int) -> None:
    """Wait until the store has run ``n`` calls more than ``before`` (their replies are then
    on their way back)."""
    deadline = time.monotonic() + 10
    while _calls(client) < before + n:
        assert time.monotonic() < deadline, "the store did not run the calls"
        time.sleep(0.01)


def _answered(sender: ScriptSender, nbytes: int) -> None:
    """Wait until ``nbytes`` of replies are in the sender's socket: the store counts a call
    when it runs it and writes its reply later, so a loaded machine can have the one without
    the other (``_sent`` alone let a poll find no reply yet)."""
    assert sender._replies is not None
    sock = socket_of(sender._replies.connection)
    assert sock is not None
    deadline = time.monotonic() + 10
    while _in_socket(sock, nbytes) < nbytes:
        assert time.monotonic() < deadline, "the replies did not come"
        time.sleep(0.01)


def _in_socket(sock: socket.socket, nbytes: int) -> int:
    """Bytes waiting in ``sock`` (up to ``nbytes``), left there."""
    try:
        return len(sock.recv(nbytes, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return 0


def _calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha")
    return int(stats["calls"]) if stats else 0


def test_replies_are_read_once_read_every_of_them_wait_each_by_its_own_call(
    private_redis: RedisServer,
) -> None:
    # Given a sender that reads its replies once 4 of them wait
    client = redis.Redis.from_url(private_redis.url)
    replies: list[Any] = []
    sender = ScriptSender(lambda reply, error: replies.append(error or reply), read_every=4)
    calls = _echo_calls(client, 7)
    try:
        sender.send(client, calls[0])  # the script loaded on the connection
        assert sender.drain(timeout_s=10) == 0
        before = _calls(client)

        # When 4 calls are sent and answered by the store
        for call in calls[1:5]:
            sender.send(client, call)
        _sent(client, before, 4)
        _answered(sender, 4 * len(b"$2\r\nc1\r\n"))

        # Then their replies are not read yet
        assert replies == [b"c0"]

        # When one more is sent: 4 replies wait, so those that came are read first
        sender.send(client, calls[5])
        assert replies == [b"c0", b"c1", b"c2", b"c3", b"c4"]

        # And a drain reads the rest, each reply handed to its own call
        sender.send(client, calls[6])
        assert sender.drain(timeout_s=10) == 0
        assert replies == [b"c0", b"c1", b"c2", b"c3", b"c4", b"c5", b"c6"]
    finally:
        sender.close()
        client.close()


def test_the_health_check_of_an_idle_connection_never_takes_a_waiting_reply_as_its_own(
    private_redis: RedisServer,
) -> None:
    # Given a sender reading in batches on a client whose connections are PINGed when idle
    # for 50 ms (redis-py's health check, which reads the next reply as the PING's)
    client = redis.Redis.from_url(private_redis.url, health_check_interval=0.05)
    replies: list[Any] = []
    sender = ScriptSender(lambda reply, error: replies.append(error or reply), read_every=100)
    calls = _echo_calls(client, 4)
    try:
        # When a call is sent, and another after the health check's interval while the
        # first one's reply waits unread
        sender.send(client, calls[0])
        time.sleep(0.2)
        sender.send(client, calls[1])

        # And another after the sender was idle longer than IDLE_S
        time.sleep(IDLE_S + 0.2)
        sender.send(client, calls[2])

        # Then the replies that came were read before it, each by its own call, with no error
        assert replies == [b"c0", b"c1"]
        sender.send(client, calls[3])
        assert sender.drain(timeout_s=10) == 0
        assert replies == [b"c0", b"c1", b"c2", b"c3"]
    finally:
        sender.close()
        client.close()
