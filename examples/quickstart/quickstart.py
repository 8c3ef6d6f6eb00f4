"""Claims against a real Redis in 30 lines of output: contention, expiry, takeover, fencing.

Run it with ``python examples/quickstart/quickstart.py``. It starts a private ``redis-server``
on a free port (and stops it at the end), or uses ``--redis-url`` if you pass one.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from celery_claims import (
    AlreadyClaimed,
    AlreadyDone,
    ClaimToken,
    RedisClaimManager,
    StaleClaimToken,
    Success,
    TookOver,
)


@contextmanager
def private_redis() -> Iterator[str]:
    """A throw-away redis-server on a free port; never touches a Redis you run."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH; pass --redis-url redis://host:port/0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="claims-quickstart-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.025)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def demo(url: str) -> None:
    with RedisClaimManager(url=url, prefix="quickstart") as claims:
        show(claims)


def show(claims: RedisClaimManager) -> None:
    first = claims.claim("emails", "send-invoice-42", "worker-a/101/1", lease_ms=300)
    assert isinstance(first, Success)
    print(
        f"worker-a claims the task:        {type(first).__name__}, instance {first.token.instance}"
    )

    second = claims.claim("emails", "send-invoice-42", "worker-b/202/1", lease_ms=300)
    assert isinstance(second, AlreadyClaimed)
    print(f"worker-b tries while it runs:    {type(second).__name__} by {second.owner}")

    time.sleep(0.1)  # the task runs for a while; the lease keeper renews it
    [renewed] = claims.renew("emails", [first.token], lease_ms=300)
    assert isinstance(renewed, ClaimToken)
    moved = renewed.expires_at - first.token.expires_at
    print(f"worker-a renews its lease:       expiry moved {moved} ms later, same instance")

    print("worker-a stops renewing (crash); the lease runs out ...")
    time.sleep(0.35)
    taken = claims.claim("emails", "send-invoice-42", "worker-b/202/1", lease_ms=30_000)
    assert isinstance(taken, TookOver)
    print(f"worker-b takes over:             {type(taken).__name__} from {taken.previous_owner}, "
          f"instance {taken.token.instance}")  # fmt: skip

    try:
        claims.release(first.token)
    except StaleClaimToken as refused:
        print(f"worker-a wakes up and releases:  refused ({refused.message}); its work is fenced")

    claims.complete(taken.token, done_ttl_ms=60_000)
    done = claims.claim_unless_done("emails", "send-invoice-42", "worker-c/303/1", 30_000)
    assert isinstance(done, AlreadyDone)
    print(f"a redelivered copy arrives:      {type(done).__name__} by instance {done.instance}"
          " -> acknowledged without running")  # fmt: skip
    print(f"stats:                           {claims.stats()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="use this Redis instead of a private one")
    args = parser.parse_args()
    if args.redis_url:
        demo(args.redis_url)
    else:
        with private_redis() as url:
            demo(url)


if __name__ == "__main__":
    main()
