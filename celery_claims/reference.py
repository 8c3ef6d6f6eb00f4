"""The parts of the docs made from the code: ``python -m celery_claims.reference`` rewrites them.

Each part sits between a begin and an end marker in its Markdown file and is made by the
module that holds its table; a test fails when a file differs from what the code makes:

- docs/settings.md, the settings reference: :func:`celery_claims.config.reference`;
- docs/testing.md, the skip reasons: :func:`celery_claims.observe.history.skip_reasons_reference`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from celery_claims.config import write_reference
from celery_claims.observe.history import write_skip_reasons

__all__ = ["PARTS", "main"]

#: Each generated part: the file (relative to the repository) and what rewrites it.
PARTS: tuple[tuple[str, Callable[[Path], bool]], ...] = (
    ("docs/settings.md", write_reference),
    ("docs/testing.md", write_skip_reasons),
)


def main(root: Path) -> list[str]:
    """Rewrite every generated part under the repository ``root``; one line per file."""
    return [f"{name}: {'updated' if write(root / name) else 'up to date'}" for name, write in PARTS]


if __name__ == "__main__":
    for line in main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()):
        print(line)
