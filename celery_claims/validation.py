"""Argument checks shared by every backend, claims and lanes alike; they run before any
state is touched.

Each check raises ``error.about(name, what is wrong)``: :class:`InvalidArgument` by default
(``lease_ms: must be ...``), :class:`~celery_claims.errors.InvalidValueError` for the lanes
(``lease_ms must be ...``, the Rust ``TaskClaimStore``'s wording), one class either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
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
    "require_int",
    "require_limit",
    "require_max_takeovers",
    "require_ms",
    "require_prefix",
    "require_sequence",
    "require_text",
    "require_token",
    "require_tokens",
    "require_utc",
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

Error = type[InvalidArgument]


def _shown(number: int) -> str:
    # 2**63-1 reads better than its 19 digits
    exponent = (number + 1).bit_length() - 1
    return f"2**{exponent}-1" if exponent >= 31 and number + 1 == 2**exponent else str(number)


def require_int(
    name: str, value: object, maximum: int, *, minimum: int = 0, error: Error = InvalidArgument
) -> int:
    """Return ``value`` if it is an ``int`` in ``minimum .. maximum``, else raise ``error``."""
    if type(value) is int and minimum <= value <= maximum:
        return value  # the usual case, in one step
    # bool is an int subclass: ``lease_ms=True`` is a bug, never one millisecond.
    if isinstance(value, bool) or not isinstance(value, int):
        raise error.about(name, f"must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise error.about(name, f"must be between {minimum} and {_shown(maximum)}, got {value}")
    return value


def require_fence(instance: object) -> int:
    """Return ``instance`` if it is a fencing number a guarded write can store (``0 ..
    2**63-1``), else raise :class:`InvalidArgument`."""
    return require_int("instance", instance, MAX_FENCE)


def require_text(
    name: str,
    value: object,
    *,
    empty: bool = False,
    max_bytes: int | None = None,
    error: Error = InvalidArgument,
) -> str:
    """Return ``value`` if it is text every store can keep: a ``str`` of valid UTF-8 without
    NUL characters, non-empty unless ``empty``, at most ``max_bytes`` long in UTF-8.

    PostgreSQL refuses NUL in text, and a lone surrogate cannot be encoded for Redis; refusing
    both everywhere keeps the stores interchangeable.
    """
    if not isinstance(value, str):
        raise error.about(name, f"must be a str, got {type(value).__name__}")
    if not value and not empty:
        raise error.about(name, "must not be empty")
    if "\x00" in value:
        raise error.about(name, "must not contain NUL characters")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise error.about(name, "must be valid UTF-8 text (no lone surrogates)") from None
    if max_bytes is not None and size > max_bytes:
        raise error.about(name, f"is {size} bytes long; the limit is {max_bytes}")
    return value


def require_id(name: str, value: Any) -> str:
    """Return ``value`` if it is a usable id, else raise :class:`InvalidArgument`."""
    # the usual id in a few steps: ASCII text's length in characters is its length in UTF-8,
    # and it holds no surrogate; any other goes through the full check
    if (
        type(value) is str
        and 0 < len(value) <= MAX_ID_BYTES
        and value.isascii()
        and "\x00" not in value
    ):
        return value
    return require_text(name, value, max_bytes=MAX_ID_BYTES)


def require_prefix(prefix: object, *, error: Error = InvalidArgument) -> str:
    """Return ``prefix`` if it is a key prefix: a non-empty str that cannot open or close a
    hash tag."""
    if not isinstance(prefix, str) or not prefix:
        raise error.about("prefix", f"must be a non-empty str, got {prefix!r:.80}")
    if "{" in prefix or "}" in prefix:
        raise error.about("prefix", "must not contain braces, '{' or '}' (they move hash slots)")
    return prefix


def require_ms(name: str, value: Any, *, maximum: int = MAX_LEASE_MS) -> int:
    """Return ``value`` if it is a non-negative int of milliseconds up to ``maximum``."""
    return require_int(name, value, maximum)


def require_utc(name: str, value: object, *, error: Error = InvalidArgument) -> datetime:
    """Return ``value`` in UTC if it is a timezone-aware datetime."""
    if not isinstance(value, datetime):
        raise error.about(name, f"must be a datetime, got {value!r:.80}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise error.about(name, f"must be timezone-aware, got naive {value!r}")
    return value.astimezone(timezone.utc)


def require_sequence(
    name: str, value: object, of: str, *, error: Error = InvalidArgument
) -> tuple[Any, ...]:
    """Return ``value`` as a tuple if it is a sequence (a bare string is refused)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error.about(name, f"must be a sequence of {of}, got {value!r:.80}")
    return tuple(value)


def require_token(value: Any) -> ClaimToken:
    """Return ``value`` if it is a well-formed :class:`ClaimToken`."""
    if isinstance(value, ClaimToken) and _plain_token(value):
        return value
    if not isinstance(value, ClaimToken):
        raise InvalidArgument("token", f"must be a ClaimToken, got {type(value).__name__}")
    require_id("token.queue_id", value.queue_id)
    require_id("token.task_id", value.task_id)
    require_id("token.owner", value.owner)
    for field in ("instance", "created_at", "expires_at"):
        require_int(f"token.{field}", getattr(value, field), MAX_TOKEN_NUMBER)
    return value


def _plain_token(token: ClaimToken) -> bool:
    """True if ``token`` passes :func:`require_token` by a few tests (those of
    :func:`require_id`'s first step, for its three ids at once): the tokens of every message.
    False only means the full checks decide, and name what is wrong."""
    queue_id, task_id, owner = token.queue_id, token.task_id, token.owner
    instance, created_at, expires_at = token.instance, token.created_at, token.expires_at
    if not (type(queue_id) is str and type(task_id) is str and type(owner) is str):
        return False
    # the three ids in one text: one scan each for non-ASCII and for NUL, and a length
    # within the limit is each one's
    ids = queue_id + task_id + owner
    return bool(
        queue_id
        and task_id
        and owner
        and len(ids) <= MAX_ID_BYTES
        and ids.isascii()
        and "\x00" not in ids
        and type(instance) is int
        and type(created_at) is int
        and type(expires_at) is int
        # in range if their bitwise or is: none negative, none larger
        and 0 <= (instance | created_at | expires_at) <= MAX_TOKEN_NUMBER
    )


def require_tokens(tokens: Any) -> list[ClaimToken]:
    """Return ``tokens`` as a list if it is a sequence of well-formed tokens."""
    return [require_token(t) for t in require_sequence("tokens", tokens, "ClaimToken")]


def require_limit(limit: Any) -> int | None:
    """Return ``limit`` if it is ``None`` or a positive int."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgument("limit", f"must be a positive int or None, got {limit!r:.80}")
    return limit


def require_max_takeovers(value: Any) -> int | None:
    """Return ``value`` if it is ``None`` (no limit) or a non-negative int of takeovers."""
    return None if value is None else require_int("max_takeovers", value, MAX_TAKEOVERS)
