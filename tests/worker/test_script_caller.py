"""Script calls waited for on a connection the package keeps (``sender.ScriptCaller``).

A worker's pool process sends its claim calls (the settle of a no-op task, the completion
record, a renewal) this way instead of through redis-py's client, whose ``Script.__call__``
costs about three times the CPU. What the client did for them, the caller must do too: load a
script the server lost, find a connection the server closed before writing on it, keep a
connection in step after an error reply, never read a late reply as the next call's, and never
share a socket across fork. Each is checked here against a private ``redis-server``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import redis
import redis.sentinel
from celery import Celery

from celery_claims import ClaimToken, RedisClaimManager
from celery_claims.claims.calls import ScriptCall
from celery_claims.errors import InsufficientReplicas, InvalidArgument
from celery_claims.model import Success
from celery_claims.worker.runtime import ClaimsRuntime
from celery_claims.worker.settings import load_settings
from celery_claims.worker.transport import sender
from celery_claims.worker.transport.sender import ScriptCaller
from tests.servers import RedisServer, command_calls, redis_server

OWNER = "w@host/1/n.1"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as started:
        yield started


@pytest.fixture
def caller() -> Iterator[ScriptCaller]:
    kept = ScriptCaller()
    try:
        yield kept
    finally:
        kept.close()


def echo_call(client: redis.Redis, source: str, *args: object) -> ScriptCall[object]:
    """A call of the script ``source`` with ``args`` as its ARGV, its reply as it comes."""
    return ScriptCall(client.register_script(source), [], list(args), lambda reply: reply)


def echo(caller: ScriptCaller, client: redis.Redis, word: str) -> object:
    """The reply to a call of ``return ARGV[1]`` with ``word``, through ``caller``."""
    return caller.call(client.connection_pool, echo_call(client, "return ARGV[1]", word))


def connections_made(observer: redis.Redis) -> int:
    """Connections the server has taken so far (``observer`` keeps its own open)."""
    return int(observer.info("stats")["total_connections_received"])


def test_claim_calls_on_a_kept_connection_answer_as_through_the_client(
    server: RedisServer, caller: ScriptCaller
) -> None:
    # Given a claim manager whose single calls go through the caller
    client = server.client(socket_timeout=5)
    manager = RedisClaimManager(client=client, prefix="kept")
    manager.send_calls_with(partial(caller.call, client.connection_pool))
    claimed = manager.claim("q", "t1", OWNER, 60_000)
    assert isinstance(claimed, Success)
    assert claimed.token is not None
    observer = server.client()
    made, loads = connections_made(observer), command_calls(observer)["script"]

    # When it renews, completes and reads the claim many times
    token = claimed.token
    for _ in range(20):
        [renewed] = manager.renew("q", [token], 60_000)
        assert isinstance(renewed, ClaimToken)
        assert renewed.instance == token.instance
        assert renewed.expires_at >= token.expires_at
        token = renewed
    manager.complete(token, 60_000)

    # Then each answered as through the client, on the one connection made for the first
    # call, each script loaded on it once
    record = manager.done_record("q", "t1")
    assert record is not None
    assert record.owner == OWNER
    assert connections_made(observer) == made
    assert command_calls(observer)["script"] - loads == 3  # renew, complete, done_record


def test_a_script_the_server_lost_is_loaded_again(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    call = echo_call(client, "return ARGV[1]", "before")
    assert caller.call(client.connection_pool, call) == b"before"
    # When the server forgets its scripts (SCRIPT FLUSH, as a restart with AOF does)
    client.script_flush()
    # Then the next call loads it again and is answered
    assert echo(caller, client, "after") == b"after"


def test_a_connection_the_server_closed_is_connected_again_before_the_call_is_written(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    assert echo(caller, client, "one") == b"one"
    # When the server restarts between two calls (the kept connection is closed by then)
    server.restart()
    # Then the next call is answered, on a new connection, with no error
    assert echo(caller, client, "two") == b"two"


@pytest.mark.parametrize("poll", [True, False], ids=["poll", "no-poll"])
def test_a_connection_killed_between_calls_is_found_before_the_next_call_is_written(
    server: RedisServer, caller: ScriptCaller, poll: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a kept connection in steady use: its probe is one poll of the socket, or, in a
    # process without select.poll (eventlet's monkey patching deletes it), redis-py's can_read
    if not poll:
        monkeypatch.setattr(sender, "_POLL", None)
    client = server.client(socket_timeout=5)
    observer = server.client()
    for word in ("one", "two"):
        assert echo(caller, client, word) == word.encode()
    made = connections_made(observer)
    # When the server closes it between two calls, at once (not a restart: no time passes)
    kept = [c["id"] for c in observer.client_list() if c["cmd"] not in ("client|list", "client")]
    assert len(kept) == 1
    observer.client_kill_filter(_id=kept[0])
    # Then the next call is answered, on a new connection, with no error
    assert echo(caller, client, "three") == b"three"
    assert connections_made(observer) == made + 1
    # and calls after it stay on that connection
    assert echo(caller, client, "four") == b"four"
    assert connections_made(observer) == made + 1


def test_an_error_reply_is_raised_and_the_connection_stays_in_step(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    assert echo(caller, client, "warm") == b"warm"
    observer = server.client()
    made = connections_made(observer)
    with pytest.raises(redis.ResponseError, match="boom"):
        caller.call(client.connection_pool, echo_call(client, "return redis.error_reply('boom')"))
    # the same connection answers the next call with its own reply
    assert echo(caller, client, "next") == b"next"
    assert connections_made(observer) == made


def test_a_reply_that_came_too_late_is_never_read_as_the_next_calls(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=0.3)
    assert echo(caller, client, "warm") == b"warm"
    # When the server stalls longer than the socket timeout while a call waits
    stall = threading.Thread(target=lambda: server.client().execute_command("DEBUG", "SLEEP", 1))
    stall.start()
    time.sleep(0.1)
    with pytest.raises(redis.TimeoutError):
        echo(caller, client, "late")
    stall.join()
    # Then the next call gets its own reply, not the late one
    assert echo(caller, client, "own") == b"own"


def test_a_forked_child_calls_on_a_connection_of_its_own(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    assert echo(caller, client, "parent") == b"parent"
    observer = server.client()
    made = connections_made(observer)
    pid = os.fork()
    if pid == 0:  # the child: its own reply, on its own connection
        try:
            reply = echo(caller, client, "child")
            os._exit(0 if reply == b"child" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # the parent's connection was neither used nor shut by the child
    assert echo(caller, client, "again") == b"again"
    assert connections_made(observer) - made == 1  # the child's


def test_a_client_that_chooses_its_server_per_command_is_refused(caller: ScriptCaller) -> None:
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 1)], socket_timeout=0.1)
    client = sentinel.master_for("nobody")
    call = echo_call(redis.Redis(), "return 1")
    with pytest.raises(InvalidArgument, match="standalone"):
        caller.call(client.connection_pool, call)


def test_a_transaction_runs_its_commands_and_the_script_in_one_exec(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    call = echo_call(client, "return redis.call('GET', KEYS[1] or 'k')")
    observer = server.client()
    # When two transactions write a key and read it in the script
    for value in ("one", "two"):
        replies = caller.transaction(
            client.connection_pool, [("SET", "k", value), ("INCR", "n")], call
        )
        # Then EXEC's replies come in order, the script's last
        assert replies[1:] == [1 if value == "one" else 2, value.encode()]
    # on one connection, the script loaded once
    calls = command_calls(observer)
    assert (calls["multi"], calls["exec"], calls["script"]) == (2, 2, 1)


def test_a_refused_transaction_runs_nothing_and_the_connection_stays_in_step(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    call = echo_call(client, "return redis.call('INCR', 'n')")
    observer = server.client()
    assert caller.transaction(client.connection_pool, [("SET", "k", "v")], call)[1] == 1
    made = connections_made(observer)
    # When a command is refused as it is queued (wrong number of arguments)
    with pytest.raises(redis.exceptions.ExecAbortError):
        caller.transaction(client.connection_pool, [("SET", "k", "w"), ("SET", "k")], call)
    # Then nothing of it ran, and the same connection answers the next transaction
    assert observer.get("k") == b"v"
    assert caller.transaction(client.connection_pool, [], call) == [2]
    assert connections_made(observer) == made


def test_a_transaction_after_the_server_lost_its_scripts_gets_noscript_then_loads_it(
    server: RedisServer, caller: ScriptCaller
) -> None:
    client = server.client(socket_timeout=5)
    call = echo_call(client, "return ARGV[1]", "said")
    assert caller.transaction(client.connection_pool, [("SET", "k", "1")], call)[1] == b"said"
    client.script_flush()
    # When the script is gone: the commands ran, the script's reply is NOSCRIPT
    replies = caller.transaction(client.connection_pool, [("SET", "k", "2")], call)
    assert isinstance(replies[1], redis.exceptions.NoScriptError)
    assert client.get("k") == b"2"
    # and the next transaction loads it again
    assert caller.transaction(client.connection_pool, [], call) == [b"said"]


def test_a_manager_that_waits_for_replicas_keeps_its_calls_on_its_client(
    server: RedisServer, caller: ScriptCaller
) -> None:
    # WAIT counts the writes of the connection it is sent on: a kept one's would not count
    client = server.client(socket_timeout=5)
    manager = RedisClaimManager(client=client, prefix="kept", wait_replicas=1)
    with pytest.raises(InvalidArgument, match="replicas"):
        manager.send_calls_with(partial(caller.call, client.connection_pool))


def test_a_worker_runtime_given_a_manager_that_waits_for_replicas_keeps_it_on_its_client(
    server: RedisServer,
) -> None:
    # Given a manager whose writes wait for a replica, handed to a worker's runtime (its
    # constructor takes any manager: the testing kit's, an embedding program's)
    app = Celery("replicas", broker="memory://", set_as_current=False)
    app.conf.claims_redis_url = server.url
    client = server.client(socket_timeout=5)
    manager = RedisClaimManager(client=client, prefix="kept", wait_replicas=1, wait_timeout_ms=50)
    observer = server.client()

    # When the runtime is built and the manager makes a claim
    runtime = ClaimsRuntime(app, load_settings(app), "w@host", manager)
    try:
        before = connections_made(observer)
        with pytest.raises(InsufficientReplicas):
            manager.claim("q", "t-1", OWNER, 60_000)
        # Then the claim went on the client's one connection, the one whose writes its WAIT
        # counts (no replica here: reported unreplicated), not on one kept by the runtime
        assert connections_made(observer) - before == 1
    finally:
        runtime.close()
        app.close()


class _Text(str):
    """A ``str`` subclass (an enum's value, say): packed as its text."""


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "{q}:claims", "{q}:done", "t-1", OWNER, 30_000, "", "1", 0, -5),
        ("SET", b"k\x00\xff", "v\u00e9\u4e2d", _Text("t"), 2**70),
        ("SET", "k", 1.5),  # a float: left to redis-py
        ("SET", "k", memoryview(b"v")),
    ],
)
def test_the_packer_writes_what_redis_pys_writes(args: tuple[object, ...]) -> None:
    connection = redis.Connection()
    packed = b"".join(sender.pack_commands([args, ("PING",)], connection))
    assert packed == b"".join(connection.pack_commands([args, ("PING",)]))


def test_the_packer_refuses_what_redis_py_refuses() -> None:
    with pytest.raises(redis.DataError):
        sender.pack_commands([("SET", "k", True)], redis.Connection())


class _Script:
    """What ``sender.pack_call`` reads of a registered script: its SHA."""

    sha = "b" * 40


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        (["{q}:c", "{q}:n"], ["t-1", OWNER, 30_000, "", "1", 0, -5]),
        ([], []),
        (["{q}:c"], ["v\u00e9\u4e2d", 2**70, _Text("t")]),  # not ASCII, a str subclass
        (["{q\u00e9}:c"], ["t-1"]),  # a key that is not ASCII
        (["{q}:c"], ["t-1", b"k\x00\xff", 1.5]),  # bytes, a float: left to redis-py
    ],
)
@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_call_is_packed_as_redis_py_packs_its_evalsha(
    keys: list[str], args: list[object], encoding: str
) -> None:
    # Given a script call and a connection of that encoding
    connection = redis.Connection(encoding=encoding)
    script: Any = _Script()  # a stand-in: only its SHA is read
    call: ScriptCall[object] = ScriptCall(script, keys, args, lambda reply: reply)
    words = ("EVALSHA", _Script.sha, len(keys), *keys, *args)
    try:
        expected = b"".join(connection.pack_commands([words]))
    except UnicodeEncodeError:  # text the encoding cannot hold: refused alike
        with pytest.raises(UnicodeEncodeError):
            sender.pack_call(call, connection)
        return
    # When it is packed twice (the second time from its packed script and keys)
    # Then both times it is what redis-py writes
    assert sender.pack_call(call, connection) == expected
    assert sender.pack_call(call, connection) == expected
