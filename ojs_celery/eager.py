"""Eager mode (``task_always_eager``, ``.apply()``): OJS tasks run in-process as Celery runs
them, with no server.

Celery's own ``Task.apply`` does the work (its tracer, ``link``/``link_error``, and eager
``self.retry()``, which reruns at once, bounded by ``max_retries``); OJS adds only the handler's
view of its job: an in-memory record, so that ``current_job()``, progress and checkpoints work.
Nothing touches the store, the broker or the outbox, so tests that set ``task_always_eager``
need neither (and a broker URL that points nowhere is never dialled).

A call that eager mode runs in place of a published one is checked as a published one is: its
arguments must be JSON data (``InvalidJob`` at the call) and so must its result (else the run
fails with ``TypeError``, as on a worker), so that eager tests fail where production would. An
explicit ``.apply()`` publishes nothing, on a worker as in tests, and keeps Celery's freedom
(but one made inside such a call's handler is checked with it), and so does eager canvas, which
Celery runs through ``.apply()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, cast

from celery.result import EagerResult, denied_join_result
from kombu import serialization

from . import lifecycle
from .callers import check_call_arguments, check_later_calls, raise_refusal
from .context import JobContext, _current
from .envelope import (
    CELERY_KWARGS_FIELD,
    InvalidJob,
    Job,
    JsonValue,
    new_job_id,
    parse_input,
    utcnow,
)
from .lifecycle import Record
from .outcome import result_problem
from .runtime import get_runtime

if TYPE_CHECKING:
    from celery import Task

    from .runtime import Runtime

#: The worker id an eager attempt runs under (no worker is involved).
EAGER_WORKER_ID = "eager"
#: Set while eager mode runs a call in place of a published one (its retries' reruns
#: included): its result must then be JSON, as a worker's would (see the module docstring).
_in_place_of_a_call: ContextVar[bool] = ContextVar("ojs_eager_call", default=False)


#: The last checkpoint of each eager job (by id) of the call eager mode runs in place of a
#: published one: its retries' reruns start from it, as a worker's next attempt does.
_checkpoints: ContextVar[dict[str, JsonValue] | None] = ContextVar("ojs_eager_checkpoints",
                                                                   default=None)


class EagerJobContext(JobContext):
    """A :class:`~ojs_celery.JobContext` whose record lives in memory: heartbeats, progress
    and checkpoints update it by the worker's own rule (``lifecycle.heartbeat``), so that
    ``ctx.record`` reads as on a worker, and never reach a store."""

    def __init__(self, record: Record) -> None:
        super().__init__(cast("Runtime", None), record, EAGER_WORKER_ID)

    def _progress_event(self) -> None:
        """Eager runs publish nothing: no ``job.progress`` event either."""

    def _beat(
        self,
        progress: float | None = None,
        data: JsonValue = None,
        checkpoint: JsonValue = None,
    ) -> bool:
        transition = lifecycle.heartbeat(self._record, self.attempt, EAGER_WORKER_ID,
                                         time.time(), progress=progress, data=data,
                                         checkpoint=checkpoint)
        self._update(transition.record)
        return transition.applied


def apply_eagerly(task: Task, args: Any, kwargs: Any, options: dict[str, Any]) -> EagerResult:
    """``apply_async`` under ``task_always_eager``: Celery's ``Task.apply``, as Celery's own
    ``apply_async`` does (nothing is published, no job is stored)."""
    get_runtime(task.app)  # NotInstalled without install(app), as a published call raises
    try:
        check_call_arguments(task, args, kwargs)
        check_later_calls(task.app, options)
    except InvalidJob as refused:  # and EncodeError, as a published call raises
        raise_refusal(refused)
    link, link_error = options.pop("link", None), options.pop("link_error", None)
    task_id = _job_id(options.pop("task_id", None))
    # the arguments as the handler gets them from a message (tuples as lists, keys as text),
    # as Celery's own eager apply_async does
    serializer = options.get("serializer") or task.serializer or task.app.conf.task_serializer
    content_type, encoding, data = serialization.dumps(  # type: ignore[no-untyped-call]
        (args, kwargs), serializer)
    args, kwargs = serialization.loads(  # type: ignore[no-untyped-call]
        data, content_type, encoding, accept=[content_type])
    reset = _in_place_of_a_call.set(True)
    remembered = _checkpoints.set({})
    try:
        with denied_join_result():  # result.get() in a handler raises, as on a worker
            result: EagerResult = task.apply(args, kwargs, task_id=task_id, link=link,
                                             link_error=link_error, **options)
    finally:
        _checkpoints.reset(remembered)
        _in_place_of_a_call.reset(reset)
    return result


def _job_id(task_id: str | None) -> str:
    """The job id a published call with ``task_id`` gets: checked (``InvalidJob``) and
    lower-cased as on a worker, or a new one."""
    if not task_id:
        return new_job_id()
    return parse_input({"type": "eager", "args": [], "id": task_id}, celery_id=True).id


def in_place_of_a_call() -> bool:
    """Whether this eager run stands in for a published call (see the module docstring)."""
    return _in_place_of_a_call.get()


def run_eagerly(task: Task, run: Callable[[], Any]) -> Any:
    """Run one eager attempt of ``task`` with its job in memory; exceptions (``Retry``
    included) go to Celery's eager tracer unchanged, as without OJS."""
    request = task.request
    now = utcnow()
    fields: dict[str, Any] = {
        "id": str(request.id or new_job_id()), "type": getattr(task, "ojs_type", None) or task.name,
        "args": list(request.args or ()), "state": "active",
        "attempt": int(request.retries or 0) + 1, "created_at": now, "enqueued_at": now,
        "started_at": now,
    }
    if request.kwargs:
        fields[CELERY_KWARGS_FIELD] = dict(request.kwargs)
    checkpoints = _checkpoints.get()
    if checkpoints is not None and checkpoints.get(fields["id"]) is not None:
        fields["last_checkpoint"] = checkpoints[fields["id"]]
    job = Job.model_construct(**fields)
    ctx = EagerJobContext(Record(job=job, worker_id=EAGER_WORKER_ID))
    reset = _current.set(ctx)
    try:
        value = run()
    finally:
        _current.reset(reset)
        if checkpoints is not None:
            checkpoints[fields["id"]] = ctx.record.job.last_checkpoint
    problem = result_problem(value) if _in_place_of_a_call.get() else None
    if problem is not None:
        raise problem
    return value
