"""The private servers the suite runs on are the servers they say they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import RedisServer, free_port, on_every_server, port_range, redis_server


@on_every_server
def test_each_private_server_is_of_the_kind_its_test_id_names(
    store_server: RedisServer,
) -> None:
    # Given the session's private server of one kind
    client = store_server.client(decode_responses=True)

    # When it is asked what it is
    info = client.info("server")

    # Then a Valkey says so (Valkey reports redis_version 7.2.4 for compatibility, and
    # valkey_version beside it), and the Redis is Redis 7
    if store_server.kind == "valkey":
        assert info["server_name"] == "valkey"
        assert int(str(info["valkey_version"]).split(".")[0]) >= 8
    else:
        assert "valkey_version" not in info
        assert int(str(info["redis_version"]).split(".")[0]) >= 7


def test_a_server_started_on_a_port_another_server_answers_on_fails_to_start() -> None:
    # Given a private server running
    with redis_server() as first:
        # When a second one is started on its port (as a restart finds it, should another
        # process's server have taken the port while the first was down)
        second = RedisServer(port=first.port)
        try:
            # Then it fails to start, saying so, rather than hand its test the other server
            with pytest.raises(RuntimeError, match=r"another server \(pid \d+\) answers there"):
                second.start()
            assert second.proc is None
        finally:
            second.cleanup()
        # and the first one is untouched
        assert first.client().ping()


def test_private_ports_are_below_the_ephemeral_range_and_each_test_process_has_its_own() -> None:
    # Given the ports of two test processes of a two-process run, and the kernel's ephemeral
    # range (where outgoing connections take their local ports)
    first, second = port_range("gw0", "2"), port_range("gw1", "2")
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])

    # Then they share no port, and no port or its cluster bus port is in the ephemeral range
    assert not set(first) & set(second)
    assert max(second) + 10000 < ephemeral_low
    # and this process hands out each of its ports in turn, not the same one twice running
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3
    assert all(port in port_range() for port in ports)
