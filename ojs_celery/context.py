"""The handler's view of its job: ``ojs_celery.current_job()`` or ``self.ojs`` in a bound task."""

from __future__ import annotations

import logging
import math
import time
from contextvars import Context, ContextVar
from typing import TYPE_CHECKING, Any

from .envelope import Job, JsonValue, json_native, storable_violations
from .lifecycle import Record, with_trace
from .store import StoreError

if TYPE_CHECKING:
    from .runtime import Runtime

logger = logging.getLogger(__name__)

#: At most one ``job.progress`` event a second per attempt (the progress extension's rate).
PROGRESS_EVENT_INTERVAL = 1.0

_current: ContextVar[JobContext | None] = ContextVar("ojs_current_job", default=None)


class NoCurrentJob(RuntimeError):
    """``current_job()`` was called outside an OJS task."""


class JobContext:
    """The running attempt: its job, heartbeats, progress, checkpoints and cancellation.

    ``cancelled`` becomes True when the attempt's execution timeout fires (the soft time limit,
    at the start of the grace period) or the worker shuts down: save a checkpoint with
    ``progress(..., checkpoint=...)`` and return; the next attempt sees it as
    ``last_checkpoint``.
    """

    def __init__(self, runtime: Runtime, record: Record, worker_id: str) -> None:
        self._runtime = runtime
        self._record = record
        self.worker_id = worker_id
        self.job: Job = record.job
        self.attempt: int = record.job.attempt
        self.last_checkpoint: JsonValue = record.job.last_checkpoint
        self.cancelled = False
        self.started = time.monotonic()
        #: Seconds the attempt's start waited (for the store) after the message reached the
        #: pool process, where Celery's time limits start counting.
        self.start_waited = 0.0
        self._last_progress_event = -PROGRESS_EVENT_INTERVAL
        #: The result state the handler gave its job in this attempt (``update_state``).
        self.result_state: str | None = None

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def record(self) -> Record:
        return self._record

    def _update(self, record: Record | None) -> None:
        if record is not None:
            self._record = record

    def heartbeat(self) -> bool:
        """Tell the store this attempt is alive (resets the stall and visibility clocks).

        Returns False if the store rejected it (the attempt is no longer ours) or is
        unreachable; a heartbeat never raises.
        """
        return self._beat()

    def progress(
        self, value: float | None, data: JsonValue = None, checkpoint: JsonValue = None
    ) -> bool:
        """Report progress in [0, 1] (clamped, never decreasing), optional data and a checkpoint.

        Counts as a heartbeat. A checkpoint is what the next attempt gets as ``last_checkpoint``.
        Emits ``job.progress`` (the progress extension's fields), at most one a second per
        attempt (the extension's rate), and always when the job reaches 1.0. ``data`` and the
        checkpoint are kept as JSON (tuples as lists, a ``datetime`` as text); ``ValueError``,
        with nothing written, for what JSON cannot hold at all (a number that is not finite, an
        object that has no JSON form) and for a value that is no finite number.
        """
        data, checkpoint = json_native(data), json_native(checkpoint)
        problems = storable_violations({"data": data, "checkpoint": checkpoint})
        fraction = None if value is None else _number(value)
        if fraction is not None and not math.isfinite(fraction):
            problems.insert(0, ("value", PROGRESS_VALUE_RULE))
        if problems:
            raise ValueError("progress(): " + "; ".join(f"{path}: {rule}"
                                                        for path, rule in problems))
        written = self._beat(progress=fraction, data=data, checkpoint=checkpoint)
        if written and (value is not None or data is not None):
            self._progress_event()
        return written

    def _progress_event(self) -> None:
        current = self._record.job.progress or {}
        fraction = float(current.get("progress", 0.0))  # type: ignore[arg-type]
        now = time.monotonic()
        if now - self._last_progress_event < PROGRESS_EVENT_INTERVAL and fraction < 1.0:
            return
        self._last_progress_event = now
        job = self._record.job
        event: dict[str, Any] = {
            "job_id": job.id, "job_type": job.type, "queue": job.queue, "state": job.state,
            "worker_id": self.worker_id, "attempt": self.attempt, "progress": fraction,
            "progress_percent": round(fraction * 100, 2),
        }
        if current.get("data") is not None:
            event["data"] = current["data"]
        self._runtime.bus.emit("job.progress", with_trace(event, job), subject=job.id)

    def _beat(
        self,
        progress: float | None = None,
        data: JsonValue = None,
        checkpoint: JsonValue = None,
    ) -> bool:
        try:
            transition = self._runtime.store.heartbeat(
                self.job.id,
                self.attempt,
                self.worker_id,
                progress=progress,
                data=data,
                checkpoint=checkpoint,
                hint=self._record,
            )
        except StoreError as exc:
            logger.warning("ojs_celery: heartbeat for job %s failed: %s", self.job.id, exc)
            return False
        if not transition.applied:
            logger.warning(
                "ojs_celery: heartbeat for job %s attempt %s rejected (%s)",
                self.job.id, self.attempt, transition.reason,
            )
            return False
        self._update(transition.record)
        return True


#: What ``progress(value)`` refuses: NaN, the infinities and what is no number, which no clamp
#: places on the scale (a finite number outside 0 to 1 is clamped, so naming the range misled).
PROGRESS_VALUE_RULE = ("must be a number, not NaN or an infinity (a finite one is clamped to "
                       "0 to 1)")


def _number(value: Any) -> float:
    """``value`` as a float (NaN when it is none: ``progress`` names it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def current_job() -> JobContext:
    """The context of the OJS job running in this task; raises outside of one."""
    ctx = _current.get()
    if ctx is None:
        raise NoCurrentJob("current_job() is only available inside a running OJS task")
    return ctx


def maybe_current_job() -> JobContext | None:
    return _current.get()


def job_in(context: Context) -> JobContext | None:
    """The job running in ``context``, another greenlet's (see :mod:`ojs_celery.softlimit`)."""
    return context.get(_current)
