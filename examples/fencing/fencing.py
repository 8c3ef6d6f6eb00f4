"""Fencing a PostgreSQL write with the claim's instance: a stale worker's late write is refused.

Run it with ``python examples/fencing/fencing.py [--dsn postgresql://...]`` (default: the local
PostgreSQL, database ``test``). A private Redis is started for the claims (or ``--redis-url``).

Worker A claims the task and stalls (a GC pause, a stopped VM) past its lease; worker B takes
the task over with a larger instance and writes. When A wakes up and writes too, the guard
``UPDATE ... WHERE fence < :instance`` refuses A's write: the row keeps B's result.
"""

from __future__ import annotations

import argparse
import time
import uuid

import psycopg

from celery_claims import RedisClaimManager, Success, TookOver
from celery_claims.demo.runner import private_redis

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"

#: The guard: a write lands only if no newer claim instance has written the row already.
FENCED_UPDATE = """
    UPDATE invoices SET status = %(status)s, fence = %(instance)s
    WHERE id = %(id)s AND fence < %(instance)s
"""


def fenced_write(conn: psycopg.Connection, invoice: str, status: str, instance: int) -> bool:
    """Write ``status`` if ``instance`` is newer than the row's fence; True if it landed."""
    with conn.transaction():
        cursor = conn.execute(
            FENCED_UPDATE, {"status": status, "instance": instance, "id": invoice}
        )
        return cursor.rowcount == 1


def run(dsn: str, url: str) -> None:
    claims = RedisClaimManager(url=url, prefix=f"fencing-{uuid.uuid4().hex[:6]}")
    invoice = f"inv-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS invoices (id text PRIMARY KEY, status text, "
            "fence bigint NOT NULL DEFAULT 0)"
        )
        conn.execute("INSERT INTO invoices (id, status) VALUES (%s, 'new')", (invoice,))
        try:
            a = claims.claim("billing", invoice, "worker-a/1/1", lease_ms=200)
            assert isinstance(a, Success)
            print(f"worker-a claims {invoice}: instance {a.token.instance}")
            time.sleep(0.3)  # worker-a stalls past its lease
            b = claims.claim("billing", invoice, "worker-b/2/1", lease_ms=30_000)
            assert isinstance(b, TookOver)
            print(f"worker-b takes over: instance {b.token.instance}")
            landed_b = fenced_write(conn, invoice, "charged by b", b.token.instance)
            outcome = "landed" if landed_b else "refused"
            print(f"worker-b writes with fence {b.token.instance}: {outcome}")
            landed_a = fenced_write(conn, invoice, "charged by a", a.token.instance)
            print(f"worker-a wakes, writes with fence {a.token.instance}: "
                  f"{'landed' if landed_a else 'refused'}")  # fmt: skip
            status, fence = conn.execute(
                "SELECT status, fence FROM invoices WHERE id = %s", (invoice,)
            ).fetchone() or ("?", 0)
            print(f"row: status={status!r} fence={fence}")
        finally:
            conn.execute("DELETE FROM invoices WHERE id = %s", (invoice,))
            for key in claims.client.scan_iter(match=f"{claims.prefix}*"):
                claims.client.delete(key)
            claims.client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    if args.redis_url:
        run(args.dsn, args.redis_url)
    else:
        with private_redis() as url:
            run(args.dsn, url)


if __name__ == "__main__":
    main()
