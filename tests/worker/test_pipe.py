"""The consumer's claim store pipe, against private redis-servers (stopped, paused, restarted)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.asynchronous.timer import Timer

from celery_claims import (
    AlreadyClaimed,
    AlreadyDone,
    BackendError,
    BackendUnavailable,
    ClaimNotFound,
    RedisClaimManager,
    StaleClaimToken,
    Success,
)
from celery_claims.worker.pipe import ReplyError, RespReader, StorePipe, encode_command
from tests.servers import RedisServer, command_calls, redis_server
from tests.worker.helpers import close_app, in_process_worker, make_app, wait_for

OWNER = "worker-1/100/abc"
LEASE_MS = 30_000
DONE_TTL_MS = 60_000


@pytest.fixture
def timer() -> Iterator[Timer]:
    timer = Timer()
    try:
        yield timer
    finally:
        timer.clear()


@pytest.fixture
def manager(redis_server: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    with RedisClaimManager(url=redis_server.url, prefix=key_prefix) as manager:
        yield manager


def open_pipe(manager: RedisClaimManager, timer: Timer, timeout_s: float = 2.0) -> StorePipe:
    pipe = StorePipe.for_manager(manager, timer, timeout_s=timeout_s)
    assert pipe is not None
    return pipe


@pytest.fixture
def pipe(manager: RedisClaimManager, timer: Timer) -> Iterator[StorePipe]:
    pipe = open_pipe(manager, timer)
    try:
        yield pipe
    finally:
        pipe.close()


def fire_due(timer: Timer) -> int:
    """Run the timer entries that are due, as the worker's event loop does; how many ran."""
    fired = 0
    scheduler = iter(timer)
    while True:
        _, entry = next(scheduler)
        if entry is None:
            return fired
        entry()
        fired += 1


# --- the protocol ----------------------------------------------------------------------------

replies = st.recursive(
    st.one_of(
        st.binary(max_size=40),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.none(),
        st.text(
            st.characters(exclude_categories=("Cs",), exclude_characters="\r\n"), max_size=20
        ).map(lambda text: ReplyError("ERR " + text)),
    ),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=20,
)


def resp(value: Any) -> bytes:
    """The server's encoding of a reply (independent of the code under test)."""
    if isinstance(value, ReplyError):
        return b"-" + value.encode("utf-8") + b"\r\n"
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":" + str(value).encode() + b"\r\n"
    if isinstance(value, bytes):
        return b"$" + str(len(value)).encode() + b"\r\n" + value + b"\r\n"
    return b"*" + str(len(value)).encode() + b"\r\n" + b"".join(resp(v) for v in value)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(replies, min_size=1, max_size=6), cuts=st.lists(st.integers(0, 400)))
def test_reader_returns_every_reply_whatever_the_chunks_it_is_fed(
    values: list[Any], cuts: list[int]
) -> None:
    data = b"".join(resp(v) for v in values)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    reader = RespReader()
    got = []
    for start, end in itertools.pairwise(points):
        reader.feed(data[start:end])
        while (reply := reader.gets()) is not RespReader.INCOMPLETE:
            got.append(reply)
    assert got == values
    assert not reader.pending()


def test_reader_refuses_bytes_that_are_not_resp2() -> None:
    reader = RespReader()
    reader.feed(b"!3\r\nabc\r\n")
    with pytest.raises(redis.exceptions.InvalidResponse, match="unexpected reply type"):
        reader.gets()


def test_encoded_commands_reach_redis_byte_for_byte(redis_server: RedisServer) -> None:
    value = "été \x00 {:}".encode() + bytes(range(256))
    sock = socket.create_connection(("127.0.0.1", redis_server.port), timeout=5)
    try:
        sock.sendall(encode_command(["SET", "pipe:bin", value]))
        sock.sendall(encode_command(["SET", "pipe:text", "ünï{c}ode", "PX", 60_000]))
        reader = RespReader()
        got: list[Any] = []
        while len(got) < 2:
            reader.feed(sock.recv(4096))
            while (reply := reader.gets()) is not RespReader.INCOMPLETE:
                got.append(reply)
    finally:
        sock.close()
    assert got == [b"OK", b"OK"]
    client = redis_server.client()
    assert client.get("pipe:bin") == value
    assert client.get("pipe:text") == "ünï{c}ode".encode()
    assert 0 < client.pttl("pipe:text") <= 60_000


def test_encoder_refuses_what_redis_cannot_take() -> None:
    with pytest.raises(TypeError, match="cannot send float"):
        encode_command(["SET", "k", 1.5])


# --- calls -----------------------------------------------------------------------------------


def test_claim_through_the_pipe_is_the_managers_claim(
    pipe: StorePipe, manager: RedisClaimManager
) -> None:
    result = pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS))
    assert isinstance(result, Success)
    assert manager.get_token("q", "t1", OWNER) == result.token
    # a second owner is refused, through the pipe as through the manager
    other = pipe.call(manager.claim_call("q", "t1", "worker-2/1/x", LEASE_MS))
    assert isinstance(other, AlreadyClaimed)
    assert other.owner == OWNER
    assert manager.stats().successes == 1
    assert manager.stats().contentions == 1


def test_completion_is_written_before_its_reply_is_read(
    pipe: StorePipe, manager: RedisClaimManager, timer: Timer
) -> None:
    token = manager.claim("q", "t1", OWNER, LEASE_MS).token
    outcomes: list[Any] = []
    pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
    # nothing has been read, but the store has the record (another client sees it)
    assert outcomes == []
    assert pipe.waiting == 1
    wait_for(lambda: manager.done_record("q", "t1"), timeout=5, what="the done record")
    # the reply is read with the next call's, in order
    second = pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS))
    assert outcomes == [None]
    assert isinstance(second, AlreadyDone)
    assert second.instance == token.instance
    assert pipe.waiting == 0


def test_a_late_reply_is_read_by_the_timer(
    pipe: StorePipe, manager: RedisClaimManager, timer: Timer
) -> None:
    pipe.poll_s = 0.02
    token = manager.claim("q", "t1", OWNER, LEASE_MS).token
    outcomes: list[Any] = []
    pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
    assert len(timer.queue) == 1
    assert fire_due(timer) == 0  # not due yet
    wait_for(lambda: manager.done_record("q", "t1"), timeout=5, what="the done record")
    time.sleep(0.03)
    assert fire_due(timer) == 1
    assert outcomes == [None]
    assert not timer.queue  # nothing left to read: no new entry


def test_refusals_reach_the_callback_as_the_managers_errors(
    pipe: StorePipe, manager: RedisClaimManager
) -> None:
    token = manager.claim("q", "t1", OWNER, LEASE_MS).token
    manager.release(token)
    outcomes: list[Any] = []
    pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
    newer = manager.claim("q", "t2", OWNER, LEASE_MS).token
    stale = dataclasses.replace(newer, instance=newer.instance - 1)
    pipe.submit(manager.complete_call(stale, DONE_TTL_MS), outcomes.append)
    pipe.drain()
    assert [type(o) for o in outcomes] == [ClaimNotFound, StaleClaimToken]
    assert outcomes[0].token == token
    # neither refusal wrote anything
    assert manager.done_record("q", "t1") is None
    assert manager.get_token("q", "t2", OWNER) == newer


def test_a_flushed_script_cache_is_loaded_again(
    pipe: StorePipe, manager: RedisClaimManager, redis_server: RedisServer
) -> None:
    assert isinstance(pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS)), Success)
    redis_server.client().script_flush()
    result = pipe.call(manager.claim_call("q", "t2", OWNER, LEASE_MS))
    assert isinstance(result, Success)
    # loaded by the EVAL: the next call goes by sha again
    assert redis_server.client().script_exists(manager.claim_call("q", "t3", OWNER, 1).script.sha)
    assert isinstance(pipe.call(manager.claim_call("q", "t3", OWNER, LEASE_MS)), Success)


def test_a_callback_that_raises_does_not_stop_the_others(
    pipe: StorePipe, manager: RedisClaimManager, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = [manager.claim("q", f"t{i}", OWNER, LEASE_MS).token for i in range(2)]
    seen: list[Any] = []

    def boom(outcome: Any) -> None:
        raise RuntimeError("callback bug")

    pipe.submit(manager.complete_call(tokens[0], DONE_TTL_MS), boom)
    pipe.submit(manager.complete_call(tokens[1], DONE_TTL_MS), seen.append)
    pipe.drain()
    assert seen == [None]
    assert "a reply callback failed" in caplog.text


def test_decoded_responses_clients_are_served_too(
    redis_server: RedisServer, key_prefix: str, timer: Timer
) -> None:
    client = redis_server.client(decode_responses=True)
    manager = RedisClaimManager(client=client, prefix=key_prefix)
    pipe = open_pipe(manager, timer)
    try:
        result = pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS))
        assert isinstance(result, Success)
        assert result.token.owner == OWNER
        assert manager.get_token("q", "t1", OWNER) == result.token
    finally:
        pipe.close()


# --- outages ---------------------------------------------------------------------------------


def test_stopped_store_fails_the_calls_and_the_pipe_reconnects_after_a_restart(
    private_redis: RedisServer, key_prefix: str, timer: Timer
) -> None:
    with RedisClaimManager(url=private_redis.url, prefix=key_prefix) as manager:
        pipe = open_pipe(manager, timer)
        token = pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS)).token
        outcomes: list[Any] = []
        private_redis.stop()
        pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
        started = time.monotonic()
        result = pipe.call(manager.claim_call("q", "t2", OWNER, LEASE_MS))
        assert isinstance(result, BackendUnavailable)
        assert time.monotonic() - started < 1.0
        # the completion sent before is failed too (the keeper retries such a completion)
        assert len(outcomes) == 1
        assert isinstance(outcomes[0], BackendUnavailable)
        assert pipe.waiting == 0
        private_redis.start()
        # no persistence: the restarted store is empty, and the pipe connects again
        assert isinstance(pipe.call(manager.claim_call("q", "t2", OWNER, LEASE_MS)), Success)
        pipe.close()


def test_paused_store_times_out_every_waiting_call(
    private_redis: RedisServer, key_prefix: str, timer: Timer
) -> None:
    with RedisClaimManager(url=private_redis.url, prefix=key_prefix) as manager:
        pipe = open_pipe(manager, timer, timeout_s=0.5)
        token = pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS)).token
        claim_call = manager.claim_call("q", "t2", OWNER, LEASE_MS)  # registers the queue now
        assert private_redis.proc is not None
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            outcomes: list[Any] = []
            pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
            started = time.monotonic()
            result = pipe.call(claim_call)
            waited = time.monotonic() - started
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        assert isinstance(result, BackendUnavailable)
        assert 0.4 < waited < 2.0
        assert [type(o) for o in outcomes] == [BackendUnavailable]
        # the old connection is gone (its replies could no longer be matched); a new one works
        assert isinstance(pipe.call(manager.claim_call("q", "t3", OWNER, LEASE_MS)), Success)
        pipe.close()


def test_the_timer_fails_a_call_whose_reply_is_overdue(
    private_redis: RedisServer, key_prefix: str, timer: Timer
) -> None:
    with RedisClaimManager(url=private_redis.url, prefix=key_prefix) as manager:
        pipe = open_pipe(manager, timer, timeout_s=0.3)
        pipe.poll_s = 0.05
        token = pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS)).token
        assert private_redis.proc is not None
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            outcomes: list[Any] = []
            pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
            deadline = time.monotonic() + 5
            while not outcomes and time.monotonic() < deadline:
                fire_due(timer)
                time.sleep(0.01)
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        assert [type(o) for o in outcomes] == [BackendUnavailable]
        assert "no reply in 0.3 s" in str(outcomes[0])
        pipe.close()


def test_close_fails_the_calls_still_waiting(pipe: StorePipe, manager: RedisClaimManager) -> None:
    token = manager.claim("q", "t1", OWNER, LEASE_MS).token
    outcomes: list[Any] = []
    pipe.submit(manager.complete_call(token, DONE_TTL_MS), outcomes.append)
    pipe.close()
    assert [type(o) for o in outcomes] == [BackendUnavailable]
    assert pipe.waiting == 0


# --- connections -----------------------------------------------------------------------------


def test_password_and_database_from_the_url_are_used(key_prefix: str, timer: Timer) -> None:
    with redis_server() as server:
        server.client().config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        with RedisClaimManager(url=url, prefix=key_prefix) as manager:
            pipe = open_pipe(manager, timer)
            assert isinstance(pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS)), Success)
            pipe.close()
        db3 = server.client(password="s3cret", db=3)
        assert db3.hlen(RedisClaimManager(client=db3, prefix=key_prefix).keys("q").claims) == 1
        with (
            RedisClaimManager(url=url, prefix=key_prefix) as good,
            RedisClaimManager(url=url.replace("s3cret", "wrong"), prefix=key_prefix) as bad,
        ):
            refused = open_pipe(bad, timer)
            outcome = refused.call(good.claim_call("q", "t2", OWNER, LEASE_MS))
            assert isinstance(outcome, BackendError)
            assert not isinstance(outcome, BackendUnavailable)
            assert "AUTH refused" in str(outcome)
            assert good.get_token("q", "t2", OWNER) is None


def test_unix_socket_urls_are_served(key_prefix: str, timer: Timer, tmp_path: Any) -> None:
    path = tmp_path / "redis.sock"
    with redis_server(["--unixsocket", str(path), "--unixsocketperm", "700"]) as server:
        with RedisClaimManager(url=f"unix://{path}", prefix=key_prefix) as manager:
            pipe = open_pipe(manager, timer)
            assert pipe.address == str(path)
            assert isinstance(pipe.call(manager.claim_call("q", "t1", OWNER, LEASE_MS)), Success)
            pipe.close()
        tcp = RedisClaimManager(client=server.client(), prefix=key_prefix)
        assert tcp.get_token("q", "t1", OWNER) is not None


def test_clients_the_pipe_cannot_serve_get_none(
    redis_server: RedisServer, key_prefix: str, timer: Timer
) -> None:
    tls = RedisClaimManager(url=f"rediss://127.0.0.1:{redis_server.port}/0", prefix=key_prefix)
    assert StorePipe.for_manager(tls, timer, timeout_s=1) is None
    waits = RedisClaimManager(client=redis_server.client(), prefix=key_prefix, wait_replicas=1)
    assert StorePipe.for_manager(waits, timer, timeout_s=1) is None
    plain = RedisClaimManager(client=redis_server.client(), prefix=key_prefix)
    assert StorePipe.for_manager(plain, None, timeout_s=1) is None
    provider = redis.UsernamePasswordCredentialProvider("u", "p")
    creds = RedisClaimManager(
        client=redis.Redis(port=redis_server.port, credential_provider=provider),
        prefix=key_prefix,
    )
    assert StorePipe.for_manager(creds, timer, timeout_s=1) is None
    creds.client.close()
    tls.close()


@pytest.mark.cluster
def test_cluster_clients_get_none(redis_cluster: Any, key_prefix: str, timer: Timer) -> None:
    manager = RedisClaimManager(client=redis_cluster.client(), prefix=key_prefix)
    assert StorePipe.for_manager(manager, timer, timeout_s=1) is None


# --- in a worker -----------------------------------------------------------------------------


#: What claim.lua and release.lua call inside Redis (commandstats counts those too).
CLAIM_AND_RELEASE_COMMANDS = {"time", "hincrby", "hget", "incr", "hset", "zadd", "hdel", "zrem"}


def test_a_worker_sends_one_claim_and_one_completion_per_message_and_nothing_else(
    redis_server: RedisServer, private_redis: RedisServer, queue: str, key_prefix: str
) -> None:
    app = make_app(
        redis_server.url,
        queue=queue,
        claims_prefix=key_prefix,
        claims_redis_url=private_redis.url,
        claims_lease_ms=60_000,
        claims_renew_interval_ms=25_000,
    )

    @app.task(shared=False, name="t.square")
    def square(i: int) -> int:
        return i * i

    observer = private_redis.client()
    try:
        with in_process_worker(app) as worker:
            assert square.delay(0).get(timeout=30) == 0  # connects, registers the queue
            counters = worker.claims.counters
            before = command_calls(observer)
            assert [square.delay(i).get(timeout=30) for i in range(1, 21)] == [
                i * i for i in range(1, 21)
            ]
            wait_for(lambda: counters.get("completed") == 21, timeout=10, what="21 completions")
            after = command_calls(observer)
            gate = worker.consumer.claim_gate
            assert gate is not None
            assert gate.pipe() is None  # this is not the consumer's thread
            assert gate.store_pipe is not None
            assert gate.store_pipe.waiting == 0
    finally:
        close_app(app)
    sent = {
        name: after[name] - before.get(name, 0)
        for name in after
        if name != "info" and after[name] != before.get(name, 0)
    }
    # commandstats counts the scripts' own commands too; from outside only EVALSHA came: the
    # worker's claim and completion of each of the 20 messages, and the producer's (this
    # process) one publish journal write per message
    assert sent["evalsha"] == 40 + 20
    assert set(sent) - {"evalsha"} <= CLAIM_AND_RELEASE_COMMANDS
    claims = RedisClaimManager(client=observer, prefix=key_prefix)
    stats = claims.stats()
    assert (stats.successes, stats.acks) == (21, 21)
    assert claims.active_claims(queue) == 0
