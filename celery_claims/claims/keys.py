"""Every Redis key name of the claim store, spelled in one place.

All keys of one queue share the hash tag ``{<escaped queue id>}``, so each queue's script
touches one Redis Cluster slot. A claim and a completion record are each one field of one hash
(no sorted-set index: it would store every task id a second time), with the compact values
described on :attr:`QueueKeys.claims` and :attr:`QueueKeys.done`; the Lua code that reads and
writes them is ``lua/_common.lua``. Ids are escaped before they go into a key: ``%``, ``{``, ``}``
and ``:`` become ``%25``, ``%7B``, ``%7D`` and ``%3A``, so a queue id can neither open another
hash tag nor collide with another queue's keys (the escape is injective).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import unquote

from celery_claims.validation import require_prefix

__all__ = [
    "DEFAULT_PREFIX",
    "QueueKeys",
    "escape",
    "keyed_owner",
    "owner_key_ttl_ms",
    "owner_task_key",
    "queues_key",
    "require_prefix",
]

#: Prefix of every key written by the claim store.
DEFAULT_PREFIX = "claims"

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D", ":": "%3A"})


def escape(identifier: str) -> str:
    """Make ``identifier`` safe to embed in a key and inside a hash tag."""
    return identifier.translate(_ESCAPES)


#: What a keyed claim's owner escapes in the attempt it names: nothing in it may end the
#: owner's head (``/``, ``.``) or the suffix (``~``).
_OWNER_ESCAPES = str.maketrans({"%": "%25", "~": "%7E", ".": "%2E", "/": "%2F"})
_KEYED_OWNER = re.compile(r"~k([^~]*)~(\d+)\Z")


def keyed_owner(owner: str, task_key: str, key_ttl_ms: int) -> str:
    """The owner of a claim held on a business key by the attempt ``task_key``.

    ``<owner>~k<escaped task key>~<key_ttl_ms>``: the claim store (``lua/_common.lua``,
    ``keyed_owner``) writes the completion record of such a claim under ``task_key`` instead
    of the key's field, and with ``key_ttl_ms`` > 0 a second record under the key, kept that
    long. The escape keeps ``/`` and ``.`` out of the suffix, so the owner's head (the worker
    process, written once per queue) is the plain owner's.
    """
    return f"{owner}~k{task_key.translate(_OWNER_ESCAPES)}~{int(key_ttl_ms)}"


def owner_task_key(owner: str) -> str | None:
    """The attempt (``<task id>:<retries>:<nesting>``) a keyed claim's owner names, or None
    for a plain owner."""
    found = _KEYED_OWNER.search(owner)
    return None if found is None else unquote(found.group(1))


def owner_key_ttl_ms(owner: str) -> int:
    """The key retention a keyed claim's owner carries (0 for none, or a plain owner)."""
    found = _KEYED_OWNER.search(owner)
    return 0 if found is None else int(found.group(2))


def queues_key(prefix: str) -> str:
    """The set of known queue ids (another slot: never touched inside a queue's script)."""
    return f"{prefix}:queues"


@dataclass(frozen=True)
class QueueKeys:
    """The keys of one queue (each name is built once, on first use)."""

    prefix: str
    queue_id: str

    @cached_property
    def tag(self) -> str:
        return f"{self.prefix}:{{{escape(self.queue_id)}}}"

    @cached_property
    def claims(self) -> str:
        """Hash: task id -> claim entry ``instance,created_at,lease,takeovers,owner id,tail``.

        Numbers in base 36 (``lease`` = ``expires_at - created_at``; ``takeovers``: the task's
        counted takeovers so far, counted only with a takeover limit, so the count costs no
        memory of its own and goes with the entry; followed by ``?`` while the claim is a
        takeover's whose holder has not marked its start, see ``mark_started.lua``). The
        owner is split after its last ``/`` or ``.``: the head (one worker process,
        ``hostname/pid/nonce.``) is written once in :attr:`owners`, the entry keeps its id and
        the tail (``0``: no head). The earlier format ``instance:created_at:expires_at:owner``
        (decimal) is still read.
        """
        return f"{self.tag}:c"

    @cached_property
    def counter(self) -> str:
        """String: the queue's last issued instance (the fencing counter)."""
        return f"{self.tag}:n"

    @cached_property
    def stats(self) -> str:
        """Hash: the queue's counters."""
        return f"{self.tag}:s"

    @cached_property
    def done(self) -> str:
        """Hash: task id -> completion record ``instance,done_at,retention,owner id,tail``.

        A task given up as poison has the record ``0,given_up_at,retention,takeovers,owner id,
        tail``: instance 0 is never issued, so it marks the record as given up. Base 36,
        ``retention`` = ``until - done_at``, the owner as in :attr:`claims`. The earlier
        formats ``instance:done_at:until:owner`` and ``0:given_up_at:until:takeovers:owner``
        are still read.
        """
        return f"{self.tag}:d"

    @cached_property
    def owners(self) -> str:
        """Hash: the owner heads of the queue's entries and records, each written once.

        ``h<head>`` -> id, ``i<id>`` -> head, ``r<id>`` -> how many entries and records name
        it (the head is deleted with its last one), ``#`` -> the last id given (base 36).
        """
        return f"{self.tag}:o"

    @cached_property
    def sweep(self) -> str:
        """Hash: where cleanup's walk over :attr:`claims` (``c``) and :attr:`done` (``d``)
        stopped (``HSCAN`` cursors)."""
        return f"{self.tag}:w"

    @cached_property
    def legacy_keys(self) -> list[str]:
        """Keys only earlier releases wrote (expiry and retention sorted sets, takeover
        counts); cleanup unlinks them."""
        return [f"{self.tag}:e", f"{self.tag}:x", f"{self.tag}:t"]

    @cached_property
    def claim_keys(self) -> list[str]:
        """KEYS of claim.lua."""
        return [self.claims, self.counter, self.stats, self.done, self.owners]

    @cached_property
    def release_keys(self) -> list[str]:
        """KEYS of release.lua (and the first four of ack_done.lua)."""
        return [self.claims, self.stats, self.done, self.owners]

    @cached_property
    def entry_keys(self) -> list[str]:
        """KEYS of extend.lua, renew.lua, peek.lua, list.lua and mark_started.lua."""
        return [self.claims, self.owners]

    @cached_property
    def record_keys(self) -> list[str]:
        """KEYS of done.lua."""
        return [self.done, self.owners]

    @cached_property
    def read_keys(self) -> list[str]:
        """KEYS of read.lua."""
        return [self.claims, self.done, self.owners]

    @cached_property
    def cleanup_keys(self) -> list[str]:
        """KEYS of cleanup.lua."""
        return [self.claims, self.stats, self.done, self.owners, self.sweep, *self.legacy_keys]

    def rate(self, name: str) -> str:
        """String: the state of the rate limit ``name`` (celery_claims.rates), under the
        queue's hash tag so the queue's claim script can count a start against it.

        ``<ms>`` or ``<ms>:<remainder>:<count>``: when the limit's next start is due (see
        ``lua/_common.lua``, ``rate_commit``); it expires once that ms has passed.
        """
        return f"{self.tag}:r:{escape(name)}"

    # --- the publish journal (celery_claims.claims.journal) --------------------------------

    @cached_property
    def journal(self) -> str:
        """Hash: task id -> the journaled message (JSON envelope written by the producer)."""
        return f"{self.tag}:j"

    @cached_property
    def journal_due(self) -> str:
        """Sorted set: task id scored by the time (ms) after which recovery may act on it."""
        return f"{self.tag}:jt"

    @cached_property
    def journal_republished(self) -> str:
        """Hash: task id -> how many times recovery has re-published its message."""
        return f"{self.tag}:jn"

    @cached_property
    def journal_lock(self) -> str:
        """String: the worker scanning this queue's journal now (``SET NX PX``)."""
        return f"{self.tag}:jl"

    @cached_property
    def journal_keys(self) -> list[str]:
        """KEYS of journal_put.lua and journal_take.lua."""
        return [self.journal, self.journal_due, self.journal_republished]
