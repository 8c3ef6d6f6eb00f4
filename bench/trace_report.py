"""Where a message's wall time goes, from ``bench/trace_path.py``'s files.

``python bench/trace_report.py DIR [--skip N]``: for each variant's worker (a main process's
file and its pool processes' files), per message (by task id): received -> body start (the
claim and the hand-off), body end -> ack sent -> ack done, and for one message at a time
(solo) the medians between consecutive events of the main process from one ``received`` to
the next, the body left out. Over the messages after the first ``--skip``: the spans' 10th,
25th and 50th percentiles (a shared machine's pauses land in the tail), the steps' medians.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[tuple[int, str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split(" ", 3)
        rows.append((int(parts[0]), parts[2], parts[3] if len(parts) > 3 else ""))
    return rows


def median_us(values: list[int]) -> str:
    return f"{statistics.median(values) / 1000:8.1f}" if values else "       -"


def quartiles_us(values: list[int]) -> str:
    """The 10th, 25th and 50th percentiles (a shared machine's pauses are in the tail)."""
    ordered = sorted(values)
    return " / ".join(f"{ordered[int(len(ordered) * q)] / 1000:.0f}" for q in (0.1, 0.25, 0.5))


def per_message(events: list[tuple[int, str, str]], skip: int) -> dict[str, list[int]]:
    """Spans by task id: received->body>, body>->body<, body<->ack>, ack>->ack<, and
    received->ack< less the body."""
    at: dict[str, dict[str, int]] = defaultdict(dict)
    for t, name, detail in events:
        if name in ("received", "pool>", "body>", "body<", "ack>", "ack<", "append>") and detail:
            at[detail].setdefault(name, t)
    spans: dict[str, list[int]] = defaultdict(list)
    done = [m for m in at.values() if {"received", "body>", "body<", "ack<"} <= m.keys()]
    done.sort(key=lambda m: m["received"])
    for m in done[skip:]:
        spans["append>->received"].append(m["received"] - m.get("append>", m["received"]))
        spans["received->body>"].append(m["body>"] - m["received"])
        if "pool>" in m:
            spans["received->pool>"].append(m["pool>"] - m["received"])
            spans["pool>->body>"].append(m["body>"] - m["pool>"])
        spans["body<->ack>"].append(m["ack>"] - m["body<"])
        spans["ack>->ack<"].append(m["ack<"] - m["ack>"])
        spans["received->ack< less body"].append(
            m["ack<"] - m["received"] - (m["body<"] - m["body>"])
        )
    return spans


def steps(events: list[tuple[int, str, str]], skip: int) -> dict[str, list[int]]:
    """Main process only, one message at a time: the time between consecutive events, summed
    per pair within each received->received window (the body's span left out)."""
    windows: list[list[tuple[int, str, str]]] = []
    for row in events:
        if row[1] == "received":
            windows.append([])
        if windows:
            windows[-1].append(row)
    found: dict[str, list[int]] = defaultdict(list)
    for window in windows[skip:-1]:
        sums: dict[str, int] = defaultdict(int)
        for (t0, a, _), (t1, b, _) in itertools.pairwise(window):
            if (a, b) != ("body>", "body<"):
                sums[f"{a} -> {b}"] += t1 - t0
        for key, value in sums.items():
            found[key].append(value)
    return found


def parent(
    child: Path, mains: list[Path], loaded: dict[Path, list[tuple[int, str, str]]]
) -> Path | None:
    """The main process of ``child`` (a pool process): the one that received the tasks whose
    bodies it ran."""
    ran = {detail for _, name, detail in loaded[child] if name == "body>"}
    for main_path in mains:
        if any(name == "received" and detail in ran for _, name, detail in loaded[main_path]):
            return main_path
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--skip", type=int, default=20)
    args = parser.parse_args()
    files = sorted(args.dir.glob("*.trace"))
    loaded = {path: load(path) for path in files}
    mains = [path for path, rows in loaded.items() if any(r[1] == "received" for r in rows)]
    for main_path in mains:
        rows = list(loaded[main_path])
        children = [p for p in files if p not in mains and parent(p, mains, loaded) == main_path]
        for child in children:
            rows += loaded[child]
        rows.sort()
        solo = not children
        print(f"== {main_path.name} ({'solo' if solo else 'prefork'}, {len(children)} children)")
        spans = per_message(rows, args.skip)
        n = len(spans.get("received->body>", []))
        for key, values in spans.items():
            print(f"  {quartiles_us(values):>20} us (p10 / p25 / p50)  {key}  (n={n})")
        if solo:
            found = steps(loaded[main_path], args.skip)
            for key, values in sorted(found.items(), key=lambda kv: -sum(kv[1])):
                if len(values) >= n // 2:
                    print(f"    {median_us(values)} us  {key}  ({len(values)})")


if __name__ == "__main__":
    main()
