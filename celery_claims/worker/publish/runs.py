"""Runs of canvas parts (docs/semantics.md, *Runs*): each apply of a canvas is a new run.

Celery defines every apply of a canvas as a new run, though a frozen canvas re-uses its task
ids; a plain task's id is the caller's idempotency key. So ``before_task_publish`` gives the
message of a **canvas part** a run (header :data:`RUN_HEADER`, base 36), once per
``send_task_message``: kombu's retries of that publish, the broker's redeliveries and journal
re-publishes carry the same run, a later apply a larger one. A canvas part is a message that
is a group member or a chord's part (Celery's ``group`` header: header tasks, and the body,
which Celery freezes with the chord's group id), or a chain step (``chain`` in the message's
embedded options, an empty list for the last step). Other messages get no run.

The run is this process's clock in microseconds, made strictly increasing per process. A
copy runs only if the task's record is of a lower run, and a completion replaces the record,
so a run that completed never runs again, whatever the clocks; a producer whose clock is
behind the last run's can only make its re-apply look earlier (skipped as done, as without
runs).

The next steps a canvas part's trace sends after its body returned (a chain's next step, a
chord's body sent by its last part, callbacks) are of the part's own run, not a new one
(:func:`inherit`), whatever their headers: a link callback has no group header and is no chain
step, nor is a chord's body on Celery 5.3 (5.7 freezes it with the chord's group id). A part
that runs again after a crash (its completion is recorded after Celery's trace) sends copies
of the steps its first run sent, which are turned away as done or held, where a new run would
make every later step run again. A part of no run (its
producer gives none: celery-claims is not installed there) sends steps of no run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from celery.signals import before_task_publish

from celery_claims.runs import MAX_RUN, format_run, parse_run

__all__ = [
    "RUN_HEADER",
    "connect_runs",
    "end_inherit",
    "inherit",
    "is_canvas_part",
    "run_of",
    "stamp",
]

#: The message header that carries a canvas part's run.
RUN_HEADER = "x-claims-run"

_lock = threading.Lock()
_last = [0]
_connected = [False]
#: the run the canvas parts this thread sends now are of (:func:`inherit`)
_inherited = threading.local()


def is_canvas_part(headers: Mapping[str, Any], body: Any) -> bool:
    """True for a group member, a chord's part or body, and a chain step (protocol 2)."""
    if headers.get("group"):
        return True
    if isinstance(body, (tuple, list)) and len(body) == 3:
        embed = body[2]
        # a dict (Celery's own) before the ABC's isinstance, which costs as much as the rest
        # of the check (it runs twice a publish)
        if type(embed) is dict or isinstance(embed, Mapping):
            return bool(embed.get("chord")) or embed.get("chain") is not None
    return False


def run_of(headers: Mapping[str, Any] | None) -> int | None:
    """The run a message's headers carry, or None (none, or not one :func:`_next_run` made)."""
    return parse_run(headers.get(RUN_HEADER)) if headers else None


def _next_run() -> int:
    with _lock:
        run = min(max(time.time_ns() // 1000, _last[0] + 1), MAX_RUN)
        _last[0] = run
    return run


def inherit(run: int | None) -> None:
    """Make the canvas parts this thread sends from now on of ``run`` (None: of no run), until
    :func:`end_inherit`. Set by the guard of a copy whose body returned, for the steps Celery's
    trace sends after it, and ended with the trace."""
    _inherited.active = True
    _inherited.run = run


def end_inherit() -> None:
    """Each canvas part this thread sends from now on is a new run (the default)."""
    _inherited.active = False


def stamp(headers: Any, body: Any) -> None:
    """Give a canvas part's message (``headers`` and ``body`` as ``before_task_publish`` has
    them) its run, unless its headers carry one already: a second call in the same send (the
    publish journal's capture, then this module's receiver) keeps the first's, and a retry
    that copies its request's headers stays in its run (a new attempt of it). A step sent by
    a part's trace after its body is of that part's run (:func:`inherit`)."""
    if not isinstance(headers, dict) or RUN_HEADER in headers:
        return
    if getattr(_inherited, "active", False):
        # every message a part's trace sends after its body is a next step of the canvas,
        # whatever its headers say: a link callback, and a chord's body on Celery 5.3 (sent
        # with no group header), carry no mark of one
        if _inherited.run is not None:
            headers[RUN_HEADER] = format_run(_inherited.run)
    elif is_canvas_part(headers, body):
        headers[RUN_HEADER] = format_run(_next_run())


def _stamp(sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
    """``before_task_publish``: :func:`stamp`."""
    stamp(headers, body)


def connect_runs() -> None:
    """Give canvas parts published by this process their runs (idempotent)."""
    with _lock:
        if not _connected[0]:
            # weak=False: a module-level function, connected once per process
            before_task_publish.connect(_stamp, weak=False)
            _connected[0] = True
