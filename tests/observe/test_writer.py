"""The task history's writer on a real Redis: order, its bounds, outages, shutdown and fork.

Each test has a private ``redis-server`` of its own, which some stop with SIGSTOP: it then
accepts connections and never answers, so a write to it blocks until the socket timeout, as
a write to a hung or reloading store does.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_claims.errors import InvalidArgument
from celery_claims.observe import History, HistoryEvent, HistoryWriter
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import wait_for

PREFIX = "claims"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A Redis of this test alone (some tests stop and resume it)."""
    with redis_server() as private:
        yield private


def _journal(server: RedisServer, *, socket_timeout_s: float = 5.0) -> History:
    # the package's own policy: one immediate retry, no backoff (closed with the server)
    client = server.client(
        socket_timeout=socket_timeout_s, socket_connect_timeout=1, retry=Retry(NoBackoff(), 1)
    )
    return History(client, PREFIX, max_events=1000)


def _event(n: int, what: str = "held") -> HistoryEvent:
    return HistoryEvent(at_ms=1_000 + n, event=what, reason="held", worker="w@test", instance=n)


def _fork() -> int:
    # Python 3.12 warns about forking a process with threads: that is what this test is about
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


@contextmanager
def _hung(server: RedisServer) -> Iterator[None]:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


def _wait_in_flight(writer: HistoryWriter) -> None:
    # the thread took the queued events for a write (which the hung store does not answer)
    wait_for(lambda: bool(writer._in_flight), timeout=10, interval=0.01, what="a write")


def test_events_are_written_per_task_in_the_order_they_were_posted(server: RedisServer) -> None:
    # Given a writer that writes small batches
    history = _journal(server)
    writer = HistoryWriter(history, batch_max=7)

    # When events of three tasks are posted interleaved, from two threads
    def post(task_ids: tuple[str, ...]) -> None:
        for n in range(60):
            for task_id in task_ids:
                writer.post(task_id, _event(n))

    threads = [threading.Thread(target=post, args=(ids,)) for ids in (("a", "b"), ("c",))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert writer.flush(10)

    # Then each task's history has every event, oldest first, as posted
    histories = history.read_many(["a", "b", "c"])
    for task_id in "abc":
        assert [e.instance for e in histories[task_id]] == list(range(60))
    assert (writer.written, writer.dropped, writer.pending) == (180, 0, 0)
    assert writer.stop(5)


def test_posting_while_the_store_hangs_returns_at_once_and_the_event_is_written_later(
    server: RedisServer,
) -> None:
    # Given a writer whose store client waits a minute for a reply
    history = _journal(server, socket_timeout_s=60)
    writer = HistoryWriter(history)

    # When the store hangs, and an event is posted (as a receiver in the worker's loop does)
    with _hung(server):
        writer.post("t-1", _event(1))
        _wait_in_flight(writer)
        # Then the post returned while the write waits on the hung store
        assert writer.pending == 1
        assert writer.flush(0.2) is False

    # And once the store answers, the event is in the history
    assert writer.flush(30)
    assert [e.instance for e in history.read("t-1")] == [1]
    assert writer.stop(5)


def test_a_full_queue_drops_its_oldest_events_and_counts_them(server: RedisServer) -> None:
    # Given a writer holding at most 10 events, whose drops go to a counter
    counted: list[int] = []
    history = _journal(server, socket_timeout_s=60)
    writer = HistoryWriter(history, max_queued=10, on_drop=counted.append)

    # When its first write waits on a hung store and 30 more events are posted meanwhile
    with _hung(server):
        writer.post("t", _event(0))
        _wait_in_flight(writer)
        for n in range(1, 31):
            writer.post("t", _event(n))

        # Then the 20 oldest of those were dropped, counted one by one
        assert writer.dropped == 20
        assert sum(counted) == 20
        assert writer.pending == 11

    # And once the store answers, the first event and the 10 newest are written, in order
    assert writer.flush(30)
    assert [e.instance for e in history.read("t")] == [0, *range(21, 31)]
    assert writer.stop(5)


def test_while_writes_fail_the_newest_events_are_kept_and_written_once_the_store_is_back(
    server: RedisServer,
) -> None:
    # Given a writer that keeps the 5 newest events while its writes fail
    history = _journal(server, socket_timeout_s=0.2)
    writer = HistoryWriter(history, keep_on_error=5, backoff_s=0.05, backoff_max_s=0.2)

    # When the store hangs past the client's timeout while 12 events are posted
    with _hung(server):
        for n in range(12):
            writer.post("t", _event(n))
        with writer._cond:
            # a write failed and the queue was cut to the newest 5
            assert writer._cond.wait_for(lambda: writer._failures >= 1, timeout=10)
        assert writer.dropped == 7

    # Then once the store answers those 5 are written, oldest first
    assert writer.flush(30)
    assert [e.instance for e in history.read("t")] == [7, 8, 9, 10, 11]
    assert writer.stop(5)


def test_stop_writes_what_is_queued_and_a_later_post_starts_the_thread_again(
    server: RedisServer,
) -> None:
    # Given a writer with events queued
    history = _journal(server)
    writer = HistoryWriter(history)
    for n in range(100):
        writer.post("t", _event(n))

    # When it is stopped (as the worker's bootstep does at shutdown)
    flushed = writer.stop(5)

    # Then every event was written and its thread has ended
    assert flushed
    assert not writer.running
    assert len(history.read("t")) == 100

    # And an event posted afterwards (a task that ended while the pool shut down) is written
    writer.post("t", _event(100))
    assert writer.flush(5)
    assert [e.instance for e in history.read("t")][-1] == 100
    assert writer.stop(5)


def test_stop_gives_up_at_its_timeout_while_the_store_hangs(server: RedisServer) -> None:
    # Given a writer whose write waits on a hung store (for up to a minute)
    history = _journal(server, socket_timeout_s=60)
    writer = HistoryWriter(history)
    with _hung(server):
        writer.post("t", _event(0))
        _wait_in_flight(writer)
        writer.post("t", _event(1))

        # When it is stopped with a short timeout
        flushed = writer.stop(0.3)

        # Then stop returned, unflushed, while its thread still waits on the store
        assert flushed is False
        assert writer.running

    # And once the store answers, the thread ends: the batch it sent was written, the event
    # still queued past the deadline was dropped (counted)
    wait_for(lambda: not writer.running, timeout=30, what="the writer's thread to end")
    assert [e.instance for e in history.read("t")] == [0]
    assert writer.dropped == 1


def test_a_forked_child_starts_without_the_writer_thread_or_its_queue(server: RedisServer) -> None:
    # Given a writer whose thread runs, with events queued behind a write to a hung store
    history = _journal(server, socket_timeout_s=60)
    writer = HistoryWriter(history)
    read_end, write_end = os.pipe()
    with _hung(server):
        writer.post("parent", _event(0))
        _wait_in_flight(writer)
        writer.post("parent", _event(1))

        # When the process forks (as a prefork pool does)
        pid = _fork()
        if pid == 0:  # the child: report what it inherited, then post and flush on its own
            code = 1
            try:
                state = f"{int(writer.running)}{writer.pending}"
                os.write(write_end, state.encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end) as inherited:
            state = inherited.read()
        _, status = os.waitpid(pid, 0)

    # Then the child had no running writer and nothing queued (its parent writes those)
    assert os.waitstatus_to_exitcode(status) == 0
    assert state == "00"
    # And the parent's events are written once, by the parent
    assert writer.flush(30)
    assert [e.instance for e in history.read("parent")] == [0, 1]
    assert writer.stop(5)


def test_a_forked_child_that_posts_writes_with_a_thread_of_its_own(server: RedisServer) -> None:
    # Given a writer whose thread runs in this process
    history = _journal(server)
    writer = HistoryWriter(history)
    writer.post("parent", _event(0))
    assert writer.flush(5)

    # When a forked child posts an event and flushes
    pid = _fork()
    if pid == 0:
        code = 1
        try:
            writer.post("child", _event(1))
            code = 0 if writer.flush(10) and writer.running else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)

    # Then the child wrote it itself, and the parent's writer carries on
    assert os.waitstatus_to_exitcode(status) == 0
    assert [e.instance for e in history.read("child")] == [1]
    writer.post("parent", _event(2))
    assert writer.flush(5)
    assert [e.instance for e in history.read("parent")] == [0, 2]
    assert writer.stop(5)


def test_a_bad_post_is_dropped_without_raising_and_bad_settings_are_refused(
    server: RedisServer,
) -> None:
    # Given a writer
    history = _journal(server)
    writer = HistoryWriter(history)

    # When it is given a bad task id or a bad event, Then nothing raises and nothing is queued
    writer.post("", _event(0))
    writer.post("t", "not an event")  # type: ignore[arg-type]
    assert writer.pending == 0
    assert not writer.running

    # And bad bounds or a bad history are refused when it is made
    for kwargs in ({"max_queued": 0}, {"batch_max": True}, {"backoff_s": -1}, {"on_drop": 3}):
        with pytest.raises(InvalidArgument):
            HistoryWriter(history, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="must be a History"):
        HistoryWriter(object())  # type: ignore[arg-type]


def test_record_many_checks_every_event_before_writing_any(server: RedisServer) -> None:
    # Given a history
    history = _journal(server)

    # When a batch with one bad task id is recorded, Then it is refused and nothing is written
    with pytest.raises(InvalidArgument):
        history.record_many([("ok", _event(0)), ("", _event(1))])
    assert history.read("ok") == []
