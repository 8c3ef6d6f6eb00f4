"""A store that stalls for a moment loses no write sent without waiting (``ScriptSender``).

The producer journals, the pool's guard records ahead of the ack and the worker clears the
journal with calls whose replies are read later. A backlog of unread replies is not a store
that went silent: the sender waits for them (for as long as the store's socket timeout), and
drops the connection only when the store does not answer in that time.
"""

from __future__ import annotations

import threading

import redis

from celery_claims import RedisClaimManager
from celery_claims.worker.transport.sender import ScriptSender
from tests.servers import RedisServer
from tests.worker.helpers import unique


def test_writes_sent_while_the_store_stalls_are_all_answered_and_written(
    private_redis: RedisServer,
) -> None:
    # Given a sender of completion records and 300 claims to record done
    manager = RedisClaimManager(url=private_redis.url, prefix=unique("p"))
    errors: list[BaseException] = []
    sender = ScriptSender(lambda reply, error: errors.append(error) if error else None)
    tokens = [manager.claim("q", f"t{i}", "a@host/1/n.1", 60_000).token for i in range(300)]
    stall = redis.Redis.from_url(private_redis.url)
    try:
        # When the store stalls for half a second while every record is sent without
        # waiting (far more replies than the sender keeps unread)
        sleeping = threading.Thread(target=stall.execute_command, args=("DEBUG", "SLEEP", "0.5"))
        sleeping.start()
        for token in tokens:
            assert token is not None
            sender.send(manager.client, manager.complete_call(token, 60_000))
        sleeping.join()

        # Then every call is answered without an error, and every task is recorded done
        assert sender.drain(timeout_s=10) == 0
        assert errors == []
        assert manager.active_claims("q") == 0
    finally:
        sender.close()
        stall.close()
        manager.close()
