"""The small public API around the store: read and cancel jobs."""

from __future__ import annotations

from celery import Celery

from .envelope import Job, parse_batch
from .producer import enqueue_job
from .runtime import get_runtime


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
        runtime.emit(done)
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
    """Validate every envelope first (all or nothing), then store and publish each."""
    runtime = get_runtime(app)
    jobs = parse_batch(envelopes)
    for job in jobs:
        runtime.task_name_for(job.type)
    return [enqueue_job(runtime, job) for job in jobs]
