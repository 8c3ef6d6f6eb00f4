"""The private servers the suite runs on are the servers they say they are."""

from __future__ import annotations

from tests.servers import RedisServer, on_every_server


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
