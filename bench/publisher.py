"""One producer of ``bench/celery_overhead.py``, in a process of its own.

``python bench/publisher.py VARIANT URL QUEUE``, run with a checkout's root first on
``PYTHONPATH``: builds that checkout's app of ``VARIANT`` (``bench.overhead_app.build``, its
``celery_claims`` and so its publish journal, if it has one), then reads one command a line on
stdin, ``TASK N OFFSET QUEUE``: publish ``N`` tasks ``TASK`` with the arguments ``OFFSET`` to
``OFFSET + N - 1`` to ``QUEUE``, on one producer, and answer ``published``. It ends at EOF.

Why a process: a ``-base`` variant's producer runs another checkout's ``celery_claims``, which
cannot be imported beside this one; every variant's producer runs so, so that their CPU is
measured alike (the caller reads this process's ``schedstat``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# A script's own folder comes first on sys.path: the checkout's root (PYTHONPATH) must win, or
# its ``bench`` modules would be this tree's.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

from bench.overhead_app import build


def main() -> None:
    variant, url, default_queue = sys.argv[1:4]
    app = build(variant, url, default_queue)
    try:
        while line := sys.stdin.readline():
            task, n, offset, queue = line.split()
            sender = app.tasks[task]
            with app.producer_or_acquire() as producer:
                for i in range(int(n)):
                    sender.apply_async((int(offset) + i,), queue=queue, producer=producer)
            sys.stdout.write("published\n")
            sys.stdout.flush()
    finally:
        app.close()


if __name__ == "__main__":
    main()
