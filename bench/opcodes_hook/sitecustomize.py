"""Imported at start by every Python process with this folder on ``PYTHONPATH`` (see
``bench/opcodes.py``): with ``BENCH_OPCODES`` set, a Celery worker's main thread counts the
bytecodes and calls of each Python function from ``worker_ready`` to ``worker_shutdown`` and
writes them, as JSON, to the file ``BENCH_OPCODES`` names; with ``BENCH_OPCODES_POOL`` set
too, each prefork pool process counts its own instead, from ``worker_process_init`` to
``worker_process_shutdown``, into that name followed by ``.<pid>``. Anything else runs
untouched."""

from __future__ import annotations

import os

if os.environ.get("BENCH_OPCODES"):
    import collections
    import json
    import sys
    from types import CodeType, FrameType
    from typing import Any

    _ops: collections.Counter[CodeType] = collections.Counter()
    _calls: collections.Counter[CodeType] = collections.Counter()

    def _opcode(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            _ops[frame.f_code] += 1
        return _opcode

    def _call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        _calls[frame.f_code] += 1
        return _opcode

    def _start(**_: Any) -> None:
        sys.settrace(_call)  # the main thread: the consumer's loop (and a solo pool's tasks)

    def _stop(**_: Any) -> None:
        sys.settrace(None)
        path = os.environ["BENCH_OPCODES"]
        if os.environ.get("BENCH_OPCODES_POOL"):
            path = f"{path}.{os.getpid()}"
        out: dict[str, list[int]] = {}
        for code in set(_ops) | set(_calls):
            counts = out.setdefault(f"{code.co_filename}:{code.co_qualname}", [0, 0])
            counts[0] += _ops[code]
            counts[1] += _calls[code]
        with open(path, "w") as f:
            json.dump(out, f)

    try:
        from celery.signals import (
            worker_process_init,
            worker_process_shutdown,
            worker_ready,
            worker_shutdown,
        )
    except ImportError:
        pass
    else:
        if os.environ.get("BENCH_OPCODES_POOL"):
            worker_process_init.connect(_start, weak=False)
            worker_process_shutdown.connect(_stop, weak=False)
        else:
            worker_ready.connect(_start, weak=False)
            worker_shutdown.connect(_stop, weak=False)
