"""The Lua source of each claim script: the shared preamble's definitions it uses, then itself.

Every claim script of ``lua/`` starts with definitions from ``lua/_common.lua`` (the journal's
scripts and ``effect_apply.lua`` stand alone). Redis runs a script's whole source on every
call, so each definition it carries costs that call time (a closure made per ``local
function``) and the server's Lua heap memory that its garbage collector walks, with every
script loaded: measured on Redis 7.0, the whole preamble cost about 3 µs per call and each
loaded copy slowed every script's collector steps (docs/benchmarks.md). A script therefore
gets only the definitions it names, directly or through other definitions, in the preamble's
own order (a Lua local is visible only after its definition).

A definition is a top-level ``local function NAME`` (up to its ``end`` in the first column) or
a one-line ``local NAME = ...``, with the comment lines just above it; a name counts as used
wherever it stands as a whole word (comments and strings too: a needless definition costs a
little, a missing one fails the script).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import MappingProxyType

__all__ = ["MANY_OPS", "preamble_names", "script_source", "with_preamble"]

#: The operations ``claim_many.lua`` runs, each as a local function holding its script's body,
#: and the code a ``claim_many`` call names it by.
MANY_OPS = MappingProxyType({"claim": "c", "ack_done": "r"})

#: Scripts that run other scripts' bodies as local functions, and which.
_EMBEDDED = MappingProxyType({"claim_many": tuple(MANY_OPS), "claim_rated": ("claim",)})

_DEFINITION = re.compile(r"^local (?:function )?([A-Za-z_]\w*)")
_WORD = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class _Definition:
    name: str
    text: str
    uses: frozenset[str]


def _lua(name: str) -> str:
    return (resources.files("celery_claims.claims") / "lua" / f"{name}.lua").read_text("utf-8")


def _split(preamble: str) -> tuple[str, list[_Definition]]:
    """The preamble's head comment and its definitions, in order."""
    lines = preamble.splitlines()
    head: list[str] = []
    pending: list[str] = []  # comments and blank lines above the next definition
    found: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        match = _DEFINITION.match(line)
        if match is None:
            if line.strip() and not line.startswith("--"):
                # top-level code that is no definition would be dropped silently
                raise ValueError(f"_common.lua line {i + 1}: not a definition: {line!r}")
            if not found and not line.strip():
                head, pending = head + pending + [line], []
            else:
                pending.append(line)
            i += 1
            continue
        body = [line]
        if line.startswith("local function "):
            start = i
            while lines[i] != "end":
                i += 1
                if i == len(lines):
                    raise ValueError(
                        f"_common.lua line {start + 1}: local function {match.group(1)} has no "
                        "'end' in the first column"
                    )
                body.append(lines[i])
        found.append((match.group(1), [*pending, *body]))
        pending = []
        i += 1
    names = {name for name, _ in found}
    definitions = [
        _Definition(name, "\n".join(text), frozenset(_words(text) & names - {name}))
        for name, text in found
    ]
    return "\n".join(head), definitions


def _words(lines: list[str]) -> set[str]:
    return {word for line in lines for word in _WORD.findall(line)}


@cache
def _preamble() -> tuple[str, tuple[_Definition, ...]]:
    head, definitions = _split(_lua("_common"))
    return head, tuple(definitions)


def preamble_names(body: str) -> list[str]:
    """The preamble definitions a script of source ``body`` needs, in the preamble's order."""
    _, definitions = _preamble()
    by_name = {d.name: d for d in definitions}
    needed: set[str] = set()
    todo = [word for word in set(_WORD.findall(body)) if word in by_name]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(by_name[name].uses - needed)
    return [d.name for d in definitions if d.name in needed]


@cache
def script_source(name: str) -> str:
    """The source registered for the script ``lua/<name>.lua``: the preamble definitions it
    uses, then its body (``claim_many`` and ``claim_rated``: the bodies of the operations
    they run, as local functions, then their own)."""
    parts = []
    # the operations it runs are the very scripts a call alone runs, as local functions
    for op in _EMBEDDED.get(name, ()):
        parts.append(f"local function {op}(KEYS, ARGV)\n{_lua(op)}\nend")
    parts.append(_lua(name))
    return with_preamble("\n".join(parts))


def with_preamble(body: str) -> str:
    """``body`` (Lua) after the preamble definitions it uses."""
    head, definitions = _preamble()
    wanted = set(preamble_names(body))
    return "\n".join([head, *(d.text for d in definitions if d.name in wanted), body])
