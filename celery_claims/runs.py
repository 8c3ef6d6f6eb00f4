"""Runs: which apply of a re-used task id a claim belongs to.

Celery defines every apply of a canvas as a new run, though a frozen canvas re-uses its task
ids. A *run* is a positive integer a producer gives a message once per publish: every copy of
that publish (a redelivery, a retried publish, a journal re-publish) carries the same run, and
a later publish carries a larger one. An owner names its run with the suffix ``~r<run>``
(base 36), so the completion record of a copy names the run that completed. A claim asked
with ``run=`` is not turned away by a completion record of an **earlier** run: that is the
new run of docs/semantics.md, *Runs*. A record of the same or a later run, a record naming no
run and a given-up record turn it away as before.

This module imports neither Celery nor kombu.
"""

from __future__ import annotations

import re

from celery_claims.errors import InvalidArgument

__all__ = ["MAX_RUN", "earlier_run", "format_run", "owner_run", "parse_run", "with_run"]

#: Largest run: every number a claim script handles is exact below 2**53.
MAX_RUN = 2**53 - 1

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_RUN_TEXT = re.compile(r"[0-9a-z]{1,11}")
_OWNER_RUN = re.compile(r"~r([0-9a-z]{1,11})\Z")


def format_run(run: int) -> str:
    """``run`` in base 36 (the header's and the owner suffix's spelling).

    Raises:
        InvalidArgument: ``run`` is not an int in ``1..MAX_RUN`` (a bool is refused).
    """
    require_run(run)
    text = ""
    while run:
        run, digit = divmod(run, 36)
        text = _DIGITS[digit] + text
    return text


def parse_run(text: object) -> int | None:
    """The run ``text`` spells (:func:`format_run`), or None for anything else."""
    if not isinstance(text, str) or not _RUN_TEXT.fullmatch(text):
        return None
    run = int(text, 36)
    return run if 0 < run <= MAX_RUN else None


def require_run(run: object) -> int:
    """``run`` itself, checked.

    Raises:
        InvalidArgument: not an int in ``1..MAX_RUN`` (a bool is refused).
    """
    if isinstance(run, bool) or not isinstance(run, int) or not 0 < run <= MAX_RUN:
        raise InvalidArgument("run", f"must be an int in 1..{MAX_RUN}, got {run!r}")
    return run


def with_run(owner: str, run: int | None) -> str:
    """``owner`` naming ``run`` (unchanged for None)."""
    return owner if run is None else f"{owner}~r{format_run(run)}"


def owner_run(owner: str) -> int | None:
    """The run ``owner`` names, or None."""
    match = _OWNER_RUN.search(owner)
    return parse_run(match.group(1)) if match else None


def earlier_run(record_owner: str, run: int | None) -> bool:
    """True when a completion record of ``record_owner`` is of a run earlier than ``run``
    (and so does not turn a copy of ``run`` away)."""
    if run is None:
        return False
    recorded = owner_run(record_owner)
    return recorded is not None and recorded < run
