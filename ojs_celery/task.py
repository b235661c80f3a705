"""``OJSTask``: the base class that makes a Celery task an OJS job handler.

Before the handler runs, the attempt is started in the store with the message's dispatch token
(compare-and-set): a duplicate or stale message is acked and dropped with Celery's ``Ignore``, so
the handler does not run, nothing reaches the result backend and no ``link`` fires. Afterwards
the outcome is written fenced on (attempt, worker id), and Celery only learns of it (result,
RETRY, FAILURE) when the store accepted it. Celery's own retry paths (``self.retry()``,
``autoretry_for``) and ``Reject``/``Ignore`` are turned into the same OJS decisions.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult

from . import header as ojs_header
from . import lifecycle
from .api import enqueue_job
from .context import JobContext, _current, maybe_current_job
from .effects import carry_out
from .envelope import JsonValue, parse_envelope
from .identity import current_worker_id
from .lifecycle import Record, Transition
from .producer import ojs_queue_of, scheduled_at_from
from .runtime import Runtime, get_runtime
from .store import StoreError

logger = logging.getLogger(__name__)

#: How long an outcome that cannot be written is retried before the sweeper is left to recover.
OUTCOME_RETRY_SECONDS = 30.0
#: Pause before a message goes back to the broker because the store is unreachable.
STORE_DOWN_PAUSE = 1.0


class JobError(Exception):
    """Raise from a handler to fail the attempt with your own OJS error ``type``.

    ``retryable=False`` discards the job at once, whatever the retry policy says.
    """

    def __init__(self, message: str, type: str = "error", retryable: bool = True) -> None:
        super().__init__(message)
        self.type = type
        self.retryable = retryable


class _RetryRequested(Exception):
    """``self.retry()`` inside an OJS task: becomes an OJS failure with an optional delay."""

    def __init__(self, exc: BaseException | None, delay: float | None) -> None:
        super().__init__(str(exc) if exc else "retry requested by the handler")
        self.exc = exc
        self.delay = delay


def error_from_exception(exc: BaseException) -> dict[str, JsonValue]:
    """The OJS error object: ``type`` is the class name unless the handler chose one."""
    type_ = exc.type if isinstance(exc, JobError) else type(exc).__name__
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    backtrace: list[JsonValue] = [line.rstrip("\n") for line in frames[-50:]]
    return lifecycle.make_error(type_, str(exc) or type(exc).__name__, backtrace=backtrace)


def _owner_cancel(attempt: int, worker_id: str, now: float) -> Callable[[Record], Transition]:
    def rule(record: Record) -> Transition:
        if record.job.state != "active" or record.job.attempt != attempt:
            return lifecycle.rejected("stale_attempt")
        if record.worker_id != worker_id:
            return lifecycle.rejected("not_owner")
        return lifecycle.cancel(record, now, reason="ignored by the handler")

    return rule


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
        for name in ("link", "link_error"):
            if options.get(name) is not None:
                value = options[name]
                envelope[f"x_celery_{name}"] = [dict(s) for s in value] if isinstance(
                    value, (list, tuple)) else dict(value)
        job = enqueue_job(runtime, parse_envelope(envelope), id_chosen="id" in envelope)
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
        raise _RetryRequested(exc, delay)

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
                                          hint=ojs_header.snapshot(header, job_id))
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
            outcome = self._run_handler(ctx, args, kwargs)
        finally:
            _current.reset(reset)
        return self._settle(runtime, ctx, *outcome)

    def _run_handler(
        self, ctx: JobContext, args: Any, kwargs: Any
    ) -> tuple[str, Any, BaseException | None]:
        try:
            result = self.run(*args, **kwargs)
        except SoftTimeLimitExceeded as exc:
            ctx.cancelled = True
            return "timeout", None, exc
        except _RetryRequested as exc:
            return "retry", exc, exc.exc
        except Ignore as exc:
            return "ignore", None, exc
        except Reject as exc:
            return "reject", None, exc
        except Retry as exc:  # raised by hand, not through self.retry()
            return "retry", _RetryRequested(exc.exc, None), exc.exc
        except Exception as exc:
            return "error", None, exc
        return "ok", result, None

    def _settle(
        self, runtime: Runtime, ctx: JobContext, kind: str, value: Any,
        exc: BaseException | None,
    ) -> Any:
        job = ctx.job
        store = runtime.store
        now = time.time()
        if kind == "ok":
            try:
                json.dumps(value)
            except (TypeError, ValueError) as bad:
                kind, exc = "error", TypeError(f"result is not JSON-serialisable: {bad}")
            else:
                done = _write(lambda: store.complete(job.id, ctx.attempt, ctx.worker_id, value,
                                                     hint=ctx.record))
                return self._after(runtime, ctx, done, value=value)
        if kind == "ignore":
            done = _write(lambda: store.apply(job.id, _owner_cancel(ctx.attempt, ctx.worker_id,
                                                                    now)))
            if done is not None and done.applied:
                carry_out(runtime, done)
                self.backend.mark_as_revoked(job.id, reason="ignored", request=self.request)
            raise Ignore()
        delay: float | None = None
        retryable = True
        if kind == "timeout" and _worker_is_draining(runtime, ctx.worker_id, job.id):
            error = lifecycle.make_error(
                "shutdown", "cancelled because the worker shut down before the job finished")
        elif kind == "timeout":
            elapsed = time.monotonic() - ctx.started
            error = lifecycle.timeout_error(
                "timeout", job.timeout, elapsed,
                f"execution timeout of {job.timeout}s exceeded",
            )
        elif kind == "retry":
            error = (error_from_exception(exc) if exc is not None
                     else lifecycle.make_error("Retry", "retry requested by the handler"))
            delay = value.delay
        elif kind == "reject":
            assert isinstance(exc, Reject)
            error = lifecycle.make_error("Reject", str(exc.reason or "rejected by the handler"))
            retryable = bool(exc.requeue)
        else:
            assert exc is not None
            error = error_from_exception(exc)
            if isinstance(exc, JobError):
                retryable = exc.retryable
        done = _write(lambda: store.fail(job.id, ctx.attempt, ctx.worker_id, error,
                                         delay=delay, retryable=retryable, hint=ctx.record))
        return self._after(runtime, ctx, done, exc=exc)

    def _after(
        self, runtime: Runtime, ctx: JobContext, done: Transition | None, *,
        value: Any = None, exc: BaseException | None = None,
    ) -> Any:
        if done is None or done.record is None:
            reason = "store unreachable" if done is None else done.reason
            logger.warning(
                "ojs_celery: outcome of job %s attempt %s rejected (%s): not reported to Celery",
                ctx.job.id, ctx.attempt, reason,
            )
            raise Ignore()
        carry_out(runtime, done)
        record = done.record
        if record.job.state == "completed":
            return value
        if record.job.state == "retryable":
            when = record.job.next_retry_at
            raise Retry(f"OJS retry at {when}", exc, when=when)
        if exc is None or isinstance(exc, (Reject, Retry, _RetryRequested)):
            raise RuntimeError(str((record.job.error or {}).get("message", "discarded")))
        raise exc


def _worker_is_draining(runtime: Runtime, worker_id: str, job_id: str) -> bool:
    """Was this job's cancellation sent by its worker's shutdown drain (then it is a
    ``shutdown``)? Its own execution timeout, even during a drain, stays a ``timeout``."""
    from .worker.registry import shutdown_key

    try:
        return runtime.store.get_meta(shutdown_key(worker_id, job_id)) is not None
    except StoreError:
        return False


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
    """Mark the current job cancelled when the soft time limit (SIGUSR1 in prefork) fires,
    before billiard's handler raises ``SoftTimeLimitExceeded`` in the handler."""
    global _soft_watch_installed
    if _soft_watch_installed:
        return
    _soft_watch_installed = True
    try:
        previous = signal.getsignal(signal.SIGUSR1)
    except (ValueError, AttributeError):
        return
    if getattr(previous, "__name__", "") != "soft_timeout_sighandler" or not callable(previous):
        return  # not a prefork child: no soft limit to watch

    def on_soft_limit(signum: int, frame: Any) -> None:
        ctx = maybe_current_job()
        if ctx is not None:
            ctx.cancelled = True
        previous(signum, frame)

    try:
        signal.signal(signal.SIGUSR1, on_soft_limit)
    except ValueError:  # not the main thread (threads pool): nothing to watch
        pass


