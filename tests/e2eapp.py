"""The Celery app that end-to-end tests run in real ``celery worker`` subprocesses.

The test process builds the same app with :func:`make_app` from a config dict, and passes that
dict to the worker as ``OJS_E2E_CONFIG`` (JSON). Handlers record what they did in files under
``config["dir"]`` so that tests can count runs across processes.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from contextvars import ContextVar
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, Task, signals, states
from celery.backends.redis import RedisBackend
from celery.exceptions import Ignore, Reject

from ojs_celery import JobError, OJSTask, current_job, install, unacked
from ojs_celery.context import maybe_current_job
from ojs_celery.store import JobStore, StoreTimeout

#: What a Flask-style task class's own ``__call__`` opens around the handler (the app context).
flask_app_context: ContextVar[str | None] = ContextVar("flask_app_context", default=None)
#: Jobs of this type are slowed in their own store writes (with ``slow_bookkeeping`` set).
SLOW_TYPE = "e2e.slow_bookkeeping"


def record(directory: str, name: str, line: str) -> None:
    """Append one line to a log file (atomic for short lines with O_APPEND)."""
    with open(pathlib.Path(directory) / name, "a") as handle:
        handle.write(line + "\n")


class AppContextTask(OJSTask):  # type: ignore[misc]
    """Flask's documented task class, with OJSTask as its base, as the app's task class
    (``task_cls``, with ``config["ojs_task_cls"]``): every task given no ``base=`` is an OJS
    task, Celery's own tasks and the sweep excepted."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reset = flask_app_context.set("task_cls")
        try:
            return self.run(*args, **kwargs)
        finally:
            flask_app_context.reset(reset)


class SlowRetryResults(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend, a second slower in storing a RETRY once it has read the
    stored state (``result_backend = "tests.e2eapp:SlowRetryResults+redis://..."``): it opens
    the window in which the next attempt's SUCCESS, stored meanwhile, is overwritten."""

    def _set_with_state(self, key: Any, value: Any, state: str) -> Any:
        if state == states.RETRY:
            time.sleep(1.0)
        return super()._set_with_state(key, value, state)


def make_app(config: dict[str, Any]) -> Celery:
    task_cls = {"task_cls": AppContextTask} if config.get("ojs_task_cls") else {}
    app = Celery(f"e2e_{config['queue']}", set_as_current=False, **task_cls)
    app.conf.update(
        broker_url=config["broker_url"],
        result_backend=config["result_backend"],
        broker_transport_options=config.get("broker_transport_options", {}),
        task_default_queue=config["queue"],
        task_default_exchange=config["queue"],
        task_default_routing_key=config["queue"],
        event_exchange=config.get("event_exchange", "celeryev"),
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        result_extended=False,
        ojs=config["ojs"],
        **config.get("celery", {}),
    )
    runtime = install(app)
    app._ojs_e2e_config = config
    directory = config["dir"]
    if config.get("slow_bookkeeping"):
        slow_bookkeeping(runtime.store, directory)
    if config.get("unacked_linger"):  # hold the removals of acknowledged Redis deliveries
        unacked.removals.linger = float(config["unacked_linger"])
    if config.get("events_linger"):  # hold each process's events in its bus thread longer
        runtime.bus.linger = float(config["events_linger"])

    class ProjectBase(Task):  # type: ignore[misc]
        """A project's base class with its own ``__call__`` (a database session, say), listed
        after OJSTask: Celery's worker calls it, so OJS must too."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            record(directory, "project_calls", f"{self.name} {self.request.id}")
            return super().__call__(*args, **kwargs)

    @app.task(shared=False, name="e2e.project", base=type("ProjectOJSTask",
                                                          (OJSTask, ProjectBase), {}),
              bind=True)
    def project(self: Task, a: int) -> dict[str, Any]:
        return {"a": a, "id": self.request.id, "args": list(self.request.args)}

    def flask_task(spelling: str) -> type:
        """Flask's documented task class ("Background Tasks with Celery"), migrated by giving
        it OJSTask as its base: its own ``__call__`` opens the app context around the handler,
        and calls ``self.run`` (as Flask's docs do) or ``super().__call__``."""

        class FlaskTask(OJSTask):  # type: ignore[misc]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                record(directory, "own_calls", f"{self.name} {self.request.id}")
                reset = flask_app_context.set(self.name)
                try:
                    if spelling == "run":
                        return self.run(*args, **kwargs)
                    return super().__call__(*args, **kwargs)
                finally:
                    flask_app_context.reset(reset)

        return FlaskTask

    for spelling in ("run", "super"):
        @app.task(shared=False, name=f"e2e.flask_{spelling}", base=flask_task(spelling),
                  bind=True)
        def flask(self: Task, a: int, retries: int = 0) -> dict[str, Any]:
            ctx = current_job()
            record(directory, "runs", f"{self.name} {ctx.job_id} attempt={ctx.attempt}")
            if self.request.retries < retries:
                raise self.retry(countdown=0.1)
            return {"a": a, "context": flask_app_context.get(), "job": ctx.job_id,
                    "id": self.request.id}

    @app.task(shared=False, name="e2e.add", base=OJSTask)
    def add(a: int, b: int) -> int:
        record(directory, "runs", f"add {current_job().job_id}")
        return a + b

    @app.task(shared=False, name="e2e.noop", base=OJSTask)
    def noop() -> None:
        return None

    @app.task(shared=False, name="e2e.echo_kwargs", base=OJSTask)
    def echo_kwargs(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"args": list(args), "kwargs": kwargs}

    @app.task(shared=False, name="e2e.sleep", base=OJSTask)
    def sleep(seconds: float, tag: str = "") -> str:
        ctx = current_job()
        record(directory, "runs", f"sleep {ctx.job_id} attempt={ctx.attempt} pid={os.getpid()}")
        time.sleep(seconds)
        record(directory, "finished", f"sleep {ctx.job_id} attempt={ctx.attempt}")
        return tag or "slept"

    @app.task(shared=False, name="e2e.stuck_first", base=OJSTask)
    def stuck_first(seconds: float) -> str:
        """Attempt 1 hangs for ``seconds`` (a frozen handler); later attempts return."""
        ctx = current_job()
        record(directory, "runs", f"stuck_first {ctx.job_id} attempt={ctx.attempt}")
        if ctx.attempt == 1:
            time.sleep(seconds)
            record(directory, "finished", f"stuck_first {ctx.job_id} attempt=1")
            return "late"
        return f"ok on {ctx.attempt}"

    @app.task(shared=False, name="e2e.dies_once", base=OJSTask)
    def dies_once() -> str:
        """Attempt 1 loses its pool process (it exits); later attempts return."""
        ctx = current_job()
        record(directory, "runs", f"dies_once {ctx.job_id} attempt={ctx.attempt}")
        if ctx.attempt == 1:
            os._exit(1)
        return f"ok on {ctx.attempt}"

    @app.task(shared=False, name="e2e.whoami", base=OJSTask)
    def whoami(seconds: float) -> str:
        """Sleeps, then answers with the id of the worker that ran it."""
        ctx = current_job()
        record(directory, "runs", f"whoami {ctx.job_id} attempt={ctx.attempt} "
               f"worker={ctx.worker_id}")
        time.sleep(seconds)
        record(directory, "finished", f"whoami {ctx.job_id} attempt={ctx.attempt}")
        return ctx.worker_id

    @app.task(shared=False, name="e2e.silent", base=OJSTask, heartbeat="handler")
    def silent(seconds: float) -> str:
        """Handler heartbeats: attempt 1 hangs without a heartbeat (a deadlock), later ones
        finish at once."""
        ctx = current_job()
        if ctx.attempt == 1:
            time.sleep(seconds)
            return "late"
        return f"ok on {ctx.attempt}"

    @app.task(shared=False, name="e2e.progressing", base=OJSTask, heartbeat="handler")
    def progressing(seconds: float) -> str:
        """Handler heartbeats: long, but reports progress all along."""
        ctx = current_job()
        steps = int(seconds / 0.2)
        for step in range(steps):
            time.sleep(0.2)
            ctx.progress((step + 1) / steps)
        return f"done on {ctx.attempt}"

    @app.task(shared=False, name="e2e.fail_until", base=OJSTask)
    def fail_until(succeed_on: int) -> str:
        ctx = current_job()
        if ctx.attempt < succeed_on:
            raise ConnectionError(f"attempt {ctx.attempt} fails")
        return f"ok on {ctx.attempt}"

    @app.task(shared=False, name="e2e.job_error", base=OJSTask)
    def job_error(error_type: str, retryable: bool) -> None:
        raise JobError("domain failure", type=error_type, retryable=retryable)

    @app.task(shared=False, name="e2e.checkpointing", base=OJSTask)
    def checkpointing(mode: str) -> Any:
        """mode: 'overrun' (checkpoint, then overrun the grace), 'return' (return in grace),
        'escape' (let SoftTimeLimitExceeded escape)."""
        ctx = current_job()
        record(directory, "runs", f"checkpointing {ctx.job_id} attempt={ctx.attempt} "
               f"last_checkpoint={json.dumps(ctx.last_checkpoint)}")
        try:
            time.sleep(60)
        except SoftTimeLimitExceeded:
            record(directory, "cancelled", f"{ctx.job_id} attempt={ctx.attempt} "
                   f"cancelled={ctx.cancelled}")
            if mode == "escape":
                raise
            ctx.progress(0.5, checkpoint={"attempt": ctx.attempt})
            if mode == "return":
                return "finished in grace"
            time.sleep(60)
        return "unreachable"

    @app.task(shared=False, name="e2e.timed", base=OJSTask)
    def timed(seconds: float) -> Any:
        """Works ``seconds``; cancelled, returns in the grace period how long after its first
        line, in which job it was cancelled, and whether ``ctx.cancelled`` said so."""
        ctx = current_job()
        began = time.monotonic()
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            return {"job": ctx.job_id, "after": time.monotonic() - began,
                    "cancelled": ctx.cancelled}
        return {"job": ctx.job_id, "after": None, "cancelled": ctx.cancelled}

    @app.task(shared=False, name="e2e.calls_itself", base=OJSTask, bind=True)
    def calls_itself(self: OJSTask, seconds: float, inner: bool = False) -> Any:
        """Calls itself directly (as a function) first, then works ``seconds``: cancelled,
        returns in the grace period."""
        if inner:
            return "inner"
        called = self(0, inner=True)
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            return f"cancelled after {called}"
        return f"not cancelled after {called}"

    @app.task(shared=False, name="e2e.retries_at_its_limit", base=OJSTask, bind=True)
    def retries_at_its_limit(self: OJSTask, seconds: float) -> Any:
        """Attempt 1 works ``seconds`` and, cancelled, retries (``self.retry()``) in the grace
        period; later attempts return."""
        ctx = current_job()
        if ctx.attempt > 1:
            return f"ok on {ctx.attempt}"
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            raise self.retry(countdown=0.1) from None
        return "not cancelled"

    @app.task(shared=False, name="e2e.soft_limit_holds", base=OJSTask)
    def soft_limit_holds() -> int:
        """How many attempts' soft-limit holds this process keeps (gevent: its own)."""
        from ojs_celery import softlimit
        return len(softlimit._greenlet_holds)

    @app.task(shared=False, name="e2e.resumable", base=OJSTask)
    def resumable(seconds: float) -> Any:
        """Resumes from its checkpoint at once; without one, works ``seconds``, and when
        cancelled records when, saves a checkpoint and overruns."""
        ctx = current_job()
        if ctx.last_checkpoint is not None:
            return {"resumed_from": ctx.last_checkpoint}
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            record(directory, "cancelled", f"{ctx.job_id} attempt={ctx.attempt} "
                   f"at={time.time()}")
            ctx.progress(0.5, checkpoint={"step": 1})
            time.sleep(seconds)
        return "unreachable"

    def retry_until(self: OJSTask, succeed_on: int) -> str:
        """Retries (0.2 s later) until attempt ``succeed_on``."""
        ctx = current_job()
        if ctx.attempt < succeed_on:
            raise self.retry(exc=ValueError(f"not yet ({ctx.attempt})"), countdown=0.2)
        return f"ok on {ctx.attempt}"

    class FailingOnRetry(OJSTask):  # type: ignore[misc]
        def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            raise RuntimeError("on_retry fails")

    app.task(shared=False, name="e2e.self_retry", base=OJSTask, bind=True)(retry_until)
    app.task(shared=False, name="e2e.retry_on_retry_fails", base=FailingOnRetry,
             bind=True)(retry_until)

    @app.task(shared=False, name="e2e.retry_when_called", base=OJSTask, bind=True)
    def retry_when_called(self: OJSTask, a: int) -> int:
        """Retries with new arguments: called directly, Celery raises the ``exc`` instead."""
        raise self.retry(args=[a + 1], exc=ValueError(f"could not with {a}"), countdown=0)

    @app.task(shared=False, name="e2e.calls_directly", base=OJSTask)
    def calls_directly(a: int) -> str:
        """Calls an OJS task directly (as a function), whose ``self.retry`` is its own."""
        try:
            return str(app.tasks["e2e.retry_when_called"](a))
        except ValueError as exc:
            return f"caught {exc}"

    @app.task(shared=False, name="e2e.autoretry", base=OJSTask, autoretry_for=(KeyError,))
    def autoretry(succeed_on: int) -> str:
        ctx = current_job()
        if ctx.attempt < succeed_on:
            raise KeyError(f"missing on {ctx.attempt}")
        return f"ok on {ctx.attempt}"

    @app.task(shared=False, name="e2e.reject", base=OJSTask)
    def reject(requeue: bool) -> None:
        raise Reject("no thanks", requeue=requeue)

    @app.task(shared=False, name="e2e.ignore", base=OJSTask)
    def ignore() -> None:
        raise Ignore()

    @app.task(shared=False, name="e2e.ignore_with_state", base=OJSTask, bind=True)
    def ignore_with_state(self: OJSTask, state: str) -> None:
        """Celery's way to end a task with its own FAILURE: update_state, then Ignore (or a
        PROGRESS report, then Ignore)."""
        self.update_state(state=state, meta={"exc_type": "ValueError",
                                             "exc_message": ["custom failure"]})
        raise Ignore()

    @app.task(shared=False, name="e2e.callback")
    def callback(result: Any, tag: str = "") -> None:
        record(directory, "callbacks", f"{tag} {json.dumps(result)}")

    @app.task(shared=False, name="e2e.app_class")
    def app_class(x: int) -> dict[str, Any]:
        """A task given no base: an OJS task where the app's task class is one."""
        ctx = maybe_current_job()
        return {"x": x, "context": flask_app_context.get(), "job": ctx and ctx.job_id}

    @app.task(shared=False, name="e2e.plain")
    def plain(x: int) -> int:
        return x

    @app.task(shared=False, name="e2e.plain_sleep", bind=True)
    def plain_sleep(self: Task, seconds: float) -> str:
        """A plain Celery task (no OJSTask) that runs a while, in a worker with ``install``."""
        record(directory, "runs", f"plain_sleep {self.request.id} pid={os.getpid()}")
        time.sleep(seconds)
        record(directory, "finished", f"plain_sleep {self.request.id}")
        return "slept"

    @app.task(shared=False, name="e2e.raise_package_error", base=OJSTask)
    def raise_package_error(name: str) -> None:
        """Raise one of ojs_celery's own exceptions (it must reach the main process whole)."""
        import ojs_celery

        job_id = current_job().job_id
        errors: dict[str, BaseException] = {
            "InvalidJob": ojs_celery.InvalidJob([("args[0]", "is bad")]),
            "DuplicateJob": ojs_celery.DuplicateJob(job_id),
            "JobError": ojs_celery.JobError("declined", type="declined", retryable=False),
            "StoreError": ojs_celery.StoreError("store down"),
            "BrokerUnavailable": ojs_celery.BrokerUnavailable("broker down"),
            "JobNotFound": ojs_celery.JobNotFound(job_id),
            "NotInstalled": ojs_celery.NotInstalled("not installed"),
            "NoCurrentJob": ojs_celery.NoCurrentJob("no job"),
        }
        raise errors[name]

    @app.task(shared=False, name="e2e.final_under_autoretry", base=OJSTask,
              autoretry_for=(Exception,), max_retries=3)
    def final_under_autoretry() -> None:
        record(directory, "runs", f"final_under_autoretry {current_job().job_id}")
        raise JobError("declined", type="declined", retryable=False)

    @app.task(shared=False, name="e2e.replacer", base=OJSTask, bind=True)
    def replacer(self: OJSTask, x: int) -> None:
        """Celery's ``self.replace``, which an OJS job refuses with a final error."""
        raise self.replace(add.s(x, 100))

    @app.task(shared=False, name="e2e.return_undecodable_name", base=OJSTask, time_limit=30)
    def return_undecodable_name() -> str:
        """Returns a file name that is not UTF-8, as ``os.fsdecode`` gives it (a lone
        surrogate): JSON text, but not text UTF-8 can encode."""
        return os.fsdecode(b"report-\xff.csv")

    @app.task(shared=False, name="e2e.raise_awkward", base=OJSTask)
    def raise_awkward(kind: str) -> None:
        """Raise an exception whose text is awkward to record: a lone surrogate, a ``str()``
        that fails, a megabyte of it."""

        class Unprintable(Exception):
            def __str__(self) -> str:
                raise RuntimeError("no str")

        if kind == "surrogate":
            raise ValueError("bad \udc80 text")
        if kind == "unprintable":
            raise Unprintable()
        raise ValueError("x" * 1_000_000)

    @app.task(shared=False, name="e2e.retry_unmigrated", base=OJSTask, bind=True)
    def retry_unmigrated(self: OJSTask, tag: str) -> None:
        """Run from a message without the ``ojs`` header (published before the app was
        migrated): Celery's own ``retry`` republishes through ``apply_async``, which refuses
        arguments that are not JSON (``InvalidJob``, wrapped by Celery in a ``Reject``)."""
        record(directory, "runs", f"retry_unmigrated {tag}")
        raise self.retry(args=[{"not", "json"}], countdown=0.1)

    @app.task(shared=False, name="e2e.mul", base=OJSTask)
    def mul(a: int, b: int) -> int:
        """No ``current_job()``: also runs inline, as ``starmap``/``chunks`` items do."""
        return a * b

    @app.task(shared=False, name="e2e.tsum", base=OJSTask)
    def tsum(values: list[int]) -> int:
        """A chord body: records each run, so that a test can count them."""
        record(directory, "chord_bodies", f"{current_job().job_id} {sum(values)}")
        return sum(values)

    @app.task(shared=False, name="e2e.collect", base=OJSTask)
    def collect(values: list[Any]) -> list[Any]:
        """A chord body for any results: records each run."""
        record(directory, "chord_bodies", f"{current_job().job_id} {json.dumps(values)}")
        return values

    @app.task(shared=False, name="e2e.errback")
    def errback(task_id: str) -> None:
        """An old-style ``link_error`` (called with the failed task's id)."""
        record(directory, "errbacks", task_id)

    # Celery callers keep Celery's semantics (tests/test_celery_semantics*.py).

    @app.task(shared=False, name="e2e.celery_fails", base=OJSTask, bind=True)
    def celery_fails(self: OJSTask, tag: str) -> None:
        record(directory, "celery", f"{tag} retries={self.request.retries}")
        raise ValueError(f"{tag} fails")

    @app.task(shared=False, name="e2e.celery_self_retry", base=OJSTask, bind=True)
    def celery_self_retry(self: OJSTask, tag: str) -> None:
        record(directory, "celery", f"{tag} retries={self.request.retries}")
        raise self.retry(exc=ValueError(f"{tag} not yet"), countdown=1, max_retries=2)

    @app.task(shared=False, name="e2e.celery_retry_past_limit", base=OJSTask, bind=True)
    def celery_retry_past_limit(self: OJSTask, tag: str) -> None:
        raise self.retry(args=[tag, "next"], countdown=0.1, max_retries=0)

    @app.task(shared=False, name="e2e.celery_retry_args", base=OJSTask, bind=True)
    def celery_retry_args(self: OJSTask, step: int, tag: str = "") -> str:
        record(directory, "celery", f"{tag} step={step} retries={self.request.retries}")
        if step < 2:
            raise self.retry(args=[step + 1], kwargs={"tag": tag}, countdown=0.1)
        return f"done at {step}"

    @app.task(shared=False, name="e2e.celery_autoretry", base=OJSTask, bind=True,
              autoretry_for=(ValueError,), retry_backoff=True, retry_jitter=False,
              max_retries=1)
    def celery_autoretry(self: OJSTask, tag: str) -> None:
        record(directory, "celery", f"{tag} retries={self.request.retries} at={time.time()}")
        raise ValueError(f"{tag} fails")

    @app.task(shared=False, name="e2e.celery_time_limit", base=OJSTask, soft_time_limit=1,
              time_limit=2)
    def celery_time_limit(tag: str) -> None:
        record(directory, "celery", f"{tag} attempt={current_job().attempt}")
        time.sleep(30)

    @app.task(shared=False, name="e2e.celery_hard_limit", base=OJSTask, time_limit=1)
    def celery_hard_limit(tag: str) -> None:
        record(directory, "celery", f"{tag} attempt={current_job().attempt}")
        time.sleep(30)

    @app.task(shared=False, name="e2e.busy_past_limit", base=OJSTask, time_limit=2)
    def busy_past_limit(seconds: float) -> str:
        """Computes past its hard time limit without yielding (on gevent, the limit's
        ``Timeout`` then strikes at the first switch after the handler: its outcome's write),
        and returns."""
        record(directory, "runs", f"busy_past_limit {current_job().job_id}")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "done"

    @app.task(shared=False, name="e2e.celery_retry_later", base=OJSTask, bind=True)
    def celery_retry_later(self: OJSTask, tag: str, countdown: float) -> None:
        record(directory, "celery", f"{tag} retries={self.request.retries}")
        raise self.retry(countdown=countdown)

    @app.task(shared=False, name="e2e.celery_retry_eta_text", base=OJSTask, bind=True)
    def celery_retry_eta_text(self: OJSTask, tag: str) -> int:
        """Retries once with ``eta`` as ISO 8601 text a second ahead, as Celery's retry takes it."""
        record(directory, "celery", f"{tag} retries={self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(eta=datetime.fromtimestamp(time.time() + 1, timezone.utc).isoformat())
        return int(self.request.retries)

    @app.task(shared=False, name="e2e.celery_retry_eta_and_countdown", base=OJSTask, bind=True)
    def celery_retry_eta_and_countdown(self: OJSTask, tag: str) -> int:
        """Retries once with an ``eta`` an hour ahead and a ``countdown`` of one second: in
        Celery the countdown wins."""
        record(directory, "celery", f"{tag} retries={self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(eta=datetime.fromtimestamp(time.time() + 3600, timezone.utc),
                             countdown=1)
        return int(self.request.retries)

    @app.task(shared=False, name="e2e.celery_retry_with", base=OJSTask, bind=True)
    def celery_retry_with(self: OJSTask, tag: str, value: str) -> None:
        """Retries with a keyword argument JSON cannot carry (``value``: "set", "object")."""
        record(directory, "celery", f"{tag} retries={self.request.retries}")
        bad = {"set": {1}, "object": object()}[value]
        raise self.retry(args=[tag, value], kwargs={"extra": bad}, countdown=0.1)

    @app.task(shared=False, name="e2e.celery_dies_once", base=OJSTask, bind=True)
    def celery_dies_once(self: OJSTask, tag: str) -> int:
        """Attempt 1 loses its pool child (a recovery OJS adds); then one Celery retry."""
        attempt = current_job().attempt
        record(directory, "celery", f"{tag} attempt={attempt} retries={self.request.retries}")
        if attempt == 1:
            os._exit(1)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return int(self.request.retries)

    @app.task(shared=False, name="e2e.celery_rejects_once", base=OJSTask, bind=True)
    def celery_rejects_once(self: OJSTask, tag: str) -> int:
        """Attempt 1 rejects its message with requeue (a redelivery, no Celery retry); then
        one Celery retry, allowed by ``max_retries=1`` only if the Reject did not count."""
        attempt = current_job().attempt
        record(directory, "celery", f"{tag} attempt={attempt} retries={self.request.retries}")
        if attempt == 1:
            raise Reject("not now", requeue=True)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1, max_retries=1)
        return int(self.request.retries)

    @app.task(shared=False, name="e2e.celery_headers", base=OJSTask, bind=True)
    def celery_headers(self: OJSTask, tag: str) -> str:
        """Retries once; each attempt records what it saw of the call's custom header
        ``x_tenant`` (as ``self.request.x_tenant`` and in ``self.request.headers``) and of
        its ``expires``."""
        record(directory, "celery", f"{tag} retries={self.request.retries} "
               f"tenant={self.request.get('x_tenant')} "
               f"headers={(self.request.headers or {}).get('x_tenant')} "
               f"expires={self.request.expires}")
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return str(self.request.get("x_tenant"))

    @app.task(shared=False, name="e2e.celery_lineage", base=OJSTask, bind=True)
    def celery_lineage(self: OJSTask, tag: str) -> int:
        """Retries once; each attempt records its ``parent_id`` and ``root_id``."""
        record(directory, "celery", f"{tag} retries={self.request.retries} "
               f"parent={self.request.parent_id} root={self.request.root_id}")
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return int(self.request.retries)

    @app.task(shared=False, name="e2e.celery_spawns", base=OJSTask, bind=True)
    def celery_spawns(self: OJSTask, tag: str) -> str:
        """Calls ``e2e.celery_lineage`` from inside a task: its parent."""
        return str(celery_lineage.delay(tag).id)

    @app.task(shared=False, name="e2e.celery_spawns_once", base=OJSTask)
    def celery_spawns_once(child_id: str) -> str:
        """Calls ``e2e.noop`` with a chosen id from inside a task (one pending job per id)."""
        return str(noop.apply_async(task_id=child_id).id)

    @app.task(shared=False, name="e2e.celery_request_flags", base=OJSTask, bind=True)
    def celery_request_flags(self: OJSTask, tag: str) -> int:
        """Records what Celery's request says of each attempt's message (its ``ignore_result``,
        its delivery priority); retries once; returns its job's priority."""
        info = self.request.delivery_info or {}
        record(directory, "celery", f"{tag} retries={self.request.retries} "
               f"ignore_result={self.request.ignore_result!r} priority={info.get('priority')!r}")
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return current_job().job.priority

    @app.task(shared=False, name="e2e.celery_spawns_flags", base=OJSTask)
    def celery_spawns_flags(tag: str) -> str:
        """Calls ``e2e.celery_request_flags`` from inside a task, without a priority."""
        return str(celery_request_flags.delay(tag).id)

    @app.task(shared=False, name="e2e.celery_returns_typed", base=OJSTask)
    def celery_returns_typed(year: int) -> dict[str, Any]:
        """A result Celery's JSON serializer carries as typed values."""
        return {"at": datetime(year, 1, 2, tzinfo=timezone.utc), "amount": Decimal("1.50")}

    # Arguments Celery's JSON serializer carries as typed values (a datetime, a Decimal, ...).

    @app.task(shared=False, name="e2e.typed_echo", base=OJSTask)
    def typed_echo(*values: Any, **named: Any) -> dict[str, Any]:
        """Records the arguments it got as Python sees them (``repr``: their types show)."""
        record(directory, "typed", f"echo {values!r} {named!r}")
        return {"values": list(values), "named": named}

    @app.task(shared=False, name="e2e.celery_typed_retries", base=OJSTask, bind=True)
    def celery_typed_retries(self: OJSTask, tag: str, *values: Any, **named: Any) -> Any:
        """Retries once keeping its arguments, then once with new typed ones; returns them."""
        record(directory, "typed", f"{tag} retries={self.request.retries} {values!r} {named!r}")
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        if self.request.retries == 1:
            raise self.retry(args=[tag, date(2031, 1, 1)], kwargs={"amount": Decimal("2.5")},
                             countdown=0.1)
        return {"values": list(values), "named": named}

    @app.task(shared=False, name="e2e.celery_typed_autoretry", base=OJSTask, bind=True,
              autoretry_for=(ValueError,), max_retries=1, default_retry_delay=0.1)
    def celery_typed_autoretry(self: OJSTask, tag: str, when: Any) -> Any:
        record(directory, "typed", f"{tag} retries={self.request.retries} {when!r}")
        if self.request.retries == 0:
            raise ValueError(f"{tag} not yet")
        return when

    @app.task(shared=False, name="e2e.ojs_typed", base=OJSTask, ojs_semantics=True)
    def ojs_typed(tag: str, when: Any) -> Any:
        attempt = current_job().attempt
        record(directory, "typed", f"{tag} attempt={attempt} {when!r}")
        if attempt == 1:
            raise ValueError(f"{tag} not yet")
        return when

    @app.task(shared=False, name="e2e.ojs_semantics", base=OJSTask, ojs_semantics=True)
    def ojs_semantics(tag: str) -> None:
        record(directory, "celery", f"{tag} attempt={current_job().attempt}")
        raise ValueError(f"{tag} fails")

    # Celery names beyond OJS core's patterns, routed jobs (tests/test_celery_semantics_routing).

    def where(task: Any) -> dict[str, Any]:
        """The job's queue in its record and the broker queue the message came from."""
        info = task.request.delivery_info or {}
        return {"job_queue": current_job().job.queue, "routing_key": info.get("routing_key"),
                "retries": task.request.retries}

    @app.task(shared=False, name="proj.tasks:send_mail", base=OJSTask, bind=True)
    def send_mail_colon(self: OJSTask, to: str) -> dict[str, Any]:
        return {"to": to, **where(self)}

    @app.task(shared=False, name="proj_tasks.send_mail", base=OJSTask, bind=True)
    def send_mail_underscore(self: OJSTask, to: str) -> dict[str, Any]:
        return {"to": to, **where(self)}

    @app.task(shared=False, name="e2e.routed_dict", base=OJSTask, bind=True)
    def routed_dict(self: OJSTask) -> dict[str, Any]:
        return where(self)

    @app.task(shared=False, name="e2e.glob_routed", base=OJSTask, bind=True)
    def glob_routed(self: OJSTask) -> dict[str, Any]:
        return where(self)

    @app.task(shared=False, name="e2e.fn_routed", base=OJSTask, bind=True)
    def fn_routed(self: OJSTask, route_to: str) -> dict[str, Any]:
        return where(self)

    @app.task(shared=False, name=SLOW_TYPE, base=OJSTask)
    def slow(where: str, seconds: float) -> str:
        """Returns at once; its store writes are slowed (see :func:`slow_bookkeeping`)."""
        ctx = current_job()
        record(directory, "runs", f"{SLOW_TYPE} {ctx.job_id} attempt={ctx.attempt}")
        return f"ok on {ctx.attempt}"

    def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is None or request.task.app is not app:
            return
        info = request.delivery_info or {}
        record(directory, "received",
               f"{request.id} redelivered={bool(info.get('redelivered'))}")

    signals.task_received.connect(on_received, weak=False)

    def on_postrun(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
        """What Celery made of each call in the pool child (SUCCESS, RETRY, IGNORED...)."""
        if sender is None or sender.app is not app:
            return
        record(directory, "postrun", f"{task_id} {state}")

    signals.task_postrun.connect(on_postrun, weak=False)

    def on_revoked(sender: Any = None, request: Any = None, terminated: Any = None,
                   expired: Any = None, **_: Any) -> None:
        if sender is None or sender.app is not app:
            return
        record(directory, "revoked", f"{request.id} terminated={terminated} expired={expired}")

    signals.task_revoked.connect(on_revoked, weak=False)

    def on_retry(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
        """Celery's ``task_retry``: the ``Retry`` it was told of, as the worker logs it."""
        if sender is None or sender.app is not app:
            return
        record(directory, "retry_signal", f"{request.id} {reason}")

    signals.task_retry.connect(on_retry, weak=False)

    watched = list(config.get("prerun_modules") or [])
    if watched:  # which modules a pool process has when a job reaches it, before its start

        def on_prerun(sender: Any = None, task_id: Any = None, **_: Any) -> None:
            if sender is not None and sender.app is app:
                found = " ".join(f"{name}={name in sys.modules}" for name in watched)
                record(directory, "prerun", f"{task_id} {found}")

        signals.task_prerun.connect(on_prerun, weak=False)
    return app


def route_by_kwarg(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                   **_: Any) -> dict[str, str] | None:
    """A Celery router function (``task_routes`` entry "tests.e2eapp.route_by_kwarg")."""
    if name == "e2e.fn_routed":
        return {"queue": str(kwargs["route_to"])}
    return None

def slow_bookkeeping(store: JobStore, directory: str) -> None:
    """Jobs of type SLOW_TYPE with args ``[where, seconds]`` sleep ``seconds`` in their first
    start (``where`` "start": before the write; "started": after it) or their first completion
    ("complete": before the write): a loaded machine on which a time limit fires there. With
    ``where`` "start-unanswered", the first start's write is done and its reply lost."""
    for name, places in (("start", ("start", "started")), ("complete", ("complete",))):
        original = getattr(store, name)

        def slowed(*args: Any, _original: Any = original, _places: tuple[str, ...] = places,
                   **kwargs: Any) -> Any:
            hint = kwargs.get("hint")
            job = hint.job if hint is not None else None
            if (job is None or job.type != SLOW_TYPE or job.args[0] not in _places
                    or not _first(directory, f"slowed-{job.id}")):
                return _original(*args, **kwargs)
            where, seconds = job.args[0], float(job.args[1])
            if where == "started":
                done = _original(*args, **kwargs)
                time.sleep(seconds)
                return done
            time.sleep(seconds)
            return _original(*args, **kwargs)

        setattr(store, name, slowed)

    # ["start-unanswered", 0]: the first start's write is done, and its reply lost to a timeout
    # (a store that thawed after store_timeout)
    cas = store._cas

    def unanswered(record: Any, previous: Any, deadlines: Any) -> bool:
        done = bool(cas(record, previous, deadlines))
        job = record.job
        if (done and job.type == SLOW_TYPE and job.args[0] == "start-unanswered"
                and job.state == "active" and _first(directory, f"unanswered-{job.id}")):
            raise StoreTimeout("job store error: TimeoutError: the test's lost reply")
        return done

    store._cas = unanswered  # type: ignore[method-assign]


def _first(directory: str, marker: str) -> bool:
    """True the first time ``marker`` is asked for, in any process."""
    try:
        os.close(os.open(pathlib.Path(directory) / marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


app = make_app(json.loads(os.environ["OJS_E2E_CONFIG"])) if "OJS_E2E_CONFIG" in os.environ else None
