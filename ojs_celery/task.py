"""``OJSTask``: the base class that makes a Celery task an OJS job handler.

Before the handler runs, the attempt is started in the store with the message's dispatch token
(compare-and-set): a duplicate or stale message is acked and dropped with Celery's ``Ignore``, so
the handler does not run, nothing reaches the result backend and no ``link`` fires. Afterwards
the outcome is written fenced on (attempt, worker id), and Celery only learns of it (result,
RETRY, FAILURE) when the store accepted it. Celery's own retry paths (``self.retry()``,
``autoretry_for``) and ``Reject``/``Ignore`` are turned into the same OJS decisions.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import billiard.pool
from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult

from . import header as ojs_header
from . import lifecycle
from .api import enqueue_job
from .context import JobContext, _current, maybe_current_job
from .effects import carry_out
from .envelope import parse_envelope
from .identity import current_worker_id
from .lifecycle import Transition
from .outcome import (
    Cancelled,
    Completed,
    Failed,
    JobError,
    Outcome,
    Rejected,
    Retried,
    RetryRequested,
    TimedOut,
    celery_exception,
    error_from_exception,
    run_handler,
)
from .producer import ojs_queue_of, scheduled_at_from
from .runtime import Runtime, get_runtime
from .store import StoreError

logger = logging.getLogger(__name__)

__all__ = ["JobError", "OJSTask", "error_from_exception"]

#: How long an outcome that cannot be written is retried before the sweeper is left to recover.
OUTCOME_RETRY_SECONDS = 30.0
#: Pause before a message goes back to the broker because the store is unreachable.
STORE_DOWN_PAUSE = 1.0


class OJSTask(Task):  # type: ignore[misc]
    """Base class for OJS tasks: ``@app.task(name="email.send", base=OJSTask)``.

    The task name is the OJS ``type`` unless ``ojs_type`` says otherwise. ``self.ojs`` (bound
    tasks) and :func:`ojs_celery.current_job` give the :class:`~ojs_celery.JobContext`.
    """

    __ojs_task__ = True
    abstract = True
    ojs_type: str | None = None
    #: "worker": the worker's beats keep the job alive; "handler": only ctx.heartbeat()/progress().
    heartbeat: str = "worker"
    acks_late = True
    Request = "ojs_celery.request:OJSRequest"

    @property
    def ojs(self) -> JobContext | None:
        return maybe_current_job()

    # ------------------------------------------------------------------ producing

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        """Existing ``.delay()``/``.apply_async()`` calls become OJS jobs (kwargs travel in
        ``x_celery_kwargs``); the message itself is published by the OJS producer."""
        if options.get("headers", {}) and "ojs" in options["headers"]:
            return super().apply_async(args, kwargs, **options)
        runtime = get_runtime(self.app)
        envelope: dict[str, Any] = {"type": self.ojs_type or self.name,
                                    "args": _json_native(list(args or ()))}
        if kwargs:
            envelope["x_celery_kwargs"] = _json_native(dict(kwargs))
        if options.get("task_id"):
            envelope["id"] = options["task_id"]
        queue = options.get("queue")
        if isinstance(queue, str) or queue is None:
            envelope["queue"] = ojs_queue_of(self.app, queue)
        when = scheduled_at_from(options.get("eta"), options.get("countdown"))
        if when is not None:
            envelope["scheduled_at"] = when.isoformat()
        links = {name: _signature_dicts(options[name]) for name in ("link", "link_error")
                 if options.get(name)}
        job = enqueue_job(runtime, parse_envelope(envelope), id_chosen="id" in envelope,
                          celery_options=links)
        return self.AsyncResult(job.id)

    # ------------------------------------------------------------------ Celery retry paths

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """``self.retry()`` (and ``autoretry_for``) fail the attempt the OJS way: the job's
        retry policy decides; an explicit ``countdown``/``eta`` replaces the backoff."""
        if maybe_current_job() is None:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        delay = countdown
        if eta is not None:
            delay = max(eta.timestamp() - time.time(), 0.0)
        raise RetryRequested(exc, delay)

    # ------------------------------------------------------------------ running

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        header = ojs_header.of_task_request(self.request)
        if header is None or self.request.called_directly:
            return self.run(*args, **kwargs)
        runtime = get_runtime(self.app)
        worker_id = current_worker_id()
        job_id = str(self.request.id)
        try:
            started = runtime.store.start(job_id, int(header["token"]), worker_id,
                                          hint=ojs_header.snapshot(header, job_id),
                                          origin=ojs_header.origin(header))
        except StoreError as exc:
            logger.error("ojs_celery: store unreachable, job %s goes back to the broker: %s",
                         job_id, exc)
            time.sleep(STORE_DOWN_PAUSE)
            raise Reject(f"store unreachable: {exc}", requeue=True) from exc
        carry_out(runtime, started)
        if started.record is None or started.record.job.state != "active":
            logger.info("ojs_celery: job %s not started (%s): message dropped", job_id,
                        started.reason)
            raise Ignore()
        ctx = JobContext(runtime, started.record, worker_id)
        _watch_soft_limit()
        reset = _current.set(ctx)
        try:
            outcome = run_handler(lambda: self.run(*args, **kwargs))
        finally:
            _current.reset(reset)
        if isinstance(outcome, TimedOut):
            ctx.cancelled = True
        return self._record_outcome(runtime, ctx, outcome)

    def _record_outcome(self, runtime: Runtime, ctx: JobContext, outcome: Outcome) -> Any:
        """Write the attempt's outcome to the store (fenced on attempt and worker), then tell
        Celery only what the store accepted: the one mapping from outcome to effects."""
        job = ctx.job
        store = runtime.store
        now = time.time()
        if isinstance(outcome, Completed):
            done = _write(lambda: store.complete(job.id, ctx.attempt, ctx.worker_id,
                                                 outcome.value, hint=ctx.record))
            return self._tell_celery(runtime, ctx, done, outcome)
        if isinstance(outcome, Cancelled):
            done = _write(lambda: store.apply(job.id, lambda r: lifecycle.cancel_by_owner(
                r, ctx.attempt, ctx.worker_id, now)))
            if done is not None and done.applied:
                carry_out(runtime, done)
                self.backend.mark_as_revoked(job.id, reason="ignored", request=self.request)
            raise Ignore()
        delay: float | None = None
        retryable = True
        if isinstance(outcome, TimedOut) and _worker_is_draining(runtime, ctx.worker_id):
            error = lifecycle.make_error(
                "shutdown", "cancelled because the worker shut down before the job finished")
        elif isinstance(outcome, TimedOut):
            elapsed = time.monotonic() - ctx.started
            error = lifecycle.timeout_error(
                "timeout", job.timeout, elapsed,
                f"execution timeout of {job.timeout}s exceeded",
            )
        elif isinstance(outcome, Retried):
            error = (error_from_exception(outcome.cause) if outcome.cause is not None
                     else lifecycle.make_error("Retry", "retry requested by the handler"))
            delay = outcome.delay
        elif isinstance(outcome, Rejected):
            error = lifecycle.make_error(
                "Reject", str(outcome.exc.reason or "rejected by the handler"))
            retryable = bool(outcome.exc.requeue)
        else:
            assert isinstance(outcome, Failed)
            error = error_from_exception(outcome.exc)
            retryable = outcome.retryable
        done = _write(lambda: store.fail(job.id, ctx.attempt, ctx.worker_id, error,
                                         delay=delay, retryable=retryable, hint=ctx.record))
        return self._tell_celery(runtime, ctx, done, outcome)

    def _tell_celery(
        self, runtime: Runtime, ctx: JobContext, done: Transition | None, outcome: Outcome
    ) -> Any:
        """Carry out the accepted transition and report it to Celery: the return value, a
        ``Retry`` (the job runs again) or the exception that ended it; nothing (``Ignore``)
        when the store rejected the outcome."""
        if done is None or done.record is None:
            reason = "store unreachable" if done is None else done.reason
            logger.warning(
                "ojs_celery: outcome of job %s attempt %s rejected (%s): not reported to Celery",
                ctx.job.id, ctx.attempt, reason,
            )
            raise Ignore()
        carry_out(runtime, done)
        record = done.record
        if record.job.state == "completed" and isinstance(outcome, Completed):
            return outcome.value
        exc = celery_exception(outcome)
        if record.job.state == "retryable":
            when = record.job.next_retry_at
            raise Retry(f"OJS retry at {when}", exc, when=when)
        if exc is None or isinstance(exc, (Reject, Retry, RetryRequested)):
            raise RuntimeError(str((record.job.error or {}).get("message", "discarded")))
        raise exc


def _worker_is_draining(runtime: Runtime, worker_id: str) -> bool:
    """A cancellation during a worker's shutdown drain is a ``shutdown``, never a ``timeout``."""
    try:
        return runtime.store.meta.is_draining(worker_id)
    except StoreError:
        return False


def _signature_dicts(value: Any) -> Any:
    """One signature or several, as the JSON data Celery sends them as."""
    if isinstance(value, (list, tuple)):
        return [dict(s) for s in value]
    return dict(value)


def _json_native(value: Any) -> Any:
    """Tuples become lists, as Celery's JSON serializer would send them; anything JSON cannot
    carry is left for envelope validation to name."""
    if isinstance(value, (list, tuple)):
        return [_json_native(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_native(v) for k, v in value.items()}
    return value


def _write(operation: Callable[[], Transition]) -> Transition | None:
    """Run a store write, retrying while the store is unreachable (None: gave up)."""
    deadline = time.monotonic() + OUTCOME_RETRY_SECONDS
    pause = 0.2
    while True:
        try:
            return operation()
        except StoreError as exc:
            if time.monotonic() > deadline:
                logger.error("ojs_celery: giving up writing an outcome: %s", exc)
                return None
            logger.warning("ojs_celery: store write failed, retrying: %s", exc)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


_soft_watch_installed = False


def _watch_soft_limit() -> None:
    """Mark the current job cancelled when the soft time limit fires, before billiard's
    handler raises ``SoftTimeLimitExceeded`` in the handler.

    billiard gives no hook for this: a prefork child installs its own handler,
    ``billiard.pool.soft_timeout_sighandler``, for ``billiard.pool.SIG_SOFT_TIMEOUT`` (SIGUSR1)
    in ``Worker.after_fork``; we chain in front of it when, and only when,
    that exact function is installed (any other pool, or a handler of the project's own, is
    left alone). Checked on Celery 5.7.0 with billiard 4.3.2.
    """
    global _soft_watch_installed
    if _soft_watch_installed:
        return
    _soft_watch_installed = True
    signum = getattr(billiard.pool, "SIG_SOFT_TIMEOUT", None)
    billiard_handler: Callable[[int, Any], None] | None = getattr(
        billiard.pool, "soft_timeout_sighandler", None)
    if signum is None or billiard_handler is None:
        return
    chained = billiard_handler
    try:
        previous = signal.getsignal(signum)
    except ValueError:
        return
    if previous is not billiard_handler:
        return  # not a prefork child: no soft limit to watch

    def on_soft_limit(signum: int, frame: Any) -> None:
        ctx = maybe_current_job()
        if ctx is not None:
            ctx.cancelled = True
        chained(signum, frame)

    try:
        signal.signal(signum, on_soft_limit)
    except ValueError:  # not the main thread (threads pool): nothing to watch
        pass
