"""What follows a transition the store accepted: the one hook every caller uses.

A transition (see :mod:`ojs_celery.lifecycle`) says what changed; once the store has written it,
:func:`carry_out` makes it visible and effective, always in the same order: emit its events,
stop the attempt it took the job from (when the caller is not that attempt's owner: the
sweeper, a cancel), report a terminal outcome to Celery's result backend when no worker will
(``report_result``: the sweeper, a cancel) with the Celery task event that monitors (Flower,
``celery events``) read, publish the message it owes. The worker, the sweeper, the producer
and the API all go through here, so a new caller (the HTTP binding) cannot forget a step.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from billiard.exceptions import WorkerLostError
from celery.backends.base import DisabledBackend
from celery.exceptions import TimeLimitExceeded
from kombu.utils.encoding import safe_repr

from .canvas import celery_context
from .envelope import Job
from .identity import worker_nodename, worker_task_events
from .lifecycle import Transition
from .producer import BrokerUnavailable, publish, trusted_options
from .runtime import Runtime

logger = logging.getLogger(__name__)

#: The remote-control command that stops one attempt (see :mod:`ojs_celery.control`).
TERMINATE_COMMAND = "ojs_terminate"


def carry_out(
    runtime: Runtime,
    done: Transition,
    *,
    stop_attempt: bool = False,
    publish_message: bool = True,
    raise_unpublished: bool = False,
    report_result: bool = False,
    producer: Any = None,
    acks: list[tuple[str, int]] | None = None,
    send_event: EventSender | None = None,
    worker_request: Any = None,
) -> bool:
    """Emit ``done``'s events, stop the attempt it ended (``stop_attempt``), report a terminal
    outcome to the result backend (``report_result``: callers that are not the attempt's
    worker, whose Celery trace reports it), publish what it owes (``publish_message``);
    returns whether a message was published.

    A message that cannot be published stays in the outbox (the sweeper publishes it later):
    logged, whatever the error; with ``raise_unpublished`` a broker that is down is raised
    as :class:`~ojs_celery.BrokerUnavailable` (and any other error as it is), for the sweeper
    to tell an outage from a job's own fault. ``producer``, ``acks``: see
    :func:`~.producer.publish`; ``send_event``, ``worker_request``: see
    :func:`report_outcome`.
    """
    if done.record is None:
        return False
    runtime.emit(done)
    before = done.previous
    stopped = stop_attempt and before is not None and before.job.state == "active"
    if stopped and before is not None:
        stop_running_attempt(runtime, before.job.id, before.token)
    if report_result and done.record.job.terminal:
        report_outcome(runtime, done.record.job, terminated=stopped, send_event=send_event,
                       worker_request=worker_request)
    if not publish_message:
        return False
    return publish_owed(runtime, done, raise_unpublished=raise_unpublished, producer=producer,
                        acks=acks)


def publish_owed(
    runtime: Runtime,
    done: Transition,
    *,
    raise_unpublished: bool = False,
    producer: Any = None,
    acks: list[tuple[str, int]] | None = None,
) -> bool:
    """Publish the message ``done`` owes, if any (see :func:`carry_out`); returns whether one
    was published. Apart from :func:`carry_out` only for a message that must wait for Celery
    (a retry's: :func:`ojs_celery.task.publish_the_retry`)."""
    if done.record is None or done.publish is None:
        return False
    try:
        publish(runtime, done.record.job, done.publish, record=done.record, producer=producer,
                acks=acks)
    except Exception as exc:
        if raise_unpublished:
            raise
        log_unpublished(done.record.job.id, exc)
        return False
    return True


def log_unpublished(job_id: str, exc: BaseException) -> None:
    """The job is stored and owes a message that could not be sent: the sweeper sends it."""
    if isinstance(exc, BrokerUnavailable):  # its message says all of that already
        logger.error("ojs_celery: %s", exc)
        return
    logger.error("ojs_celery: job %s is stored but its message could not be published (%s); "
                 "the sweeper publishes it later", job_id, exc)


def stop_running_attempt(runtime: Runtime, job_id: str, token: int) -> None:
    """Ask every worker to kill the attempt that ``token`` started (never revoke-by-id, which
    would make Celery drop the job's later messages too)."""
    try:
        runtime.app.control.broadcast(
            TERMINATE_COMMAND, arguments={"job_id": job_id, "token": token}, reply=False
        )
    except Exception as exc:
        logger.warning("ojs_celery: could not ask workers to stop job %s: %r", job_id, exc)


class JobDiscarded(RuntimeError):
    """The outcome Celery's result backend shows for a job the sweeper discarded (other than
    by a timeout or a dead worker, which get Celery's own exceptions)."""


#: Error types of the expiry rules: Celery reports an expired task as REVOKED.
EXPIRY_ERRORS = frozenset({"expired", "enqueue_ttl_expired", "total_timeout"})


#: Sends one Celery task event of the job: ``send(type, **fields)``, as Celery's
#: ``Request.send_event`` (the worker's own dispatcher) takes it.
EventSender = Callable[..., Any]


def report_outcome(runtime: Runtime, job: Job, *, terminated: bool = False,
                   send_event: EventSender | None = None, worker_request: Any = None) -> None:
    """Write a terminal ``job``'s outcome to Celery's result backend as Celery's worker would
    (completed -> SUCCESS; discarded -> FAILURE, with the chord part counted, the chain's
    results failed and the ``link_error`` callbacks called; cancelled or expired -> REVOKED,
    the chord part counted), so that a chord whose member the sweeper ended never hangs; then
    send its task event (:func:`report_event`; ``terminated``: the ending stopped a running
    attempt). ``worker_request``: the Celery request of the message a worker is handling when
    it reports (an expiry found at the start, a drain's or a lost process's ending), whose
    host, queue and retries fill ``result_extended``'s ``worker``, ``queue`` and ``retries``
    as Celery's worker writes them for the same ending; without one (the sweeper, a cancel
    from any process) they stay empty, as no worker handled the message.

    Called once per accepted transition (the store's compare-and-set decides who makes it).
    """
    backend = runtime.app.backend
    if job.state not in ("completed", "discarded", "cancelled"):
        return
    name, task = _task_of(runtime, job)
    if not isinstance(backend, DisabledBackend):
        options = trusted_options(job)
        ignored = options.get("ignore_result", task is not None and task.ignore_result)
        store = not ignored  # the call's ignore_result, else the task's, as Celery's worker
        request = _as_handled_by(celery_context(job, name, options), worker_request)
        error: dict[str, Any] = dict(job.error or {})
        try:
            if job.state == "completed":
                backend.mark_as_done(job.id, job.result, request=request, store_result=store)
            elif _revoked(job):
                backend.mark_as_revoked(job.id, reason=str(error.get("type") or job.state),
                                        request=request, store_result=store)
            else:
                backend.mark_as_failure(job.id, _exception(error), request=request,
                                        store_result=store, call_errbacks=True)
        except Exception as exc:  # the backend is down: the job's outcome is in the store
            logger.error("ojs_celery: could not report job %s (%s) to the result backend: %r",
                         job.id, job.state, exc)
    report_event(runtime, job, terminated=terminated, send_event=send_event)


def _as_handled_by(context: Any, worker_request: Any) -> Any:
    """``context`` with the fields of the message a worker handles (see
    :func:`report_outcome`), which the job's record does not hold."""
    if worker_request is not None:
        context.hostname = getattr(worker_request, "hostname", None)
        context.delivery_info = getattr(worker_request, "delivery_info", None) or {}
        retries = getattr(worker_request, "retries", None)
        if retries is None:  # a worker's Request keeps it in the message's headers
            retries = (getattr(worker_request, "request_dict", None) or {}).get("retries")
        context.retries = retries or 0
    return context


def _task_of(runtime: Runtime, job: Job) -> tuple[str, Any]:
    """The Celery task name of ``job`` (its type where the app maps none) and the app's task of
    that name (None if it has none)."""
    try:
        name = runtime.task_name_for(job.type)
    except Exception:
        name = job.type
    return name, runtime.app.tasks.get(name)


def _revoked(job: Job) -> bool:
    """Does Celery call this ending REVOKED (a cancel, an expiry) rather than a failure?"""
    return job.state == "cancelled" or (job.error or {}).get("type") in EXPIRY_ERRORS


def report_event(runtime: Runtime, job: Job, *, terminated: bool = False,
                 send_event: EventSender | None = None) -> None:
    """Send the Celery task event of a terminal ``job`` that Celery's own worker would have
    sent for the same ending (``task-succeeded``; ``task-revoked`` with ``expired``, and with
    ``terminated``/``signum`` when a running attempt was stopped; ``task-failed``), so that
    monitors, which read only events, do not show the task running for ever. ``send_event``:
    the worker request's own (Celery decides there whether events are on); by default this
    process's app dispatcher, when this process sends task events (:func:`send_task_event`).
    Best effort: a failure is logged, never raised."""
    fields: dict[str, Any]
    if job.state == "completed":
        event, fields = "task-succeeded", {"result": event_repr(job.result)}
    elif _revoked(job):
        expired = job.state != "cancelled"
        event, fields = "task-revoked", {
            "terminated": terminated, "signum": int(signal.SIGKILL) if terminated else None,
            "expired": expired}
    elif job.state == "discarded":
        error: dict[str, Any] = dict(job.error or {})
        frames = error.get("backtrace")
        trace = "".join(map(str, frames)) if isinstance(frames, list) else ""
        event, fields = "task-failed", {"exception": event_repr(_exception(error)),
                                        "traceback": trace}
    else:
        return
    try:
        if send_event is not None:
            send_event(event, **fields)
        else:
            send_task_event(runtime, job, event, **fields)
    except Exception as exc:
        logger.warning("ojs_celery: could not send the %s event of job %s: %r", event, job.id,
                       exc)


def event_repr(value: Any) -> str:
    """A value as Celery's worker puts it in a task event (kombu's ``safe_repr``)."""
    return str(safe_repr(value))  # type: ignore[no-untyped-call]


def task_events_enabled(runtime: Runtime) -> bool:
    """Whether this process sends Celery task events: a worker's ``-E`` or
    ``worker_send_task_events`` (its pool children too), else the app's setting."""
    found = worker_task_events()
    if found is not None:
        return found
    return bool(runtime.app.conf.worker_send_task_events)


def send_task_event(runtime: Runtime, job: Job, event: str, **fields: Any) -> None:
    """Send one task event of ``job`` from a process that has no worker request for it (the
    sweeper, a cancel, a pool process): through the app's default dispatcher, under this
    worker's node name (or the app's own name outside a worker), when task events are on
    here and the job's task sends them (Celery's ``Task.send_events``)."""
    if not task_events_enabled(runtime):
        return
    _, task = _task_of(runtime, job)
    if task is not None and not task.send_events:
        return
    now = time.monotonic()
    if now < _events_paused_until[0]:
        return  # the last send failed: a sweep or a drain must not wait on each job for it
    try:
        with runtime.app.events.default_dispatcher(hostname=worker_nodename()) as dispatcher:
            dispatcher.send(event, uuid=job.id, **fields)
    except Exception:
        _events_paused_until[0] = time.monotonic() + EVENTS_PAUSE_AFTER_FAILURE
        raise


#: How long a process sends no task events of its own after one could not be sent (a broker
#: that is down makes each try wait for kombu's connection timeout).
EVENTS_PAUSE_AFTER_FAILURE = 60.0
#: Until when (monotonic) this process sends none (see :data:`EVENTS_PAUSE_AFTER_FAILURE`).
_events_paused_until = [0.0]


def _exception(error: dict[str, Any]) -> BaseException:
    """The exception Celery itself would record for this error."""
    message = str(error.get("message") or "discarded")
    kind = error.get("type")
    if kind == "timeout":
        timed_out: BaseException = TimeLimitExceeded(message)
        return timed_out
    if kind == "worker_death":
        lost: BaseException = WorkerLostError(message)
        return lost
    return JobDiscarded(f"{kind}: {message}" if kind else message)
