"""Rendering: the text and JSON that ``celery claims`` prints of the reading views and history.

Pure functions of :mod:`celery_claims.observe.views` and :mod:`celery_claims.observe.history`
values: nothing here reads the store, so the CLI is command wiring only and every line an
operator sees is spelled in this one module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

from celery_claims.model import ClaimStats
from celery_claims.observe.history import HistoryEvent, SkipReason
from celery_claims.observe.views import ClaimView, KeyWaiter, LaneOccupancy, is_key_field

__all__ = [
    "SKIP_WORDING",
    "STAT_FIELDS",
    "claim_line",
    "describe_views",
    "event_text",
    "inspect_json",
    "inspect_text",
    "key_json",
    "key_not_found",
    "key_text",
    "lanes_text",
    "list_json",
    "list_text",
    "seconds",
    "skipped_text",
    "stats_json",
    "stats_text",
    "table",
    "utc",
    "waiter_line",
]

#: The per-queue counters ``celery claims stats`` shows, in order.
STAT_FIELDS = ("attempts", "successes", "contentions", "takeovers", "acks", "expirations")


# --- building blocks ------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, columns padded to their widest cell."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def utc(ms: int) -> str:
    """Epoch ms as ``YYYY-MM-DD HH:MM:SS.mmmZ``."""
    return (
        datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        + "Z"
    )


def seconds(ms: int) -> str:
    """A duration in ms as ``1.5s``."""
    return f"{ms / 1000:.1f}s"


# --- history events -------------------------------------------------------------------------

#: How ``inspect`` tells a copy a worker did not run, one wording per :class:`SkipReason` (a
#: test fails when a reason has none, or two share one). Fields: ``worker``, ``other`` and
#: ``instance`` of the history event (:class:`HistoryEvent`), and ``key``, the key's field of
#: a keyed task's claim.
SKIP_WORDING: Mapping[SkipReason, str] = MappingProxyType(
    {
        SkipReason.DONE: (
            "copy acked without running on {worker}: already done by {other} (instance {instance})"
        ),
        SkipReason.GIVEN_UP: (
            "copy acked without running on {worker}: the task was given up as poison (taken "
            "over too often; last holder {other})"
        ),
        SkipReason.KEY_HELD: (
            "copy acked without running on {worker}: task {other} held its key {key} "
            "(claims_key_conflict skip); its result is stored as REVOKED"
        ),
        SkipReason.KEY_RESCHEDULED: (
            "copy published again for later, then acked on {worker}: task {other} held its "
            "key {key} (claims_key_conflict reschedule)"
        ),
        SkipReason.KEY_DONE: (
            "copy acked without running on {worker}: its key {key} was done by task {other} "
            "(instance {instance}) within claims_key_done_ttl; its result is stored as REVOKED"
        ),
        SkipReason.KEY_REFUSED: (
            "message acked on {worker}, never run: no key could be made from its arguments "
            "({other}); recorded as failed (KeyRefused)"
        ),
        SkipReason.CLAIMED: (
            "duplicate acked without running on {worker}: the task, acknowledged at claim, is "
            "running under {other}'s live lease, its publish journal entry the durable copy"
        ),
    }
)


#: Skips of a keyed task's copy that met another task's key (or could not make one): its own
#: task id never had a claim nor a record, only the history tells of it.
_NO_CLAIM_OF_ITS_OWN = frozenset(
    {SkipReason.KEY_HELD, SkipReason.KEY_RESCHEDULED, SkipReason.KEY_DONE, SkipReason.KEY_REFUSED}
)


def skipped_text(event: HistoryEvent) -> str:
    """The line of a ``skipped`` history event: its reason's :data:`SKIP_WORDING`."""
    try:
        reason = SkipReason(event.reason)
    except ValueError:
        # written by a newer worker than this reader: say what is known
        return (
            f"copy acked without running on {event.worker}: {event.reason or 'no reason'} "
            f"({event.other or '?'})"
        )
    # the worker writes a keyed skip's key on the event; before it did, the key was read
    # from the claim id, `<queue>/<key field>` (wrong where the queue's name holds a "/")
    key = event.key or event.claim_id.partition("/")[2] or "?"
    return SKIP_WORDING[reason].format(
        worker=event.worker, other=event.other or "?", instance=event.instance, key=key
    )


def event_text(event: HistoryEvent) -> str:
    """One line for humans of what a history event says."""
    if event.event == "skipped":
        return skipped_text(event)
    if event.event == "held" and event.reason == "unavailable":
        return f"copy held unacked on {event.worker}: the claim store was unreachable"
    if event.event == "held":
        return f"copy held unacked on {event.worker}: lease held by {event.other or '?'}"
    if event.event == "took_over":
        previous = f" from {event.other}" if event.other else ""
        return f"taken over by {event.worker}{previous} (instance {event.instance})"
    if event.event == "lease_lost":
        return f"lease lost on {event.worker} (instance {event.instance}): result fenced"
    if event.event == "waiting":
        return (
            f"claimed on {event.worker} (instance {event.instance}), waiting for a slot of "
            f"lane {event.reason} (full)"
        )
    if event.event == "rate_wait":
        return (
            f"claimed on {event.worker} (instance {event.instance}), waiting for rate "
            f"{event.reason} (used up): kept unacked, re-checked when its window frees"
        )
    if event.event == "rate_pass":
        return f"rate {event.reason} let it start on {event.worker} (instance {event.instance})"
    if event.event == "lane_slot":
        return (
            f"got a slot of lane {event.reason} on {event.worker} (instance "
            f"{event.instance}): handed to the pool"
        )
    if event.event == "released":
        return (
            f"ended without success on {event.worker}: {event.reason} (instance "
            f"{event.instance}); claim released, a later copy runs it again"
        )
    return f"run by {event.worker} (instance {event.instance})"


# --- claim views ----------------------------------------------------------------------------


def describe_views(views: Iterable[ClaimView]) -> list[str]:
    """One short line per view, for humans."""
    lines = []
    for v in views:
        if v.state == "done":
            lines.append(
                f"{v.queue}: attempt {v.attempt} done by {v.owner} (instance {v.instance})"
            )
        elif v.state == "given_up":
            lines.append(
                f"{v.queue}: attempt {v.attempt} given up as poison (takeovers: {v.takeovers}, "
                f"last holder {v.owner})"
            )
        elif v.state == "waiting":
            lines.append(
                f"{v.queue}: attempt {v.attempt} claimed by {v.owner} (instance {v.instance}), "
                f"waiting for {_waits_for(v)}; lease {v.remaining_ms / 1000:.1f} s left"
            )
        elif v.state == "running":
            lines.append(
                f"{v.queue}: attempt {v.attempt} held by {v.owner} (instance {v.instance}), "
                f"lease {v.remaining_ms / 1000:.1f} s left"
            )
        else:
            lines.append(
                f"{v.queue}: attempt {v.attempt} lease of {v.owner} expired "
                f"(instance {v.instance}); the next copy takes it over"
            )
    return lines


def claim_line(view: ClaimView, now_ms: int) -> str:
    """The ``inspect`` line of one claim or record (indented, with times in UTC)."""
    head = f"  queue {view.queue}, attempt {view.attempt}: "
    if view.state == "done":
        return (
            head + f"DONE by {view.owner} (instance {view.instance}) at {utc(view.since_ms)}; "
            f"later copies are acked unrun until {utc(view.until_ms)}"
        )
    if view.state == "given_up":
        return (
            head + f"GIVEN UP as poison at {utc(view.since_ms)} (takeovers: {view.takeovers}, "
            f"last holder whose lease ran out: {view.owner}); later copies are acked unrun "
            f"until {utc(view.until_ms)}"
        )
    if view.state == "waiting":
        return (
            head + f"WAITING for {_waits_for(view)} (claimed, not running yet), held by "
            f"{view.owner} (instance {view.instance}) since {utc(view.since_ms)}, lease until "
            f"{utc(view.until_ms)} ({seconds(view.remaining_ms)} left)"
        )
    if view.state == "running":
        return (
            head + f"RUNNING, held by {view.owner} (instance {view.instance}) since "
            f"{utc(view.since_ms)}, lease until {utc(view.until_ms)} "
            f"({seconds(view.remaining_ms)} left)"
        )
    return (
        head + f"EXPIRED lease of {view.owner} (instance {view.instance}) "
        f"{seconds(now_ms - view.until_ms)} ago; the next copy takes it over"
    )


def _waits_for(view: ClaimView) -> str:
    return f"rate {view.rate}" if view.rate else f"a slot of lane {view.lane}"


def _state(view: ClaimView) -> str:
    if view.state != "waiting":
        return view.state
    return f"waiting (rate {view.rate})" if view.rate else f"waiting (lane {view.lane})"


def _without_claim(history: Sequence[HistoryEvent]) -> str:
    """What the history says of a task the store has no claim or record of."""
    ended = [e for e in history if e.event in ("released", "lease_lost", "skipped")]
    last = ended[-1] if ended else None
    if last is not None and last.event == "skipped" and last.reason in _NO_CLAIM_OF_ITS_OWN:
        return (
            f"  no claim and no completion record of its own: its last copy was not run "
            f"({last.reason}, on {last.worker} at {utc(last.at_ms)}; below)"
        )
    if last is not None and last.event == "released":
        return (
            f"  no live claim and no completion record: the last attempt ended without success "
            f"on {last.worker} at {utc(last.at_ms)} ({last.reason}); its claim was released, "
            f"so a later copy of it runs again (the result backend has the error)"
        )
    return (
        "  no live claim and no completion record (finished and its record expired, or "
        "released): the history below is all that is known"
    )


# --- the commands' output -------------------------------------------------------------------


def list_json(now_ms: int, queues: Sequence[str], views: Sequence[ClaimView]) -> dict[str, Any]:
    """``claims list --json``."""
    return {"now_ms": now_ms, "queues": list(queues), "claims": [v.as_dict() for v in views]}


def list_text(queue: str | None, queues: Sequence[str], views: Sequence[ClaimView]) -> str:
    """``claims list``: a table of the live claims and a count line."""
    if not views:
        where = f"queue {queue!r}" if queue else f"{len(queues)} known queue(s)"
        return f"no live claims in {where}"
    rows: list[tuple[object, ...]] = [
        (v.queue, v.task_id, v.attempt, _state(v), v.owner, v.instance, seconds(v.remaining_ms))
        for v in views
    ]
    headers: tuple[str, ...] = (
        "QUEUE", "TASK", "ATTEMPT", "STATE", "OWNER", "INSTANCE", "LEASE LEFT"
    )  # fmt: skip
    if any(v.key for v in views):
        # keyed tasks' claims (claims_key): the key, held by the task of the row
        headers = (*headers, "KEY")
        rows = [(*row, v.key or "-") for row, v in zip(rows, views, strict=True)]
    waiting = sum(1 for v in views if v.state == "waiting")
    return (
        f"{table(headers, rows)}\n\n"
        f"{len(views)} live claim(s), {waiting} of them waiting for a lane slot or a rate"
    )


def stats_json(
    per_queue: Mapping[str, ClaimStats],
    live: Mapping[str, int],
    lanes: Sequence[LaneOccupancy],
    rates: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """``claims stats --json`` (``rates``: rate name -> copies waiting for it)."""
    return {
        "queues": {
            q: {"live": live[q], **{k: getattr(s, k) for k in STAT_FIELDS}}
            for q, s in per_queue.items()
        },
        "lanes": [lane.as_dict() for lane in lanes],
        "rates": [{"rate": name, "waiting": n} for name, n in sorted((rates or {}).items())],
    }


def rates_text(rates: Mapping[str, int]) -> str:
    """The rate table of ``claims stats``: the copies claimed and waiting for each rate."""
    if not rates:
        return "rates: no copy waits for a fleet-wide rate"
    return table(("RATE", "WAITING"), sorted(rates.items()))


def lanes_text(lanes: Sequence[LaneOccupancy]) -> str:
    """The lane occupancy table of ``claims stats``."""
    if not lanes:
        return "lanes: none configured or in use"
    rows = [
        (
            lane.lane,
            lane.kind,
            f"{lane.active}/{'-' if lane.limit is None else lane.limit}",
            lane.waiting,
            ", ".join(f"{key}={count}" for key, count in lane.keys) or "-",
        )
        for lane in lanes
    ]
    return table(("LANE", "KIND", "ACTIVE/LIMIT", "WAITING", "TOP KEYS (RUNNING)"), rows)


def stats_text(
    per_queue: Mapping[str, ClaimStats],
    live: Mapping[str, int],
    lanes: Sequence[LaneOccupancy],
    rates: Mapping[str, int] | None = None,
) -> str:
    """``claims stats``: the per-queue counters, the lanes and the rates waited for."""
    if per_queue:
        rows = [
            (q, live[q], *(getattr(s, k) for k in STAT_FIELDS))
            for q, s in sorted(per_queue.items())
        ]
        queues = table(("QUEUE", "LIVE", *(k.upper() for k in STAT_FIELDS)), rows)
    else:
        queues = "no queue has been claimed in yet"
    return f"{queues}\n\n{lanes_text(lanes)}\n\n{rates_text(rates or {})}"


def inspect_json(
    task_id: str, now_ms: int, views: Sequence[ClaimView], history: Sequence[HistoryEvent]
) -> dict[str, Any]:
    """``claims inspect --json``: the claims and the history, each event with its text."""
    return {
        "task_id": task_id,
        "now_ms": now_ms,
        "found": bool(views or history),
        "claims": [v.as_dict() for v in views],
        "history": [{**e.as_dict(), "text": event_text(e)} for e in history],
    }


def inspect_text(
    task_id: str, now_ms: int, views: Sequence[ClaimView], history: Sequence[HistoryEvent]
) -> str:
    """``claims inspect`` of a task the store or the history knows."""
    lines = [f"task {task_id}", *(claim_line(view, now_ms) for view in views)]
    if not views:
        lines.append(_without_claim(history))
    if history:
        lines.append("copies:")
        lines += [f"  {utc(event.at_ms)}  {event_text(event)}" for event in history]
    else:
        lines.append("copies: no copy was skipped or held (or the history is not connected)")
    return "\n".join(lines)


def key_json(
    key: str,
    now_ms: int,
    views: Sequence[ClaimView],
    lanes: Sequence[tuple[str, int]] = (),
    waiters: Sequence[KeyWaiter] = (),
    queues: Sequence[str] = (),
) -> dict[str, Any]:
    """``claims key --json``: the key's claims, its running count in each keyed lane, the
    copies waiting on it, whether the name has a key's form, and the queues looked in."""
    return {
        "key": key,
        "is_key": is_key_field(key),
        "queues": list(queues),
        "now_ms": now_ms,
        "claims": [v.as_dict() for v in views],
        "lanes": [{"lane": lane, "running": running} for lane, running in lanes],
        "waiting": [w.as_dict() for w in waiters],
    }


def key_not_found(key: str, queues: Sequence[str]) -> str:
    """What ``claims key`` says when nothing holds or waits on ``key``: free if it has a
    key's form, else that it is not a key; with the queues it looked in."""
    where = f"looked in queue(s) {', '.join(queues)}" if queues else "no queue is known yet"
    if not is_key_field(key):
        return (
            f"{key!r} is not a key: a key is `<task or namespace>[<key>]` (a keyed task's, as "
            f"`claims list` shows it, e.g. \"tasks.sync['acme']\") or `<lane>[<key>]` (a keyed "
            f"lane's); no claim, lane slot or waiting copy has it ({where})"
        )
    return (
        f"key {key!r} is free: no claim or lane slot holds it, it is not kept done, and "
        f"nothing waits on it ({where})"
    )


def waiter_line(waiter: KeyWaiter) -> str:
    """The ``claims key`` line of one copy waiting on the key."""
    if waiter.waits_for == "lane":
        return (
            f"  task {waiter.task_id}: WAITING for its key's slot of the lane, claimed "
            f"({waiter.claim_id}, instance {waiter.instance}) by {waiter.worker} since "
            f"{utc(waiter.since_ms)}"
        )
    holder = f" (then held by {waiter.holder})" if waiter.holder else ""
    return (
        f"  task {waiter.task_id}: WAITING for the key, held unacked on {waiter.worker} "
        f"since {utc(waiter.since_ms)}{holder}"
    )


def key_text(
    key: str,
    now_ms: int,
    views: Sequence[ClaimView],
    lanes: Sequence[tuple[str, int]] = (),
    waiters: Sequence[KeyWaiter] = (),
) -> str:
    """``claims key``: who holds a key or keeps it done, how many of a keyed lane's slots it
    holds, and what waits on it (not all empty)."""
    lines = [f"key {key}"]
    lines += [f"{claim_line(view, now_ms)} (task {view.task_id})" for view in views]
    lines += [f"  lane {lane}: {running} running with this key" for lane, running in lanes]
    if not views and not lanes:
        lines.append("  nothing holds it now")
    lines.append(f"waiting on it: {len(waiters)}")
    lines += [waiter_line(waiter) for waiter in waiters]
    return "\n".join(lines)
