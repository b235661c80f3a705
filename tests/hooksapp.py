"""A Celery app built twice for differential tests: plain Celery (``ojs: false``, no
``install``) and OJS (``ojs: true``: ``install(app)`` and ``base=OJSTask``), with the same task
names, hooks and signal receivers. Each hook and signal appends a JSON line to the file
``observed`` in ``config["dir"]``, so a test compares what a user of each sees.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

from celery import Celery, Task, signals
from celery.worker.request import Request

from ojs_celery import OJSTask, install

#: The request fields a hook reports (``delivery_info`` by its keys only).
REQUEST_FIELDS = ("retries", "hostname", "correlation_id", "root_id", "parent_id", "group",
                  "reply_to", "is_eager", "ignore_result")


def note(directory: str, **fields: Any) -> None:
    """Append one observation (atomic for short lines with O_APPEND)."""
    with open(pathlib.Path(directory) / "observed", "a") as handle:
        handle.write(json.dumps(fields, default=repr, sort_keys=True) + "\n")


def seen(directory: str) -> list[dict[str, Any]]:
    path = pathlib.Path(directory) / "observed"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def described(exc: Any) -> Any:
    """An exception as a user compares it: its class and text."""
    if isinstance(exc, BaseException):
        return [type(exc).__name__, str(exc)]
    return exc


def request_fields(task: Task) -> dict[str, Any]:
    request = task.request
    fields = {name: getattr(request, name, None) for name in REQUEST_FIELDS}
    fields["delivery_info"] = sorted((request.delivery_info or {}).keys())
    return fields


def make_app(config: dict[str, Any]) -> Celery:
    ojs = bool(config["ojs"])
    app = Celery(f"hooks_{config['queue']}", set_as_current=False)
    app.conf.update(
        broker_url=config["broker_url"],
        result_backend=config["result_backend"],
        task_default_queue=config["queue"],
        task_default_exchange=config["queue"],
        task_default_routing_key=config["queue"],
        event_exchange=config["event_exchange"],
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        task_send_sent_event=True,
        worker_send_task_events=True,
        result_expires=600,
        result_extended=bool(config.get("result_extended")),
    )
    if ojs:
        app.conf.ojs = config["store"]
        install(app)
    directory = config["dir"]

    class Hooks(Task):  # type: ignore[misc]
        """A project's task class with every hook Celery calls."""

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            note(directory, what="before_start", name=self.name,
                 task_id=task_id == self.request.id, args=args, kwargs=kwargs)

        def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
            note(directory, what="on_success", name=self.name, retval=retval,
                 task_id=task_id == self.request.id, args=args, kwargs=kwargs,
                 request=request_fields(self))

        def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            note(directory, what="on_failure", name=self.name, exc=described(exc),
                 task_id=task_id == self.request.id, args=args, kwargs=kwargs,
                 einfo=[type(einfo).__name__, described(einfo.exception)],
                 frames=_handler_frames(einfo), request=request_fields(self))

        def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            note(directory, what="on_retry", name=self.name, exc=described(exc),
                 task_id=task_id == self.request.id, args=args, kwargs=kwargs,
                 einfo=[type(einfo).__name__, described(einfo.exception)],
                 request=request_fields(self))

        def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any,
                         einfo: Any) -> None:
            note(directory, what="after_return", name=self.name, status=status,
                 retval=described(retval), task_id=task_id == self.request.id, args=args,
                 kwargs=kwargs,
                 einfo=None if einfo is None else type(einfo).__name__)

    class Guarded(Hooks):
        """A task class whose ``before_start`` refuses the task (a lock not acquired, say)."""

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            super().before_start(task_id, args, kwargs)
            raise PermissionError("refused before start")

    class TimedRequest(Request):  # type: ignore[misc]
        """A project's worker request class (Celery's "custom requests"), whose hooks run in
        the worker's main process."""

        def on_timeout(self, soft: bool, timeout: float) -> None:
            note(directory, what="request.on_timeout", name=self.task.name, soft=soft)
            super().on_timeout(soft, timeout)

        def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                       return_ok: bool = False) -> None:
            note(directory, what="request.on_failure", name=self.task.name,
                 exc=described(exc_info.exception))
            super().on_failure(exc_info, send_failed_event=send_failed_event,
                               return_ok=return_ok)

    class Timed(Hooks):
        Request = TimedRequest

    base: type = type("OJSHooks", (Hooks, OJSTask), {}) if ojs else Hooks
    # OJSTask first (the README's order for a project base class), and last
    timed_first: type = type("OJSTimedFirst", (OJSTask, Timed), {}) if ojs else Timed
    timed_last: type = type("OJSTimedLast", (Timed, OJSTask), {}) if ojs else Timed

    @app.task(shared=False, name="d.timed_first", base=timed_first, time_limit=1)
    def timed_first_task(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @app.task(shared=False, name="d.timed_last", base=timed_last, time_limit=1)
    def timed_last_task(seconds: float) -> float:
        time.sleep(seconds)
        return seconds
    guarded: type = type("OJSGuarded", (Guarded, OJSTask), {}) if ojs else Guarded

    @app.task(shared=False, name="d.ok", base=base, bind=True)
    def ok(self: Task, a: int, b: int, k: int = 0) -> int:
        note(directory, what="ran", name="d.ok", request=request_fields(self))
        return a + b + k

    @app.task(shared=False, name="d.fail", base=base, bind=True)
    def fail(self: Task, a: int, k: str = "") -> None:
        raise ValueError(f"bad {a}{k}")

    @app.task(shared=False, name="d.retry_once", base=base, bind=True, default_retry_delay=0)
    def retry_once(self: Task, a: int) -> int:
        note(directory, what="ran", name="d.retry_once", request=request_fields(self))
        if self.request.retries == 0:
            # one second, not none: with none, plain Celery's next attempt (another pool
            # process) can store its SUCCESS between Celery's read and write of this attempt's
            # RETRY, which then overwrites it, and a get() waits for ever (OJS publishes the
            # next attempt after that write: docs/celery-notes.md, tests/test_retry_order.py)
            raise self.retry(exc=KeyError("again"), countdown=1)
        return a

    @app.task(shared=False, name="d.expected", base=base, throws=(KeyError,))
    def expected() -> None:
        raise KeyError("expected")

    @app.task(shared=False, name="d.started", base=base, track_started=True)
    def started(flag: str) -> str:
        _wait_for(flag)
        return "done"

    @app.task(shared=False, name="d.progress", base=base, bind=True)
    def progress(self: Task, flag: str) -> str:
        self.update_state(state="PROGRESS", meta={"done": 1, "of": 2})
        _wait_for(flag)
        return "done"

    @app.task(shared=False, name="d.quiet_fail", base=base, ignore_result=True,
              store_errors_even_if_ignored=True)
    def quiet_fail() -> None:
        raise ValueError("quiet")

    @app.task(shared=False, name="d.quiet_ok", base=base, ignore_result=True)
    def quiet_ok() -> int:
        return 1

    @app.task(shared=False, name="d.always_retry", base=base, bind=True, max_retries=1,
              default_retry_delay=0)
    def always_retry(self: Task, countdown: float) -> None:
        raise self.retry(exc=KeyError("again"), countdown=countdown)

    @app.task(shared=False, name="d.guarded", base=guarded)
    def guarded_task(a: int) -> int:
        note(directory, what="ran", name="d.guarded")
        return a

    @app.task(shared=False, name="d.parent", base=base, bind=True)
    def parent(self: Task) -> None:
        ok.delay(1, 1)

    @app.task(shared=False, name="d.retried_by_receiver", base=base, max_retries=2)
    def retried_by_receiver() -> None:
        note(directory, what="ran", name="d.retried_by_receiver")
        raise ValueError("retried by the task_failure receiver")

    @signals.task_prerun.connect(weak=False)
    def prerun(sender: Any = None, task_id: Any = None, task: Any = None, args: Any = None,
               kwargs: Any = None, **_: Any) -> None:
        note(directory, what="task_prerun", name=task.name, args=args, kwargs=kwargs)

    @signals.task_postrun.connect(weak=False)
    def postrun(sender: Any = None, task_id: Any = None, task: Any = None, args: Any = None,
                kwargs: Any = None, retval: Any = None, state: Any = None, **_: Any) -> None:
        note(directory, what="task_postrun", name=task.name, args=args, kwargs=kwargs,
             retval=described(retval), state=state)

    @signals.task_success.connect(weak=False)
    def success(sender: Any = None, result: Any = None, **_: Any) -> None:
        note(directory, what="task_success", name=sender.name, result=result)

    @signals.task_failure.connect(weak=False)
    def failure(sender: Any = None, task_id: Any = None, exception: Any = None, args: Any = None,
                kwargs: Any = None, traceback: Any = None, einfo: Any = None, **_: Any) -> None:
        note(directory, what="task_failure", name=sender.name, exception=described(exception),
             args=args, kwargs=kwargs, traceback=traceback is not None,
             einfo=type(einfo).__name__)
        if sender.name == "d.retried_by_receiver":
            # a project's "retry every failed task" receiver (ibutsu-server's, say)
            sender.retry(countdown=0)

    @signals.task_retry.connect(weak=False)
    def retried(sender: Any = None, request: Any = None, reason: Any = None, einfo: Any = None,
                **_: Any) -> None:
        note(directory, what="task_retry", name=sender.name, reason=described(reason),
             exc=described(getattr(reason, "exc", None)), request_args=request.args,
             request_kwargs=request.kwargs, einfo=type(einfo).__name__)

    @signals.task_received.connect(weak=False)
    def received(sender: Any = None, request: Any = None, **_: Any) -> None:
        note(directory, what="task_received", name=request.name, args=list(request.args),
             kwargs=request.kwargs)

    return app


def _handler_frames(einfo: Any) -> list[str]:
    """The function names of the traceback's frames in this module: a user's traceback names
    their handler's frames."""
    tb = einfo.tb
    names = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == __file__:
            names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def _wait_for(flag: str, timeout: float = 15.0) -> None:
    """Until the test creates the file ``flag``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)


app = make_app(json.loads(os.environ["OJS_HOOKS_CONFIG"])) if "OJS_HOOKS_CONFIG" in os.environ \
    else None
