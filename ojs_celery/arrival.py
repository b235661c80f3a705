"""A message reaches a pool process: what its ``ojs`` header says, and what its start comes to.

The job's record is the authority; the header only says which attempt the message may start
(its dispatch token) and, for a job whose record cannot be found, how old the message is. So:

* a header whose token is unusable (not an object, no integer ``token``) cannot be fenced: the
  message is dropped with a log line naming the job, and the sweeper's redispatch backstop
  (``redispatch_after``) publishes the job once more;
* anything else wrong in it (a snapshot that does not decode, a missing ``created_at``) only
  costs the shortcut it offered: the start reads the record;
* a record that does not exist yet may still be on its way (the overlapped Redis enqueue
  publishes while its insert is in flight): the start waits briefly for it, and the message then
  goes back to the broker, until the header's ``created_at`` is older than
  :data:`ORPHAN_AFTER` (the insert surely failed): then it is dropped as an orphan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import header as ojs_header
from .envelope import CELERY_KWARGS_FIELD, Job, json_native, typed_json
from .lifecycle import Record, Transition
from .store import JobStore

#: A message whose job has no record is an orphan once its ``created_at`` is this many seconds
#: old: longer than any store write of the enqueue that published it can take (SQLite's busy
#: timeout, redis-py's retries), so the insert it was published beside surely failed.
ORPHAN_AFTER = 30.0
#: An insert whose reply came within this many seconds of the ``created_at`` its message
#: carries was written before any worker could drop that message as an orphan: half of
#: :data:`ORPHAN_AFTER`, the rest room for a worker's clock ahead of the producer's.
LANDED_IN_TIME = ORPHAN_AFTER / 2
#: How long a start waits in the pool process for a record that may still be being written,
#: before the message goes back to the broker (the insert it follows normally lands in a few ms).
RECORD_WAIT = 0.5


@dataclass(frozen=True)
class Arrival:
    """What a message's ``ojs`` header says (``token`` None: unusable, ``problem`` says why)."""

    token: int | None
    created_at: float | None
    snapshot: Record | None
    problem: str | None = None
    #: The origin of the record the message was published for (fencing), if it says.
    origin: str | None = None

    def record_may_come(self, now: float | None = None) -> bool:
        """May the job's record still be written (a message younger than ORPHAN_AFTER)? A
        ``created_at`` further ahead than that is no clock skew but a header that lies: it
        would send the message back to the broker for ever."""
        if self.created_at is None:
            return False
        at = time.time() if now is None else now
        return -ORPHAN_AFTER < at - self.created_at < ORPHAN_AFTER


def landed_in_time(job: Job, now: float | None = None) -> bool:
    """Whether ``job``'s insert, whose reply came ``now``, was written while the message
    published beside it (before the reply: an insert in flight) could still find it. Else a
    worker may have dropped that message as an orphan (the insert waited for a lock, or for a
    server that stalled, or was sent again after a lost reply), and the job's outbox entry
    must stay for the sweeper to publish it once more: without it the job would wait for
    ``redispatch_after``."""
    if job.created_at is None:
        return False
    at = time.time() if now is None else now
    return at - job.created_at.timestamp() < LANDED_IN_TIME


def has_header(request: Any) -> bool:
    return ojs_header.of_task_request(request) is not ojs_header.ABSENT


def read(request: Any, job_id: str) -> Arrival:
    """The arrival of an OJS message (one with an ``ojs`` header, see :func:`has_header`)."""
    return parse(ojs_header.of_task_request(request), job_id)


def parse(raw: Any, job_id: str) -> Arrival:
    if not isinstance(raw, dict):
        return Arrival(None, None, None, f"the ojs header is a {type(raw).__name__}, not an object")
    token = ojs_header.parse_token(raw.get("token"))
    created_at = _seconds(raw.get("created_at"))
    if token is None:
        return Arrival(None, created_at, None, f"token {raw.get('token')!r} is not an integer")
    return Arrival(token, created_at, ojs_header.snapshot(raw, job_id),
                   origin=ojs_header.origin(raw))


def start(
    store: JobStore, job_id: str, arrival: Arrival, worker_id: str,
    carries: Callable[[Job], bool] | None = None,
) -> Transition:
    """Start the attempt the message asks for (``carries``: whether the message is the job's,
    see :func:`carries_call`); a record that may still come is waited for (at most
    :data:`RECORD_WAIT`). Store errors, and any other, reach the caller."""
    assert arrival.token is not None
    started = store.start(job_id, arrival.token, worker_id, hint=arrival.snapshot,
                          origin=arrival.origin, carries=carries)
    deadline = time.monotonic() + RECORD_WAIT
    pause = 0.02
    while started.reason == "unknown_job" and arrival.record_may_come():
        if time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
        started = store.start(job_id, arrival.token, worker_id, hint=arrival.snapshot,
                              origin=arrival.origin, carries=carries)
    return started


def carries_call(args: Any, kwargs: Any, job: Job) -> bool:
    """Whether a message's arguments are its job's. The record is the authority: a message
    written by hand with a job's id and token but other arguments is not that job's. A pickled
    message's tuples are compared as the lists the job's JSON holds, and the typed values a
    Celery caller's arguments may hold (a ``datetime``, decoded by kombu from the message) as
    the kombu typed JSON the job keeps them as (:func:`~ojs_celery.envelope.typed_json`)."""
    stored_kwargs = (job.model_extra or {}).get(CELERY_KWARGS_FIELD) or {}
    given_args = list(args or ())
    given_kwargs = dict(kwargs or {})
    if given_args == job.args and given_kwargs == stored_kwargs:
        return True
    if (json_native(given_args) == json_native(job.args)
            and json_native(given_kwargs) == json_native(stored_kwargs)):
        return True
    try:  # only a job with typed values, or a message that is not the job's, gets here
        return bool(typed_json(given_args) == job.args
                    and typed_json(given_kwargs) == stored_kwargs)
    except (TypeError, ValueError):  # what kombu's JSON cannot write is not a job's
        return False


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
