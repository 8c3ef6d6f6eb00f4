"""The claim scripts' sources: each carries every preamble definition it names (and, for the
bodies checked below, no other), and base 36 is written as Python reads it."""

from __future__ import annotations

import re

import pytest
import redis

from celery_claims.claims.calls import SCRIPTS
from celery_claims.claims.scripts import (
    _preamble,
    _split,
    preamble_names,
    script_source,
    with_preamble,
)

DEFINED = re.compile(r"^local (?:function )?([A-Za-z_]\w*)", re.MULTILINE)


def base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if n == 0:
            return out


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_carries_every_preamble_definition_it_names_and_loads(
    name: str, redis_client: redis.Redis
) -> None:
    # Given the preamble's definitions and a script's registered source
    _, definitions = _preamble()
    source = script_source(name)
    carried = set(DEFINED.findall(source))
    words = set(re.findall(r"[A-Za-z_]\w*", source))

    # Then every preamble name the source mentions is defined in it, and it compiles on Redis
    missing = {d.name for d in definitions if d.name in words} - carried
    assert missing == set()
    assert redis_client.script_load(source)


def test_a_script_that_names_no_helper_carries_none_and_one_that_names_b36_carries_it_alone() -> (
    None
):
    assert preamble_names("return 1") == []
    assert preamble_names("return b36(5)") == ["b36"]
    # owner_ref uses split_owner and b36: they come too, in the preamble's order
    assert preamble_names("return owner_ref(KEYS[1], ARGV[1])") == [
        "b36",
        "split_owner",
        "owner_ref",
    ]


def test_the_preamble_refuses_top_level_code_that_is_no_definition() -> None:
    # code that is no definition would be dropped from every script: refused instead
    with pytest.raises(ValueError, match="not a definition"):
        _split("-- a comment\nlocal function f()\n  return 1\nend\nredis.call('DEL', 'x')\n")


def test_the_preamble_refuses_a_function_whose_end_is_not_in_the_first_column() -> None:
    # its end indented, or missing: the definition would run to the end of the file
    with pytest.raises(ValueError, match=r"line 2: local function f has no 'end'"):
        _split("-- a comment\nlocal function f()\n  return 1\n  end\n")


@pytest.mark.parametrize(
    "n", [0, 1, 35, 36, 37, 1295, 1296, 46655, 46656, 60_000, 1_733_370_000_123, 2**53 - 1]
)
def test_base_36_numbers_are_written_as_python_reads_them(
    n: int, redis_client: redis.Redis
) -> None:
    script = with_preamble("return {b36(tonumber(ARGV[1])), b36(-tonumber(ARGV[1]))}")
    written = redis_client.eval(script, 0, n)
    assert [w.decode() for w in written] == [base36(n), "-" * (n > 0) + base36(n)]
    assert int(written[0], 36) == n


@pytest.mark.parametrize("digits", range(1, 12))
def test_base_36_numbers_of_every_length_are_written_as_python_reads_them(
    digits: int, redis_client: redis.Redis
) -> None:
    # b36 writes up to 8 digits in one step and recurses above: each length, each edge
    numbers = [36 ** (digits - 1), 36**digits - 1, 36 ** (digits - 1) * 17 + 5]
    if digits > 1:
        numbers.append(36 ** (digits - 1) - 1)
    numbers = [n for n in numbers if n < 2**53]
    script = with_preamble(
        "local out = {} for i, n in ipairs(ARGV) do out[i] = b36(tonumber(n)) end return out"
    )
    written = redis_client.eval(script, 0, *numbers)
    assert [w.decode() for w in written] == [base36(n) for n in numbers]


def test_a_fractional_number_is_written_in_base_36_rounded_down(redis_client: redis.Redis) -> None:
    written = redis_client.eval(with_preamble("return b36(tonumber(ARGV[1]))"), 0, "46655.75")
    assert written.decode() == base36(46655)
