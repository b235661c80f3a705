"""OJS messages that kombu's Redis transport holds for a worker that no longer will run them,
put back in their queue at once rather than after the broker's ``visibility_timeout``.

On a Redis broker kombu records every message it delivers in an ``unacked`` hash (the message)
and an ``unacked_index`` sorted set (when it was delivered, by the receiving host's clock) until
it is acknowledged, and puts back what was never acknowledged once ``visibility_timeout`` (an
hour by default) has passed. Two holders go away sooner without kombu noticing:

- a worker whose broker connection failed while Redis was away: Celery drops what it held
  (:mod:`ojs_celery.worker.reconnect` hands its messages back once it reconnects);
- a worker killed or frozen just after it received a message, before a beat listed it: the
  sweeper that declares it dead redispatches the jobs its last beat listed, and puts back the
  messages delivered since that no worker lists (:func:`ojs_celery.sweeper.sweep`).

Both put messages back as kombu's own ``QoS.restore_by_tag`` does: a transaction that watches
the record, so a message that kombu or another sweeper put back meanwhile is not put back twice.
Only OJS messages: a copy of one is harmless (fencing drops it at its start), a plain task's is
not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kombu.utils.json import loads

from . import header

__all__ = ["Delivery", "deliveries", "learn_exchanges", "named", "plain_client", "put_back",
           "recorded_between", "routable"]

#: How many of the jobs put back a log line names.
LISTED = 10
#: How many messages :func:`deliveries` reads from kombu's record per round trip.
PAGE = 100


@dataclass(frozen=True)
class Delivery:
    """One unacknowledged OJS message in kombu's record."""

    tag: str
    job_id: str
    #: The dispatch token it carries (None: its header has none this version can read).
    token: int | None
    #: Where kombu would put it back: the exchange and routing key it was published with.
    exchange: str
    routing_key: str


def recorded_between(channel: Any, since: float, until: float, limit: int) -> list[str]:
    """The delivery tags kombu records as delivered between ``since`` and ``until`` and not
    yet acknowledged, oldest first, at most ``limit`` (plain messages among them).
    ``channel`` is a kombu Redis channel; its errors (redis-py's, ``OSError``) are the
    caller's."""
    client, prefix = plain_client(channel)
    tags = client.execute_command("ZRANGE", prefix + channel.unacked_index_key, since,
                                  until, "BYSCORE", "LIMIT", 0, limit)  # as kombu reads it
    return [_text(tag) for tag in tags or ()]


def deliveries(channel: Any, tags: list[str]) -> list[Delivery]:
    """The OJS messages among those kombu records under ``tags`` (plain messages, and those
    acknowledged meanwhile, left out), read a page at a time."""
    found = []
    client, prefix = plain_client(channel)
    for start in range(0, len(tags), PAGE):
        page = tags[start:start + PAGE]
        payloads = client.execute_command("HMGET", prefix + channel.unacked_key, *page)
        for tag, payload in zip(page, payloads, strict=True):
            delivery = _ojs_delivery(tag, payload)
            if delivery is not None:
                found.append(delivery)
    return found


def put_back(channel: Any, tags: Iterable[str]) -> list[str]:
    """Put each message still in kombu's record back in its queue; the tags of those it put
    back (a tag missing from the record was acknowledged or put back meanwhile, by kombu or
    another sweeper). A failure of the broker is the caller's: the messages not yet put back
    stay in the record."""
    qos = channel.qos
    with channel.conn_or_acquire() as client:  # kombu's client: it prefixes HGET and WATCH
        return [tag for tag in tags if _restore(qos, tag, client)]


def _restore(qos: Any, tag: str, client: Any) -> bool:
    """kombu's ``QoS.restore_by_tag`` (a transaction that watches the record: the message
    leaves it and goes back to its queue once, whoever else restores it), made of kombu's
    own parts, which also says whether this call put it back: kombu's says nothing, and two
    sweepers that both saw it in the record would both count it."""
    restored = False

    def transaction(pipe: Any) -> None:
        nonlocal restored
        payload = pipe.hget(qos.unacked_key, tag)
        pipe.multi()
        qos._remove_from_indices(tag, pipe)
        restored = payload is not None
        if restored:
            message, exchange, routing_key = loads(_text(payload))  # type: ignore[no-untyped-call]
            qos.channel._do_restore_message(message, exchange, routing_key, pipe, False)

    client.transaction(transaction, qos.unacked_key)
    return restored


def named(job_ids: list[str]) -> str:
    """The jobs put back, as a log line names them."""
    return ", ".join(job_ids[:LISTED]) + (", ..." if len(job_ids) > LISTED else "")


def learn_exchanges(channel: Any, app: Any) -> None:
    """Make the app's exchanges (those of its ``task_queues``) known to ``channel``, as a
    worker's channel knows them once it has declared its queues. kombu's virtual transports
    keep an exchange's type in memory only, and a channel that never declared one routes by
    it as a direct exchange: a message published to a topic exchange would be put back in no
    queue. Nothing is written to the broker."""
    for queue in list(app.amqp.queues.values()):
        exchange = queue.exchange
        if exchange is not None and exchange.name:
            channel.exchange_declare(exchange=exchange.name, type=exchange.type,
                                     durable=exchange.durable,
                                     auto_delete=exchange.auto_delete)


def routable(channel: Any, delivery: Delivery) -> bool:
    """Whether kombu would put ``delivery`` back in some queue (its ``_lookup``, which
    ``restore_by_tag`` follows): a message it would route nowhere is left to kombu's own
    restore, by a worker's channel that knows its exchange."""
    return bool(channel._lookup(delivery.exchange, delivery.routing_key))


def plain_client(channel: Any) -> tuple[Any, str]:
    """A redis-py client on the channel's pool that prefixes nothing, and kombu's
    ``global_keyprefix`` to put before each key: kombu's own client prefixes only the commands it
    uses itself (``ZRANGE`` only as its first argument, ``HMGET`` not at all)."""
    import redis  # only with a Redis broker, so with kombu's Redis extra

    return redis.Redis(connection_pool=channel.pool), getattr(channel, "global_keyprefix", "") or ""


def _ojs_delivery(tag: str, payload: Any) -> Delivery | None:
    """The delivery of an OJS message from kombu's record (``[message, exchange,
    routing_key]``); None for any other message, or one the record no longer holds."""
    if payload is None:
        return None
    try:
        message, exchange, routing_key = json.loads(payload)
        headers = message["headers"]
        ojs = headers[header.NAME]
        job_id = headers["id"]
    except (ValueError, LookupError, TypeError):
        return None  # a plain message, a Celery protocol 1 one, or not kombu's JSON
    if not (isinstance(ojs, dict) and isinstance(job_id, str) and isinstance(exchange, str)
            and isinstance(routing_key, str)):
        return None
    return Delivery(tag, job_id, header.parse_token(ojs.get("token")), exchange, routing_key)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
