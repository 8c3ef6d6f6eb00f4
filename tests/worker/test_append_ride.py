"""The claim in kombu's append transaction, on a connection kept for it (``BrokerRide``).

Where the claim store is the Redis broker's own server, the worker replaces its task
channel's ``QoS.append`` (the ``MULTI``/``EXEC`` that records a delivery in ``unacked``) by
the same transaction with the claim in it. It goes on a redis-py ``Connection`` made from the
channel's own pool and kept for it (``sender.ScriptCaller.transaction``), not through
kombu's pipeline, which builds a client per call. What kombu's pipeline did for it, the kept
connection must do too, or hand the transaction back to kombu's pipeline: each case is
checked here on a real kombu channel against a private ``redis-server``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_claims import RedisClaimManager
from celery_claims.claims.calls import ScriptCall
from celery_claims.model import GateResult, Success
from celery_claims.worker.transport.broker import BrokerRide
from tests.servers import RedisServer, command_calls, redis_server
from tests.worker.kombu_channel import QUEUE, Channel

OWNER = "w@host/1/n.1"


class Ride(Channel):
    """A kombu channel on ``server`` whose appends carry claims of ``manager``."""

    def __init__(self, server: RedisServer, socket_timeout: float = 5.0) -> None:
        super().__init__(server, socket_timeout=socket_timeout)
        self.manager = RedisClaimManager(client=self.store, prefix="ride")
        ride = BrokerRide.of(self.channel, self.store)
        assert ride is not None, "the channel is on the store's server"
        self.calls: dict[str, ScriptCall[GateResult]] = {}
        self.results: dict[str, GateResult | BaseException] = {}
        #: run in claim_for, after the call is built and before it is sent
        self.before_send: Any = None
        assert ride.hook_append(self._claim_for, self._claimed)

    def _claim_for(self, message: Any) -> ScriptCall[GateResult]:
        task_id = message.payload["id"]
        call = self.manager.claim_call(QUEUE, task_id, OWNER, 60_000)
        self.calls[task_id] = call
        if self.before_send is not None:
            self.before_send()
        return call

    def _claimed(self, message: Any, reply: Any) -> None:
        task_id = message.payload["id"]
        if isinstance(reply, BaseException):
            self.results[task_id] = reply
        else:
            self.results[task_id] = self.calls[task_id].decode(reply)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as started:
        yield started


@pytest.fixture
def ride(server: RedisServer) -> Iterator[Ride]:
    kept = Ride(server)
    try:
        yield kept
    finally:
        kept.close()


def test_deliveries_are_claimed_in_kombus_transaction_on_one_kept_connection(
    ride: Ride,
) -> None:
    # Given three messages in the queue
    ride.publish("t1", "t2", "t3")
    # When they are delivered
    ride.deliver()
    made = int(ride.store.info("stats")["total_connections_received"])
    before = command_calls(ride.store)
    ride.deliver()
    ride.deliver()
    # Then each is claimed and recorded as kombu records it
    assert all(isinstance(ride.results[t], Success) for t in ("t1", "t2", "t3"))
    assert ride.unacked() == (3, 3)
    # in one transaction each, on the connection the first one made, the script loaded once
    calls = command_calls(ride.store)
    assert [calls[c] - before[c] for c in ("multi", "exec", "evalsha", "script")] == [2, 2, 2, 0]
    assert int(ride.store.info("stats")["total_connections_received"]) == made
    # and kombu closing the channel closes the kept connection too
    before = ride.connections()
    ride.channel.close()
    deadline = time.monotonic() + 5
    while ride.connections() > before - 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # kombu's own connection and the kept one
    assert ride.connections() <= before - 2


def test_a_delivery_after_the_broker_restarted_rides_on_a_new_connection(
    ride: Ride, server: RedisServer
) -> None:
    ride.publish("t1")
    ride.deliver()
    # When the server restarts between two deliveries (the kept connection is closed by then)
    server.restart()
    ride.publish("t2")
    ride.deliver()
    # Then the delivery is recorded and claimed, the script loaded again on the new server
    assert isinstance(ride.results["t2"], Success)
    assert ride.unacked() == (1, 1)
    assert command_calls(ride.store)["script"] == 1


def test_a_transaction_whose_reply_timed_out_is_sent_again_through_kombus_pipeline(
    server: RedisServer,
) -> None:
    # Given a channel with a 1 s socket timeout, and a server that stalls for 1.6 s once the
    # message has been taken from the queue and before its append is sent
    ride = Ride(server, socket_timeout=1.0)
    try:
        ride.publish("t0", "t1")
        ride.deliver()  # the script is known to the server
        stall = threading.Thread(
            target=lambda: server.client().execute_command("DEBUG", "SLEEP", 1.6)
        )

        def stall_the_server() -> None:
            stall.start()
            time.sleep(0.1)

        ride.before_send = stall_the_server
        # When the next message is delivered (the kept connection times out and is closed;
        # kombu's pipeline, sent then, is answered once the server wakes)
        ride.deliver()
        stall.join()
        # Then the delivery is recorded once and the claim is its owner's (whether the
        # first transaction ran too or not: the server may have read it before the close)
        assert isinstance(ride.results["t1"], Success)
        assert ride.unacked() == (2, 2)
        held = ride.manager.is_claimed(QUEUE, "t1")
        assert held is not None
        assert held[0] == OWNER
    finally:
        ride.close()


def test_a_write_the_server_refuses_fails_the_delivery_as_kombus_append_would(
    ride: Ride,
) -> None:
    # Given kombu's unacked hash clobbered with a string (every HSET on it is refused)
    ride.publish("t1")
    ride.store.set("unacked", "not a hash")
    # When the message is delivered, kombu's error is raised, as its own append raises it
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        ride.deliver()
    # and the kept connection answers the next delivery with its own replies
    ride.store.delete("unacked")
    ride.publish("t2")
    ride.deliver()
    assert isinstance(ride.results["t2"], Success)
    assert ride.unacked() == (1, 2)  # t1's index entry went in with the refused HSET
