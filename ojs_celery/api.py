"""The public API around the store: enqueue, read and cancel jobs."""

from __future__ import annotations

from typing import Any

from celery import Celery

from .effects import carry_out
from .envelope import InvalidJob, Job, parse_batch, parse_envelope
from .producer import BrokerUnavailable, publish, with_celery_options
from .runtime import Runtime, UnknownType, get_runtime
from .store import DuplicateJob


class JobNotFound(LookupError):
    """No job with this id (it never existed, or it was pruned after its retention)."""


def get_job(job_id: str, *, app: Celery | None = None) -> Job | None:
    """The job as the store has it now, or None."""
    return get_runtime(app).store.get(job_id.lower())


def cancel(job_id: str, *, app: Celery | None = None) -> Job:
    """Cancel a job that has not ended; an active attempt's late outcome is then rejected.

    Cancelling a cancelled job returns it unchanged; a completed or discarded job raises
    ``ValueError``; an unknown id raises :class:`JobNotFound`.
    """
    runtime = get_runtime(app)
    done = runtime.store.cancel(job_id.lower())
    if done.record is not None:
        carry_out(runtime, done)
        return done.record.job
    job = runtime.store.get(job_id.lower())
    if job is None:
        raise JobNotFound(f"no job with id {job_id}")
    if job.state == "cancelled":
        return job
    raise ValueError(f"job {job_id} is already {job.state}: it cannot be cancelled")


def enqueue_batch(
    envelopes: str | bytes | list[object], *, app: Celery | None = None
) -> list[Job]:
    """Validate every envelope, store them all in one atomic step (all or none: a duplicate
    id stores nothing), then publish each. A broker that fails leaves the rest to the
    sweeper (they are stored with their outbox entries) and raises at the end."""
    runtime = get_runtime(app)
    jobs = parse_batch(envelopes)
    for job in jobs:
        runtime.task_name_for(job.type)
    try:
        transitions = runtime.store.create_many(jobs)
    except DuplicateJob as exc:
        raise InvalidJob([("id", str(exc).removeprefix("id: "))]) from None
    unpublished: BrokerUnavailable | None = None
    for transition in transitions:
        try:
            carry_out(runtime, transition, publish_message=unpublished is None,
                      raise_unpublished=True)
        except BrokerUnavailable as exc:
            unpublished = exc
    if unpublished is not None:
        raise unpublished
    return [transition.record.job for transition in transitions if transition.record]


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


def enqueue_job(
    runtime: Runtime, job: Job, *, id_chosen: bool = True,
    celery_options: dict[str, Any] | None = None,
) -> Job:
    """Store and publish a job that is already valid. ``celery_options`` (``link``,
    ``link_error``) come from trusted Python code only, never from an envelope."""
    try:
        runtime.task_name_for(job.type)
    except UnknownType as exc:
        raise InvalidJob([("type", str(exc).removeprefix("type: "))]) from None
    if celery_options:
        job = with_celery_options(job, celery_options)
    if id_chosen:
        # A client-chosen id may be taken: the store answers before anything is published.
        try:
            transition = runtime.store.create(job)
        except DuplicateJob as exc:
            raise InvalidJob([("id", str(exc).removeprefix("id: "))]) from None
        assert transition.record is not None
        carry_out(runtime, transition, raise_unpublished=True)
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
