"""The ``ojs`` message header: the one codec for what an OJS message carries besides Celery's.

Every message of an OJS job carries, in the ``ojs`` header, the dispatch token of the attempt it
may start, the job's fixed deadlines and, when the publisher has it, a snapshot of the stored
record (``record``): the worker starts the attempt from it with one compare-and-set instead of a
read and a write (a stale snapshot only costs the read it tried to save). It is built when a
message is published and read in the worker's main process (a ``Request``: Celery keeps the
message's headers in its private ``_request_dict``, the one place they are reachable there) and
in the pool process (the task's ``request``).

The snapshot travels as one string, ``snapshot``: the record's fields as a JSON array in
:data:`~ojs_celery.store.base.RECORD_FIELDS` order, a newline, then the job's JSON as the store
wrote it. One string is one item for AMQP's header table and for the pickling to a pool process
(a nested object cost about twenty, each encoded and decoded on its own), and the job's JSON
goes out as written, without being escaped into another document. A worker still reads the
older nested form, ``record``, from messages published before an upgrade; a worker that predates
``snapshot`` ignores it and reads the store.

The header also carries the record's ``origin`` (the nonce of the job's insert), and so does the
snapshot with the nonce of its write: a snapshot matches only the very record it was taken from,
and a message for a job that never got stored (its id was taken) cannot start the job that has
that id. See :mod:`ojs_celery.store.base` for the fencing scheme.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .envelope import Job
from .lifecycle import Record
from .store.base import RECORD_FIELDS, decode_job, encode_job

NAME = "ojs"
#: The header's key for the record snapshot (see the module docstring).
SNAPSHOT = "snapshot"
#: The older, nested form of the snapshot, still read.
NESTED_SNAPSHOT = "record"
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
            fields = json.dumps([getattr(record, name) for name in RECORD_FIELDS],
                                separators=(",", ":"))
            header[SNAPSHOT] = fields + "\n" + data
    return header


#: The order :func:`snapshot` unpacks a snapshot's fields in: the store's.
_UNPACKED = ("version", "token", "worker_id", "heartbeat_at", "extended_at", "dispatch_due",
             "promote_at", "dead_letter", "nonce", "origin")
if _UNPACKED != RECORD_FIELDS:  # pragma: no cover - a field added to the store, not here
    raise RuntimeError(f"header.snapshot unpacks {_UNPACKED}, the store writes {RECORD_FIELDS}")

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
    try:
        found = _snapshot_parts(header)
        if found is None:
            return None
        values, job = found
        (version, token, worker_id, heartbeat_at, extended_at, dispatch_due, promote_at,
         dead_letter, nonce, origin) = values  # _UNPACKED, which is RECORD_FIELDS
        record = Record(
            job=decode_job(job),
            token=int(token),
            version=int(version),
            worker_id=str(worker_id) if worker_id else None,
            heartbeat_at=_optional_float(heartbeat_at),
            extended_at=_optional_float(extended_at),
            dispatch_due=_optional_float(dispatch_due),
            promote_at=_optional_float(promote_at),
            dead_letter=bool(dead_letter),
            nonce=str(nonce),
            origin=str(origin),
        )
        expected_token = int(header["token"])
    except Exception:  # whatever is wrong with it, reading the store instead is always right
        return None
    if record.job.id != job_id or record.token != expected_token or record.version < 1:
        return None
    return record


def _snapshot_parts(header: dict[str, Any]) -> tuple[list[Any], Any] | None:
    """The snapshot's field values in RECORD_FIELDS order and its job's JSON (None: the
    header has none). Raises on a malformed one."""
    text = header.get(SNAPSHOT)
    if isinstance(text, str):
        head, newline, job = text.partition("\n")
        if not newline:
            raise ValueError("no job in the snapshot")
        return json.loads(head), job
    nested = header.get(NESTED_SNAPSHOT)
    if not isinstance(nested, dict):
        return None
    return [nested[name] for name in RECORD_FIELDS], nested["job"]


def origin(header: dict[str, Any]) -> str | None:
    """The origin of the record the message was published for (None: not known)."""
    value = header.get("origin")
    return value if isinstance(value, str) else None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
