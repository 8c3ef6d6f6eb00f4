"""The publish journal's write riding kombu's own ``LPUSH`` on the Redis broker, and the
kombu serializer its envelope may skip.

Replaces a producer channel's ``_put`` on its instance (kombu's Redis ``Channel._put``); read
in kombu 5.3 to 5.7 (:data:`celery_claims.worker.compat.TESTED`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import redis
from celery.utils.log import get_logger
from kombu.serialization import registry
from kombu.utils import json

from celery_claims.claims.calls import ScriptCall
from celery_claims.connection import server_of
from celery_claims.worker.compat import close_with
from celery_claims.worker.transport.sender import ScriptCaller

__all__ = ["RIDE_BODY_ENCODINGS", "PublishRide", "PublishRideFn", "kombu_json_codec"]

logger = get_logger("celery_claims.worker")


def kombu_json_codec(serializer: str | None) -> tuple[str, str] | None:
    """``serializer``'s content type and encoding where kombu's registry encodes it with
    kombu's own JSON encoder (``kombu.utils.json.dumps``: its ``json``, unless replaced),
    else None. kombu's registry keeps its codecs in ``_encoders`` (name -> ``codec``
    namedtuple of content type, encoding, encoder); read in kombu 5.3 to 5.7
    (``kombu/serialization.py``), and None wherever it reads otherwise."""
    encoders = getattr(registry, "_encoders", None)
    codec = encoders.get(serializer) if isinstance(encoders, dict) and serializer else None
    if codec is None or getattr(codec, "encoder", None) is not json.dumps:
        return None
    content_type, content_encoding = codec.content_type, codec.content_encoding
    if not isinstance(content_type, str) or not isinstance(content_encoding, str):
        return None
    return content_type, content_encoding


#: The body encodings of kombu's virtual channels (``Channel.body_encoding``: base64 unless a
#: transport option says otherwise; None and utf-8 leave the body as it is) whose messages
#: the journal keeps as kombu pushes them (:meth:`~celery_claims.worker.publish.envelope.
#: Envelope.loads` decodes these); a message in another rides nothing and is journaled apart.
RIDE_BODY_ENCODINGS = ("base64", None, "utf-8")

#: ``ride(queue, list_key, payload)``: the journal write to send with a publish to ``queue``'s
#: list ``list_key`` of ``payload`` (kombu's serialized message, which the entry keeps as it
#: is), or None (kombu publishes it alone); ``rode()`` is told once such a call was taken.
PublishRideFn = Callable[[str, str, str], "ScriptCall[Any] | None"]


class PublishRide:
    """The publish journal's write riding kombu's own ``LPUSH`` on the Redis broker.

    Where the claim store is the broker's server and database, a producer channel's
    ``_put`` (kombu's Redis ``Channel._put``: one ``LPUSH`` of the serialized message to the
    queue's list, by priority) is replaced, on the channel's instance, by one script that
    pushes the same payload to the same list and journals that payload as it is
    (``journal_put.lua`` with the list key): the journal costs no write, no round trip and
    no encoding of its own, and the message is never in the queue unjournaled. What kombu's
    ``_put`` does besides (kombu 5.7's publish batches, queues with an expiry), a message
    whose body encoding the journal does not read (:data:`RIDE_BODY_ENCODINGS`) and a
    channel whose transport prefixes keys get kombu's own ``_put``, and the journal writes
    on its own. The script goes on a connection the ride keeps, made from the channel's pool
    (``pool``). Read in kombu 5.3 to 5.7 (``kombu/transport/redis.py``).
    """

    #: Attribute of a channel caching its ride: (store client, hooked or not).
    CACHED = "_celery_claims_publish_ride"

    @classmethod
    def hook(
        cls,
        channel: Any,
        store_client: Any,
        ride: PublishRideFn,
        rode: Callable[[], object],
    ) -> bool:
        """Replace ``channel._put`` (idempotent per channel and store client); False where
        the channel cannot carry the journal (not kombu's Redis channel, another server,
        prefixed keys)."""
        cached = getattr(channel, cls.CACHED, None)
        if cached is not None and cached[0] is store_client:
            return bool(cached[1])
        hooked = cls._hook(channel, store_client, ride, rode)
        with contextlib.suppress(AttributeError):
            setattr(channel, cls.CACHED, (store_client, hooked))
        return hooked

    @staticmethod
    def _hook(
        channel: Any, store_client: Any, ride: PublishRideFn, rode: Callable[[], object]
    ) -> bool:
        kombu_put = getattr(type(channel), "_put", None)
        if (
            kombu_put is None
            or bool(getattr(channel, "global_keyprefix", None))
            or not all(
                callable(getattr(channel, name, None))
                for name in ("_q_for_pri", "_get_message_priority", "conn_or_acquire")
            )
        ):
            return False
        try:
            server = server_of(channel.client)
        except Exception:  # not a Redis channel after all
            return False
        if server is None or server != server_of(store_client):
            return False

        caller = ScriptCaller()
        close_with(channel, caller.close)  # its connections go with the channel's

        def _put(queue: Any, message: Any, **kwargs: Any) -> Any:
            expires = getattr(channel, "_expires", None)
            if (
                kwargs.get("_publish_batch") is None
                and not (expires and queue in expires)
                and (message.get("properties") or {}).get("body_encoding") in RIDE_BODY_ENCODINGS
            ):
                priority = channel._get_message_priority(message, reverse=False)
                list_key = channel._q_for_pri(queue, priority)
                dumps: Any = json.dumps
                payload = dumps(message)
                call = ride(str(queue), str(list_key), payload)
                if call is not None:
                    # kombu's _put, and the journal entry, in one script: on a connection
                    # made from the channel's own pool (kombu's settings), kept for the
                    # ride, where the pool is a standalone server's (the CPU of a call
                    # through a client is 3 times a kept connection's, docs/benchmarks.md);
                    # a connection error is redis-py's, for kombu's publish retry
                    pool = channel.pool
                    if type(pool) is redis.ConnectionPool:
                        caller.call(pool, call)
                    else:
                        with channel.conn_or_acquire() as client:
                            call.script(keys=call.keys, args=call.args, client=client)
                    rode()
                    return None
            return kombu_put(channel, queue, message, **kwargs)

        channel._put = _put  # an instance attribute: exchanges call channel._put
        return True
