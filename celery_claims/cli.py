"""The ``claims`` command: ``celery -A app claims ...`` and the standalone ``celery-claims``.

Both are this one click group. Under ``celery`` it is a ``celery.commands`` entry point and
reads the claim store's URL and prefix from the app's ``claims_*`` settings; standalone it
takes ``--redis-url`` (or ``-A app``). Output is a human table by default and JSON with
``--json``.

Exit codes: 0 success; 1 nothing found (``inspect`` of an unknown task) or an unsafe setting
(``check``); 2 the claim store cannot be reached, or a usage or configuration error. Errors
are one line on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

import click

from celery_claims.claims.keys import DEFAULT_PREFIX, require_prefix
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.errors import BackendUnavailable, ClaimError, InvalidArgument
from celery_claims.observe import (
    ClaimView,
    Journal,
    JournalEvent,
    LaneOccupancy,
    find_claims,
    lane_occupancy,
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


def _safe_url(url: str) -> str:
    # never print a password: keep scheme, host, port and db
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"celery-claims: error: {' '.join(message.split())}", err=True)
    sys.exit(code)


@contextmanager
def _errors(target: Target) -> Iterator[None]:
    """Turn the package's errors into one line on stderr and an exit code."""
    try:
        yield
    except BackendUnavailable as exc:
        where = target.redis_url or "the configured claim store"
        # the URL is only known once resolved; an unresolvable one keeps the generic text
        with suppress(Exception):
            where = _safe_url(target.store()[0])
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


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, columns padded to their widest cell."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _utc(ms: int) -> str:
    return (
        datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        + "Z"
    )


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.1f}s"


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
        # a copy waiting for its lane holds a live claim too: the journal tells them apart
        journals = Journal(manager.client, manager.prefix).read_many(v.task_id for v in views)
        views = mark_waiting(views, journals)
    if as_json:
        _emit_json({"now_ms": now, "queues": queues, "claims": [v.as_dict() for v in views]})
        return
    if not views:
        where = f"queue {queue!r}" if queue else f"{len(queues)} known queue(s)"
        click.echo(f"no live claims in {where}")
        return
    rows = [
        (v.queue, v.task_id, v.attempt, _state(v), v.owner, v.instance, _seconds(v.remaining_ms))
        for v in views
    ]
    headers = ("QUEUE", "TASK", "ATTEMPT", "STATE", "OWNER", "INSTANCE", "LEASE LEFT")
    click.echo(_table(headers, rows))
    waiting = sum(1 for v in views if v.state == "waiting")
    click.echo(f"\n{len(views)} live claim(s), {waiting} of them waiting for a lane slot")


def _state(view: ClaimView) -> str:
    return f"waiting (lane {view.lane})" if view.state == "waiting" else view.state


@claims.command()
@_json_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Per-queue counters and live claims, and lane occupancy."""
    target = _target(ctx)
    with _errors(target):
        manager = target.manager()
        now = server_now_ms(manager.client)
        per_queue = manager.queue_stats()
        live = {q: len(list_views(manager, q, now)) for q in per_queue}
        lanes = lane_occupancy(
            manager.client, manager.prefix, now_ms=now, limits=target.lane_limits()
        )
    if as_json:
        _emit_json(
            {
                "queues": {
                    q: {"live": live[q], **{k: getattr(s, k) for k in _STAT_FIELDS}}
                    for q, s in per_queue.items()
                },
                "lanes": [lane.as_dict() for lane in lanes],
            }
        )
        return
    if per_queue:
        rows = [
            (q, live[q], *(getattr(s, k) for k in _STAT_FIELDS))
            for q, s in sorted(per_queue.items())
        ]
        click.echo(_table(("QUEUE", "LIVE", *(k.upper() for k in _STAT_FIELDS)), rows))
    else:
        click.echo("no queue has been claimed in yet")
    click.echo()
    click.echo(_lanes_text(lanes))


_STAT_FIELDS = ("attempts", "successes", "contentions", "takeovers", "acks", "expirations")


def _lanes_text(lanes: Sequence[LaneOccupancy]) -> str:
    if not lanes:
        return "lanes: none in use"
    rows = [
        (lane.lane, lane.kind, lane.active, "-" if lane.limit is None else lane.limit, lane.waiting)
        for lane in lanes
    ]
    return _table(("LANE", "KIND", "ACTIVE", "LIMIT", "WAITING"), rows)


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
        journal = Journal(manager.client, manager.prefix).read(task_id)
        views = mark_waiting(views, {task_id: journal})
    if as_json:
        _emit_json(
            {
                "task_id": task_id,
                "now_ms": now,
                "found": bool(views or journal),
                "claims": [v.as_dict() for v in views],
                "journal": [
                    {**{k: getattr(e, k) for k in e.__slots__}, "text": e.describe()}
                    for e in journal
                ],
            }
        )
        if not (views or journal):
            sys.exit(EXIT_NOT_FOUND)
        return
    if not (views or journal):
        _fail(
            f"task {task_id!r} is unknown to the claim store: no claim, completion record or "
            f"journal (never claimed, claimed under another prefix, or its records expired)",
            EXIT_NOT_FOUND,
        )
    click.echo(f"task {task_id}")
    for view in views:
        click.echo(_describe(view, now))
    if not views:
        click.echo(_without_claim(journal))
    if journal:
        click.echo("copies:")
        for event in journal:
            click.echo(f"  {_utc(event.at_ms)}  {event.describe()}")
    else:
        click.echo("copies: no copy was skipped or held (or the journal is not connected)")


def _describe(view: ClaimView, now: int) -> str:
    head = f"  queue {view.queue}, attempt {view.attempt}: "
    if view.state == "done":
        return (
            head + f"DONE by {view.owner} (instance {view.instance}) at {_utc(view.since_ms)}; "
            f"later copies are acked unrun until {_utc(view.until_ms)}"
        )
    if view.state == "given_up":
        return (
            head + f"GIVEN UP as poison at {_utc(view.since_ms)} (takeovers: {view.takeovers}, "
            f"last holder whose lease ran out: {view.owner}); later copies are acked unrun "
            f"until {_utc(view.until_ms)}"
        )
    if view.state == "waiting":
        return (
            head + f"WAITING for a slot of lane {view.lane} (claimed, not running yet), held by "
            f"{view.owner} (instance {view.instance}) since {_utc(view.since_ms)}, lease until "
            f"{_utc(view.until_ms)} ({_seconds(view.remaining_ms)} left)"
        )
    if view.state == "running":
        return (
            head + f"RUNNING, held by {view.owner} (instance {view.instance}) since "
            f"{_utc(view.since_ms)}, lease until {_utc(view.until_ms)} "
            f"({_seconds(view.remaining_ms)} left)"
        )
    return (
        head + f"EXPIRED lease of {view.owner} (instance {view.instance}) "
        f"{_seconds(now - view.until_ms)} ago; the next copy takes it over"
    )


def _without_claim(journal: Sequence[JournalEvent]) -> str:
    """What the journal says of a task the store has no claim or record of."""
    ended = [e for e in journal if e.event in ("released", "lease_lost", "skipped")]
    last = ended[-1] if ended else None
    if last is not None and last.event == "released":
        return (
            f"  no live claim and no completion record: the last attempt ended without success "
            f"on {last.worker} at {_utc(last.at_ms)} ({last.reason}); its claim was released, "
            f"so a later copy of it runs again (the result backend has the error)"
        )
    return (
        "  no live claim and no completion record (finished and its record expired, or "
        "released): the journal below is all that is known"
    )


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
@_json_option
@click.pass_context
def check(ctx: click.Context, strict: bool, pool: str | None, as_json: bool) -> None:
    """Report settings that weaken or defeat claims, each with its fix (needs the app)."""
    from celery_claims.safety import Severity, check_settings

    target = _target(ctx)
    if target.app is None:
        _fail("check needs the app: run `celery -A yourapp claims check`", EXIT_UNAVAILABLE)
    with _errors(target):
        findings = check_settings(target.app.conf, pool=pool)
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
