"""A kombu Redis channel on a private server, delivering as a consumer's channel does: the
QoS's ``append`` records each delivery in ``unacked`` and its ``ack`` removes it (the tests of
the broker ride and of kombu's writes on a kept connection)."""

from __future__ import annotations

from typing import Any

import kombu

from tests.servers import RedisServer

QUEUE = "work"


class Channel:
    """A kombu channel on ``server`` (``options``: the transport's), and a client of it."""

    def __init__(self, server: RedisServer, **options: Any) -> None:
        self.server = server
        url = f"redis://127.0.0.1:{server.port}/0"
        self.connection = kombu.Connection(url, transport_options=options)
        self.channel = self.connection.channel()
        self.store = server.client(socket_timeout=5)

    def publish(self, *task_ids: str) -> None:
        with kombu.Producer(self.channel) as producer:
            for task_id in task_ids:
                producer.publish({"id": task_id}, routing_key=QUEUE, declare=[kombu.Queue(QUEUE)])

    def deliver(self) -> Any:
        """One message, delivered as a consumer's is (the QoS's ``append`` records it)."""
        message = self.channel.basic_get(QUEUE, no_ack=False)
        assert message is not None
        return message

    def unacked(self) -> tuple[int, int]:
        return self.store.hlen("unacked"), self.store.zcard("unacked_index")

    def connections(self) -> int:
        return len(self.store.client_list())

    def close(self) -> None:
        self.channel.close()
        self.connection.release()
