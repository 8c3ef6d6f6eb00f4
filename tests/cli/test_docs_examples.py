"""The command outputs docs/cli.md and docs/celery.md show are what the tools print today:
``tests/cli/docs_examples.py`` runs them on real workers, and each output, its times, hosts,
process ids and counts aside, must be in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.docs_examples import examples

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

#: What differs from run to run: times, leases left, owners' pids and nonces, hosts, counts.
_VARYING = (
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z"), "<time>"),
    (re.compile(r"\(\d+\.\ds left\)"), "(<left>)"),
    (re.compile(r"@[\w.-]+/\d+/[0-9a-f]+\.\d+"), "@<host>/<owner>"),
    (re.compile(r"@[\w.-]+"), "@<host>"),
    (re.compile(r"\b\d+\b"), "<n>"),
    (re.compile(r"[ \t]+"), " "),
    (re.compile(r"-{2,}"), "--"),
)


def _shape(text: str) -> str:
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return "\n".join(line.strip() for line in text.strip().splitlines())


def test_the_docs_show_the_outputs_the_commands_print_on_real_workers() -> None:
    docs = _shape(
        (ROOT / "docs" / "cli.md").read_text() + (ROOT / "docs" / "celery.md").read_text()
    )

    printed = examples()

    missing = [example for example in printed if _shape(example) not in docs]
    assert not missing, (
        "docs/cli.md or docs/celery.md no longer show what these commands print; paste from "
        "`python -m tests.cli.docs_examples`:\n\n" + "\n\n".join(missing)
    )
