"""Skews this Python process's wall clock by ``CHAOS_CLOCK_SKEW_S`` seconds (the chaos soak).

Put on ``PYTHONPATH`` of a worker subprocess, it runs before anything else is imported, so
Celery, kombu and celery-claims all read the skewed ``time.time()``; the monotonic clock (what
timeouts and sleeps use) is left alone, as a wrong NTP setting would leave it. libfaketime,
the usual tool, cannot be used with Python 3.11 here: under it ``threading.Event.wait`` never
returns and ``time.sleep`` fails with EINVAL (libfaketime 0.9.10, measured).
"""

import os
import time

_skew_s = float(os.environ.get("CHAOS_CLOCK_SKEW_S", "0") or 0)
if _skew_s:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew_s  # type: ignore[assignment]
    time.time_ns = lambda: _time_ns() + int(_skew_s * 1e9)  # type: ignore[assignment]
