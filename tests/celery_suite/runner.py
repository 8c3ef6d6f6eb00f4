"""Fetch Celery's own integration suite and run its modules without and with claims.

The suite is ``t/integration`` of the sdist of the installed Celery, fetched with pip into a
directory of the caller's (never into this repository: no Celery code is copied here). Each
run gets a private ``redis-server`` for broker, result backend and claim store
(``TEST_BROKER``, ``TEST_BACKEND``, ``REDIS_HOST``/``REDIS_PORT``: what Celery's integration
conftest and tasks read) and runs one module in a pytest subprocess, in one of three modes:
``plain`` (Celery as shipped), ``settings`` (the guide's settings, ``plugin.py``) and
``claims`` (the guide's settings and ``install(app)``).

Command line (from the repository's root)::

    python -m tests.celery_suite.runner fetch DEST
    python -m tests.celery_suite.runner run --suite DEST --module test_canvas --mode claims
    python -m tests.celery_suite.runner compare plain.xml claims.xml
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import celery

from celery_claims.demo.runner import private_redis

#: Celery's integration modules the harness runs (the others need more services or queues).
MODULES = ("test_tasks", "test_inspect", "test_canvas")
#: ``plain``: Celery as shipped; ``settings``: the guide's settings; ``claims``: and install.
MODES = ("plain", "settings", "claims")
#: Environment variable naming the directory ``fetch`` extracted the suite into.
SUITE_ENV = "CLAIMS_CELERY_SUITE"
#: Per-test timeout (s) of a run; Celery's own ``flaky`` tests carry 300 s of their own.
TEST_TIMEOUT_S = 120
#: Root of this repository: the subprocess imports the plugin (and the package) from here.
REPO_ROOT = Path(__file__).resolve().parents[2]


def suite_path(root: Path, version: str | None = None) -> Path:
    """Where ``fetch`` puts the suite of ``version`` (the installed Celery's by default)."""
    return Path(root) / f"celery-{version or celery.__version__}"


def fetch(root: Path, version: str | None = None) -> Path:
    """Download Celery's sdist with pip and extract its ``t/`` and ``pyproject.toml``.

    Only the tests and pytest's configuration are extracted: the sdist's ``celery/`` package
    would shadow the installed one for a run started in that directory. Idempotent.

    Returns:
        the directory to run the suite in.
    """
    version = version or celery.__version__
    target = suite_path(root, version)
    if (target / "t" / "integration" / "conftest.py").is_file():
        return target
    Path(root).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="celery-sdist-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", f"celery=={version}", "--dest", tmp],
            check=True,
        )  # fmt: skip
        archive = next(Path(tmp).glob("celery-*.tar.gz"))
        prefix = f"celery-{version}/"
        with tarfile.open(archive) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix + "t/") or m.name == prefix + "pyproject.toml"
            ]
            tar.extractall(root, members=members, filter="data")
    return target


@dataclass
class RunResult:
    """One module's run: each test's outcome and duration, and the run's wall time."""

    module: str
    mode: str
    outcomes: dict[str, str] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    returncode: int = 0

    def counts(self) -> dict[str, int]:
        """Tests per outcome."""
        out: dict[str, int] = {}
        for outcome in self.outcomes.values():
            out[outcome] = out.get(outcome, 0) + 1
        return dict(sorted(out.items()))


def read_junit(path: Path) -> tuple[dict[str, str], dict[str, float]]:
    """Outcomes (``passed``, ``failed``, ``error``, ``skipped``, ``xfailed``; an xpass is
    ``passed``) and durations of a junit file, keyed ``module.py::Class::test``."""
    outcomes: dict[str, str] = {}
    durations: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        # classname is t.integration.test_canvas[.test_chord]
        module_at = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts))
        node = "::".join([parts[module_at] + ".py", *parts[module_at + 1 :], case.get("name", "")])
        kinds = {child.tag: child for child in case}
        if "error" in kinds:
            outcome = "failed" if node in outcomes else "error"  # an error at teardown
        elif "failure" in kinds:
            outcome = "failed"
        elif "skipped" in kinds:
            xfail = kinds["skipped"].get("type") == "pytest.xfail"
            outcome = "xfailed" if xfail else "skipped"
        else:
            outcome = "passed"
        # a test with a teardown error appears twice: the worse outcome wins
        if outcomes.get(node) not in (None, "passed"):
            outcome = outcomes[node]
        outcomes[node] = outcome
        durations[node] = durations.get(node, 0.0) + float(case.get("time", "0") or 0)
    return outcomes, durations


@contextlib.contextmanager
def _redis_url(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
    else:
        with private_redis() as private:
            yield private


def run_module(
    suite: Path,
    module: str,
    mode: str,
    *,
    junit: Path,
    redis_url: str | None = None,
    broker_url: str | None = None,
    pytest_args: Sequence[str] = (),
    log: Path | None = None,
) -> RunResult:
    """Run one of Celery's integration modules in a pytest subprocess.

    Args:
        suite: the directory ``fetch`` returned.
        module: a name of :data:`MODULES` (or any module of ``t/integration``).
        mode: one of :data:`MODES`.
        junit: where pytest writes its junit XML.
        redis_url: broker, backend and claim store; a private ``redis-server`` if None.
        broker_url: another broker (RabbitMQ): the Redis of ``redis_url`` is then the result
            backend and the claim store (``claims_redis_url``).
        pytest_args: more arguments for pytest (``-k``, ``-x``, ...).
        log: where the run's output goes (inherited if None).

    Returns:
        the run's outcomes.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    args = [
        sys.executable, "-m", "pytest", f"t/integration/{module}.py",
        "-p", "no:cacheprovider", "-p", "no:docker_tools", "-q", "-rfE",
        "--timeout", str(TEST_TIMEOUT_S), f"--junitxml={junit}", "-o", "junit_family=xunit2",
    ]  # fmt: skip
    if mode != "plain":
        args += ["-p", "tests.celery_suite.plugin"]
    args += list(pytest_args)
    with _redis_url(redis_url) as url:
        parts = urlsplit(url)
        env = {
            **os.environ,
            "TEST_BROKER": broker_url or url,
            "TEST_BACKEND": url,
            "REDIS_HOST": parts.hostname or "127.0.0.1",
            "REDIS_PORT": str(parts.port or 6379),
            "CLAIMS_SUITE_MODE": "claims" if mode == "claims" else "settings",
            "CLAIMS_SUITE_STORE_URL": url if broker_url else "",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        started = time.monotonic()
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(log, "w")) if log is not None else None
            proc = subprocess.run(
                args, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT if out else None
            )
        wall = time.monotonic() - started
    outcomes, durations = read_junit(junit) if junit.is_file() else ({}, {})
    return RunResult(module, mode, outcomes, durations, wall, proc.returncode)


def differences(base: dict[str, str], other: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Tests whose outcome differs between two runs: test -> (base's, other's)."""
    return {
        test: (base.get(test, "absent"), other.get(test, "absent"))
        for test in sorted(set(base) | set(other))
        if base.get(test) != other.get(test)
    }


def regressions(plain: dict[str, str], other: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Tests that pass in ``plain`` and do not in ``other``."""
    return {t: o for t, o in differences(plain, other).items() if o[0] == "passed"}


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.celery_suite.runner")
    sub = parser.add_subparsers(dest="command", required=True)
    p_fetch = sub.add_parser("fetch", help="download and extract the installed Celery's suite")
    p_fetch.add_argument("root", type=Path)
    p_run = sub.add_parser("run", help="run one module in one mode")
    p_run.add_argument("--suite", type=Path, default=os.environ.get(SUITE_ENV))
    p_run.add_argument("--module", required=True)
    p_run.add_argument("--mode", choices=MODES, required=True)
    p_run.add_argument("--junit", type=Path, required=True)
    p_run.add_argument("--log", type=Path)
    p_run.add_argument("--redis-url")
    p_run.add_argument("--broker-url", help="a broker other than the Redis (RabbitMQ)")
    p_run.add_argument("pytest_args", nargs="*")
    p_cmp = sub.add_parser("compare", help="list the tests whose outcome differs")
    p_cmp.add_argument("base", type=Path)
    p_cmp.add_argument("other", type=Path)
    ns = parser.parse_args(argv)
    if ns.command == "fetch":
        print(fetch(ns.root))
        return 0
    if ns.command == "run":
        if ns.suite is None:
            parser.error(f"--suite or {SUITE_ENV} is required")
        suite = fetch(ns.suite) if not (ns.suite / "t").is_dir() else ns.suite
        result = run_module(
            suite, ns.module, ns.mode, junit=ns.junit, redis_url=ns.redis_url,
            broker_url=ns.broker_url, pytest_args=ns.pytest_args, log=ns.log,
        )  # fmt: skip
        summary = {"module": ns.module, "mode": ns.mode, "wall_s": round(result.wall_s, 1),
                   "returncode": result.returncode, "counts": result.counts()}  # fmt: skip
        print(json.dumps(summary))
        return 0
    base, _ = read_junit(ns.base)
    other, _ = read_junit(ns.other)
    for test, (was, now) in differences(base, other).items():
        print(f"{test}: {was} -> {now}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
