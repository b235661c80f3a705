"""A project's own ``__call__`` on an OJS task: run as plain Celery runs it, in eager mode and in
a direct call (the worker's side is in ``test_e2e_features``). Each task class is built twice,
on Celery's ``Task`` and on ``OJSTask``, and both must call the same methods in the same order.

Flask's documented task class (``class FlaskTask(Task)`` whose ``__call__`` opens the app
context and calls ``self.run``) is the common case: migrated either as the base of an OJS task
(``class OJSFlaskTask(OJSTask, FlaskTask)``) or by changing its base (``FlaskTask(OJSTask)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import pytest
from celery import Celery, Task

from ojs_celery import OJSTask, current_job, install
from ojs_celery.context import maybe_current_job
from tests.test_eager import dead_port

#: What a project's ``__call__`` sets around the handler (Flask's app context, say).
opened: ContextVar[tuple[str, ...]] = ContextVar("opened", default=())


@pytest.fixture
def app() -> Iterator[Celery]:
    """An eager app whose broker and store point where nothing listens: any publish or store
    write would fail the test."""
    port = dead_port()
    app = Celery("own_calls", set_as_current=False)
    app.conf.update(broker_url=f"redis://127.0.0.1:{port}/0",
                    result_backend=f"redis://127.0.0.1:{port}/0",
                    task_always_eager=True, task_eager_propagates=True,
                    ojs={"store_url": f"redis://127.0.0.1:{port}/0"})
    install(app)
    yield app


@contextmanager
def opening(name: str) -> Iterator[None]:
    reset = opened.set((*opened.get(), name))
    try:
        yield
    finally:
        opened.reset(reset)


def hierarchies(base: type) -> dict[str, tuple[type, ...]]:
    """The ways a project's own ``__call__`` meets ``base`` (Celery's Task or OJSTask), each
    as the bases of a task class."""

    class FlaskRun(base):  # type: ignore[valid-type,misc]  # Flask's class, on ``base``
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("flask"):
                return self.run(*args, **kwargs)

    class FlaskSuper(base):  # type: ignore[valid-type,misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("flask"):
                return super().__call__(*args, **kwargs)

    class ProjectRun(Task):  # type: ignore[misc]  # Flask's class, left as it was
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("project"):
                return self.run(*args, **kwargs)

    class ProjectSuper(Task):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("project"):
                return super().__call__(*args, **kwargs)

    def after(project: type) -> tuple[type, ...]:  # class OJSFlaskTask(OJSTask, FlaskTask)
        return (project,) if base is Task else (base, project)

    class Both(*after(ProjectSuper)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("flask"):
                return super().__call__(*args, **kwargs)

    class Outer(FlaskSuper):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("outer"):
                return super().__call__(*args, **kwargs)

    class Mixin:  # no task class, before the base
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with opening("mixin"):
                return super().__call__(*args, **kwargs)  # type: ignore[misc]

    return {"after, run": after(ProjectRun), "after, super": after(ProjectSuper),
            "before, run": (FlaskRun,), "before, super": (FlaskSuper,),
            "before and after": (Both,), "two before": (Outer,), "mixin before": (Mixin, base)}


def seen_by(app: Celery, bases: tuple[type, ...], name: str) -> Any:
    @app.task(shared=False, name=name, base=type("T", bases, {}), bind=True)
    def handler(self: Task, a: int) -> dict[str, Any]:
        ctx = maybe_current_job()
        return {"opened": list(opened.get()), "a": a, "request_args": list(self.request.args or ()),
                "job": None if ctx is None else ctx.job_id, "id": self.request.id}

    return handler


KINDS = list(hierarchies(Task))


@pytest.mark.parametrize("kind", KINDS)
def test_eager_runs_the_projects_own_calls_as_celery_does_with_the_job(app: Celery,
                                                                        kind: str) -> None:
    plain_result = seen_by(app, hierarchies(Task)[kind], "own.plain").delay(4)
    ojs_result = seen_by(app, hierarchies(OJSTask)[kind], "own.ojs").delay(4)
    plain, ojs = plain_result.get(), ojs_result.get()
    assert plain["opened"] and ojs["opened"] == plain["opened"]
    assert ojs["a"] == 4 and ojs["request_args"] == plain["request_args"]
    # the request's id where Celery shows it (Celery 5.4's Task.__call__ pushes a request
    # with the arguments only, no id, where the calls reach it), and current_job() in them all
    assert ojs["id"] == ojs_result.id or plain["id"] is None
    assert ojs["job"] == ojs_result.id


@pytest.mark.parametrize("kind", KINDS)
def test_a_direct_call_runs_the_projects_own_calls_as_celery_does(app: Celery, kind: str) -> None:
    plain = seen_by(app, hierarchies(Task)[kind], "own.plain")(3)
    ojs = seen_by(app, hierarchies(OJSTask)[kind], "own.ojs")(3)
    assert ojs == plain and ojs["opened"] and ojs["job"] is None


def test_a_handler_calling_its_own_task_again_opens_the_own_call_again(app: Celery) -> None:
    """The own call runs once per call, not once per job: a direct call from inside the
    handler goes through it again, as in Celery."""
    bases = hierarchies(OJSTask)["before, super"]

    @app.task(shared=False, name="own.nested", base=type("T", bases, {}))
    def nested(depth: int) -> list[str]:
        current_job()
        return nested(depth - 1) if depth else list(opened.get())

    assert nested.delay(2).get() == ["flask", "flask", "flask"]
