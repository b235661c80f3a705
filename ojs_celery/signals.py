"""Celery signals for OJS events, sent in the process where the event happens.

Connect to ``ojs_event`` for every event or to one per type; receivers get ``event`` (the OJS
event envelope as a dict) and must accept ``**kwargs``::

    from ojs_celery.signals import job_timeout

    @job_timeout.connect
    def on_timeout(sender, event, **kwargs):
        print(event["data"]["job_id"], event["data"]["elapsed_seconds"])

Events from other processes (workers, the sweeper) reach you through ``ojs-celery events`` or
:func:`ojs_celery.events.listen`, which read Celery's event bus.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

ojs_event = Signal(name="ojs_event", providing_args={"event"})

job_enqueued = Signal(name="job.enqueued", providing_args={"event"})
job_scheduled = Signal(name="job.scheduled", providing_args={"event"})
job_started = Signal(name="job.started", providing_args={"event"})
job_completed = Signal(name="job.completed", providing_args={"event"})
job_failed = Signal(name="job.failed", providing_args={"event"})
job_retrying = Signal(name="job.retrying", providing_args={"event"})
job_discarded = Signal(name="job.discarded", providing_args={"event"})
job_cancelled = Signal(name="job.cancelled", providing_args={"event"})
job_timeout = Signal(name="job.timeout", providing_args={"event"})
job_stalled = Signal(name="job.stalled", providing_args={"event"})
job_ttl_expired = Signal(name="job.ttl_expired", providing_args={"event"})
job_total_timeout = Signal(name="job.total_timeout", providing_args={"event"})
job_expired = Signal(name="job.expired", providing_args={"event"})
job_heartbeat = Signal(name="job.heartbeat", providing_args={"event"})
job_progress = Signal(name="job.progress", providing_args={"event"})
worker_started = Signal(name="worker.started", providing_args={"event"})
worker_quiet = Signal(name="worker.quiet", providing_args={"event"})
worker_stopped = Signal(name="worker.stopped", providing_args={"event"})
worker_heartbeat = Signal(name="worker.heartbeat", providing_args={"event"})

BY_TYPE: dict[str, Signal] = {
    signal.name: signal
    for signal in (
        job_enqueued, job_scheduled, job_started, job_completed, job_failed, job_retrying,
        job_discarded, job_cancelled, job_timeout, job_stalled, job_ttl_expired,
        job_total_timeout, job_expired, job_heartbeat, job_progress, worker_started,
        worker_quiet, worker_stopped, worker_heartbeat,
    )
}
