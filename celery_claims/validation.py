"""Argument checks shared by every backend; they run before any state is touched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_claims.errors import InvalidArgument
from celery_claims.model import ClaimToken

__all__ = [
    "MAX_ID_BYTES",
    "MAX_LEASE_MS",
    "MAX_FENCE",
    "MAX_TAKEOVERS",
    "require_fence",
    "require_id",
    "require_limit",
    "require_max_takeovers",
    "require_ms",
    "require_token",
    "require_tokens",
]

#: Longest id accepted, in UTF-8 bytes. Celery ids are 36; queue names are short.
MAX_ID_BYTES = 1024

#: Longest lease or extension accepted: 30 days. Leases are renewed, never set for ages.
MAX_LEASE_MS = 30 * 24 * 3600 * 1000

#: Largest takeover limit accepted; a limit is a handful, this only keeps it a sane int.
MAX_TAKEOVERS = 2**31 - 1

#: Largest fencing number a guarded write accepts: a signed 64-bit integer, what a SQL
#: ``BIGINT`` fence column and the effect guard's markers hold.
MAX_FENCE = 2**63 - 1

#: Largest instance or timestamp a token may carry: exact in a Lua (double) number.
MAX_TOKEN_NUMBER = 2**53


def require_fence(instance: object) -> int:
    """Return ``instance`` if it is a fencing number a guarded write can store (``0 ..
    2**63-1``), else raise :class:`InvalidArgument`."""
    if isinstance(instance, bool) or not isinstance(instance, int):
        raise InvalidArgument("instance", f"must be an int, got {type(instance).__name__}")
    if not 0 <= instance <= MAX_FENCE:
        raise InvalidArgument("instance", f"must be in 0 .. 2**63-1, got {instance!r:.80}")
    return instance


def require_id(name: str, value: Any) -> str:
    """Return ``value`` if it is a usable id, else raise :class:`InvalidArgument`."""
    if not isinstance(value, str):
        raise InvalidArgument(name, f"must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(name, "must not be empty")
    if "\x00" in value:
        raise InvalidArgument(name, "must not contain NUL characters")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(name, "must be valid Unicode (no lone surrogates)") from None
    if size > MAX_ID_BYTES:
        raise InvalidArgument(name, f"is {size} bytes long; the limit is {MAX_ID_BYTES}")
    return value


def require_ms(name: str, value: Any, *, maximum: int = MAX_LEASE_MS) -> int:
    """Return ``value`` if it is a non-negative int of milliseconds up to ``maximum``."""
    # bool is an int subclass: ``lease_ms=True`` is a bug, never one millisecond.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an int of milliseconds, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgument(name, f"must not be negative, got {value}")
    if value > maximum:
        raise InvalidArgument(name, f"must be at most {maximum} ms, got {value}")
    return value


def require_token(value: Any) -> ClaimToken:
    """Return ``value`` if it is a well-formed :class:`ClaimToken`."""
    if not isinstance(value, ClaimToken):
        raise InvalidArgument("token", f"must be a ClaimToken, got {type(value).__name__}")
    require_id("token.queue_id", value.queue_id)
    require_id("token.task_id", value.task_id)
    require_id("token.owner", value.owner)
    for field in ("instance", "created_at", "expires_at"):
        number = getattr(value, field)
        if isinstance(number, bool) or not isinstance(number, int):
            raise InvalidArgument(f"token.{field}", f"must be an int, got {type(number).__name__}")
        if not 0 <= number <= MAX_TOKEN_NUMBER:
            raise InvalidArgument(f"token.{field}", f"is out of range: {number}")
    return value


def require_tokens(tokens: Any) -> list[ClaimToken]:
    """Return ``tokens`` as a list if it is a sequence of well-formed tokens."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidArgument("tokens", f"must be a sequence of ClaimToken, got {tokens!r:.80}")
    return [require_token(t) for t in tokens]


def require_limit(limit: Any) -> int | None:
    """Return ``limit`` if it is ``None`` or a positive int."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgument("limit", f"must be a positive int or None, got {limit!r:.80}")
    return limit


def require_max_takeovers(value: Any) -> int | None:
    """Return ``value`` if it is ``None`` (no limit) or a non-negative int of takeovers."""
    # bool is an int subclass: ``max_takeovers=True`` is a bug, never a limit of one
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TAKEOVERS
    ):
        raise InvalidArgument(
            "max_takeovers",
            f"must be None or an int in 0..{MAX_TAKEOVERS}, got {value!r:.80}",
        )
    return value
