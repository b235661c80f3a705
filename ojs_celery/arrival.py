"""A message reaches a pool process: what its ``ojs`` header says, and what its start comes to.

The job's record is the authority; the header only says which attempt the message may start
(its dispatch token) and, for a job whose record cannot be found, how old the message is. So:

* a header whose token is unusable (not an object, no integer ``token``) cannot be fenced: the
  message is dropped with a log line naming the job, and the sweeper's redispatch backstop
  (``redispatch_after``) publishes the job once more;
* anything else wrong in it (a snapshot that does not decode, a missing ``created_at``) only
  costs the shortcut it offered: the start reads the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import header as ojs_header
from .lifecycle import Record, Transition
from .store import JobStore

_ABSENT: Any = object()


@dataclass(frozen=True)
class Arrival:
    """What a message's ``ojs`` header says (``token`` None: unusable, ``problem`` says why)."""

    token: int | None
    created_at: float | None
    snapshot: Record | None
    problem: str | None = None


def raw_header(request: Any) -> Any:
    """The ``ojs`` header as a pool process sees it (``task.request``), whatever its shape, or
    :data:`_ABSENT` when the message has none (a plain Celery message)."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and ojs_header.NAME in headers:
        return headers[ojs_header.NAME]
    return getattr(request, ojs_header.NAME, _ABSENT)


def has_header(request: Any) -> bool:
    return raw_header(request) is not _ABSENT


def read(request: Any, job_id: str) -> Arrival:
    """The arrival of an OJS message (one with an ``ojs`` header, see :func:`has_header`)."""
    return parse(raw_header(request), job_id)


def parse(raw: Any, job_id: str) -> Arrival:
    if not isinstance(raw, dict):
        return Arrival(None, None, None, f"the ojs header is a {type(raw).__name__}, not an object")
    token = ojs_header.parse_token(raw.get("token"))
    created_at = _seconds(raw.get("created_at"))
    if token is None:
        return Arrival(None, created_at, None, f"token {raw.get('token')!r} is not an integer")
    return Arrival(token, created_at, ojs_header.snapshot(raw, job_id))


def start(store: JobStore, job_id: str, arrival: Arrival, worker_id: str) -> Transition:
    """Start the attempt the message asks for. Store errors, and any other, reach the caller."""
    assert arrival.token is not None
    return store.start(job_id, arrival.token, worker_id, hint=arrival.snapshot)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
