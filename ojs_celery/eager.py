"""Eager mode (``task_always_eager``, ``.apply()``): OJS tasks run in-process as Celery runs
them, with no server.

Celery's own ``Task.apply`` does the work (its tracer, ``link``/``link_error``, and eager
``self.retry()``, which reruns at once, bounded by ``max_retries``); OJS adds only the handler's
view of its job: an in-memory record, so that ``current_job()``, progress and checkpoints work.
Nothing touches the store, the broker or the outbox, so tests that set ``task_always_eager``
need neither (and a broker URL that points nowhere is never dialled).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from celery.result import EagerResult

from .context import JobContext, _current
from .envelope import CELERY_KWARGS_FIELD, Job, JsonValue, new_job_id, utcnow
from .lifecycle import Record

if TYPE_CHECKING:
    from celery import Task

    from .runtime import Runtime

#: The worker id an eager attempt runs under (no worker is involved).
EAGER_WORKER_ID = "eager"


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
    link, link_error = options.pop("link", None), options.pop("link_error", None)
    task_id = options.pop("task_id", None) or new_job_id()
    result: EagerResult = task.apply(args, kwargs, task_id=task_id, link=link,
                                     link_error=link_error, **options)
    return result


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
        return run()
    finally:
        _current.reset(reset)
