"""Quieter worker logs for what a healthy OJS worker does all the time.

Celery logs every task it receives and every success at INFO: with the sweep task running every
``sweep_interval`` (2 s), that is two lines every two seconds that say nothing. And an execution
timeout is an expected outcome of an OJS job (recorded, evented, retried per its policy), but
Celery logs the exception it raised with a full traceback. :func:`quiet_worker_logs` adds
logging filters to Celery's own loggers: the sweep task's received/succeeded lines go, and a
timeout of an OJS task keeps its one line (Celery's "Soft/Hard time limit (Ns) exceeded for
task[job id]" and the task's failure line) without the traceback, and so does the ``Reject``
that sends an OJS message back to the broker (the store unreachable, a draining worker): OJS
has said why in one line already, and during an outage or a deploy there is one per message.
Plain Celery tasks are left as Celery logs them.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery import Celery
from celery.exceptions import Reject

#: Celery's loggers for "Task ... received" (strategy) and "... succeeded/raised" (trace).
CELERY_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
TIMEOUTS = (SoftTimeLimitExceeded, TimeLimitExceeded)
#: What an OJS task's records keep without a traceback (see the module docstring). A handler's
#: own Reject never reaches Celery as one: the job's outcome reports it.
SAID_ALREADY = (*TIMEOUTS, Reject)


class QuietOJSRecords(logging.Filter):
    """Drops the sweep task's INFO lines; strips the traceback from an OJS task's timeout and
    from the Reject that sends its message back."""

    def __init__(self, app: Celery, sweep_task: str) -> None:
        super().__init__()
        self.app = app
        self.sweep_task = sweep_task

    def filter(self, record: logging.LogRecord) -> bool:
        name = _task_name(record)
        if name is None:
            return True
        if name == self.sweep_task:
            return record.levelno > logging.INFO
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, SAID_ALREADY) and getattr(self.app.tasks.get(name), "__ojs_task__",
                                                     False):  # only then: every record passes
            record.exc_info = None
            record.exc_text = None
        return True


def _task_name(record: logging.LogRecord) -> str | None:
    """The task a Celery log record is about (its format arguments are a dict with ``name``)."""
    args: Any = record.args
    if isinstance(args, dict):
        name = args.get("name")
        return name if isinstance(name, str) else None
    return None


def quiet_worker_logs(app: Celery, sweep_task: str) -> None:
    """Add :class:`QuietOJSRecords` to Celery's task loggers (once per app)."""
    for logger_name in CELERY_TASK_LOGGERS:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, QuietOJSRecords) and f.app is app for f in logger.filters):
            logger.addFilter(QuietOJSRecords(app, sweep_task))
