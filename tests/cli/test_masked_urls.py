"""A claim store's password never reaches what the command prints (what a worker logs:
tests/worker/test_masked_store_url.py).

URLs are masked by kombu's own sanitiser (``kombu.utils.url.maybe_sanitize_url``, each part of
a Sentinel list on its own); it also leaves out the query string, where redis-py takes a
``password=`` too.
"""

from __future__ import annotations

import pytest

from celery_claims.connection import describe
from tests.cli.conftest import run_cli
from tests.servers import free_port

SECRET = "s3cret-Pa55"


def _urls(port: int) -> list[str]:
    return [
        f"redis://:{SECRET}@127.0.0.1:{port}/0",
        f"redis://user:{SECRET}@127.0.0.1:{port}/0",
        f"redis://127.0.0.1:{port}/0?password={SECRET}",
        f"redis://user@127.0.0.1:{port}/0?password={SECRET}&db=0",
    ]


@pytest.mark.parametrize("form", range(4))
def test_an_unreachable_store_is_named_without_its_password(form: int) -> None:
    # Given a claim store URL with a password, on a port nothing listens on
    port = free_port()
    url = _urls(port)[form]

    # When a command cannot reach it
    result = run_cli("--redis-url", url, "list")

    # Then the one error line names the store, its password masked or left out
    assert result.returncode == 2
    assert f"127.0.0.1:{port}/0" in result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_every_part_of_a_sentinel_list_is_masked_on_its_own() -> None:
    # Given a Sentinel list whose every part has a password
    url = f"sentinel://:{SECRET}@h1:26379;sentinel://u:{SECRET}@h2:26380/0"

    # When it is described for a message, Then each host is kept and no password is
    assert describe(url) == "sentinel://:**@h1:26379/;sentinel://u:**@h2:26380/0"


@pytest.mark.parametrize(
    "url",
    [f"redis://:{SECRET}@h:notaport/0", f"user:{SECRET}@h:6379", f"redis://:{SECRET}@h/0#x"],
)
def test_a_url_kombu_cannot_parse_is_never_shown_as_given(url: str) -> None:
    assert SECRET not in describe(url)
