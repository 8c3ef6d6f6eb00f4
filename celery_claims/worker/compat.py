"""Every Celery internal the worker layer touches, in one place; kombu's are in ``transport/``.

Each function here leans on something Celery does not document as public: a private
attribute of ``Request``, the shape of an exception wrapper, an app's cached ``amqp``. They
were read in Celery and kombu 5.3 to 5.7 (:data:`TESTED`), and the suite runs on each of those
minors (tox.ini, ``celery53`` to ``celery57``); a worker running other versions logs a warning
once at start (:func:`check_versions`), and every function degrades to the safe side when what
it expects is missing (the broker then redelivers, nothing is lost).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import celery
import kombu
from celery import signals as celery_signals
from celery.exceptions import TaskRevokedError, TimeLimitExceeded
from celery.utils.log import get_logger
from celery.utils.saferepr import saferepr
from celery.worker.state import task_ready

__all__ = [
    "set_queue_consuming",
    "TESTED",
    "RequestHooks",
    "hook_request",
    "request_fields",
    "set_request_field",
    "prefetch_qos",
    "before_gone",
    "check_versions",
    "close_result_backend",
    "close_with",
    "fail_unrun",
    "fleet_rate_limits",
    "message_state",
    "pool_name",
    "republish",
    "requeued",
    "result_ready",
    "revoke_unrun",
    "task_queues",
    "task_ready",
    "unwrap_exception",
    "wrap_send_task",
    "wrap_task_sender",
]

logger = get_logger("celery_claims.worker")

#: (first, last) major.minor of Celery and kombu whose internals this module was checked on,
#: each run by tox (celery53: Celery 5.3.6, kombu 5.3.7 ... celery57: Celery 5.7.0, kombu 5.7.0).
TESTED = {"celery": ((5, 3), (5, 7)), "kombu": ((5, 3), (5, 7))}


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_versions() -> list[str]:
    """Warn about a Celery or kombu outside :data:`TESTED`; returns the warnings."""
    found = {"celery": celery.__version__, "kombu": kombu.__version__}
    warnings = []
    for name, version in found.items():
        first, last = TESTED[name]
        if not first <= _major_minor(version) <= last:
            warnings.append(
                f"{name} {version} is outside the versions celery-claims was checked on "
                f"({first[0]}.{first[1]} to {last[0]}.{last[1]})"
            )
    for text in warnings:
        logger.warning("celery-claims: %s", text)
    return warnings


#: Celery's pool modules (``celery.concurrency.<module>``) by the names ``-P`` takes.
_POOL_MODULES = {
    "prefork": "prefork",
    "thread": "threads",
    "solo": "solo",
    "gevent": "gevent",
    "eventlet": "eventlet",
}


def pool_name(pool_cls: Any) -> str:
    """Celery's name of a worker's pool class (``w.pool_cls``): ``"prefork"``, ``"threads"``,
    ``"solo"``, ``"gevent"``, ``"eventlet"``; ``""`` for any other (a custom pool)."""
    module = str(getattr(pool_cls, "__module__", "") or "")
    package, _, leaf = module.rpartition(".")
    if package != "celery.concurrency":
        return ""
    return _POOL_MODULES.get(leaf, "")


def result_ready(request: Any) -> bool:
    """True if the pool already has the request's outcome (prefork ``ApplyResult``)."""
    ref = getattr(request, "_apply_result", None)
    result = ref() if callable(ref) else None
    ready = getattr(result, "ready", None)
    return bool(ready()) if callable(ready) else False


def unwrap_exception(exc: BaseException | None) -> BaseException | None:
    """The exception a pool reported, unwrapped from prefork's pickling wrapper."""
    inner = getattr(exc, "exc", None)
    if type(exc).__name__ == "ExceptionWithTraceback" and isinstance(inner, BaseException):
        return inner
    return exc


def message_state(request: Any) -> str | None:
    """kombu's state of the request's message once it was acked or rejected (``ACK``,
    ``REJECTED``, ``REQUEUED``); None before (still ``RECEIVED``), or unknown."""
    state = getattr(getattr(request, "message", None), "_state", None)
    return state if state in ("ACK", "REJECTED", "REQUEUED") else None


def before_gone(request: Any, fn: Callable[[], object]) -> bool:
    """Run ``fn()`` once, just before Celery acks the request's message or rejects it for
    good (not when it requeues it); False where the request cannot be hooked (nothing done).

    Wraps the request's ``_on_ack`` and ``_on_reject``, the callables ``Request.acknowledge``
    and ``Request.reject`` call (``message.ack_log_error`` / ``reject_log_error``, through
    ``consumer.call_soon_ack`` in Celery 5.7); read in Celery 5.3 to 5.7. Celery's own call
    always follows, whatever ``fn`` raises.
    """
    on_ack = getattr(request, "_on_ack", None)
    on_reject = getattr(request, "_on_reject", None)
    if not callable(on_ack) or not callable(on_reject):
        return False
    pending = [fn]

    def run_once() -> None:
        if pending:
            try:
                pending.pop()()
            except Exception:
                logger.exception("celery-claims: a callback before the ack failed")

    def ack(*args: Any, **kwargs: Any) -> Any:
        run_once()
        return on_ack(*args, **kwargs)

    def reject(logger_: Any, errors: Any, requeue: bool = False, *args: Any, **kw: Any) -> Any:
        if not requeue:
            run_once()
        return on_reject(logger_, errors, requeue, *args, **kw)

    try:
        request._on_ack = ack
        request._on_reject = reject
    except AttributeError:
        return False
    return True


def requeued(request: Any) -> bool:
    """True if Celery's handler handed the request's message back to the broker
    (``reject(requeue=True)``): kombu's ``Message._state`` is ``REQUEUED`` then (``ACK`` or
    ``REJECTED`` when the message is gone for good). Unknown means requeued: the journal entry
    is then kept, which costs only its memory."""
    return message_state(request) not in ("ACK", "REJECTED")


def wrap_send_task(app: Any, around: Callable[..., Any]) -> None:
    """Route ``app.send_task`` through ``around(send_task, name, args, kwargs)`` (idempotent).

    ``Celery.send_task`` is the one path every publish of an app takes (``apply_async``,
    ``retry``, ``replace``, canvas, beat, ``celery call``), and ``Task.apply_async`` looks
    it up on the app instance at call time, so an instance attribute catches them all. It
    knows the app, which Celery's ``before_task_publish`` signal does not say. Read in
    Celery 5.3 to 5.7 (``celery/app/base.py``, ``celery/app/task.py``).
    """
    if getattr(app.send_task, "_celery_claims_wrapped", False):
        return
    original = app.send_task

    def send_task(*args: Any, **kwargs: Any) -> Any:
        return around(original, args, kwargs)

    send_task._celery_claims_wrapped = True  # type: ignore[attr-defined]
    send_task.__doc__ = original.__doc__
    app.send_task = send_task


def wrap_task_sender(app: Any, on_producer: Callable[[Any], object]) -> None:
    """Call ``on_producer(producer)`` before each task message ``app`` sends (idempotent).

    Celery's ``app.amqp.send_task_message(producer, name, message, ...)`` is the one call of
    ``send_task`` that holds the producer; it is a ``cached_property`` of ``app.amqp``, built
    from the configuration when first read, so this wraps it on the first publish (once the
    app is configured). Read in Celery 5.3 to 5.7 (``celery/app/amqp.py``, ``base.py``).
    """
    amqp = app.amqp
    inner = amqp.send_task_message
    if getattr(inner, "_celery_claims_wrapped", False):
        return

    def send_task_message(producer: Any, *args: Any, **kwargs: Any) -> Any:
        on_producer(producer)
        return inner(producer, *args, **kwargs)

    send_task_message._celery_claims_wrapped = True  # type: ignore[attr-defined]
    amqp.send_task_message = send_task_message


def close_with(owner: Any, close: Callable[[], object]) -> None:
    """Call ``close()`` when ``owner.close()`` is called (before the owner's own close): a
    Celery app or a kombu channel.

    Celery has no signal for an app's close (``Celery.close`` only releases its broker
    pool), kombu none for a channel's (a connection's ``release`` calls each channel's
    ``close``); an instance attribute is looked up first, as for :func:`wrap_send_task`.
    Read in Celery 5.3 to 5.7 and kombu 5.3 to 5.7.
    """
    original = owner.close

    def closing(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            close()
        return original(*args, **kwargs)

    closing.__doc__ = original.__doc__
    owner.close = closing


def _nothing_to_cancel(task_id: str) -> None:
    """The ``cancel_for`` of a closed result consumer: it follows nothing any more."""


def close_result_backend(backend: Any) -> None:
    """Close a result backend's pub/sub consumer and its connections.

    Celery leaves these to the garbage collector. The consumer also lets go of its pub/sub:
    an ``AsyncResult`` deleted later unsubscribes through it, and Celery 5.3 to 5.6's Redis
    consumer sends that even for a task it no longer follows, reconnecting for it (to a
    server that may be gone by then); 5.7 skips it. A later wait subscribes afresh. Read in
    Celery 5.3 to 5.7.
    """
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        with contextlib.suppress(Exception):
            consumer.stop()
        if getattr(consumer, "_pubsub", None) is not None:
            consumer._pubsub = None
        # a result the collector frees later (one in a reference cycle) unsubscribes from
        # nothing: through the stopped consumer it reconnected for 20 s to a server that may
        # be gone by then, and raised in its finaliser
        with contextlib.suppress(Exception):
            consumer.cancel_for = _nothing_to_cancel
    client = getattr(backend, "client", None)
    if client is not None:
        with contextlib.suppress(Exception):
            client.connection_pool.disconnect()


def fail_unrun(request: Any, exc: BaseException) -> None:
    """Record a request that is never run as failed with ``exc``, as Celery records a task
    that rejects its message without requeueing (``Request.on_failure`` for ``Reject``): the
    FAILURE result, the ``task_failure`` signal and the ``task-failed`` event. The caller acks.

    Touches ``Request._context`` (the task's request context, built lazily by Celery) and
    ``Request.store_errors``.
    """
    task = request.task
    context = getattr(request, "_context", None)
    task.backend.mark_as_failure(
        request.id, exc, request=context, store_result=getattr(request, "store_errors", True)
    )
    celery_signals.task_failure.send(
        sender=task,
        task_id=request.id,
        exception=exc,
        args=request.args,
        kwargs=request.kwargs,
        traceback=None,
        einfo=None,
    )
    with contextlib.suppress(Exception):
        request.send_event("task-failed", exception=saferepr(exc), traceback="")


def republish(request: Any, countdown_s: float, headers: dict[str, Any]) -> None:
    """Publish ``request``'s message again (same task id, arguments, links, routing) with a
    countdown and extra ``headers``, as ``Task.retry`` does from the task's own context
    (``Task.signature_from_request`` with ``Request._context``), but without counting a retry.

    Raises:
        Exception: whatever the producer raises (nothing was published then).
    """
    task = request.task
    context = request._context
    merged = {**(context.headers or {}), **headers}
    signature = task.signature_from_request(
        context, request.args, request.kwargs, countdown=countdown_s, headers=merged
    )
    signature.apply_async()


def revoke_unrun(request: Any, reason: str) -> None:
    """Store a REVOKED result with ``reason`` for a request that is acked without running
    (another task held its key), so ``AsyncResult.get()`` raises ``TaskRevokedError`` instead
    of waiting on a PENDING task for ever. Touches ``Request._context`` and ``store_errors``.
    """
    request.task.backend.mark_as_revoked(
        request.id,
        reason,
        request=getattr(request, "_context", None),
        store_result=getattr(request, "store_errors", True),
    )


def task_queues(app: Any) -> Any:
    """``app.amqp.queues``, the app's task queues, read where Celery keeps them.

    ``Celery.amqp`` and ``AMQP.queues`` are kombu ``cached_property``s: data descriptors
    that take a lock on every read, which the gate makes for every message. Their values are
    kept in the instances' ``__dict__`` once read (set there by the property's setter too,
    removed by its deleter): read there, else through the properties. Read in Celery 5.3 to
    5.7, kombu 5.3 to 5.7 (``kombu/utils/objects.py``).
    """
    amqp = app.__dict__.get("amqp")
    queues = amqp.__dict__.get("queues") if amqp is not None else None
    return app.amqp.queues if queues is None else queues


def request_fields(request: Any) -> Mapping[str, Any]:
    """The request's ``request_dict``: the message's fields the pool hands to the tracer."""
    fields: Mapping[str, Any] = request.request_dict
    return fields


def set_request_field(request: Any, key: str, value: Any) -> None:
    """Set ``key`` in the request dict, or remove it for None.

    The request dict is what the pool hands to the tracer (pickled to a prefork child), which
    builds the task's ``self.request`` from it: how task code and the pool-side guard see
    what the worker decided. Read in Celery 5.3 to 5.7 (``Request.request_dict``).
    """
    if value is None:
        request.request_dict.pop(key, None)
    else:
        request.request_dict[key] = value


def prefetch_qos(consumer: Any) -> tuple[Any, int]:
    """The consumer's prefetch QoS (``consumer.qos``, Celery's ``QoS`` with
    ``increment_eventually``) and its initial prefetch count (0: no limit)."""
    return consumer.qos, int(getattr(consumer, "initial_prefetch_count", 0) or 0)


def set_queue_consuming(consumer: Any, queue: str, consuming: bool) -> bool:
    """Stop (``consuming`` False) or start again the worker's consumer of task queue
    ``queue``, leaving the queues it is set to consume alone: Celery's
    ``cancel_task_queue`` and ``add_task_queue`` also change ``app.amqp.queues``' selection
    (``celery control cancel_consumer``), so a queue an operator cancelled meanwhile is never
    started again here. On the Redis transport a cancel during a read waits for its end
    (kombu's ``basic_cancel``); messages delivered before a cancel stay this worker's, unacked.

    Checked on Celery 5.5-5.7, kombu 5.5-5.7 (``Consumer.task_consumer``, kombu's
    ``Consumer.cancel_by_queue``, ``add_queue``, ``consume``, ``consuming_from``).

    Returns:
        True if the consumer changed.
    """
    tasks = getattr(consumer, "task_consumer", None)
    if tasks is None:
        return False
    if not consuming:
        if not tasks.consuming_from(queue):
            return False
        tasks.cancel_by_queue(queue)
        return True
    queues = consumer.app.amqp.queues
    if tasks.consuming_from(queue) or queue not in queues.consume_from:
        return False
    tasks.add_queue(queues[queue])
    tasks.consume()
    return True


class RequestHooks(Protocol):
    """What to call as the pool reports on a request; each handler argument is Celery's own.

    One per request: made for each message, so a plain object (``__slots__``), not a frozen
    dataclass of callables.
    """

    def accepted(self) -> object:
        """After Celery's ``on_accepted`` (the pool started it)."""

    def succeeded(self, handler: Callable[[], object]) -> object:
        """The body returned; ``handler()`` is Celery's ``on_success``, to be called by the
        hook (or not, for a stale copy)."""

    def failed(self, exc: BaseException | None, handler: Callable[[], object]) -> object:
        """The attempt failed with ``exc`` (unwrapped from prefork's pickling wrapper);
        ``handler()`` is Celery's ``on_failure``."""

    def timed_out(self, soft: bool, handler: Callable[[], object]) -> object:
        """A time limit fired; ``handler()`` is Celery's ``on_timeout``."""

    def revoked(self) -> object:
        """It was revoked before it ran (Celery acks it without a callback)."""

    def reported(self) -> object:
        """The pool's last report on the request was routed: the hooks let go of what refers
        back to the request (the copy), so that the request is freed by reference counting
        rather than left to the cyclic garbage collector. Only a late ``accepted`` may come
        after it (prefork may deliver a start after the result)."""


#: The request's attribute that holds its hooks (in its ``__dict__``).
_HOOKS = "_claims_hooks"

#: The attribute of a request class that holds its hooked subclass (made once per class).
_HOOKED = "_claims_hooked_class"


def hook_request(request: Any, hooks: RequestHooks) -> None:
    """Route the pool's reports on ``request`` through ``hooks``.

    Moves the request to a subclass of its class, made once per class, whose
    ``on_accepted``, ``on_success``, ``on_failure``, ``on_timeout`` and
    ``execute_using_pool`` call the hooks kept on the instance: Celery's generated
    ``Request`` subclass defines them on the class, and the pool call looks them up on the
    instance at call time. A failed trace reaches ``on_success`` first and goes on to
    ``on_failure``. Nothing on the request refers back to it (no closure over its bound
    methods), and after the pool's last report the hooks let go of the copy
    (:meth:`RequestHooks.reported`): a request and its copy are freed by reference counting.
    Read in Celery 5.3 to 5.7 (``celery/worker/request.py``).
    """
    cls = type(request)
    hooked = cls.__dict__.get(_HOOKED)  # a hooked class is its own
    if hooked is None:
        hooked = _hooked_class(cls)
        setattr(cls, _HOOKED, hooked)
    setattr(request, _HOOKS, hooks)
    request.__class__ = hooked


def _last_failure(exc: BaseException | None) -> bool:
    """False for prefork's hard time limit, which reports a failure, then ``on_timeout``."""
    return not isinstance(exc, TimeLimitExceeded)


def _hooked_class(base: Any) -> Any:
    """The subclass of Celery's request class ``base`` whose pool reports go to the hooks."""

    # Celery's request classes are untyped (Any) to mypy
    class Hooked(base):  # type: ignore[misc]
        __slots__ = ()  # the same layout as ``base``, for ``__class__`` assignment

        def on_accepted(self, *args: Any, **kwargs: Any) -> Any:
            result = base.on_accepted(self, *args, **kwargs)
            getattr(self, _HOOKS).accepted()
            return result

        def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
            if failed__retval__runtime[0]:
                # a failed trace goes on to self.on_failure, hooked too
                return base.on_success(self, failed__retval__runtime, **kwargs)
            hooks = getattr(self, _HOOKS)
            try:
                hooks.succeeded(lambda: base.on_success(self, failed__retval__runtime, **kwargs))
            finally:
                hooks.reported()
            return None

        def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            exc = unwrap_exception(getattr(exc_info, "exception", None))
            hooks = getattr(self, _HOOKS)
            try:
                hooks.failed(exc, lambda: base.on_failure(self, exc_info, *args, **kwargs))
            finally:
                if _last_failure(exc):
                    hooks.reported()
            return None

        def on_timeout(self, soft: bool, timeout: Any) -> Any:
            hooks = getattr(self, _HOOKS)
            try:
                hooks.timed_out(soft, lambda: base.on_timeout(self, soft, timeout))
            finally:
                if not soft:
                    hooks.reported()
            return None

        def execute_using_pool(self, pool: Any, **kwargs: Any) -> Any:
            try:
                return base.execute_using_pool(self, pool, **kwargs)
            except TaskRevokedError:
                # revoked before it ran: Celery acks it without calling any callback
                hooks = getattr(self, _HOOKS)
                hooks.revoked()
                hooks.reported()
                raise

    Hooked.__name__ = base.__name__
    Hooked.__qualname__ = base.__qualname__
    Hooked.__module__ = base.__module__
    setattr(Hooked, _HOOKED, Hooked)
    return Hooked


def fleet_rate_limits(consumer: Any, fleetwide: Callable[[Any, str], bool]) -> None:
    """Turn Celery's per-worker ``rate_limit`` token bucket off for the tasks ``fleetwide``
    says have a fleet-wide rate instead (``claims_rate_limit_fleetwide``).

    Celery's strategy takes a task's bucket from ``consumer.task_buckets`` (filled by
    ``consumer.reset_rate_limits()`` with ``consumer.bucket_for_task(task)``, again whenever
    ``celery control rate_limit`` changes a limit) and sleeps requests through it. The
    consumer's own ``bucket_for_task`` is replaced on this instance with one that gives such
    a task no bucket, and the buckets are made again. Read in Celery 5.7
    (``celery/worker/consumer/consumer.py``, ``celery/worker/strategy.py``; the tox matrix of
    5.3 to 5.6 was not run for it yet); without those attributes nothing changes: the task
    is then limited both per worker and per fleet.
    """
    inner = getattr(consumer, "bucket_for_task", None)
    reset = getattr(consumer, "reset_rate_limits", None)
    if inner is None or reset is None or getattr(inner, "claims_fleetwide", False):
        return

    def bucket_for_task(task: Any) -> Any:
        if fleetwide(task, getattr(task, "name", "")):
            return None
        return inner(task)

    bucket_for_task.claims_fleetwide = True  # type: ignore[attr-defined]  # idempotence mark
    consumer.bucket_for_task = bucket_for_task
    reset()
