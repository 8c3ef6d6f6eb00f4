"""The envelope a journal entry keeps: a published message, enough to publish it again.

An entry is written in one of two forms, both read by :meth:`Envelope.loads`:

- **kombu's message as its Redis transport pushes it** (``{"body": ..., "content-type": ...,
  "headers": ..., "properties": {"delivery_info": ..., "body_encoding": ...}}``): where the
  entry rides the publish on the Redis broker (:class:`~celery_claims.worker.transport.publish.
  PublishRide`), the payload kombu serialized for its ``LPUSH`` is journaled as it is, so the
  producer encodes nothing of its own for the journal;
- **the envelope** (``{"v": 1, "task": ..., "body": <base64>, ...}``, :meth:`Envelope.dumps`):
  everywhere else (another broker, a store apart, a message a worker journals itself).
"""

from __future__ import annotations

import base64
import json as stdlib_json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kombu.serialization import dumps as serialize
from kombu.utils import json

from celery_claims.worker.identity import attempt_task_id
from celery_claims.worker.transport.publish import RIDE_BODY_ENCODINGS, kombu_json_codec

__all__ = ["Envelope", "eta_ms_of", "task_of"]

#: Envelope format version.
_VERSION = 1

#: The publish properties of a delivered message that a re-publish carries again.
_REPUBLISHED = ("correlation_id", "reply_to", "priority")

#: The properties kombu sets on a message as it publishes it (``Producer.publish``, the
#: virtual channel's ``prepare_message`` and ``basic_publish``), not the publisher's: a
#: re-publish of a journaled kombu message leaves them to kombu again.
_SET_BY_KOMBU = frozenset(
    {"delivery_info", "delivery_tag", "body_encoding", "delivery_mode", "expiration"}
)


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is left to kombu's JSON encoder")


#: The stdlib's C encoder factory (``json.encoder.c_make_encoder``, None without ``_json``).
_C_MAKE_ENCODER: Callable[..., Any] | None = getattr(stdlib_json.encoder, "c_make_encoder", None)


def _plain_json_text(value: Any) -> str | None:
    """kombu's JSON text of ``value`` (``kombu.utils.json.dumps``), character for character,
    in two thirds of its time; None where kombu's encoder must write it.

    kombu's encoder is the stdlib's with a ``default`` for the types JSON has not (datetime,
    UUID, Decimal...): on the values JSON has, both write the same text. So the stdlib's C
    encoder writes it, built afresh per call (its circular-reference markers are its own),
    where kombu's goes through a new ``JSONEncoder`` and its ``iterencode`` each call; a
    value only kombu's ``default`` can write (or any error) is left to kombu's, which
    writes it or raises as it always did.
    """
    if _C_MAKE_ENCODER is None:
        return None
    try:
        encode = _C_MAKE_ENCODER(
            {}, _refuse, stdlib_json.encoder.encode_basestring_ascii, None, ": ", ", ",
            False, False, True,
        )  # fmt: skip
        return "".join(encode(value, 0))
    except (TypeError, ValueError):
        return None  # a value of kombu's own types, or an error kombu's encoder says itself


def _json_text(value: Any) -> str:
    """kombu's JSON text of ``value`` (:func:`_plain_json_text`, else kombu's encoder)."""
    text = _plain_json_text(value)
    if text is None:
        text = str(json.dumps(value))  # type: ignore[no-untyped-call]  # kombu is untyped
    return text


def task_of(headers: Mapping[str, Any]) -> tuple[str, str]:
    """The task name and id a message's ``headers`` carry (task protocol 2).

    Raises:
        ValueError: they carry none (task protocol 1?).
    """
    task, task_id = headers.get("task"), headers.get("id")
    if not isinstance(task, str) or not isinstance(task_id, str) or not task_id:
        raise ValueError("the message headers carry no task name and id (task protocol 1?)")
    return task, task_id


def eta_ms_of(headers: Mapping[str, Any]) -> int | None:
    """The ETA of a message with ``headers`` in epoch ms, or None."""
    return _epoch_ms(headers.get("eta"))


def _epoch_ms(value: Any) -> int | None:
    """An ETA or expiry header (ISO 8601 string or datetime) in epoch ms; None if absent."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)


@dataclass(frozen=True)
class Envelope:
    """One published message as the journal keeps it: what a re-publish needs.

    Attributes:
        task: the task name.
        task_id: the Celery task id.
        headers: the message headers (protocol 2: ``id``, ``retries``, ``eta``...).
        body: the body, serialized with the message's own serializer.
        content_type: the serializer's content type.
        content_encoding: the serializer's content encoding.
        exchange: the exchange it was published to.
        routing_key: its routing key.
        properties: the other publish properties (``correlation_id``, ``reply_to``,
            ``priority``...).
    """

    task: str
    task_id: str
    headers: Mapping[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    exchange: str
    routing_key: str
    properties: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        *,
        body: Any,
        serializer: str,
        headers: Mapping[str, Any],
        exchange: Any,
        routing_key: Any,
        properties: Mapping[str, Any] | None,
    ) -> Envelope:
        """The envelope of a message about to be published (``before_task_publish``).

        Raises:
            kombu.exceptions.EncodeError: the body cannot be serialized.
            ValueError: the headers name no task or id (task protocol 1).
        """
        task, task_id = task_of(headers)
        # the message's own serializer, as kombu's Producer would apply it: kombu's JSON
        # text written as kombu writes it, where its registry's json is kombu's own
        codec = kombu_json_codec(serializer)
        text = _plain_json_text(body) if codec is not None else None
        if codec is not None and text is not None:
            content_type, content_encoding = codec
            data: Any = text
        else:  # kombu is untyped
            content_type, content_encoding, data = serialize(  # type: ignore[no-untyped-call]
                body, serializer=serializer
            )
        if isinstance(data, str):
            data = data.encode(content_encoding or "utf-8")
        envelope = object.__new__(cls)
        # the fields set as the dataclass's __init__ sets them, without its nine
        # object.__setattr__ calls (a frozen dataclass's): this runs for every publish
        envelope.__dict__.update(
            task=task,
            task_id=task_id,
            headers=dict(headers),
            body=bytes(data),
            content_type=content_type,
            content_encoding=content_encoding,
            exchange=str(getattr(exchange, "name", exchange) or ""),
            routing_key=str(routing_key or ""),
            properties=dict(properties or {}),
        )
        return envelope

    @classmethod
    def of_delivery(cls, message: Any) -> Envelope:
        """The envelope of a delivered kombu ``Message``: its body as the broker carried it,
        its headers, and the exchange and routing key it was published to (for a message a
        worker journals itself: acknowledged at claim, it must be publishable again).

        Raises:
            ValueError: the message carries no task name and id, or no body.
        """
        headers = dict(getattr(message, "headers", None) or {})
        task, task_id = task_of(headers)
        body = getattr(message, "body", None)
        if isinstance(body, str):
            body = body.encode(getattr(message, "content_encoding", None) or "utf-8")
        if not isinstance(body, bytes):
            raise ValueError("the delivered message has no body to journal")
        info = getattr(message, "delivery_info", None) or {}
        properties = getattr(message, "properties", None) or {}
        return cls(
            task=task,
            task_id=task_id,
            headers=headers,
            body=body,
            content_type=str(getattr(message, "content_type", None) or ""),
            content_encoding=str(getattr(message, "content_encoding", None) or ""),
            exchange=str(info.get("exchange") or ""),
            routing_key=str(info.get("routing_key") or ""),
            properties={k: properties[k] for k in _REPUBLISHED if properties.get(k) is not None},
        )

    @property
    def task_key(self) -> str:
        """The claim store's task id of its attempt."""
        return attempt_task_id(self.task_id, self.headers)

    @property
    def eta_ms(self) -> int | None:
        """Its ETA in epoch ms, or None."""
        return eta_ms_of(self.headers)

    def expired(self, now_ms: int) -> bool:
        """True if its ``expires`` has passed at ``now_ms`` (Celery would drop it)."""
        expires = _epoch_ms(self.headers.get("expires"))
        return expires is not None and now_ms >= expires

    def dumps(self) -> str:
        """The envelope as the journal stores it (JSON, the body in base64)."""
        headers, properties = self.headers, self.properties
        return _json_text(
            {
                "v": _VERSION,
                "task": self.task,
                "id": self.task_id,
                # a dict as it is (the JSON of a copy is the same text)
                "headers": headers if type(headers) is dict else dict(headers),
                "body": base64.b64encode(self.body).decode("ascii"),
                "content_type": self.content_type,
                "content_encoding": self.content_encoding,
                "exchange": self.exchange,
                "routing_key": self.routing_key,
                "properties": properties if type(properties) is dict else dict(properties),
            }
        )

    @classmethod
    def loads(cls, text: str) -> Envelope:
        """The envelope of a journal entry: one :meth:`dumps` wrote, or kombu's message as its
        Redis transport pushed it (the module docstring).

        Raises:
            ValueError: neither form, or not a version this one can read.
        """
        try:
            raw = json.loads(text)  # type: ignore[no-untyped-call]  # kombu is untyped
            if not isinstance(raw, dict):
                raise ValueError(f"a JSON {type(raw).__name__}, not an object")
            if "v" not in raw:
                return cls._of_kombu_message(raw)
            if raw["v"] != _VERSION:
                raise ValueError(f"journal envelope version {raw['v']!r}")
            return cls(
                task=str(raw["task"]),
                task_id=str(raw["id"]),
                headers=dict(raw["headers"]),
                body=base64.b64decode(raw["body"]),
                content_type=str(raw["content_type"]),
                content_encoding=str(raw["content_encoding"]),
                exchange=str(raw["exchange"]),
                routing_key=str(raw["routing_key"]),
                properties=dict(raw["properties"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"unreadable journal envelope: {exc!r}") from exc

    @classmethod
    def _of_kombu_message(cls, raw: Mapping[str, Any]) -> Envelope:
        """The envelope of kombu's message as its Redis transport pushes it (read in kombu
        5.3 to 5.7: ``kombu/transport/virtual/base.py``, ``prepare_message`` and
        ``_inplace_augment_message``): its body decoded from the channel's body encoding, its
        route from ``delivery_info``, and the publisher's properties without kombu's own."""
        headers = dict(raw["headers"])
        task, task_id = task_of(headers)
        properties = dict(raw["properties"])
        encoding = properties.get("body_encoding")
        if encoding not in RIDE_BODY_ENCODINGS:
            raise ValueError(f"a message body in {encoding!r}, not one of {RIDE_BODY_ENCODINGS}")
        content_encoding = str(raw["content-encoding"] or "")
        body = raw["body"]
        if isinstance(body, str):
            if encoding == "base64":
                body = base64.b64decode(body)
            else:
                body = body.encode(content_encoding or "utf-8")
        elif not isinstance(body, bytes) or encoding == "base64":
            raise ValueError(f"a message body of type {type(body).__name__}")
        route = properties["delivery_info"]
        return cls(
            task=task,
            task_id=task_id,
            headers=headers,
            body=body,
            content_type=str(raw["content-type"] or ""),
            content_encoding=content_encoding,
            exchange=str(route["exchange"] or ""),
            routing_key=str(route["routing_key"] or ""),
            properties={k: v for k, v in properties.items() if k not in _SET_BY_KOMBU},
        )
