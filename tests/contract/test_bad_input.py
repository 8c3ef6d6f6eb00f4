"""Bad input raises a typed error with a clear message and leaves the store byte-for-byte as is."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from celery_claims import (
    ClaimError,
    ClaimManager,
    ClaimNotFound,
    ClaimToken,
    InvalidArgument,
    NotClaimOwner,
    StaleClaimToken,
    Success,
)
from celery_claims.testing import ManualClock
from tests.contract.conftest import Backend

Q = "emails"
MEGABYTE_ID = "x" * (1024 * 1024)

BAD_IDS: list[Any] = [
    "",
    None,
    42,
    b"bytes-id",
    ["list"],
    MEGABYTE_ID,
    "nul\x00inside",
    "lone-surrogate-\ud800",
]
BAD_MS: list[Any] = [-1, 1.5, 10.0, True, False, "100", None, 2**64, 10**15]


@pytest.fixture
def seeded(backend: Backend) -> Backend:
    """Given a store holding a live claim, a completed task and an expired claim."""
    manager = backend.manager
    manager.claim(Q, "live", "worker-1", 60_000)
    done = manager.claim(Q, "done", "worker-1", 60_000).token
    assert done is not None
    manager.complete(done, 60_000)
    manager.claim(Q, "expired", "worker-1", 1)
    backend.clock.advance(1)
    return backend


def refused(backend: Backend, call: Any, error: type[ClaimError], match: str) -> ClaimError:
    """Run ``call``; require ``error`` with ``match`` in its message and unchanged state."""
    before = backend.snapshot()
    with pytest.raises(error, match=match) as raised:
        call()
    assert backend.snapshot() == before
    return raised.value


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
@pytest.mark.parametrize("position", ["queue_id", "task_id", "owner"])
def test_claim_rejects_a_bad_id_in_any_position(seeded: Backend, bad: Any, position: str) -> None:
    args = {"queue_id": Q, "task_id": "t1", "owner": "worker-1"} | {position: bad}

    for call in (seeded.manager.claim, seeded.manager.claim_unless_done):
        error = refused(seeded, lambda c=call: c(**args, lease_ms=1_000), InvalidArgument, position)
        assert isinstance(error, ValueError)
        assert error.name == position


@pytest.mark.parametrize("bad", BAD_MS, ids=repr)
def test_claim_rejects_a_bad_lease(seeded: Backend, bad: Any) -> None:
    refused(seeded, lambda: seeded.manager.claim(Q, "t1", "w", bad), InvalidArgument, "lease_ms")


@pytest.mark.parametrize("bad", [-1, 1.5, True, False, "2", [1], 2**31, 2**64], ids=repr)
def test_claim_unless_done_rejects_a_bad_takeover_limit(seeded: Backend, bad: Any) -> None:
    # Given a store with an expired claim another owner could take over
    # When the takeover limit is not None or a non-negative int, Then nothing changes
    error = refused(
        seeded,
        lambda: seeded.manager.claim_unless_done(Q, "expired", "w2", 1_000, max_takeovers=bad),
        InvalidArgument,
        "max_takeovers",
    )
    assert error.name == "max_takeovers"


@pytest.mark.parametrize("bad", BAD_MS, ids=repr)
def test_claim_unless_done_rejects_a_bad_given_up_retention(seeded: Backend, bad: Any) -> None:
    refused(
        seeded,
        lambda: seeded.manager.claim_unless_done(
            Q, "expired", "w2", 1_000, max_takeovers=0, given_up_ttl_ms=bad
        ),
        InvalidArgument,
        "given_up_ttl_ms",
    )


@pytest.mark.parametrize("bad", BAD_MS, ids=repr)
def test_extend_renew_and_complete_reject_bad_durations(seeded: Backend, bad: Any) -> None:
    token = seeded.manager.get_token(Q, "live", "worker-1")
    assert token is not None
    m = seeded.manager

    refused(seeded, lambda: m.extend(Q, token, bad), InvalidArgument, "additional_ms")
    refused(seeded, lambda: m.renew(Q, [token], bad), InvalidArgument, "lease_ms")
    refused(seeded, lambda: m.complete(token, bad), InvalidArgument, "done_ttl_ms")


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "token",
        ("emails", "live", "worker-1", 1, 0, 0),
        ClaimToken(Q, "live", "worker-1", "1", 0, 0),  # type: ignore[arg-type]
        ClaimToken(Q, "live", "worker-1", True, 0, 0),
        ClaimToken(Q, "live", "worker-1", -1, 0, 0),
        ClaimToken(Q, "live", "worker-1", 2**70, 0, 0),
        ClaimToken("", "live", "worker-1", 1, 0, 0),
        ClaimToken(Q, MEGABYTE_ID, "worker-1", 1, 0, 0),
        ClaimToken(Q, "live", "", 1, 0, 0),
        ClaimToken(Q, "live", "worker\x00-1", 1, 0, 0),
        ClaimToken(Q, "live\ud800", "worker-1", 1, 0, 0),
        ClaimToken(Q, "live", b"worker-1", 1, 0, 0),  # type: ignore[arg-type]
        ClaimToken(Q, "live", "worker-1", 1, -1, 0),
        ClaimToken(Q, "live", "worker-1", 1, 0, 2**53 + 1),
        ClaimToken(Q, "live", "worker-1", 1, 0, False),
        ClaimToken(Q, "live", "worker-1", 1, 1.0, 0),  # type: ignore[arg-type]
    ],
    ids=repr,
)
def test_malformed_tokens_are_rejected_before_any_lookup(seeded: Backend, bad: Any) -> None:
    m = seeded.manager
    refused(seeded, lambda: m.release(bad), InvalidArgument, "token")
    refused(seeded, lambda: m.extend(Q, bad, 1_000), InvalidArgument, "token")
    refused(seeded, lambda: m.complete(bad, 1_000), InvalidArgument, "token")
    refused(seeded, lambda: m.mark_started(bad), InvalidArgument, "token")
    refused(seeded, lambda: m.renew(Q, [bad], 1_000), InvalidArgument, "token")


@pytest.mark.parametrize(
    "token",
    [
        # ids longer together than one id may be, each within the limit
        ClaimToken(Q, "t" * 1024, "w" * 1024, 1, 0, 0),
        ClaimToken("очередь", "задача", "wørker 🚀", 1, 0, 0),  # not ASCII
        # numbers at the limit, each (together their bits pass it)
        ClaimToken(Q, "live", "worker-1", 2**53, 2**53 - 1, 1),
    ],
    ids=["long-ids", "unicode-ids", "largest-numbers"],
)
def test_well_formed_tokens_at_the_limits_are_answered_by_the_store(
    seeded: Backend, token: ClaimToken
) -> None:
    # Given well-formed tokens the store never handed out
    # When they are used, Then the store refuses them: none is refused as malformed
    m = seeded.manager
    for use in (lambda: m.release(token), lambda: m.complete(token, 1_000)):
        error = refused(seeded, use, ClaimError, ".")
        assert not isinstance(error, InvalidArgument)


def test_renew_rejects_a_non_sequence_of_tokens(seeded: Backend) -> None:
    token = seeded.manager.get_token(Q, "live", "worker-1")
    refused(seeded, lambda: seeded.manager.renew(Q, token, 1_000), InvalidArgument, "tokens")  # type: ignore[arg-type]


def test_a_token_from_another_queue_is_not_found_there(seeded: Backend) -> None:
    token = seeded.manager.get_token(Q, "live", "worker-1")
    assert token is not None

    refused(seeded, lambda: seeded.manager.release(replace(token, queue_id="other")),
            ClaimNotFound, "Claim not found")  # fmt: skip
    refused(seeded, lambda: seeded.manager.extend("other", token, 10), ClaimNotFound, "not found")


def test_forged_instances_and_owners_are_refused(seeded: Backend) -> None:
    token = seeded.manager.get_token(Q, "live", "worker-1")
    assert token is not None
    m = seeded.manager

    refused(seeded, lambda: m.release(replace(token, instance=token.instance + 1)),
            StaleClaimToken, "Stale")  # fmt: skip
    refused(seeded, lambda: m.release(replace(token, instance=0)), StaleClaimToken, "Stale")
    refused(seeded, lambda: m.release(replace(token, owner="worker-2")), NotClaimOwner, "owner")
    refused(seeded, lambda: m.extend(Q, replace(token, owner="x"), 5), NotClaimOwner, "owner")
    refused(seeded, lambda: m.complete(replace(token, owner="x"), 5), NotClaimOwner, "owner")


def test_a_token_after_takeover_is_refused_everywhere(seeded: Backend) -> None:
    m = seeded.manager
    old = m.claim(Q, "contested", "worker-1", 5).token
    assert old is not None
    seeded.clock.advance(5)
    assert m.claim(Q, "contested", "worker-2", 60_000).acquired

    refused(seeded, lambda: m.release(old), StaleClaimToken, "Stale")
    refused(seeded, lambda: m.extend(Q, old, 1_000), StaleClaimToken, "Stale")
    refused(seeded, lambda: m.complete(old, 1_000), StaleClaimToken, "Stale")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"], ids=repr)
def test_cleanup_rejects_a_bad_limit(seeded: Backend, bad: Any) -> None:
    refused(seeded, lambda: seeded.manager.cleanup_expired(limit=bad), InvalidArgument, "limit")


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_reads_reject_bad_ids(seeded: Backend, bad: Any) -> None:
    m = seeded.manager
    refused(seeded, lambda: m.is_claimed(bad, "t"), InvalidArgument, "queue_id")
    refused(seeded, lambda: m.is_claimed(Q, bad), InvalidArgument, "task_id")
    refused(seeded, lambda: m.get_token(Q, "live", bad), InvalidArgument, "owner")
    refused(seeded, lambda: m.active_claims(bad), InvalidArgument, "queue_id")
    refused(seeded, lambda: m.list_claims(bad), InvalidArgument, "queue_id")
    refused(seeded, lambda: m.done_record(Q, bad), InvalidArgument, "task_id")


def test_unicode_and_long_but_legal_ids_round_trip(manager: ClaimManager) -> None:
    long_id = "ø" * 512  # 1024 UTF-8 bytes: the limit itself
    queue_id = "очередь:{тег}"

    result = manager.claim(queue_id, long_id, "wørker 🚀", 1_000)

    assert isinstance(result, Success)
    assert manager.list_claims(queue_id) == [result.token]
    assert manager.get_token(queue_id, long_id, "wørker 🚀") == result.token


def test_the_manual_clock_refuses_to_go_backwards(clock: ManualClock) -> None:
    with pytest.raises(InvalidArgument, match="non-negative"):
        clock.advance(-1)
