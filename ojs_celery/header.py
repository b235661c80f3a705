"""The ``ojs`` message header: the one codec for what an OJS message carries besides Celery's.

Every message of an OJS job carries, in the ``ojs`` header, the dispatch token of the attempt it
may start, the job's fixed deadlines and, when the publisher has it, a snapshot of the stored
record (``record``): the worker starts the attempt from it with one compare-and-set instead of a
read and a write (a stale snapshot only costs the read it tried to save). It is built when a
message is published and read in the worker's main process (a ``Request``: Celery keeps the
message's headers in its private ``_request_dict``, the one place they are reachable there) and
in the pool process (the task's ``request``).

The header also carries the record's ``origin`` (the nonce of the job's insert), and so does the
snapshot with the nonce of its write: a snapshot matches only the very record it was taken from,
and a message for a job that never got stored (its id was taken) cannot start the job that has
that id. See :mod:`ojs_celery.store.base` for the fencing scheme.
"""

from __future__ import annotations

import time
from typing import Any

from .envelope import Job
from .lifecycle import Record
from .store.base import RECORD_FIELDS, decode_job, encode_job

NAME = "ojs"
#: Only jobs whose JSON is at most this long travel with a record snapshot: AMQP puts all
#: headers in one frame, and a big job would double the message for a saving of one read.
SNAPSHOT_MAX_CHARS = 8192


def build(job: Job, token: int, record: Record | None = None) -> dict[str, Any]:
    """The ``ojs`` header; with ``record`` (the stored record, just written) it also carries
    the record's snapshot, unless the job is too big for one."""
    created = job.created_at.timestamp() if job.created_at else time.time()
    header: dict[str, Any] = {
        "token": token,
        "created_at": created,
        "ttl_deadline": created + job.enqueue_ttl if job.enqueue_ttl else None,
        "total_deadline": created + job.total_timeout if job.total_timeout else None,
    }
    if record is not None:
        header["origin"] = record.origin
        data = record.written_json if record.written_json is not None else encode_job(record.job)
        if len(data) <= SNAPSHOT_MAX_CHARS:
            header["record"] = {name: getattr(record, name) for name in RECORD_FIELDS}
            header["record"]["job"] = data
    return header


#: What :func:`of_task_request` returns for a message without an ``ojs`` header.
ABSENT: Any = object()


def of_task_request(request: Any) -> Any:
    """The header as a pool process sees it (``task.request``), as it was sent (any shape:
    :mod:`ojs_celery.arrival` decides what an unusable one means), or :data:`ABSENT` when the
    message has none (a plain Celery message)."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and NAME in headers:
        return headers[NAME]
    return getattr(request, NAME, ABSENT)


def of_request(request: Any) -> dict[str, Any] | None:
    """The header of a worker main process ``Request`` (Celery's private ``_request_dict``)."""
    header = (getattr(request, "_request_dict", None) or {}).get(NAME)
    return header if isinstance(header, dict) else None


def token_of(request: Any) -> int | None:
    """The dispatch token of a worker ``Request`` (None for a message that is no OJS job)."""
    header = of_request(request)
    return None if header is None else parse_token(header.get("token"))


def parse_token(value: Any) -> int | None:
    """A dispatch token as the producer writes it (an integer), or None: a malformed header
    must neither start an attempt nor break a worker loop that lists its messages."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def snapshot(header: dict[str, Any], job_id: str) -> Record | None:
    """The record snapshot a header carries, or None: absent (an older publisher, a big job),
    malformed, or not this message's job and token."""
    data = header.get("record")
    if not isinstance(data, dict):
        return None
    try:
        record = Record(
            job=decode_job(data["job"]),
            token=int(data["token"]),
            version=int(data["version"]),
            worker_id=str(data["worker_id"]) if data["worker_id"] else None,
            heartbeat_at=_optional_float(data["heartbeat_at"]),
            extended_at=_optional_float(data["extended_at"]),
            dispatch_due=_optional_float(data["dispatch_due"]),
            promote_at=_optional_float(data["promote_at"]),
            dead_letter=bool(data["dead_letter"]),
            nonce=str(data["nonce"]),
            origin=str(data["origin"]),
        )
        token = int(header["token"])
    except Exception:  # whatever is wrong with it, reading the store instead is always right
        return None
    if record.job.id != job_id or record.token != token or record.version < 1:
        return None
    return record


def origin(header: dict[str, Any]) -> str | None:
    """The origin of the record the message was published for (None: not known)."""
    value = header.get("origin")
    return value if isinstance(value, str) else None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
