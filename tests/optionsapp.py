"""The differential app of ``tests/hooksapp.py`` with tasks that use Celery's task options and
control-flow exceptions (``Ignore``, ``Reject``, ``self.retry`` to exhaustion, ``autoretry_for``
with its backoff, ``max_retries=None``, ``rate_limit``, ``task_annotations``, a lost pool
process under ``acks_late`` + ``reject_on_worker_lost``), built plain (``ojs: false``) and with
``base=OJSTask`` (``ojs: true``) under the same names. Each body run appends a ``ran`` line to
``observed`` (with the time and ``self.request.retries``), so a test counts runs on each side.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from ojs_celery import OJSTask
from tests import hooksapp
from tests.hooksapp import note

#: ``task_annotations`` of both apps: options a project sets from its configuration.
ANNOTATIONS = {"o.annotated": {"max_retries": 1, "default_retry_delay": 0.2},
               "o.annot_limit": {"time_limit": 1}}


def make_app(config: dict[str, Any]) -> Celery:
    app = hooksapp.make_app(config)
    app.conf.task_annotations = ANNOTATIONS
    base: type = OJSTask if config["ojs"] else Task
    directory = config["dir"]

    def ran(task: Task, name: str) -> None:
        note(directory, what="ran", name=name, id=task.request.id,
             retries=task.request.retries, at=time.time())

    @app.task(shared=False, name="o.ignore", base=base, bind=True)
    def ignore(self: Task) -> None:
        ran(self, "o.ignore")
        raise Ignore()

    @app.task(shared=False, name="o.reject", base=base, bind=True)
    def reject(self: Task) -> None:
        ran(self, "o.reject")
        raise Reject("not for us", requeue=False)

    @app.task(shared=False, name="o.auto_kwargs", base=base, bind=True,
              autoretry_for=(LookupError,), dont_autoretry_for=(IndexError,),
              retry_kwargs={"max_retries": 1, "countdown": 0.2})
    def auto_kwargs(self: Task, which: str) -> None:
        """``autoretry_for`` with ``retry_kwargs``; an exception in ``dont_autoretry_for``."""
        ran(self, "o.auto_kwargs")
        raise (IndexError if which == "index" else KeyError)(which)

    @app.task(shared=False, name="o.later", base=base, bind=True)
    def later(self: Task) -> int:
        """Retried once, two seconds later: its RETRY is seen meanwhile."""
        ran(self, "o.later")
        if self.request.retries == 0:
            raise self.retry(exc=KeyError("wait"), countdown=2)
        return int(self.request.retries)

    @app.task(shared=False, name="o.soft", base=base, bind=True, soft_time_limit=1,
              expires=30)
    def soft(self: Task, seconds: float) -> str:
        """A soft limit the handler survives (it cleans up and returns)."""
        ran(self, "o.soft")
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            return "cleaned up"
        return "in time"

    @app.task(shared=False, name="o.rebind", base=base, bind=True)
    def rebind(self: Task, a: int, b: int = 0, how: str = "args") -> list[int]:
        """A retry with new positional arguments only, or new keyword arguments only."""
        ran(self, "o.rebind")
        if self.request.retries == 0:
            if how == "args":
                raise self.retry(args=[5, 6], countdown=0.1)
            raise self.retry(kwargs={"a": 7}, countdown=0.1)
        return [a, b]

    @app.task(shared=False, name="o.annot_limit", base=base, bind=True)
    def annot_limit(self: Task, seconds: float) -> float:
        ran(self, "o.annot_limit")
        time.sleep(seconds)
        return seconds

    @app.task(shared=False, name="o.reject_requeue", base=base, bind=True)
    def reject_requeue(self: Task) -> None:
        ran(self, "o.reject_requeue")
        raise Reject("again", requeue=True)

    @app.task(shared=False, name="o.nothrow", base=base, bind=True, max_retries=1)
    def nothrow(self: Task) -> str:
        ran(self, "o.nothrow")
        self.retry(countdown=0.2, throw=False)
        return "returned"

    @app.task(shared=False, name="o.exhaust", base=base, bind=True, max_retries=1)
    def exhaust(self: Task, with_exc: bool) -> None:
        ran(self, "o.exhaust")
        raise self.retry(exc=KeyError("again") if with_exc else None, countdown=0.2)

    @app.task(shared=False, name="o.exhaust_call", base=base, bind=True, max_retries=5)
    def exhaust_call(self: Task) -> None:
        """The call's ``max_retries`` wins over the task's."""
        ran(self, "o.exhaust_call")
        raise self.retry(exc=KeyError("again"), countdown=0.2, max_retries=1)

    @app.task(shared=False, name="o.autoretry", base=base, bind=True, autoretry_for=(KeyError,),
              max_retries=2, retry_backoff=1, retry_backoff_max=1, retry_jitter=True)
    def autoretry(self: Task) -> None:
        ran(self, "o.autoretry")
        raise KeyError("auto")

    @app.task(shared=False, name="o.unbounded", base=base, bind=True, max_retries=None)
    def unbounded(self: Task, upto: int, k: str = "") -> int:
        ran(self, "o.unbounded")
        if self.request.retries < upto:
            raise self.retry(countdown=0.1)
        return int(self.request.retries)

    @app.task(shared=False, name="o.annotated", base=base, bind=True)
    def annotated(self: Task) -> None:
        ran(self, "o.annotated")
        raise self.retry(exc=KeyError("annotated"))

    @app.task(shared=False, name="o.rated", base=base, bind=True, rate_limit="4/s")
    def rated(self: Task) -> None:
        ran(self, "o.rated")

    @app.task(shared=False, name="o.lost", base=base, bind=True, acks_late=True,
              reject_on_worker_lost=True)
    def lost(self: Task, flag: str) -> str:
        """Its pool process exits at the first run (``flag``: a file name, made then)."""
        ran(self, "o.lost")
        made = pathlib.Path(directory) / flag
        if not made.exists():
            made.touch()
            os._exit(1)
        return "again"

    @app.task(shared=False, name="o.slow", base=base, bind=True)
    def slow(self: Task, seconds: float) -> float:
        ran(self, "o.slow")
        time.sleep(seconds)
        return seconds

    return app


app = make_app(json.loads(os.environ["OJS_OPTIONS_CONFIG"])) if "OJS_OPTIONS_CONFIG" in os.environ \
    else None
