"""The publish journal: producers journal, workers clear acked messages' entries and recover
the others (dropped when done, put off while claimed, re-published, given up in the end).

Recovery is driven directly here (:meth:`JournalRecovery.recover`, what each worker's keeper
runs every ``claims_journal_scan_interval_ms``) against the real Redis broker and claim store;
the end-to-end case, a message lost with a killed worker, is
``test_defect_fetch_window.py``.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, group
from celery.worker import state as worker_state
from kombu.message import Message as KombuMessage

from celery_claims import InvalidArgument, RedisClaimManager
from celery_claims.claims.journal import Held, RedisJournal
from celery_claims.model import AlreadyClaimed
from celery_claims.runs import with_run
from celery_claims.worker import load_settings
from celery_claims.worker.publish.envelope import Envelope
from celery_claims.worker.publish.producer import PUBLISH_COUNTERS, connect_producer
from celery_claims.worker.publish.recovery import JournalRecovery
from celery_claims.worker.publish.runs import run_of
from celery_claims.worker.signals import Counters
from tests.servers import RedisServer, free_port
from tests.worker.helpers import close_app, in_process_worker, make_app, wait_for

#: Recovery may act on an entry this soon after its publish (the tests wait for it).
RECOVER_AFTER_MS = 300


def _app(broker: str, queue: str, prefix: str, **conf: Any) -> Celery:
    app = make_app(
        broker,
        queue=queue,
        claims_prefix=prefix,
        claims_journal_recover_after_ms=RECOVER_AFTER_MS,
        claims_journal_scan_interval_ms=200,
        **conf,
    )

    @app.task(shared=False, name="t.echo")
    def echo(value: Any) -> Any:
        return value

    @app.task(shared=False, name="t.fail")
    def fail() -> None:
        raise ValueError("boom")

    @app.task(shared=False, name="t.retry_once", bind=True)
    def retry_once(self: Any) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return int(self.request.retries)

    @app.task(shared=False, name="t.unclaimed", claims=False)
    def unclaimed() -> None:
        return None

    return app


@pytest.fixture
def app(redis_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    app = _app(redis_server.url, queue, key_prefix)
    try:
        yield app
    finally:
        close_app(app)


@pytest.fixture
def journal(redis_client: redis.Redis, key_prefix: str) -> RedisJournal:
    return RedisJournal(client=redis_client, prefix=key_prefix)


def _send(app: Celery, name: str, args: tuple[Any, ...] = (), **options: Any) -> None:
    """Publish without subscribing to the result (these tests never read it)."""
    app.tasks[name].apply_async(args, ignore_result=True, **options)


def _written_since(app: Celery, before: int) -> int:
    """Journal writes counted since ``before``, once the replies sent for have come."""
    assert connect_producer(app).flush(timeout_s=10)
    return PUBLISH_COUNTERS.get("journal_written") - before


def _recovery(app: Celery, claims: RedisClaimManager) -> tuple[JournalRecovery, Counters]:
    counters = Counters()
    return JournalRecovery(app, load_settings(app), claims, counters, "test"), counters


def _due(journal: RedisJournal, queue: str, key: str) -> int:
    return journal.entries(queue)[key][1]


def _server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_producer_journals_each_message_with_what_a_republish_needs(
    app: Celery, journal: RedisJournal, redis_client: redis.Redis, queue: str
) -> None:
    # Given a claims-aware producer and no worker
    written = PUBLISH_COUNTERS.get("journal_written")
    before = _server_ms(redis_client)

    # When it publishes a task, an ETA task, an opted-out task and one of celery-claims'
    _send(app, "t.echo", (7,), task_id="j-1")
    _send(app, "t.echo", (8,), task_id="j-eta", countdown=3600)
    _send(app, "t.unclaimed", task_id="j-unclaimed")
    _send(app, "celery_claims.cleanup_expired", task_id="j-ours", queue=queue)

    # Then the claimed ones are journaled under their attempt, the others are not
    entries = journal.entries(queue)
    assert sorted(entries) == ["j-1:0:0", "j-eta:0:0"]
    assert _written_since(app, written) == 2
    # And the entry is the message as published: headers, body in its serializer, route
    envelope = Envelope.loads(entries["j-1:0:0"][0])
    assert (envelope.task, envelope.task_id, envelope.headers["id"]) == ("t.echo", "j-1", "j-1")
    assert envelope.content_type == "application/json"
    assert json.loads(envelope.body)[:2] == [[7], {}]
    assert (envelope.exchange, envelope.routing_key) == ("", queue)
    assert envelope.properties["correlation_id"] == "j-1"
    # And recovery may act on it once claims_journal_recover_after_ms has passed (the ETA
    # task: that long after its ETA)
    assert before + RECOVER_AFTER_MS <= entries["j-1:0:0"][1] <= _server_ms(redis_client) + 300
    assert entries["j-eta:0:0"][1] >= before + 3600_000 + RECOVER_AFTER_MS


def test_the_journal_entry_of_a_completed_or_failed_task_is_cleared_by_its_worker(
    app: Celery, journal: RedisJournal, queue: str
) -> None:
    # Given a worker (started first, so recovery finds nothing due before it runs them)
    with in_process_worker(app):
        # When a task completes and another fails
        assert app.tasks["t.echo"].delay(1).get(timeout=10) == 1
        with pytest.raises(ValueError, match="boom"):
            app.tasks["t.fail"].delay().get(timeout=10)

        # Then the keeper clears both entries on its next beats
        wait_for(lambda: not journal.entries(queue), timeout=10, what="the entries cleared")


def test_the_journal_entry_of_a_revoked_task_is_cleared_when_its_worker_drops_it(
    app: Celery, journal: RedisJournal, queue: str
) -> None:
    # Given a task revoked in the worker (Celery acks it without running it)
    worker_state.revoked.add("j-revoked")
    try:
        with in_process_worker(app):
            # When it is published and the worker drops it
            result = app.tasks["t.echo"].apply_async((1,), task_id="j-revoked")
            wait_for(lambda: result.state == "REVOKED", timeout=10, what="the task revoked")

            # Then its entry is cleared too
            wait_for(lambda: not journal.entries(queue), timeout=10, what="the entry cleared")
    finally:
        worker_state.revoked.discard("j-revoked")


def test_a_worker_journals_what_its_tasks_publish_with_its_own_settings(
    app: Celery, redis_client: redis.Redis, queue: str, key_prefix: str
) -> None:
    # Given a worker whose claim prefix is a worker option, not the app's configuration
    other = f"{key_prefix}w"
    written = PUBLISH_COUNTERS.get("journal_written")
    with in_process_worker(app, claims_prefix=other):
        # When a task it runs publishes its next attempt (a retry)
        assert app.tasks["t.retry_once"].delay().get(timeout=15) == 1

        # Then both messages were journaled where the worker clears and recovers them, and
        # both entries are cleared once acked
        assert _written_since(app, written) == 2
        mine = RedisJournal(client=redis_client, prefix=other)
        wait_for(lambda: not mine.entries(queue), timeout=10, what="the entries cleared")
    assert RedisJournal(client=redis_client, prefix=key_prefix).entries(queue) == {}


@pytest.mark.parametrize("placement", ["riding the publish", "written apart"])
def test_a_compressed_tasks_entry_decodes_as_its_message_wherever_it_is_written(
    redis_server: RedisServer, queue: str, key_prefix: str, placement: str
) -> None:
    # Given an app whose task messages kombu compresses (kombu adds its ``compression`` header
    # to the message's headers as it publishes), its journal riding the broker's push or
    # written apart (the claim store on another database)
    store_url = (
        redis_server.url if placement == "riding the publish" else redis_server.url[:-1] + "3"
    )
    app = _app(redis_server.url, queue, key_prefix, task_compression="gzip",
               claims_redis_url=store_url)  # fmt: skip
    try:
        with redis.Redis.from_url(store_url) as store:
            journal = RedisJournal(client=store, prefix=key_prefix)
            # When a task is published
            _send(app, "t.echo", ({"n": 7},), task_id="j-gzip")
            assert connect_producer(app).flush(timeout_s=10)
            entry = journal.entries(queue)["j-gzip:0:0"][0]
            store.delete(*journal.keys(queue).journal_keys)

        # Then its entry decodes as kombu's consumer decodes the message (its body
        # decompressed exactly when its headers say so): the task's own arguments
        envelope = Envelope.loads(entry)
        message = KombuMessage(
            body=envelope.body, headers=dict(envelope.headers),
            content_type=envelope.content_type, content_encoding=envelope.content_encoding,
        )  # fmt: skip
        assert message.errors == []  # kombu's consumer rejects a message it cannot decompress
        assert message.decode()[0] == [{"n": 7}]
    finally:
        close_app(app)


def test_recovery_drops_the_entry_of_a_task_recorded_done_without_republishing_it(
    app: Celery, journal: RedisJournal, claims: RedisClaimManager, redis_client: redis.Redis,
    queue: str,
) -> None:  # fmt: skip
    # Given a journaled task whose message is gone and whose completion is recorded (its
    # worker died before the keeper cleared the entry)
    _send(app, "t.echo", (1,), task_id="j-done")
    redis_client.delete(queue)
    claimed = claims.claim(queue, "j-done:0:0", "w/1/a", 60_000)
    assert claimed.token is not None
    claims.complete(claimed.token, 60_000)
    recovery, counters = _recovery(app, claims)

    # When recovery looks at it once it is due
    time.sleep(RECOVER_AFTER_MS / 1000)
    assert recovery.recover(queue) == 0

    # Then the entry is gone and nothing was published again
    assert journal.entries(queue) == {}
    assert redis_client.llen(queue) == 0
    assert counters.get("journal_cleared") == 1


@pytest.mark.parametrize("recorded", ["earlier run", "same run"])
def test_recovery_republishes_a_later_run_of_a_canvas_part_an_earlier_run_completed(
    app: Celery, journal: RedisJournal, claims: RedisClaimManager, redis_client: redis.Redis,
    queue: str, recorded: str,
) -> None:  # fmt: skip
    # Given a journaled group member (a canvas part: its message carries a run) whose
    # message is gone, and a completion record of an earlier run of it, or of its own run
    group(app.tasks["t.echo"].s(1).set(task_id="j-run")).apply_async(ignore_result=True)
    message = json.loads(redis_client.rpop(queue) or b"{}")
    run = run_of(message["headers"])
    assert run is not None
    owner = with_run("w/1/a", run - 1 if recorded == "earlier run" else run)
    claimed = claims.claim_unless_done(queue, "j-run:0:0", owner, 60_000)
    assert claimed.token is not None
    claims.complete(claimed.token, 60_000)
    recovery, counters = _recovery(app, claims)

    # When recovery looks at it once it is due
    time.sleep(RECOVER_AFTER_MS / 1000)
    republished = recovery.recover(queue)

    # Then a later run is published again (it has not run); its own run's record clears it
    if recorded == "earlier run":
        assert republished == 1
        assert json.loads(redis_client.rpop(queue) or b"{}")["headers"] == message["headers"]
    else:
        assert republished == 0
        assert journal.entries(queue) == {}
        assert counters.get("journal_cleared") == 1


def test_recovery_puts_off_the_entry_of_a_task_a_live_claim_holds(
    app: Celery, journal: RedisJournal, claims: RedisClaimManager, redis_client: redis.Redis,
    queue: str,
) -> None:  # fmt: skip
    # Given a journaled task a worker holds a live claim on (running, or held in a lane)
    _send(app, "t.echo", (1,), task_id="j-held")
    redis_client.delete(queue)
    assert claims.claim(queue, "j-held:0:0", "w/1/a", 60_000).acquired
    recovery, counters = _recovery(app, claims)
    time.sleep(RECOVER_AFTER_MS / 1000)
    due = _due(journal, queue, "j-held:0:0")

    # When recovery looks at it
    assert recovery.recover(queue) == 0

    # Then it is not published again, and is looked at again one recover delay later
    assert redis_client.llen(queue) == 0
    assert _due(journal, queue, "j-held:0:0") >= due + RECOVER_AFTER_MS
    assert counters.get("journal_deferred") == 1


def test_recovery_republishes_a_lost_message_as_it_was_then_gives_up_after_max_republish(
    redis_server: RedisServer, redis_client: redis.Redis, claims: RedisClaimManager,
    queue: str, key_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    # Given a journaled task whose only message is gone (nobody ran, claimed or acked it),
    # and at most two re-publishes
    app = _app(redis_server.url, queue, key_prefix, claims_journal_max_republish=2)
    journal = RedisJournal(client=redis_client, prefix=key_prefix)
    try:
        _send(app, "t.echo", (5,), task_id="j-lost", priority=3)
        original = json.loads(redis_client.rpop(f"{queue}\x06\x163") or b"{}")
        assert original["headers"]["id"] == "j-lost"
        recovery, counters = _recovery(app, claims)

        # When recovery looks at it each time it is due
        copies = []
        for _ in range(2):
            time.sleep(RECOVER_AFTER_MS / 1000)
            assert recovery.recover(queue) == 1
            copies.append(json.loads(redis_client.rpop(f"{queue}\x06\x163") or b"{}"))
        time.sleep(RECOVER_AFTER_MS / 1000)
        with caplog.at_level(logging.WARNING, logger="celery_claims.worker"):
            assert recovery.recover(queue) == 0

        # Then it was published again twice, as it was: same id, headers, body, priority
        for copy in copies:
            assert copy["headers"] == original["headers"]
            assert copy["body"] == original["body"]
            assert copy["content-type"] == original["content-type"]
            assert copy["properties"]["priority"] == 3
            assert copy["properties"]["correlation_id"] == "j-lost"
        # And then it was given up with a warning, and counted
        assert journal.entries(queue) == {}
        assert counters.get("journal_republished") == 2
        assert counters.get("journal_dropped") == 1
        assert "gave up t.echo[j-lost]" in caplog.text
    finally:
        close_app(app)


def test_a_journal_write_that_fails_never_fails_the_publish(
    redis_server: RedisServer, redis_client: redis.Redis, queue: str, key_prefix: str
) -> None:
    # Given a producer whose claim store is unreachable (its broker is fine)
    app = _app(
        redis_server.url, queue, key_prefix, claims_redis_url=f"redis://127.0.0.1:{free_port()}"
    )
    failed = PUBLISH_COUNTERS.get("journal_write_failed")
    try:
        # When it publishes two tasks
        _send(app, "t.echo", (1,), task_id="j-unjournaled-1")
        _send(app, "t.echo", (2,), task_id="j-unjournaled-2")

        # Then both are in the broker, and the failed journal writes are counted
        assert redis_client.llen(queue) == 2
        assert PUBLISH_COUNTERS.get("journal_write_failed") - failed == 2
    finally:
        close_app(app)


def test_a_store_that_stalls_for_a_moment_loses_no_journal_entry(
    redis_server: RedisServer, redis_client: redis.Redis, queue: str, key_prefix: str
) -> None:
    # Given a producer whose claim store is a server of its own, with one message journaled
    store = RedisServer().start()
    app = _app(redis_server.url, queue, key_prefix, claims_redis_url=store.url)
    journal = RedisJournal(client=store.client(), prefix=key_prefix)
    try:
        _send(app, "t.echo", (0,), task_id="j-stall-0")
        assert connect_producer(app).flush(timeout_s=10)
        assert "j-stall-0:0:0" in journal.entries(queue)
        written = PUBLISH_COUNTERS.get("journal_written")

        # When the store stops answering (SIGSTOP: a long GC pause of a VM, a fork for an RDB
        # save on a big dataset) while three messages are published, then answers again
        assert store.proc is not None
        store.proc.send_signal(signal.SIGSTOP)
        try:
            for i in (1, 2, 3):
                _send(app, "t.echo", (i,), task_id=f"j-stall-{i}")
        finally:
            store.proc.send_signal(signal.SIGCONT)

        # Then every message is in the broker and journaled: the publish did not wait for
        # the store, and the writes were not given up
        assert redis_client.llen(queue) == 4
        want = {f"j-stall-{i}:0:0" for i in range(4)}
        wait_for(lambda: want <= set(journal.entries(queue)), timeout=10)
        assert _written_since(app, written) == 3
    finally:
        close_app(app)
        store.cleanup()


def test_a_producer_with_an_invalid_journal_setting_publishes_unjournaled(
    redis_server: RedisServer, redis_client: redis.Redis, queue: str, key_prefix: str
) -> None:
    # Given a producer whose journal setting is invalid
    app = _app(redis_server.url, queue, key_prefix, claims_journal_max_republish=0)
    failed = PUBLISH_COUNTERS.get("journal_write_failed")
    try:
        # When it publishes, Then the message is published and counted as not journaled
        _send(app, "t.echo", (1,), task_id="j-misconfigured")
        assert redis_client.llen(queue) == 1
        assert PUBLISH_COUNTERS.get("journal_write_failed") - failed == 1
        assert RedisJournal(client=redis_client, prefix=key_prefix).entries(queue) == {}
    finally:
        close_app(app)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("claims_journal", "yes"),
        ("claims_journal_recover_after_ms", 0),
        ("claims_journal_recover_after_ms", "600000"),
        ("claims_journal_recover_after_ms", 86_400_000),
        ("claims_journal_scan_interval_ms", 5),
        ("claims_journal_max_republish", 0),
        ("claims_journal_max_republish", True),
    ],
)
def test_bad_journal_settings_are_refused_naming_the_setting(key: str, value: Any) -> None:
    # Given an app with one bad journal setting (a recover delay not below the retention of
    # completion records is one: recovery could no longer tell done from lost)
    app = Celery("journal-settings", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf[key] = value

    # When the settings are read, Then the error is typed and names the setting
    with pytest.raises(InvalidArgument) as info:
        load_settings(app)
    assert info.value.name == key


def test_a_kept_write_leaves_the_producers_entry_and_count_and_brings_its_recover_time_forward(
    journal: RedisJournal, redis_client: redis.Redis
) -> None:
    # Given a producer's entry due in an hour, re-published twice by recovery
    queue, task = "q", "t1:0:0"
    due = journal.put(queue, task, "producer's", recover_after_ms=3_600_000)
    key = journal.keys(queue).journal_republished
    redis_client.hset(key, task, 2)

    # When a worker acking at claim journals the message it was delivered, kept
    soon = journal.put(queue, task, "worker's", recover_after_ms=5_000, keep=True)

    # Then the producer's message and the count stay, and recovery may act 5 s from now
    assert journal.entries(queue)[task][0] == "producer's"
    assert int(redis_client.hget(key, task) or 0) == 2
    assert soon < due
    # ... a later kept write never pushes it back
    assert journal.put(queue, task, "again", recover_after_ms=60_000, keep=True) == soon

    # And where the producer wrote nothing, the kept write journals the message
    journal.put(queue, "t2:0:0", "worker's", recover_after_ms=5_000, keep=True)
    assert journal.entries(queue)["t2:0:0"][0] == "worker's"


def test_journal_held_tells_a_live_lease_of_another_owner_with_or_without_the_entry(
    journal: RedisJournal, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a claim store whose task t1 another owner holds, and whose message is journaled
    claims = RedisClaimManager(client=redis_client, prefix=key_prefix)
    queue, task = "q", "t1:0:0"
    token = claims.claim(queue, task, "holder", 60_000).token
    assert token is not None
    journal.put(queue, task, "message", recover_after_ms=60_000)

    def held(task_id: str, owner: str = "asker") -> tuple[Held, AlreadyClaimed | None]:
        return claims.execute(journal.held_call(queue, task_id, owner))

    # When a copy asks, Then: held by a live lease with its entry, in one answer
    assert held(task) == (Held.JOURNALED, AlreadyClaimed("holder", token.expires_at))
    # ... the holder asking finds its own claim holds nothing against it
    assert held(task, "holder") == (Held.NOT_HELD, None)
    # ... without the entry it says so (the copy is held: fail closed)
    journal.forget(queue, [task])
    assert held(task)[0] is Held.NOT_JOURNALED
    # ... and a task nobody holds, or whose lease has run out, is not held
    assert held("t2:0:0") == (Held.NOT_HELD, None)
    claims.claim(queue, "t3:0:0", "holder", 1)
    journal.put(queue, "t3:0:0", "message", recover_after_ms=60_000)
    wait_for(lambda: held("t3:0:0") == (Held.NOT_HELD, None), timeout=5, what="expiry")


def test_journal_held_refuses_bad_ids_before_anything_is_sent(journal: RedisJournal) -> None:
    with pytest.raises(InvalidArgument, match="owner"):
        journal.held_call("q", "t1:0:0", "")
    with pytest.raises(InvalidArgument, match="task_id"):
        journal.held_call("q", "", "asker")


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"list_key": ""}, "list_key"),
        ({"payload": ""}, "message"),
        ({"payload": b"{}"}, "message"),
        ({"task_id": ""}, "task_id"),
        ({"recover_after_ms": -1}, "recover_after_ms"),
        ({"eta_ms": "soon"}, "eta_ms"),
    ],
)
def test_a_publish_with_its_journal_entry_refuses_bad_input_before_anything_is_sent(
    journal: RedisJournal, redis_client: redis.Redis, key_prefix: str, change: dict[str, Any],
    name: str,
) -> None:  # fmt: skip
    args: dict[str, Any] = {
        "task_id": "t1:0:0", "list_key": f"{key_prefix}list", "payload": '{"body": ""}',
        "recover_after_ms": 1_000, "eta_ms": None, **change,
    }  # fmt: skip
    with pytest.raises(InvalidArgument, match=name):
        journal.publish_call("q", args.pop("task_id"), args.pop("list_key"), **args)
    assert redis_client.exists(f"{key_prefix}list", *journal.keys("q").journal_keys) == 0


def test_a_publish_with_its_journal_entry_pushes_and_journals_the_same_payload(
    journal: RedisJournal, redis_client: redis.Redis, key_prefix: str
) -> None:
    # When a payload is published with its entry (a Redis broker's push and the journal)
    list_key = f"{key_prefix}list"
    call = journal.publish_call("q", "t1:0:0", list_key, '{"body": "x"}', recover_after_ms=1_000)
    at = call.decode(call.script(keys=call.keys, args=call.args))

    # Then the list holds it, the entry is it, due that recover time later
    assert redis_client.lrange(list_key, 0, -1) == [b'{"body": "x"}']
    assert journal.entries("q") == {"t1:0:0": ('{"body": "x"}', at)}
    redis_client.delete(list_key)


def test_a_journal_entry_is_due_at_the_exact_ms_its_eta_and_delay_name(
    journal: RedisJournal, redis_client: redis.Redis
) -> None:
    # Given an ETA a year ahead, in whole ms
    eta = int(time.time() * 1000) + 365 * 86_400_000 + 123

    # When a message is journaled with it, and again keeping its entry with a sooner delay
    at = journal.put("q", "t1", '{"m": 1}', recover_after_ms=2**31 - 1, eta_ms=eta)
    due = redis_client.zscore(journal.keys("q").journal_due, "t1")
    soon = journal.put("q", "t1", '{"m": 1}', recover_after_ms=5_000, keep=True)
    kept = redis_client.zscore(journal.keys("q").journal_due, "t1")

    # Then its recover time, returned and stored, is that very ms; the kept one is now's
    assert at == due == eta + 2**31 - 1
    assert soon == kept
    assert abs(soon - (time.time() * 1000 + 5_000)) < 60_000
