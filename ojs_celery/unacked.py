"""kombu's Redis record of an acknowledged OJS delivery, removed in batches after the ack.

On a Redis broker kombu keeps every delivered message in an ``unacked`` hash and index until it
is acknowledged, so that it can put back what a dead consumer held. kombu's ``QoS.ack`` removes
the entry with a blocking round trip (a MULTI/EXEC of ``ZREM`` and ``HDEL``) in the worker's
main process, once per message. For an OJS message that removal only keeps the message from
being delivered again, which the job's fencing already makes harmless: a message whose attempt
was started (and ended) is dropped by the start's compare-and-set, never run twice. So the ack of
an OJS message that this process runs as an OJS task (see :mod:`ojs_celery.kept_client`) does
kombu's in-process bookkeeping at once and queues the removal; a background thread removes a
batch of entries in one round trip.

If the process dies before a batch is sent (a SIGKILL, the machine), those entries stay: after
the broker's ``visibility_timeout`` kombu puts their messages back, and a worker drops each
whose attempt started (its token is spent). A message that was acknowledged without starting
its attempt (a header it could not use, a task with ``acks_late`` off) may then start that
attempt, once, as the sweeper's redispatch backstop would. The recording of a delivery
(``QoS.append``), a reject, an OJS message that a plain task ran, and every plain message keep
kombu's synchronous path: delaying those could lose or redeliver a message that has not run, or
run one again.
"""

from __future__ import annotations

import logging
from typing import Any

from .batching import Batcher, Handler

__all__ = ["Removal", "flush", "removals", "remove_later"]

logger = logging.getLogger(__name__)

#: One entry to remove: the channel's kept client, kombu's unacked index key and hash key,
#: the delivery tag.
Removal = tuple[Any, str, str, str]
#: Seconds the thread waits after an ack for more to send with it.
LINGER = 0.02
MAX_BATCH = 500


class UnackedRemovals(Batcher[Removal]):
    """The process's queue of entries to take out of kombu's unacked record."""

    thread_name = "ojs-unacked"

    def _open(self) -> Handler[Removal]:
        return _remove


def _remove(batch: list[Removal]) -> None:
    """One MULTI/EXEC per client and pair of keys, as kombu's own ack sends (``ZREM`` and
    ``HDEL`` take many members). A refusal or a lost connection leaves the entries: logged,
    they are restored and dropped as stale later (see the module docstring)."""
    groups: dict[tuple[int, str, str], tuple[Any, list[str]]] = {}
    for client, index_key, unacked_key, tag in batch:
        groups.setdefault((id(client), index_key, unacked_key), (client, []))[1].append(tag)
    for (_, index_key, unacked_key), (client, tags) in groups.items():
        try:
            client.pipeline().zrem(index_key, *tags).hdel(unacked_key, *tags).execute()
        except Exception as exc:
            logger.warning(
                "ojs_celery: %d acknowledged OJS deliveries stay in kombu's unacked record "
                "(%s: %s); after the broker's visibility_timeout kombu restores them, and "
                "workers drop them as already run", len(tags), type(exc).__name__, exc)


#: This process's queue (one thread per process, started on first use).
removals = UnackedRemovals(linger=LINGER, max_batch=MAX_BATCH)


def remove_later(client: Any, index_key: str, unacked_key: str, delivery_tag: str) -> None:
    """Queue the removal of an acknowledged delivery's entry (see the module docstring)."""
    removals.put((client, index_key, unacked_key, delivery_tag))


def flush(timeout: float = 5.0) -> None:
    """Send what is queued and wait for it (a worker shutting down, the process exiting,
    tests); say so if that did not finish in ``timeout`` seconds."""
    if not removals.flush(timeout):
        logger.warning(
            "ojs_celery: the removals of acknowledged OJS deliveries from kombu's unacked record "
            "were not all sent within %ss; after the broker's visibility_timeout kombu restores "
            "what is left, and workers drop those messages as already run", timeout)
