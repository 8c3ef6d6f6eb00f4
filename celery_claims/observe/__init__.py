"""What operators read: claims by Celery task id, lane occupancy, and the per-task journal.

Three parts, one module each:

- :mod:`~celery_claims.observe.views`: reading views, what ``celery claims list``, ``stats``
  and ``inspect`` compute from the store (claims by task id, lane occupancy);
- the event journal: :mod:`~celery_claims.observe.journal` (the per-task list of the claim
  gate's decisions about copies, its writes and reads) and :mod:`~celery_claims.observe.writer`
  (the thread a worker writes it from, so its loop never waits on the store);
- :mod:`~celery_claims.observe.render`: the text and JSON the command prints.

Nothing here imports Celery. The worker's side of the journal (the signal receivers, the
writer's binding and shutdown) is :mod:`celery_claims.worker.event_journal`;
``connect_journal`` and ``journal_connected`` are still served from here, where earlier
versions documented them, on first use.
"""

from typing import TYPE_CHECKING, Any

from celery_claims.observe.journal import (
    DEFAULT_JOURNAL_TTL_MS,
    JOURNAL_MAX_EVENTS,
    SKIP_REASONS,
    Journal,
    JournalEvent,
    SkipReason,
    journal_key,
)
from celery_claims.observe.render import SKIP_WORDING, describe_views, event_text
from celery_claims.observe.views import (
    MAX_PROBED_NESTING,
    MAX_PROBED_RETRIES,
    ClaimView,
    LaneOccupancy,
    find_claims,
    lane_occupancy,
    list_views,
    mark_waiting,
    server_now_ms,
)
from celery_claims.observe.writer import JournalWriter

if TYPE_CHECKING:
    from celery_claims.worker.event_journal import (
        attach_journal,
        connect_journal,
        journal_connected,
        stop_journal,
    )

#: Names served by the worker's side of the journal, imported on first use (PEP 562): it
#: imports Celery, and the worker package imports this one.
_FROM_WORKER = ("attach_journal", "connect_journal", "journal_connected", "stop_journal")


def __getattr__(name: str) -> Any:
    if name in _FROM_WORKER:
        from celery_claims.worker import event_journal

        return getattr(event_journal, name)
    raise AttributeError(f"module 'celery_claims.observe' has no attribute {name!r}")


__all__ = [
    # reading views
    "ClaimView",
    "LaneOccupancy",
    "find_claims",
    "lane_occupancy",
    "list_views",
    "mark_waiting",
    "server_now_ms",
    "MAX_PROBED_NESTING",
    "MAX_PROBED_RETRIES",
    # the event journal
    "Journal",
    "JournalEvent",
    "JournalWriter",
    "SkipReason",
    "SKIP_REASONS",
    "journal_key",
    "DEFAULT_JOURNAL_TTL_MS",
    "JOURNAL_MAX_EVENTS",
    # the worker's side (celery_claims.worker.event_journal)
    "attach_journal",
    "connect_journal",
    "journal_connected",
    "stop_journal",
    # rendering
    "describe_views",
    "event_text",
    "SKIP_WORDING",
]
