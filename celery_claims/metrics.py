"""An optional Prometheus exporter (``pip install 'celery-claims[prometheus]'``).

Two collectors, read at scrape time, so nothing is counted twice and nothing costs anything
between scrapes:

- :class:`WorkerCollector`: one worker's events, from its ``worker.claims.counters`` (the
  counters the claim gate and the lease keeper keep): claims, contentions, takeovers, skipped
  copies by reason, renewals, lease losses, completions; gauges for its live claims and held
  copies. Labelled ``worker``.
- :class:`StoreCollector`: the fleet-wide view from the claim store: per-queue counters and live
  claims, and lane occupancy. One exporter per fleet is enough for these (``celery claims
  metrics``), but every worker may export them too.

``install_metrics(app)`` starts an exporter in each worker's main process (where the gate
runs) once the worker is ready. Several workers on one host each need a port of their own:
``claims_metrics_port`` (or ``--claims-metrics-port``) is a port, a range ``"9808-9817"`` (the
default) from which each worker takes the first free port, or 0 for any free port; the port
taken is logged, and the ``worker`` label tells the workers apart.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from celery.signals import worker_ready
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import ClaimError, InvalidArgument
from celery_claims.observe.views import DEFAULT_TOP_KEYS, LaneOccupancy, fleet_stats
from celery_claims.worker.settings import parse_ports

__all__ = [
    "StoreCollector",
    "WorkerCollector",
    "install_metrics",
    "serve_store_metrics",
    "worker_registry",
]

logger = logging.getLogger("celery_claims.metrics")

#: (metric, help, {label value: counter names summed into it}) of the worker's counters.
_WORKER_COUNTERS: tuple[tuple[str, str, str, dict[str, tuple[str, ...]]], ...] = (
    (
        "celery_claims_claims",
        "Claims acquired by this worker, by result.",
        "result",
        {"acquired": ("acquired",), "took_over": ("took_over",)},
    ),
    (
        "celery_claims_skipped_copies",
        "Copies not run when delivered: done (acked unrun), held (another worker's lease is "
        "live; kept unacked), unavailable (claim store down; kept unacked); for keyed tasks "
        "(claims_key) key_held (another task id held the key: skip policy, acked unrun), "
        "key_rescheduled (published again for later), key_done (the key was kept done by "
        "claims_key_done_ttl), key_refused (no key could be made: recorded failed); claimed "
        "(acknowledged at claim: another worker's live lease and the task's journal entry "
        "keep it, acked unrun).",
        "reason",
        {
            "done": ("skipped_done",),
            "held": ("held",),
            "unavailable": ("held_unavailable",),
            "key_held": ("skipped_key_held",),
            "key_rescheduled": ("rescheduled_key_held",),
            "key_done": ("skipped_key_done",),
            "key_refused": ("refused_key",),
            "claimed": ("skipped_claimed",),
        },
    ),
    (
        "celery_claims_completions",
        "Claims ended by this worker: done (completion recorded), released (failure, revoke, "
        "rejection), deferred (completion retried because the store was down).",
        "result",
        {
            "done": ("completed",),
            "released": ("released",),
            "deferred": ("completion_deferred",),
        },
    ),
    (
        "celery_claims_journal",
        "The publish journal: messages journaled by this process (written) or not "
        "(write_failed: the publish went on unjournaled); entries this worker's recovery "
        "re-published, dropped (given up after claims_journal_max_republish, expired or "
        "unreadable), cleared (found done) or deferred (a live claim holds the task).",
        "event",
        {
            "written": ("journal_written",),
            "write_failed": ("journal_write_failed",),
            "republished": ("journal_republished",),
            "dropped": ("journal_dropped",),
            "cleared": ("journal_cleared",),
            "deferred": ("journal_deferred",),
        },
    ),
)

#: (metric, help, counter name) of the worker's unlabelled counters.
_WORKER_SINGLE: tuple[tuple[str, str, str], ...] = (
    ("celery_claims_contentions", "Copies that found another worker's live lease.", "held"),
    ("celery_claims_takeovers", "Expired leases of other workers taken over.", "took_over"),
    ("celery_claims_renewals", "Leases renewed by the lease keeper.", "renewals"),
    (
        "celery_claims_renewal_failures",
        "Renewal rounds that could not reach the claim store.",
        "renew_unavailable",
    ),
    ("celery_claims_lease_losses", "Running tasks whose lease was lost (fenced).", "lease_lost"),
    (
        "celery_claims_fenced_successes",
        "Successes not recorded as done because the lease had been lost.",
        "fenced_success",
    ),
    ("celery_claims_held_rechecks", "Re-checks of held copies.", "rechecks"),
    (
        "celery_claims_events_dropped",
        "Task history entries dropped: its writer's queue was full, or the claim store stayed "
        "away longer than its newest entries could be kept.",
        "events_dropped",
    ),
)

_STORE_FIELDS = ("attempts", "successes", "contentions", "takeovers", "acks", "expirations")


class WorkerCollector(Collector):
    """Exports one worker's claim counters and gauges.

    Args:
        runtime: the worker's ``ClaimsRuntime`` (``worker.claims``): anything with
            ``counters.snapshot()``, ``live_claims()``, ``held_copies()`` and ``hostname``.

    Raises:
        InvalidArgument: ``runtime`` lacks those.
    """

    def __init__(self, runtime: Any) -> None:
        for name in ("counters", "live_claims", "held_copies", "hostname"):
            if not hasattr(runtime, name):
                raise InvalidArgument("runtime", f"has no {name!r}: pass worker.claims")
        self.runtime = runtime

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The metric families at this instant."""
        values: dict[str, int] = self.runtime.counters.snapshot()
        # what this process published (its journal writes) is counted process-wide
        publish = getattr(self.runtime, "publish_counters", None)
        if publish is not None:
            values.update(publish.snapshot())
        worker = str(self.runtime.hostname)
        for metric, doc, label, parts in _WORKER_COUNTERS:
            family = CounterMetricFamily(metric, doc, labels=["worker", label])
            for label_value, names in parts.items():
                family.add_metric([worker, label_value], sum(values.get(n, 0) for n in names))
            yield family
        for metric, doc, name in _WORKER_SINGLE:
            family = CounterMetricFamily(metric, doc, labels=["worker"])
            family.add_metric([worker], values.get(name, 0))
            yield family
        live = GaugeMetricFamily(
            "celery_claims_worker_live_claims", "Claims this worker holds now.", labels=["worker"]
        )
        live.add_metric([worker], len(self.runtime.live_claims()))
        yield live
        held = GaugeMetricFamily(
            "celery_claims_worker_held_copies",
            "Copies this worker keeps unacked now (held or store down).",
            labels=["worker"],
        )
        held.add_metric([worker], len(self.runtime.held_copies()))
        yield held
        waiting = GaugeMetricFamily(
            "celery_claims_worker_rate_waiting",
            "Copies this worker keeps claimed and unacked now, waiting for a fleet-wide rate "
            "(by the name of the first limit they wait on: task:<task>, key:<task>:<key>, "
            "lane:<lane>...).",
            labels=["worker", "rate"],
        )
        rates = getattr(getattr(self.runtime, "life", None), "rates", None)
        for name, count in sorted(rates.waiting_per_rate().items() if rates else ()):
            waiting.add_metric([worker, name], count)
        yield waiting
        starts = CounterMetricFamily(
            "celery_claims_worker_rate_checks",
            "Rate checks of this worker by outcome: allowed (a start counted), limited (told "
            "to wait), unavailable (the store did not answer).",
            labels=["worker", "outcome"],
        )
        for outcome in ("allowed", "limited", "unavailable"):
            starts.add_metric([worker, outcome], values.get(f"rate_{outcome}", 0))
        yield starts


class StoreCollector(Collector):
    """Exports the fleet-wide view of a claim store: per-queue counters, live claims, lanes.

    The reading ``celery claims stats`` prints (:func:`~celery_claims.observe.views.fleet_stats`):
    every configured lane, idle ones at 0, and as waiting only the copies waiting for a slot.
    A scrape costs a few round trips (queues, counters, live claims, their histories, lane
    scan). When the store cannot be reached the scrape still answers, with
    ``celery_claims_store_up 0``.

    Args:
        manager: the claim store.
        lane_limits: lane key -> limit, exported as ``celery_claims_lane_limit``.
        lanes: also export lane occupancy (a ``SCAN`` per scrape).
    """

    def __init__(
        self,
        manager: RedisClaimManager,
        *,
        lane_limits: Mapping[str, int] | None = None,
        lanes: bool = True,
    ) -> None:
        if not isinstance(manager, RedisClaimManager):
            raise InvalidArgument("manager", "must be a RedisClaimManager")
        self.manager = manager
        self.lane_limits = dict(lane_limits or {})
        self.lanes = lanes

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The metric families at this instant."""
        up = GaugeMetricFamily("celery_claims_store_up", "1 if the claim store answered.")
        try:
            fleet = fleet_stats(self.manager, self.lane_limits, lanes=self.lanes)
        except ClaimError as exc:
            logger.warning("celery-claims metrics: claim store unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _store_families(fleet.per_queue, fleet.live)
        yield from _lane_families(fleet.lanes, self.lane_limits)


def _store_families(
    per_queue: Mapping[str, Any], live: Mapping[str, int]
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The claim store's counters and live claims of each queue."""
    for name in _STORE_FIELDS:
        family = CounterMetricFamily(
            f"celery_claims_store_{name}",
            f"Claim store counter '{name}' of each queue (all workers).",
            labels=["queue"],
        )
        for queue, stats in per_queue.items():
            family.add_metric([queue], getattr(stats, name))
        yield family
    gauge = GaugeMetricFamily(
        "celery_claims_live_claims",
        "Live claims of each queue (all workers).",
        labels=["queue"],
    )
    for queue, count in live.items():
        gauge.add_metric([queue], count)
    yield gauge


def _lane_families(
    lanes: Sequence[LaneOccupancy], lane_limits: Mapping[str, int]
) -> Iterator[GaugeMetricFamily]:
    """Each lane's active and waiting tasks, its busiest keys, and its limit."""
    active = GaugeMetricFamily(
        "celery_claims_lane_active",
        "Tasks processing in each lane now.",
        labels=["lane", "kind"],
    )
    waiting = GaugeMetricFamily(
        "celery_claims_lane_waiting", "Tasks waiting in each lane.", labels=["lane", "kind"]
    )
    per_key = GaugeMetricFamily(
        "celery_claims_lane_key_active",
        f"Tasks processing now per key of each keyed lane, for its {DEFAULT_TOP_KEYS} "
        f"busiest keys only (bounded label cardinality).",
        labels=["lane", "key"],
    )
    for lane in lanes:
        active.add_metric([lane.lane, lane.kind], lane.active)
        waiting.add_metric([lane.lane, lane.kind], lane.waiting)
        for key, count in lane.keys:
            per_key.add_metric([lane.lane, key], count)
    yield active
    yield waiting
    yield per_key
    limit = GaugeMetricFamily("celery_claims_lane_limit", "Limit of each lane.", labels=["lane"])
    for lane_key, value in sorted(lane_limits.items()):
        limit.add_metric([lane_key], value)
    yield limit


def _serve(registry: CollectorRegistry, port: int, addr: str) -> tuple[Any, int]:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument("port", f"must be an int in 0..65535, got {port!r:.80}")
    if not isinstance(addr, str) or not addr:
        raise InvalidArgument("addr", f"must be a non-empty str, got {addr!r:.80}")
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, int(server.server_port)


def _serve_first(registry: CollectorRegistry, ports: tuple[int, int], addr: str) -> tuple[Any, int]:
    """Serve on the first free port of ``ports`` (first, last).

    Raises:
        OSError: every port of the range is taken (``EADDRINUSE``), or another bind error.
    """
    first, last = ports
    for port in range(first, last + 1):
        try:
            return _serve(registry, port, addr)
        except OSError as exc:
            # another worker of this host has it: the next port is this worker's to try
            if exc.errno != errno.EADDRINUSE or port == last:
                raise
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover


def serve_store_metrics(
    manager: RedisClaimManager,
    *,
    port: int = 9808,
    addr: str = "127.0.0.1",
    lane_limits: Mapping[str, int] | None = None,
) -> int:
    """Serve :class:`StoreCollector` over HTTP in a daemon thread; return the bound port.

    Args:
        manager: the claim store.
        port: TCP port (0 picks a free one).
        addr: address to listen on.
        lane_limits: lane key -> limit.

    Raises:
        InvalidArgument: a bad port or address.
        OSError: the port is taken.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(manager, lane_limits=lane_limits))
    return _serve(registry, port, addr)[1]


def worker_registry(runtime: Any, *, store: bool = True) -> CollectorRegistry:
    """A registry with the worker's collector (and the store's, with ``store``, with the
    limits of the worker's ``claims_lanes``, as ``celery claims metrics`` exports them)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(runtime))
    if store:
        lanes = getattr(getattr(runtime, "settings", None), "lanes", ())
        limits = {spec.name: spec.limit for spec in lanes if spec.limit is not None}
        registry.register(StoreCollector(runtime.manager, lane_limits=limits))
    return registry


_servers_lock = threading.Lock()
_servers: dict[int, Any] = {}


def _export_once(runtime: Any, ports: tuple[int, int], addr: str, *, store: bool) -> int | None:
    """Serve ``runtime``'s registry on the first free port of ``ports``; return the bound port.

    ``None`` if this runtime is served already, or if no port is free (logged: the worker
    runs without an exporter).
    """
    with _servers_lock:
        if id(runtime) in _servers:
            return None
        try:
            server, bound = _serve_first(worker_registry(runtime, store=store), ports, addr)
        except OSError as exc:
            where = f"{ports[0]}" if ports[0] == ports[1] else f"{ports[0]}-{ports[1]}"
            logger.error(
                "celery-claims metrics: worker %s cannot listen on %s:%s (%s); it runs "
                "without an exporter. Give each worker of a host its own port: a range "
                "in claims_metrics_port (e.g. '9808-9817'), --claims-metrics-port, or 0",
                runtime.hostname,
                addr,
                where,
                exc.strerror or exc,
            )
            return None
        _servers[id(runtime)] = server
    logger.info(
        "celery-claims metrics of worker %s on http://%s:%d/metrics",
        runtime.hostname,
        addr,
        bound,
    )
    return bound


def install_metrics(
    app: Any,
    *,
    port: int | str | tuple[int, int] | None = None,
    addr: str = "127.0.0.1",
    store: bool = True,
    on_serving: Callable[[int], None] | None = None,
) -> None:
    """Export each worker's metrics over HTTP once it is ready (idempotent per app).

    Call it next to ``celery_claims.install(app)``. The exporter runs in the worker's main
    process, where the claim gate and the lease keeper count, so prefork children need no
    multiprocess mode.

    Each worker needs a port of its own: with a range (the default ``claims_metrics_port``,
    ``"9808-9817"``) each worker of a host takes the first free port of it, so a Prometheus
    job listing the range's ports finds every worker, told apart by the ``worker`` label;
    a single port suits one worker per host (or ``--claims-metrics-port`` per worker); 0
    takes any free port. The port taken is logged (``celery-claims metrics of worker ... on
    http://...``). A worker that finds no free port logs an error and runs without one.

    Args:
        app: the Celery app.
        port: a port, a range ``"first-last"`` / ``(first, last)``, or 0 (default: the
            worker's ``claims_metrics_port`` setting).
        addr: address to listen on.
        store: also export the fleet-wide claim store view.
        on_serving: called with the bound port once serving (for tests and logs).

    Raises:
        InvalidArgument: a bad port or address.
    """
    ports = None if port is None else parse_ports(port, key="port")
    if not isinstance(addr, str) or not addr:
        raise InvalidArgument("addr", f"must be a non-empty str, got {addr!r:.80}")
    if getattr(app, "_celery_claims_metrics", False):
        return
    app._celery_claims_metrics = True

    def start(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        runtime = getattr(getattr(sender, "controller", None), "claims", None)
        if runtime is None:
            logger.warning("celery-claims metrics: install(app) has not run; nothing to export")
            return
        chosen = ports if ports is not None else runtime.settings.metrics_port
        bound = _export_once(runtime, chosen, addr, store=store)
        if bound is not None and on_serving is not None:
            on_serving(bound)

    # weak=False: the receiver is a closure nothing else references
    worker_ready.connect(start, weak=False)
