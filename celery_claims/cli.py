"""The ``claims`` command: ``celery -A app claims ...`` and the standalone ``celery-claims``.

Both are this one click group. Under ``celery`` it is a ``celery.commands`` entry point and
reads the claim store's URL and prefix from the app's ``claims_*`` settings; standalone it
takes ``--redis-url`` (or ``-A app``). Output is a human table by default and JSON with
``--json``.

Exit codes: 0 success; 1 nothing found (``inspect`` of an unknown task) or an unsafe setting
(``check``); 2 the claim store cannot be reached, or a usage or configuration error (``check``
of an app a worker would refuse to start). Errors are one line on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import click

from celery_claims.claims.keys import DEFAULT_PREFIX, require_prefix
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.connection import describe as safe_url
from celery_claims.errors import BackendUnavailable, ClaimError, InvalidArgument
from celery_claims.observe import render
from celery_claims.observe.history import History
from celery_claims.observe.views import (
    DEFAULT_TOP_KEYS,
    find_claims,
    find_key,
    find_key_waiters,
    fleet_stats,
    lane_key_running,
    list_views,
    mark_waiting,
    server_now_ms,
)

__all__ = ["EXIT_NOT_FOUND", "EXIT_UNAVAILABLE", "claims", "main"]

#: Exit code of ``inspect`` for a task the store knows nothing about, and of ``check`` when
#: it finds an unsafe setting.
EXIT_NOT_FOUND = 1
#: Exit code when the claim store cannot be reached (also usage and configuration errors).
EXIT_UNAVAILABLE = 2

_F = TypeVar("_F", bound=Callable[..., Any])


# --- the target: which claim store, which app -----------------------------------------------


@dataclass
class Target:
    """What a sub-command works on: the app (if any) and how to reach the claim store.

    Attributes:
        app: the Celery app (from ``celery -A`` or ``--app``), or ``None``.
        redis_url: ``--redis-url``, or ``None`` to take it from the app's settings.
        prefix: ``--prefix``, or ``None`` to take it from the app's settings.
    """

    app: Any = None
    redis_url: str | None = None
    prefix: str | None = None
    _manager: RedisClaimManager | None = field(default=None, repr=False)

    def store(self) -> tuple[str, str]:
        """The claim store's URL and key prefix.

        Raises:
            click.UsageError: neither ``--redis-url`` nor an app says where the store is.
            InvalidArgument: the app's ``claims_*`` settings are invalid.
        """
        url, prefix = self.redis_url, self.prefix
        if self.app is not None and (url is None or prefix is None):
            from celery_claims.worker.settings import load_settings

            # the app's default claim store is its broker as Celery resolves it (the
            # environment's CELERY_BROKER_URL, `celery -b`); --redis-url overrides it
            settings = load_settings(self.app, {"claims_redis_url": url})
            url = url or settings.redis_url
            prefix = prefix or settings.prefix
        if url is None:
            raise click.UsageError(
                "no claim store: pass --redis-url redis://host:port/db, set CLAIMS_REDIS_URL, "
                "or run it as `celery -A yourapp claims ...`"
            )
        return url, require_prefix(prefix or DEFAULT_PREFIX)

    def manager(self) -> RedisClaimManager:
        """A claim manager for the store (made once per command; the app's
        ``claims_redis_options`` and ``claims_redis_cluster`` apply)."""
        if self._manager is None:
            url, prefix = self.store()
            options, cluster = None, False
            if self.app is not None:
                from celery_claims.worker.settings import load_settings

                settings = load_settings(self.app, {"claims_redis_url": self.redis_url})
                options, cluster = dict(settings.redis_options), settings.redis_cluster
            client = connect(url, options, cluster=cluster)
            self._manager = RedisClaimManager(client=client, prefix=prefix)
        return self._manager

    def lane_limits(self) -> dict[str, int]:
        """Lane limits from the app's ``claims_lanes`` setting (``{lane: {"limit": n}}``)."""
        lanes = self.app.conf.get("claims_lanes", None) if self.app is not None else None
        limits: dict[str, int] = {}
        if isinstance(lanes, Mapping):
            for name, spec in lanes.items():
                limit = spec.get("limit") if isinstance(spec, Mapping) else None
                if isinstance(limit, int) and not isinstance(limit, bool):
                    limits[str(name)] = limit
        return limits

    def close(self) -> None:
        """Close the connections the command opened."""
        if self._manager is not None:
            close_client(self._manager.client)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"celery-claims: error: {' '.join(message.split())}", err=True)
    sys.exit(code)


@contextmanager
def _errors(target: Target) -> Iterator[None]:
    """Turn the package's errors into one line on stderr and an exit code."""
    try:
        yield
    except BackendUnavailable as exc:
        where = "the configured claim store"
        # the URL is only known once resolved; an unresolvable one keeps the generic text.
        # Never printed as given: kombu's sanitiser masks its password
        with suppress(Exception):
            where = safe_url(target.store()[0])
        _fail(f"cannot reach the claim store at {where}: {exc.__cause__ or exc}", EXIT_UNAVAILABLE)
    except InvalidArgument as exc:
        _fail(str(exc), EXIT_UNAVAILABLE)
    except ClaimError as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_UNAVAILABLE)
    finally:
        target.close()


def _target(ctx: click.Context) -> Target:
    obj = ctx.find_object(Target)
    assert obj is not None, "the claims group always sets a Target"
    return obj


def _json_option(func: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def _load_app(name: str) -> Any:
    from celery.app.utils import find_app

    # the user's module is found relative to where they run the command, as `celery -A` does
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return find_app(name)
    except Exception as exc:
        _fail(f"cannot load the app {name!r}: {type(exc).__name__}: {exc}", EXIT_UNAVAILABLE)


# --- the group ------------------------------------------------------------------------------


@click.group(name="claims", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--redis-url",
    envvar="CLAIMS_REDIS_URL",
    metavar="URL",
    help="Claim store URL (default: the app's claims_redis_url or Redis broker; "
    "env CLAIMS_REDIS_URL).",
)
@click.option("--prefix", metavar="PREFIX", help="Claim key prefix (default: claims_prefix).")
@click.option(
    "-A", "--app", "app_name", metavar="MODULE", help="Celery app (standalone use; "
    "`celery -A app claims` passes it already)."
)  # fmt: skip
@click.pass_context
def claims(
    ctx: click.Context, redis_url: str | None, prefix: str | None, app_name: str | None
) -> None:
    """Inspect and manage celery-claims: live claims, counters, one task, cleanup, settings."""
    parent = ctx.obj
    app = getattr(parent, "app", None) if parent is not None else None
    if app_name:
        app = _load_app(app_name)
    ctx.obj = Target(app=app, redis_url=redis_url or None, prefix=prefix or None)


@claims.command(name="list")
@click.argument("queue", required=False)
@_json_option
@click.pass_context
def list_command(ctx: click.Context, queue: str | None, as_json: bool) -> None:
    """Live claims (all queues, or QUEUE): task, attempt, running or waiting for its lane,
    owner, instance, lease left."""
    target = _target(ctx)
    with _errors(target):
        manager = target.manager()
        queues = [queue] if queue else manager.known_queues()
        now = server_now_ms(manager.client)
        views = [view for q in queues for view in list_views(manager, q, now)]
        # a copy waiting for its lane holds a live claim too: the history tells them apart
        histories = History(manager.client, manager.prefix).read_many(v.task_id for v in views)
        views = mark_waiting(views, histories)
    if as_json:
        _emit_json(render.list_json(now, queues, views))
    else:
        click.echo(render.list_text(queue, queues, views))


@claims.command()
@click.option(
    "--top-keys",
    type=click.IntRange(min=1),
    default=DEFAULT_TOP_KEYS,
    show_default=True,
    help="Keys shown per keyed lane: those with the most running tasks.",
)
@_json_option
@click.pass_context
def stats(ctx: click.Context, top_keys: int, as_json: bool) -> None:
    """Per-queue counters and live claims, lane occupancy (per key in a keyed lane), and the
    copies waiting for each fleet-wide rate."""
    target = _target(ctx)
    with _errors(target):
        fleet = fleet_stats(target.manager(), target.lane_limits(), top_keys=top_keys)
    if as_json:
        _emit_json(render.stats_json(fleet.per_queue, fleet.live, fleet.lanes, fleet.rates))
    else:
        click.echo(render.stats_text(fleet.per_queue, fleet.live, fleet.lanes, fleet.rates))


@claims.command()
@click.argument("task_id")
@click.option("--queue", "queues", multiple=True, help="Look only in this queue (repeatable).")
@_json_option
@click.pass_context
def inspect(ctx: click.Context, task_id: str, queues: tuple[str, ...], as_json: bool) -> None:
    """One task: who holds it and until when, done or not, and why copies were skipped."""
    target = _target(ctx)
    with _errors(target):
        manager = target.manager()
        now = server_now_ms(manager.client)
        views = find_claims(manager, task_id, queues=list(queues) or None, now_ms=now)
        history = History(manager.client, manager.prefix).read(task_id)
        views = mark_waiting(views, {task_id: history})
    found = bool(views or history)
    if as_json:
        _emit_json(render.inspect_json(task_id, now, views, history))
        if not found:
            sys.exit(EXIT_NOT_FOUND)
        return
    if not found:
        _fail(
            f"task {task_id!r} is unknown to the claim store: no claim, completion record or "
            f"history (never claimed, claimed under another prefix, or its records expired)",
            EXIT_NOT_FOUND,
        )
    click.echo(render.inspect_text(task_id, now, views, history))


@claims.command(name="key")
@click.argument("key")
@click.option("--queue", "queues", multiple=True, help="Look only in this queue (repeatable).")
@_json_option
@click.pass_context
def key_command(ctx: click.Context, key: str, queues: tuple[str, ...], as_json: bool) -> None:
    """Who holds KEY and what waits on it. KEY is a keyed task's key
    (`<task or namespace>[<key>]`, as `list` shows it, e.g. "tasks.sync['acme']": its holder,
    until when, whether it is kept done by claims_key_done_ttl, and the copies held waiting
    for it) or a keyed lane's (`<lane>[<key>]`, e.g. "exports['acme']": the lane slots it
    holds and the messages waiting for its slot)."""
    target = _target(ctx)
    with _errors(target):
        manager = target.manager()
        now = server_now_ms(manager.client)
        looked_in = list(queues) or manager.known_queues()
        views = find_key(manager, key, queues=looked_in, now_ms=now)
        lanes = lane_key_running(manager.client, manager.prefix, key, now_ms=now)
        waiters = find_key_waiters(manager, key, holders=views, queues=looked_in, now_ms=now)
    found = bool(views or lanes or waiters)
    if as_json:
        _emit_json(render.key_json(key, now, views, lanes, waiters, looked_in))
        if not found:
            sys.exit(EXIT_NOT_FOUND)
        return
    if not found:
        # a name without a key's form (a task id, a bare value) is not called free
        _fail(render.key_not_found(key, looked_in), EXIT_NOT_FOUND)
    click.echo(render.key_text(key, now, views, lanes, waiters))


@claims.command()
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Remove at most this many.")
@_json_option
@click.pass_context
def cleanup(ctx: click.Context, limit: int | None, as_json: bool) -> None:
    """Remove expired claims and completion records now (what the beat task does)."""
    target = _target(ctx)
    with _errors(target):
        removed = target.manager().cleanup_expired(limit=limit)
    if as_json:
        _emit_json({"removed": removed})
    else:
        click.echo(f"removed {removed} expired claim(s)")


@claims.command()
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too, not only on errors.")
@click.option(
    "--pool",
    "-P",
    type=click.Choice(["prefork", "threads", "solo", "gevent", "eventlet"]),
    default=None,
    help="The workers' pool (default: worker_pool, else prefork): what it does not enforce.",
)
@click.option(
    "--queues",
    "-Q",
    default="",
    metavar="QUEUES",
    help="Queues the workers consume besides those the app declares (their -Q), "
    "comma-separated: a lane on one of them matches something.",
)
@_json_option
@click.pass_context
def check(ctx: click.Context, strict: bool, pool: str | None, queues: str, as_json: bool) -> None:
    """Check the app as a worker does when it starts: exit 2 with the worker's own error if
    it would refuse to start; report settings that weaken or defeat claims, each with its
    fix, and lanes that match nothing (needs the app)."""
    from celery_claims.safety import Finding, Severity
    from celery_claims.worker.steps import check_start

    target = _target(ctx)
    if target.app is None:
        _fail("check needs the app: run `celery -A yourapp claims check`", EXIT_UNAVAILABLE)
    consumed = [name.strip() for name in queues.split(",") if name.strip()]
    with _errors(target):
        # the task modules a worker imports before it starts (imports, include)
        target.app.loader.import_default_modules()
        settings, findings = check_start(target.app, pool=pool, queues=consumed)
        unsure = _check_durable(target.app, settings)
    if unsure is not None:
        findings.append(Finding("claims_ack_on_claim", Severity.WARNING, unsure))
    if as_json:
        _emit_json({"findings": [f.as_dict() for f in findings]})
    elif not findings:
        click.echo("no unsafe settings found")
    else:
        for finding in findings:
            click.echo(f"{finding.severity.value.upper():7}  {finding.key}: {finding.message}")
    failing = [
        f
        for f in findings
        if f.severity == Severity.ERROR or (strict and f.severity == Severity.WARNING)
    ]
    if failing:
        sys.exit(EXIT_NOT_FOUND)


def _check_durable(app: Any, settings: Any) -> str | None:
    """The worker's start check of a claim store that must persist (``claims_ack_on_claim``),
    as the worker runs it: refused with its words (exit 2), or a warning where it cannot tell."""
    from celery_claims.worker.policy import any_acks_on_claim
    from celery_claims.worker.transport.store import StoreRefused, check_durable, new_client

    if not any_acks_on_claim(app, settings):
        return None
    client = new_client(settings)
    try:
        return check_durable(client, settings, safe_url(settings.redis_url))
    except StoreRefused as exc:
        _fail(exc.message, EXIT_UNAVAILABLE)
    except BackendUnavailable as exc:
        return (
            f"claims_ack_on_claim: the claim store must persist; it could not be reached to "
            f"tell ({exc})"
        )
    finally:
        close_client(client)


@claims.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.pass_context
def metrics(ctx: click.Context, port: int, addr: str) -> None:
    """Serve the claim store's fleet-wide metrics for Prometheus until interrupted."""
    import time

    from celery_claims.metrics import serve_store_metrics

    target = _target(ctx)
    with _errors(target):
        manager = target.manager()
        server_now_ms(manager.client)  # fail now, not at the first scrape, if unreachable
        bound = serve_store_metrics(manager, port=port, addr=addr, lane_limits=target.lane_limits())
        click.echo(f"serving celery-claims metrics on http://{addr}:{bound}/metrics", err=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


@claims.command()
@click.option(
    "--redis-url",
    "demo_url",
    metavar="URL",
    help="Use this Redis instead of starting a private one (keys are namespaced and removed).",
)
@click.option("--lane-limit", type=click.IntRange(1, 3), default=2, show_default=True)
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a TTY).")
@_json_option
@click.pass_context
def demo(
    ctx: click.Context, demo_url: str | None, lane_limit: int, progress: bool | None, as_json: bool
) -> None:
    """Run a real 2-worker fleet with and without claims and report the difference."""
    from celery_claims.demo.runner import DemoError, run_demo

    url = demo_url or _target(ctx).redis_url
    try:
        report = run_demo(redis_url=url, lane_limit=lane_limit, progress=progress)
    except DemoError as exc:
        _fail(str(exc), EXIT_UNAVAILABLE)
    if as_json:
        _emit_json(report.as_dict())
    else:
        click.echo(report.text())


def main(argv: Sequence[str] | None = None) -> None:
    """The ``celery-claims`` console script."""
    claims.main(args=list(argv) if argv is not None else None, prog_name="celery-claims")


if __name__ == "__main__":
    main()
