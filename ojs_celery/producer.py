"""From a job to a Celery message: enqueue, and the publish options of every attempt.

A message is only a request to run one attempt: it carries the job id as Celery task id (for
every attempt, so ``AsyncResult(job_id)`` follows the job) and an ``ojs`` header with the
dispatch token, the deadlines and, when the publisher has it, a snapshot of the stored record
(``record``): the worker starts the attempt from it with one compare-and-set instead of a read
and a write (a stale snapshot only costs the read it tried to save). OJS never uses Celery's
``expires`` or revoke-by-id for its jobs: both would make Celery drop every later message with
the same task id, retries included.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError

from .envelope import Job, from_epoch, parse_envelope
from .lifecycle import Publish, Record, Transition
from .runtime import Runtime, get_runtime
from .store.base import RECORD_FIELDS, decode_job, encode_job

logger = logging.getLogger(__name__)

#: Publish retries: fail fast enough that ``enqueue`` can report a broker that is down.
PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5,
                        "interval_max": 1.0}
DEFAULT_QUEUE = "default"
#: Only jobs whose JSON is at most this long travel with a record snapshot: AMQP puts all
#: headers in one frame, and a big job would double the message for a saving of one read.
SNAPSHOT_MAX_CHARS = 8192


class BrokerUnavailable(RuntimeError):
    """The job is stored but its message could not be published (it stays in the outbox)."""


def celery_queue(app: Celery, ojs_queue: str) -> str:
    """OJS ``default`` is the app's default queue; other names are used as they are."""
    if ojs_queue == DEFAULT_QUEUE:
        return str(app.conf.task_default_queue)
    return ojs_queue


def ojs_queue_of(app: Celery, celery_queue_name: str | None) -> str:
    if not celery_queue_name or celery_queue_name == app.conf.task_default_queue:
        return DEFAULT_QUEUE
    return celery_queue_name


def broker_priority(app: Celery, priority: int, amqp_max: int) -> int | None:
    """Map OJS priority (−100..100, higher first) to the broker's range and direction.

    RabbitMQ: 0..``amqp_max_priority``, higher first (the queue needs ``x-max-priority``).
    Redis: 0..9 where 0 is served first. Other transports ignore priorities.
    """
    driver = broker_driver(app)
    fraction = (priority + 100) / 200
    if driver == "amqp":
        return round(fraction * amqp_max)
    if driver == "redis":
        return round((1 - fraction) * 9)
    return None


def broker_driver(app: Celery) -> str:
    """The broker's kind (``amqp``, ``redis``, ``filesystem``...), asked of kombu without
    connecting; cached per app."""
    cached = getattr(app, "_ojs_broker_driver", None)
    if cached is None:
        try:
            with app.connection_for_write() as connection:
                cached = str(connection.transport.driver_type)
        except ImportError:  # a transport whose client library is missing: no priorities
            cached = "unknown"
        app._ojs_broker_driver = cached
    return str(cached)


def time_limits(job: Job, start_at: float) -> tuple[float | None, float]:
    """``(soft, hard)`` for an attempt starting at ``start_at``, clamped to the total deadline."""
    hard = float(job.timeout + job.grace_period)
    soft: float | None = float(job.timeout) if job.grace_period > 0 else None
    if job.total_timeout is not None and job.created_at is not None:
        remaining = job.created_at.timestamp() + job.total_timeout - start_at
        hard = max(min(hard, remaining), 1.0)
        if soft is not None:
            soft = min(soft, hard)
    if soft is not None and soft >= hard:
        soft = None
    return soft, hard


def ojs_header(job: Job, token: int, record: Record | None = None) -> dict[str, Any]:
    """The ``ojs`` message header; with ``record`` (the stored record, just written) it also
    carries the record's snapshot, unless the job is too big for one."""
    created = job.created_at.timestamp() if job.created_at else time.time()
    header: dict[str, Any] = {
        "token": token,
        "created_at": created,
        "ttl_deadline": created + job.enqueue_ttl if job.enqueue_ttl else None,
        "total_deadline": created + job.total_timeout if job.total_timeout else None,
    }
    if record is not None:
        data = encode_job(record.job)
        if len(data) <= SNAPSHOT_MAX_CHARS:
            header["record"] = {name: getattr(record, name) for name in RECORD_FIELDS}
            header["record"]["job"] = data
    return header


def record_from_header(header: dict[str, Any], job_id: str) -> Record | None:
    """The record snapshot an ``ojs`` header carries, or None: absent (an older publisher, a
    big job), malformed, or not this message's job and token."""
    snapshot = header.get("record")
    if not isinstance(snapshot, dict):
        return None
    try:
        record = Record(
            job=decode_job(snapshot["job"]),
            token=int(snapshot["token"]),
            version=int(snapshot["version"]),
            worker_id=str(snapshot["worker_id"]) if snapshot["worker_id"] else None,
            heartbeat_at=_optional_float(snapshot["heartbeat_at"]),
            extended_at=_optional_float(snapshot["extended_at"]),
            dispatch_due=_optional_float(snapshot["dispatch_due"]),
            promote_at=_optional_float(snapshot["promote_at"]),
            dead_letter=bool(snapshot["dead_letter"]),
        )
        token = int(header["token"])
    except Exception:  # whatever is wrong with it, reading the store instead is always right
        return None
    if record.job.id != job_id or record.token != token or record.version < 1:
        return None
    return record


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def publish(
    runtime: Runtime,
    job: Job,
    request: Publish,
    now: float | None = None,
    *,
    record: Record | None = None,
) -> None:
    """Send the message for ``request`` and clear its outbox entry (in the background: see
    :mod:`ojs_celery.outbox`). Pass ``record``, the record the store write that owes this
    message returned, to put its snapshot in the header.

    Raises :class:`BrokerUnavailable` if the broker cannot be reached; the outbox entry stays,
    so the sweeper publishes it later.
    """
    app = runtime.app
    at = time.time() if now is None else now
    start_at = max(at, request.eta or at)
    soft, hard = time_limits(job, start_at)
    options: dict[str, Any] = {
        "task_id": job.id,
        "queue": celery_queue(app, job.queue),
        "headers": {"ojs": ojs_header(job, request.token, record)},
        "time_limit": hard,
        "retry": True,
        "retry_policy": PUBLISH_RETRY_POLICY,
    }
    if soft is not None:
        options["soft_time_limit"] = soft
    priority = broker_priority(app, job.priority, runtime.settings.amqp_max_priority)
    if priority is not None:
        options["priority"] = priority
    if request.eta is not None and request.eta > at:
        options["eta"] = from_epoch(request.eta)
    extensions = job.extensions
    if extensions.get("x_celery_link"):
        options["link"] = extensions["x_celery_link"]
    if extensions.get("x_celery_link_error"):
        options["link_error"] = extensions["x_celery_link_error"]
    kwargs = extensions.get("x_celery_kwargs") or {}
    try:
        app.send_task(
            runtime.task_name_for(job.type), args=list(job.args), kwargs=kwargs, **options
        )
    except OperationalError as exc:
        raise BrokerUnavailable(
            f"job {job.id} is stored but the broker is unreachable ({exc}); it stays in the "
            "outbox and the sweeper publishes it when the broker is back"
        ) from exc
    runtime.acks.ack(job.id, request.token)


def settle(runtime: Runtime, done: Transition) -> None:
    """After a transition the store accepted: emit its events and publish the message it owes.

    A broker that is down is logged, not raised: the outbox entry stays and the sweeper
    publishes the message later.
    """
    runtime.emit(done)
    if done.publish is None or done.record is None:
        return
    try:
        publish(runtime, done.record.job, done.publish, record=done.record)
    except BrokerUnavailable as exc:
        logger.error("ojs_celery: %s", exc)


def enqueue(envelope: dict[str, Any] | str | bytes | Job, *, app: Celery | None = None) -> Job:
    """Validate an OJS envelope, store it and publish it; return the stored job.

    Raises :class:`~ojs_celery.InvalidJob` (nothing stored or published) for a bad envelope,
    an unknown type or a duplicate id, and :class:`BrokerUnavailable` if the broker is down.
    """
    runtime = get_runtime(app)
    job = parse_envelope(envelope)
    return enqueue_job(runtime, job, id_chosen=client_chose_id(envelope))


def client_chose_id(envelope: Any) -> bool:
    """Whether the producer may have set the job id (then it may be taken). Errs on "yes"."""
    if isinstance(envelope, dict):
        return envelope.get("id") is not None
    if isinstance(envelope, str):
        return '"id"' in envelope
    if isinstance(envelope, bytes):
        return b'"id"' in envelope
    return True


def enqueue_job(runtime: Runtime, job: Job, *, id_chosen: bool = True) -> Job:
    """Store and publish a job that is already valid."""
    from .envelope import InvalidJob
    from .runtime import UnknownType
    from .store import DuplicateJob

    try:
        runtime.task_name_for(job.type)
    except UnknownType as exc:
        raise InvalidJob([("type", str(exc).removeprefix("type: "))]) from None
    if id_chosen:
        # A client-chosen id may be taken: the store answers before anything is published.
        try:
            transition = runtime.store.create(job)
        except DuplicateJob as exc:
            raise InvalidJob([("id", str(exc).removeprefix("id: "))]) from None
        assert transition.record is not None
        runtime.emit(transition)
        if transition.publish is not None:
            publish(runtime, transition.record.job, transition.publish, record=transition.record)
        return transition.record.job
    # A fresh UUIDv7 cannot collide: publish while the store write is in flight (one round
    # trip instead of two). If the write fails, enqueue raises and the message already sent
    # names a job that does not exist, which a worker drops.
    transition, confirm = runtime.store.begin_create(job)
    assert transition.record is not None
    try:
        if transition.publish is not None:
            publish(runtime, transition.record.job, transition.publish, record=transition.record)
    finally:
        confirm()
    runtime.emit(transition)
    return transition.record.job


def scheduled_at_from(eta: datetime | None, countdown: float | None) -> datetime | None:
    if eta is not None:
        return eta
    if countdown:
        return from_epoch(time.time() + float(countdown))
    return None
