"""The bootsteps, thin as Celery's ``worker/consumer/heart.py``: each starts a service.

- :class:`LeaseKeeper` (worker): reads and checks the settings, creates the worker's
  :class:`~celery_claims.worker.runtime.ClaimsRuntime` (``worker.claims``), guards the tasks'
  ``run`` and runs the :class:`~celery_claims.worker.delivery.keeper.Keeper` thread.
- :class:`History` (worker): stops the task history's writer at shutdown, after writing
  what it holds for a bounded time (:func:`~celery_claims.worker.history.stop_history`).
- :class:`Gate` (consumer): installs the :class:`~celery_claims.worker.delivery.gate.ClaimGate` in
  front of ``consumer.on_task_request``.
- :class:`Sweep` (consumer): runs the Redis broker's restore sweep where kombu does not run it
  at the configured cadence (:class:`~celery_claims.worker.transport.sweep.RestoreSweep`: pools
  without an event loop, and kombu before 5.7).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from celery_claims.connection import describe
from celery_claims.errors import InvalidArgument
from celery_claims.names import check_names, lane_findings
from celery_claims.safety import Finding, Severity, check_settings
from celery_claims.worker.compat import check_versions, pool_name
from celery_claims.worker.delivery.gate import ClaimGate
from celery_claims.worker.delivery.guard import guard_tasks
from celery_claims.worker.delivery.keeper import Keeper
from celery_claims.worker.history import stop_history
from celery_claims.worker.policy import any_acks_on_claim, check_task_policies
from celery_claims.worker.publish.producer import connect_producer
from celery_claims.worker.runtime import ClaimsRuntime
from celery_claims.worker.settings import (
    WORKER_OPTION_NAMES,
    ClaimsSettings,
    SettingRefused,
    load_settings,
)
from celery_claims.worker.transport.broker import store_is_broker
from celery_claims.worker.transport.loop import forget_hub_when_closed
from celery_claims.worker.transport.store import check_durable, check_store
from celery_claims.worker.transport.sweep import RestoreSweep, bound_restore_lock

__all__ = ["History", "Gate", "LeaseKeeper", "Sweep", "check_start", "check_unsafe_settings"]

logger = get_logger("celery_claims.worker")


class _Overridden:
    """``app.conf`` as the worker sees it: command-line ``--claims-*`` values win."""

    def __init__(self, conf: Any, overrides: Mapping[str, Any]) -> None:
        self._conf = conf
        self._given = {k: v for k, v in overrides.items() if v is not None}

    def get(self, key: str, default: Any = None) -> Any:
        return self._given[key] if key in self._given else self._conf.get(key, default)

    @property
    def broker_read_url(self) -> Any:
        """The broker as Celery resolves it (the environment and ``celery -b`` included)."""
        return getattr(self._conf, "broker_read_url", None)


def check_start(
    app: Any,
    overrides: Mapping[str, Any] | None = None,
    *,
    pool: str | None = None,
    queues: Iterable[str] = (),
) -> tuple[ClaimsSettings, list[Finding]]:
    """Everything a worker of ``app`` checks before it starts; ``celery claims check`` runs
    this same function, so the two refuse the same configurations with the same words.

    Args:
        app: the Celery app, its tasks registered.
        overrides: the worker's ``--claims-*`` values (``None`` values are ignored).
        pool: the worker's pool by Celery's name (what it does not enforce is noticed).
        queues: the queues the worker consumes, besides those the configuration declares.

    Returns:
        The settings, and the findings to report (unsafe settings, lanes that match
        nothing), errors first.

    Raises:
        InvalidArgument: an unknown ``claims_*`` name, a refused value, a bad task attribute,
            or, under ``claims_strict_settings``, any finding but a notice.
    """
    overrides = overrides or {}
    check_names(app.conf, app.tasks)
    settings = load_settings(app, overrides)
    check_task_policies(app, settings)
    findings = check_settings(_Overridden(app.conf, overrides), pool=pool or None)
    findings += lane_findings(settings.lanes, app.conf, app.tasks, queues)
    findings.sort(key=lambda finding: list(Severity).index(finding.severity))
    _refuse_unsafe(findings, strict=settings.strict_settings)
    return settings, findings


def check_unsafe_settings(
    conf: Any, overrides: Mapping[str, Any], *, strict: bool, pool: str | None = None
) -> None:
    """Log each unsafe Celery setting with its fix; refuse to start in strict mode.

    ``pool`` is the worker's pool by Celery's name (what the pool enforces matters too).

    Raises:
        InvalidArgument: ``strict`` and at least one finding; ``name`` is
            ``claims_strict_settings`` and the message lists every finding.
    """
    findings = check_settings(_Overridden(conf, overrides), pool=pool or None)
    log_findings(findings)
    _refuse_unsafe(findings, strict=strict)


def log_findings(findings: Iterable[Finding]) -> None:
    """Log each finding as a warning (a notice says what the pool does not do)."""
    for finding in findings:
        if finding.severity is Severity.NOTICE:
            # what the pool does not do: nothing in the settings to fix, never refused
            logger.warning("Notice (%s): %s", finding.key, finding.message)
            continue
        logger.warning(
            "Unsafe setting %s (%s): %s", finding.key, finding.severity.value, finding.message
        )


def _refuse_unsafe(findings: Iterable[Finding], *, strict: bool) -> None:
    refused = [f for f in findings if f.severity is not Severity.NOTICE]
    if strict and refused:
        listed = "; ".join(f"{f.key}: {f.message}" for f in refused)
        raise InvalidArgument(
            "claims_strict_settings",
            f"the worker refuses to start with {len(refused)} unsafe setting(s): {listed}",
        )


class LeaseKeeper(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Worker bootstep: reads the settings, creates ``worker.claims``, runs the keeper.

    Settings are validated here, while the worker starts, so a bad ``claims_*`` value stops
    the worker with an error naming the key (:class:`SettingRefused`, one line under
    ``celery worker``) instead of failing on the first task.
    """

    label = "Claims"
    requires = ("celery.worker.components:Timer",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        w.claims = None
        overrides = {name: kwargs.get(name) for name in WORKER_OPTION_NAMES}
        pool = pool_name(getattr(w, "pool_cls", None))
        try:
            # the queues it consumes are known by now (-Q, Celery's setup_queues)
            consumed = list(w.app.amqp.queues)
            settings, findings = check_start(w.app, overrides, pool=pool, queues=consumed)
        except InvalidArgument as exc:
            # one line naming the setting under `celery worker`, not a traceback
            raise SettingRefused.of(exc) from None
        log_findings(findings)
        check_versions()
        # before the consumer connects: the restore lock of a sweeper killed in mid-sweep
        # must not stop takeovers for kombu's 300 s
        bound_restore_lock(w.app.conf)
        # before "ready": a store the worker cannot use stops it here, with one line
        manager = check_store(settings)
        if any_acks_on_claim(w.app, settings):
            unsure = check_durable(manager.client, settings, describe(settings.redis_url))
            if unsure is not None:
                logger.warning("celery-claims: %s", unsure)
        self.runtime = ClaimsRuntime(w.app, settings, w.hostname, manager)
        self.runtime.pool_name = pool
        # the limits Celery hands the pool when a task has none of its own
        self.runtime.time_limits = (
            getattr(w, "soft_time_limit", None),
            getattr(w, "time_limit", None),
        )
        self.keeper = Keeper(self.runtime)
        # the ack carries the completion where the store is the Redis broker's own server
        self.runtime.life.ride_acks = store_is_broker(w.app, self.runtime.manager.client)
        # Where nothing can fail after a task's body, its record goes with the ack. With the
        # store on the broker the process that ran the body sends both in one script
        # (Lifecycle.pool_settle). With a store apart and the body in a pool process or
        # thread of its own (prefork, threads), that process records it, waiting for the
        # store, and the worker acks without a write of its own: one store call per message
        # fewer, and the loop waits for nothing. Where the body runs on the event loop's own
        # thread (solo, gevent, eventlet) the worker writes the record on its pipe instead,
        # without holding up the loop, before the ack.
        left = self.runtime.life.ride_acks or pool not in ("prefork", "threads")
        self.runtime.life.records_left = left
        # before the pool forks and the consumer builds its tracers, which capture task.run
        guard_tasks(w.app, settings, self.runtime.manager, ack_records=left)
        # what the worker's tasks publish is journaled with the worker's settings (also before
        # the fork, so every pool process inherits them)
        connect_producer(w.app).configure(settings)
        w.claims = self.runtime
        super().__init__(w, **kwargs)

    def start(self, w: Any) -> None:
        self.runtime.life.pool = getattr(w, "pool", None)
        forget_hub_when_closed(getattr(w, "hub", None))
        self.keeper.start()

    def stop(self, w: Any) -> None:
        self.keeper.stop()

    terminate = stop
    shutdown = stop


class History(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Worker bootstep: at shutdown, writes what the task history's writer still holds (for
    a bounded time) and stops its thread.

    The writer itself is bound when the worker is ready (``worker_ready``, in the main
    process only). Celery may stop this step before the pool has finished its last tasks;
    an event posted after that starts the writer again, and interpreter exit writes it.
    """

    label = "Claims task history"
    requires = ("celery.worker.components:Timer",)

    def start(self, w: Any) -> None:
        pass

    def stop(self, w: Any) -> None:
        stop_history(w.app)

    terminate = stop
    shutdown = stop


class Gate(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Consumer bootstep installing the :class:`ClaimGate` (written like Celery's ``Heart``)."""

    label = "Claim gate"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        runtime = getattr(getattr(c, "controller", None), "claims", None)
        self.gate: ClaimGate | None = None
        c.claim_gate = None
        if isinstance(runtime, ClaimsRuntime):
            # wrapped here, before the Tasks step builds the strategies that capture it
            self.gate = ClaimGate(c, runtime, c.on_task_request)
            c.on_task_request = self.gate
            c.claim_gate = self.gate
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.resume()

    def stop(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.drop_connection_state()

    shutdown = stop


class Sweep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Consumer bootstep running the :class:`RestoreSweep` (a crashed worker's messages)."""

    label = "Claims restore sweep"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        runtime = getattr(getattr(c, "controller", None), "claims", None)
        self.sweep: RestoreSweep | None = None
        c.claims_sweep = None
        if isinstance(runtime, ClaimsRuntime):
            self.sweep = c.claims_sweep = RestoreSweep(c)
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        if self.sweep is not None:
            self.sweep.start()

    def stop(self, c: Any) -> None:
        if self.sweep is not None:
            self.sweep.stop()

    shutdown = stop
