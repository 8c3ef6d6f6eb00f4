"""apply_once in a real Celery task: a resent task and a stale copy of an attempt write once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_claims import RedisClaimManager
from celery_claims.effects import apply_once, effect_key, effects_table
from celery_claims.fencing import TaskClaim
from celery_claims.worker import signals
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_done, wait_for


def test_a_task_writes_its_effect_once_for_a_resent_copy_and_for_a_stale_copy(
    redis_server: RedisServer,
    queue: str,
    key_prefix: str,
    claims: RedisClaimManager,
    tmp_path: Path,
) -> None:
    # Given a claim-aware app whose task pays an invoice through apply_once (SQLite sink)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'payments.db'}")
    metadata = sa.MetaData()
    markers = effects_table(metadata)
    payments = sa.Table("payments", metadata, sa.Column("invoice", sa.Integer, nullable=False))
    metadata.create_all(engine)
    app = make_app(redis_server.url, queue=queue, claims_prefix=key_prefix)
    seen: list[TaskClaim] = []
    skipped: list[dict[str, Any]] = []

    def pay(conn: sa.Connection, claim: TaskClaim, invoice: int) -> bool:
        done, _ = apply_once(
            conn,
            effect_key(claim),
            lambda c: c.execute(sa.insert(payments).values(invoice=invoice)),
            instance=claim.instance,
            table=markers,
        )
        return done

    @app.task(bind=True, shared=False, name="t.pay")
    def pay_task(self: Any, invoice: int) -> bool:
        seen.append(self.request.claim)
        with engine.begin() as conn:
            return pay(conn, self.request.claim, invoice)

    def on_skipped(sender: Any = None, **kwargs: Any) -> None:
        skipped.append(kwargs)

    task_id = unique("pay")
    signals.task_skipped.connect(on_skipped, weak=False)
    try:
        with in_process_worker(app):
            # When the task runs, and the same task id is published again after completion
            assert pay_task.apply_async((42,), task_id=task_id).get(timeout=20) is True
            wait_done(claims, queue, f"{task_id}:0:0")
            pay_task.apply_async((42,), task_id=task_id)
            wait_for(lambda: skipped, timeout=10, what="the skip of the resent copy")
    finally:
        signals.task_skipped.disconnect(on_skipped)
        close_app(app)

    # Then the body ran once (the gate skipped the resent copy)
    assert [claim.task_id for claim in seen] == [f"{task_id}:0:0"]

    # And a stale copy of that attempt (same claim, running its body a second time) skips
    with engine.begin() as conn:
        assert pay(conn, seen[0], 42) is False
    with engine.connect() as conn:
        assert conn.execute(sa.select(payments.c.invoice)).scalars().all() == [42]
        marked = conn.execute(sa.select(markers.c.key, markers.c.instance)).all()
    assert [tuple(row) for row in marked] == [(f"{queue}/{task_id}:0:0", seen[0].instance)]
    engine.dispose()
