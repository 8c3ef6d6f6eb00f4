"""What operators read: claims by Celery task id, lane occupancy, and each task's history.

Three parts, one module each:

- :mod:`~celery_claims.observe.views`: reading views, what ``celery claims list``, ``stats``
  and ``inspect`` compute from the store (claims by task id, lane occupancy);
- the task history: :mod:`~celery_claims.observe.history` (the per-task list of the claim
  gate's decisions about copies, its writes and reads) and :mod:`~celery_claims.observe.writer`
  (the thread a worker writes it from, so its loop never waits on the store);
- :mod:`~celery_claims.observe.render`: the text and JSON the command prints.

Nothing here imports Celery or the worker layer. The worker's side of the history (the signal
receivers, the writer's binding and shutdown, ``connect_history``) is
:mod:`celery_claims.worker.history`.
"""

from celery_claims.observe.history import (
    DEFAULT_HISTORY_TTL_MS,
    HISTORY_MAX_EVENTS,
    SKIP_REASONS,
    History,
    HistoryEvent,
    SkipReason,
    history_key,
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
from celery_claims.observe.writer import HistoryWriter

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
    # the task history
    "History",
    "HistoryEvent",
    "HistoryWriter",
    "SkipReason",
    "SKIP_REASONS",
    "history_key",
    "DEFAULT_HISTORY_TTL_MS",
    "HISTORY_MAX_EVENTS",
    # rendering
    "describe_views",
    "event_text",
    "SKIP_WORDING",
]
