"""A message's critical path in a real worker, as timestamps (``BENCH_TRACE=DIR``).

Imported by ``bench/overhead_app.py`` when ``BENCH_TRACE`` names a directory: it wraps the
points a message passes in the worker's main process (kombu's ``BRPOP`` sent and read, its
``unacked`` append and its ack, the claim store pipe's writes and replies, the hub's poll,
the pool's hand-off, the blocking round trips of ``rt1``/``rt2-sep``) and, in whichever
process runs the body, the body's start and end (``task_prerun``/``task_postrun``). Each
event is a line ``<monotonic ns> <pid> <event> <detail>``, written to
``DIR/<variant>-<pid>.trace`` (the clock is the system's monotonic one: comparable across
processes; with ``BENCH_TRACE_PROFILE=1`` the main process is also profiled, cProfile, from
its first delivery on, to ``DIR/<variant>-<pid>.prof``). ``bench/trace_report.py`` turns the
files into the time spent between events. Only for measuring: it costs each event a few
microseconds.
"""

from __future__ import annotations

import atexit
import functools
import os
import time
from collections.abc import Callable
from typing import Any

_EVENTS: list[str] = []
_DIR = os.environ.get("BENCH_TRACE", "")
_VARIANT = os.environ.get("BENCH_VARIANT", "x")


def event(name: str, detail: object = "") -> None:
    """Record ``name`` now."""
    _EVENTS.append(f"{time.monotonic_ns()} {os.getpid()} {name} {detail}")
    if len(_EVENTS) >= 500:
        flush()


def flush() -> None:
    """Append the events recorded so far to this process's file."""
    if not _EVENTS or not _DIR:
        return
    lines = "\n".join(_EVENTS) + "\n"
    _EVENTS.clear()
    with open(os.path.join(_DIR, f"{_VARIANT}-{os.getpid()}.trace"), "a") as out:
        out.write(lines)


def wrap(
    owner: Any,
    name: str,
    before: str,
    after: str = "",
    detail: Callable[..., object] = lambda *args, **kwargs: "",
) -> None:
    """Record ``before`` when ``owner.name`` is called and ``after`` when it returns, each
    with ``detail(*args)``."""
    inner: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(inner)
    def traced(*args: Any, **kwargs: Any) -> Any:
        what = detail(*args, **kwargs)
        event(before, what)
        try:
            return inner(*args, **kwargs)
        finally:
            if after:
                event(after, what)

    setattr(owner, name, traced)


def install() -> None:
    """Wrap the points of the path (see the module docstring)."""
    import redis
    from celery import signals
    from celery.concurrency import base as pool_base
    from kombu.transport import redis as kombu_redis
    from kombu.utils import eventio

    wrap(kombu_redis.Channel, "_brpop_start", "brpop>")
    wrap(kombu_redis.Channel, "_brpop_read", "brpop<", "brpop-done")
    tags: dict[Any, str] = {}

    def appended(qos: Any, message: Any, tag: Any, **_: Any) -> str:
        tags[tag] = task_id = str(message.headers.get("id", ""))
        return task_id

    wrap(kombu_redis.QoS, "append", "append>", "append<", appended)
    wrap(kombu_redis.QoS, "ack", "ack>", "ack<", lambda qos, tag, **_: tags.pop(tag, ""))
    wrap(
        pool_base.BasePool,
        "apply_async",
        "pool>",
        detail=lambda pool, target, args=(), *rest, **options: args[1] if args else "",
    )
    wrap(redis.commands.core.Script, "__call__", "rt>", "rt<")

    poll = eventio._epoll.poll

    def traced_poll(self: Any, timeout: Any) -> Any:
        event("poll>", timeout)
        events = poll(self, timeout)
        event("poll<", len(events or ()))
        return events

    eventio._epoll.poll = traced_poll

    try:
        from celery_claims.worker.transport import pipe
    except ImportError:
        pass
    else:
        send = pipe.StorePipe._send

        def traced_send(self: Any, commands: list[Any]) -> None:
            event("pipe>", len(commands))
            send(self, commands)

        pipe.StorePipe._send = traced_send
        wrap(pipe.StorePipe, "_read_one", "pipe<", "pipe-done")
        wrap(pipe.StorePipe, "defer", "defer")
        wrap(pipe.StorePipe, "_on_tick", "tick")

    profiler: Any = None
    if os.environ.get("BENCH_TRACE_PROFILE"):
        import cProfile

        profiler = cProfile.Profile()

    def received(request: Any = None, **_: Any) -> None:
        event("received", getattr(request, "id", ""))
        if profiler is not None and not getattr(profiler, "started", False):
            profiler.started = True
            profiler.enable()  # the consumer's loop, from the first delivery on

    def stop_profile(**_: Any) -> None:
        flush()
        if profiler is not None and getattr(profiler, "started", False):
            profiler.disable()
            profiler.dump_stats(os.path.join(_DIR, f"{_VARIANT}-{os.getpid()}.prof"))

    def prerun(task_id: str = "", **_: Any) -> None:
        event("body>", task_id)

    def postrun(task_id: str = "", **_: Any) -> None:
        event("body<", task_id)

    signals.task_received.connect(received, weak=False)
    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    signals.worker_process_init.connect(lambda **_: _EVENTS.clear(), weak=False)
    signals.worker_process_shutdown.connect(lambda **_: flush(), weak=False)
    signals.worker_shutdown.connect(stop_profile, weak=False)
    atexit.register(flush)


if _DIR:
    install()
