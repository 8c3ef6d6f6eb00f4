"""The Redis limiter's script: it loads with the preamble it needs, reloads after a flush, keeps
its keys in the scope's slot (the claim queue's, so the claim script can count a start in the
same call), reads the server's clock, and its one decoding function refuses unknown codes."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import pytest
import redis

from celery_claims.claims.calls import RatedClaim
from celery_claims.claims.keys import QueueKeys
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.claims.scripts import _preamble, script_source, with_preamble
from celery_claims.errors import BackendError, InvalidArgument
from celery_claims.model import AlreadyClaimed, AlreadyDone, Success
from celery_claims.rates import Limit, Rate, RateAllowed, RateLimited, RedisRateLimiter
from celery_claims.rates.redis import rate_result
from celery_claims.testing import ManualClock
from tests.servers import RedisClusterNodes

EVERY_SECOND = [Limit("task:send", Rate(1, 1_000))]


def test_the_rate_script_carries_every_preamble_definition_it_names_and_loads(
    redis_client: redis.Redis,
) -> None:
    _, definitions = _preamble()
    source = script_source("rate")
    carried = set(re.findall(r"^local (?:function )?([A-Za-z_]\w*)", source, re.MULTILINE))
    words = set(re.findall(r"[A-Za-z_]\w*", source))
    assert {d.name for d in definitions if d.name in words} - carried == set()
    assert {"now_ms", "rate_check", "rate_commit", "rate_read", "fmt"} <= carried
    # and the claim script carries none of the rate functions: it costs it nothing
    assert "rate_commit" not in script_source("claim")
    assert redis_client.script_load(source)


def test_the_script_is_loaded_again_after_a_script_flush(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    limiter = RedisRateLimiter(client=redis_client, prefix=key_prefix)
    assert limiter.acquire("q", EVERY_SECOND).allowed
    redis_client.script_flush()
    assert isinstance(limiter.acquire("q", EVERY_SECOND), RateLimited)


def test_without_a_clock_the_servers_time_decides(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    limiter = RedisRateLimiter(client=redis_client, prefix=key_prefix)
    seconds, micros = redis_client.time()
    result = limiter.acquire("q", EVERY_SECOND)
    assert isinstance(result, RateAllowed)
    assert 0 <= result.at_ms - (seconds * 1000 + micros // 1000) < 1_000
    # and the key lives until its next turn has passed: about one interval, no longer
    (key,) = limiter.keys("q", EVERY_SECOND)
    assert 900 < redis_client.pttl(key) <= 1_001
    assert redis_client.get(key) == str(result.next_at_ms[0]).encode()


def test_a_fractional_turn_is_stored_with_its_remainder_and_count(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    limiter = RedisRateLimiter(client=redis_client, prefix=key_prefix, clock=lambda: 1_000)
    third = [Limit("x", Rate(3, 1_000))]
    assert limiter.acquire("q", third) == RateAllowed(1_000, (1_333,))
    assert redis_client.get(limiter.keys("q", third)[0]) == b"1333:1:3"


@pytest.mark.cluster
def test_rate_keys_share_the_claim_queues_slot(
    redis_cluster: RedisClusterNodes, key_prefix: str
) -> None:
    client = redis_cluster.client()
    limiter = RedisRateLimiter(client=client, prefix=key_prefix)
    limits = [Limit("task:x", Rate(1, 1_000)), Limit("key:{other}:7", Rate(1, 1_000))]
    queue = QueueKeys(key_prefix, "emails")
    slots = {client.keyslot(key) for key in [*limiter.keys("emails", limits), *queue.claim_keys]}
    assert len(slots) == 1
    assert all(key.startswith(queue.tag + ":r:") for key in limiter.keys("emails", limits))


def test_an_unknown_status_code_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="unknown rate status code 4"):
        rate_result([4, 0, 0, 1], ["x"])


#: How a later change folds the rate check into the queue's claim script: the rates' keys
#: after claim.lua's five, their counts and periods after its seven arguments; checked first
#: (a start the rates refuse claims nothing, and is asked again at its turn), counted only
#: when the claim is acquired (a copy refused by the claim costs the rates nothing).
FOLD = """
local function claim(KEYS, ARGV)
%s
end
local now = now_ms(ARGV[4])
local n = #KEYS - 5
local wait, index, states = rate_check(KEYS, 5, n, now)
if wait > 0 then
  return {9, now, wait, index}
end
local args = {unpack(ARGV, 1, 7)}
args[4] = tostring(now)
local reply = claim(KEYS, args)
if reply[1] == 1 or reply[1] == 3 then
  rate_commit(KEYS, 5, ARGV, 7, states, n, now, 0)
end
return reply
"""


@pytest.mark.cluster
def test_the_rate_functions_fold_into_the_claim_script_on_one_slot(
    redis_cluster: RedisClusterNodes, key_prefix: str
) -> None:
    # Given the claim script with a rate of one start a minute folded in, on Redis Cluster
    client = redis_cluster.client()
    claim_body = (resources.files("celery_claims.claims") / "lua" / "claim.lua").read_text()
    folded = client.register_script(with_preamble(FOLD % claim_body))
    limiter = RedisRateLimiter(client=client, prefix=key_prefix)
    limits = [Limit("task:send", Rate(1, 60_000))]
    keys = [*QueueKeys(key_prefix, "emails").claim_keys, *limiter.keys("emails", limits)]

    def claim(task: str, owner: str, now: int) -> list[int]:
        args = [task, owner, 600_000, now, "1", "", 0, 1, 60_000]
        return [int(x) if isinstance(x, int) else -1 for x in folded(keys=keys, args=args)]

    # When a task is claimed, a copy of it comes at its rate's next turn (refused by the
    # claim), then another task at the same turn, and a third just after
    first = claim("t1", "w1", 1_000)
    copy = claim("t1", "w2", 61_000)
    second = claim("t2", "w1", 61_000)
    third = claim("t3", "w1", 61_001)

    # Then the refused copy did not count against the rate, and the third waits its turn:
    # claims and rates in one script call, on one slot
    assert [first[0], copy[0], second[0]] == [1, 2, 1]
    assert third == [9, 61_001, 59_999, 1]


def _script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


def test_a_rated_claim_counts_its_start_in_its_own_call_and_only_when_granted(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a claim store on a manual clock and a rate of one start a minute
    clock = ManualClock(1_000)
    manager = RedisClaimManager(client=redis_client, prefix=key_prefix, clock=clock)
    limiter = RedisRateLimiter(client=redis_client, prefix=key_prefix, clock=clock)
    limits = [Limit("task:send", Rate(1, 60_000))]
    part = limiter.claim_part("rates", limits)

    def claim(task: str, owner: str) -> Any:
        return manager.execute(manager.claim_call("emails", task, owner, 600_000, rate=part))

    # the queue's registration (once per process) and the script's loading are calls of
    # their own, once
    redis_client.script_load(manager.scripts["claim_rated"].script)
    manager.claim_call("emails", "t0", "w0", 1)
    redis_client.config_resetstat()

    # When a task is claimed, a copy of it comes (held by the claim), and another task
    first = claim("t1", "w1")
    copy = claim("t1", "w2")
    clock.advance(1)
    second = claim("t2", "w1")

    # Then one script call each: the first claim counted its start, the held copy counted
    # none, and the second is claimed and told how long to wait for its start
    assert _script_calls(redis_client) == 3
    assert isinstance(first, RatedClaim)
    assert isinstance(first.claim, Success)
    assert first.rate == RateAllowed(1_000, (61_000,))
    assert isinstance(copy, AlreadyClaimed)
    assert isinstance(second, RatedClaim)
    assert second.rate == RateLimited(1_001, 59_999, "task:send")
    assert manager.is_claimed("emails", "t2") == ("w1", 601_001)
    # and the rate's state is the one rate.lua keeps: asked alone, it says the same
    assert limiter.acquire("rates", limits) == RateLimited(1_001, 59_999, "task:send")


def test_a_done_or_given_up_task_counts_no_start(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    clock = ManualClock(1_000)
    manager = RedisClaimManager(client=redis_client, prefix=key_prefix, clock=clock)
    limiter = RedisRateLimiter(client=redis_client, prefix=key_prefix, clock=clock)
    limits = [Limit("task:send", Rate(1, 60_000))]
    token = manager.claim("emails", "t1", "w1", 600_000).token
    assert token is not None
    manager.complete(token, 600_000)
    call = manager.claim_call("emails", "t1", "w2", 600_000, rate=limiter.claim_part("r", limits))
    assert isinstance(manager.execute(call), AlreadyDone)
    assert limiter.acquire("r", limits).allowed


@pytest.mark.cluster
def test_on_a_cluster_a_claim_does_not_take_rates_from_another_slot(
    redis_cluster: RedisClusterNodes, key_prefix: str
) -> None:
    client = redis_cluster.client()
    manager = RedisClaimManager(client=client, prefix=key_prefix)
    limiter = RedisRateLimiter(client=client, prefix=key_prefix)
    part = limiter.claim_part("rates", EVERY_SECOND)
    assert not manager.folds_rates
    with pytest.raises(InvalidArgument, match="call of their own"):
        manager.claim_call("emails", "t1", "w1", 1_000, rate=part)
