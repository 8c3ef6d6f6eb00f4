"""The publish journal's envelope (worker/publish/envelope.py) and a canvas part's check
(worker/publish/runs.py): the producer's shortcuts write what kombu's and Celery's own helpers
would, character for character."""

from __future__ import annotations

import datetime
import decimal
import math
import uuid
from typing import Any

import pytest
from kombu.exceptions import EncodeError
from kombu.serialization import dumps as serialize
from kombu.serialization import registry
from kombu.utils import json as kombu_json

from celery_claims.worker.identity import attempt_of, claim_task_id
from celery_claims.worker.publish.envelope import Envelope
from celery_claims.worker.publish.runs import is_canvas_part

UTC = datetime.timezone.utc


def envelope(headers: dict[str, Any], properties: dict[str, Any] | None = None) -> Envelope:
    return Envelope.of(
        body=((1, "ü"), {"k": 2.5}, {"callbacks": None, "chain": None, "chord": None}),
        serializer="json",
        headers={"task": "t.echo", "id": "id-1", **headers},
        exchange="",
        routing_key="q",
        properties=properties,
    )


def kombus_text(env: Envelope) -> str:
    """The envelope's text as kombu's encoder writes it (what ``dumps`` wrote before)."""
    import base64

    return str(
        kombu_json.dumps(
            {
                "v": 1,
                "task": env.task,
                "id": env.task_id,
                "headers": dict(env.headers),
                "body": base64.b64encode(env.body).decode("ascii"),
                "content_type": env.content_type,
                "content_encoding": env.content_encoding,
                "exchange": env.exchange,
                "routing_key": env.routing_key,
                "properties": dict(env.properties),
            }
        )
    )


@pytest.mark.parametrize(
    "headers",
    [
        {"retries": 0, "replaced_task_nesting": 0, "eta": None, "timelimit": [600, None]},
        {"argsrepr": "('ünïcödé', '\\u2028', '\"quoted\"')", "stamps": {}, "n": -(2**70)},
        {"floats": [1.5, 1e300, math.inf, -math.inf, math.nan], "flag": True, "none": None},
        {"nested": {"a": [{"b": (1, 2)}], "1": {}}, 3: "int key", 2.5: "float key"},
        # kombu's own types: written by kombu's encoder, as before
        {"eta": datetime.datetime(2026, 12, 7, 8, 0, tzinfo=UTC), "uid": uuid.UUID(int=7)},
        {"price": decimal.Decimal("1.10"), "raw": b"\xff\x00", "day": datetime.date(2026, 1, 2)},
    ],
)
def test_an_envelope_is_written_as_kombus_json_encoder_writes_it(headers: dict[str, Any]) -> None:
    # Given an envelope whose headers hold JSON's values, or kombu's own types
    env = envelope(headers, {"correlation_id": "id-1", "priority": None})

    # When it is written
    text = env.dumps()

    # Then the text is kombu's, character for character, and reads back
    assert text == kombus_text(env)
    assert Envelope.loads(text).task_id == "id-1"


def test_an_envelope_kombu_cannot_write_raises_what_kombus_encoder_raises() -> None:
    # Given headers holding a cycle, and headers holding a value no encoder knows
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic

    # When they are written, Then the error is kombu's encoder's own
    for headers, error in (({"c": cyclic}, ValueError), ({"o": object()}, TypeError)):
        env = envelope(headers)
        with pytest.raises(error):
            kombus_text(env)
        with pytest.raises(error):
            env.dumps()


@pytest.mark.parametrize(
    "counts",
    [
        {"retries": 0, "replaced_task_nesting": 0},
        {"retries": 3, "replaced_task_nesting": 2},
        {},
        {"retries": None, "replaced_task_nesting": None},
        {"retries": "4", "replaced_task_nesting": 1},
        {"retries": -2, "replaced_task_nesting": 1},
        {"retries": True, "replaced_task_nesting": 0},
        {"retries": 1.0, "replaced_task_nesting": "x"},
    ],
)
def test_an_envelopes_task_key_is_its_attempts_claim_id(counts: dict[str, Any]) -> None:
    env = envelope(counts)
    assert env.task_key == claim_task_id("id-1", attempt_of(env.headers))


EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@pytest.mark.parametrize(
    ("headers", "body", "part"),
    [
        ({}, ((1,), {}, EMBED), False),
        ({}, ((1,), {}, {**EMBED, "chain": []}), True),
        ({}, ((1,), {}, {**EMBED, "chain": [{"task": "t"}]}), True),
        ({}, ((1,), {}, {**EMBED, "chord": {"task": "t"}}), True),
        ({"group": "g-1"}, ((1,), {}, EMBED), True),
        ({}, [[1], {}, {**EMBED, "chain": []}], True),
        ({}, [[1], {}, EMBED], False),
        ({}, ((1,), {}), False),
        ({}, "a body", False),
    ],
)
def test_a_canvas_part_is_a_group_member_a_chords_part_or_a_chain_step(
    headers: dict[str, Any], body: Any, part: bool
) -> None:
    assert is_canvas_part(headers, body) is part


@pytest.mark.parametrize(
    "body",
    [
        ((1, "ü"), {"k": 2.5}, EMBED),
        ((datetime.datetime(2026, 12, 7, tzinfo=UTC), uuid.UUID(int=3)), {}, EMBED),
        ([b"\xff", decimal.Decimal("2.5")], {}, None),
    ],
)
@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_an_envelopes_body_is_the_message_serialized_as_kombus_producer_serializes_it(
    body: Any, serializer: str
) -> None:
    # Given a body of JSON's values or of kombu's own types
    # When its envelope is made
    env = Envelope.of(
        body=body, serializer=serializer, headers={"task": "t", "id": "i"}, exchange=None,
        routing_key=None, properties=None,
    )  # fmt: skip

    # Then its body, content type and encoding are kombu's, and it equals one built field by
    # field
    content_type, content_encoding, data = serialize(body, serializer=serializer)
    expected = data.encode(content_encoding) if isinstance(data, str) else data
    assert (env.body, env.content_type, env.content_encoding) == (
        expected,
        content_type,
        content_encoding,
    )
    assert env == Envelope(
        task="t", task_id="i", headers={"task": "t", "id": "i"}, body=expected,
        content_type=content_type, content_encoding=content_encoding, exchange="",
        routing_key="", properties={},
    )  # fmt: skip


def test_an_envelope_uses_the_json_encoder_registered_in_kombus_place() -> None:
    # Given kombu's json replaced in its registry by an encoder of the application's
    def shout(value: Any) -> str:
        return str(kombu_json.dumps(value)).upper()

    registry.register("json", shout, kombu_json.loads, "application/json", "utf-8")
    try:
        # When an envelope is made, Then its body is that encoder's
        env = Envelope.of(
            body=(("a",), {}, EMBED), serializer="json", headers={"task": "t", "id": "i"},
            exchange="", routing_key="q", properties={},
        )  # fmt: skip
        assert env.body.startswith(b'[["A"], {}')
    finally:
        registry.register("json", kombu_json.dumps, kombu_json.loads, "application/json", "utf-8")


def test_a_body_kombu_cannot_serialize_raises_kombus_encode_error() -> None:
    with pytest.raises(EncodeError):
        Envelope.of(
            body=((object(),), {}, EMBED), serializer="json", headers={"task": "t", "id": "i"},
            exchange="", routing_key="q", properties={},
        )  # fmt: skip


def _kombus_message(
    body: Any, serializer: str, body_encoding: str | None, **publish: Any
) -> dict[str, Any]:
    """The message kombu's virtual channel hands its ``_put`` for a publish of ``body`` (the
    Redis transport's ``_put`` pushes it JSON-encoded): published through kombu's own
    ``Producer`` on its in-memory virtual transport, the channel's body encoding set."""
    from kombu import Connection, Exchange, Producer, Queue

    with Connection("memory://") as conn:
        channel = conn.channel()
        channel.body_encoding = body_encoding
        exchange = Exchange("ex", "direct")
        Queue("q", exchange, routing_key="rk")(channel).declare()
        put: list[dict[str, Any]] = []
        channel._put = lambda queue, message, **kw: put.append(message)
        Producer(channel).publish(
            body, serializer=serializer, exchange=exchange, routing_key="rk", **publish
        )
    assert len(put) == 1
    return put[0]


def _kombu_pushes_utf8_bodies() -> bool:
    """True where kombu's virtual channels take ``utf-8`` as a body encoding (as none): kombu
    5.3's look a codec of that name up and fail."""
    from kombu import Connection

    with Connection("memory://") as conn:
        try:
            conn.channel().encode_body("x", "utf-8")
        except AttributeError:
            return False
    return True


JSON_BODY = ((1, "ü"), {"k": 2.5}, EMBED)
KOMBU_TYPES_BODY = ((datetime.datetime(2026, 12, 7, tzinfo=UTC), uuid.UUID(int=3)), {}, EMBED)


@pytest.mark.parametrize(
    ("serializer", "body", "body_encoding"),
    [
        ("json", JSON_BODY, "base64"),  # kombu's Redis channels' own
        ("json", JSON_BODY, None),
        pytest.param(
            "json",
            JSON_BODY,
            "utf-8",
            marks=pytest.mark.skipif(
                not _kombu_pushes_utf8_bodies(), reason="this kombu pushes no utf-8 body"
            ),
        ),
        ("json", KOMBU_TYPES_BODY, "base64"),
        # a pickled body is bytes: pushed in base64 only
        ("pickle", ([b"\xff", decimal.Decimal("2.5")], {}, None), "base64"),
    ],
)
def test_a_journaled_kombu_message_reads_as_the_envelope_of_the_same_publish(
    serializer: str, body: Any, body_encoding: str | None
) -> None:
    # Given a task message as Celery hands it to kombu, and the message kombu's virtual
    # channel pushes for it (what the journal keeps where it rides the Redis broker's push)
    headers = {"task": "t.echo", "id": "id-9", "retries": 2, "eta": "2026-12-07T08:00:00+00:00"}
    properties = {"correlation_id": "id-9", "reply_to": "r-1", "priority": 4}
    pushed = _kombus_message(body, serializer, body_encoding, headers=headers, **properties)

    # When the journal reads the pushed message back
    env = Envelope.loads(kombu_json.dumps(pushed))

    # Then it is the envelope the journal writes apart for the same publish: the task, its
    # headers, the body in its serializer, the route, the publisher's properties (kombu's
    # own left to kombu's re-publish)
    assert env == Envelope.of(
        body=body, serializer=serializer, headers=headers, exchange="ex", routing_key="rk",
        properties=properties,
    )  # fmt: skip
    assert env.task_key == "id-9:2:0"
    assert env.eta_ms == 1796630400000


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda m: m["properties"].update(body_encoding="zlib"), "a message body in 'zlib'"),
        (lambda m: m["headers"].pop("task"), "no task name and id"),
        (lambda m: m["properties"].pop("delivery_info"), "delivery_info"),
        (lambda m: m.update(body=7), "a message body of type int"),
    ],
)
def test_a_kombu_message_the_journal_cannot_read_back_is_refused_naming_why(
    change: Any, why: str
) -> None:
    pushed = _kombus_message(((1,), {}, EMBED), "json", "base64", headers={"task": "t", "id": "i"})
    change(pushed)
    with pytest.raises(ValueError, match="unreadable journal envelope") as raised:
        Envelope.loads(kombu_json.dumps(pushed))
    assert why in str(raised.value)
