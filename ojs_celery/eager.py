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

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, cast

from celery.result import EagerResult

from .callers import check_call_arguments
from .context import JobContext, _current
from .envelope import CELERY_KWARGS_FIELD, Job, JsonValue, new_job_id, utcnow
from .lifecycle import Record
from .outcome import result_problem

if TYPE_CHECKING:
    from celery import Task

    from .runtime import Runtime

#: The worker id an eager attempt runs under (no worker is involved).
EAGER_WORKER_ID = "eager"
#: Set while eager mode runs a call in place of a published one (its retries' reruns
#: included): its result must then be JSON, as a worker's would (see the module docstring).
_in_place_of_a_call: ContextVar[bool] = ContextVar("ojs_eager_call", default=False)


class EagerJobContext(JobContext):
    """A :class:`~ojs_celery.JobContext` whose record lives in memory: heartbeats, progress
    and checkpoints update it and never reach a store."""

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
        update: dict[str, Any] = {}
        if progress is not None:
            before = (self.job.progress or {}).get("value")
            value = min(max(float(progress), 0.0), 1.0)
            if isinstance(before, (int, float)):
                value = max(value, float(before))
            update["progress"] = {"value": value, "data": data}
        if checkpoint is not None:
            update["last_checkpoint"] = checkpoint
        if update:
            self.job = self.job.model_copy(update=update)
            self._record = Record(job=self.job, worker_id=EAGER_WORKER_ID)
        return True


def apply_eagerly(task: Task, args: Any, kwargs: Any, options: dict[str, Any]) -> EagerResult:
    """``apply_async`` under ``task_always_eager``: Celery's ``Task.apply``, as Celery's own
    ``apply_async`` does (nothing is published, no job is stored)."""
    check_call_arguments(task, args, kwargs)  # InvalidJob, as a published call
    link, link_error = options.pop("link", None), options.pop("link_error", None)
    task_id = options.pop("task_id", None) or new_job_id()
    reset = _in_place_of_a_call.set(True)
    try:
        result: EagerResult = task.apply(args, kwargs, task_id=task_id, link=link,
                                         link_error=link_error, **options)
    finally:
        _in_place_of_a_call.reset(reset)
    return result


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
    job = Job.model_construct(**fields)
    ctx = EagerJobContext(Record(job=job, worker_id=EAGER_WORKER_ID))
    reset = _current.set(ctx)
    try:
        value = run()
    finally:
        _current.reset(reset)
    problem = result_problem(value) if _in_place_of_a_call.get() else None
    if problem is not None:
        raise problem
    return value
