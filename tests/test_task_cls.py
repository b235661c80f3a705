"""An app's own task class, the base of every task given no ``base=``. As an OJS task class
(Flask's documented ``FlaskTask`` as ``task_cls``, migrated by giving it OJSTask as its base),
every task given no ``base=`` is an OJS task; Celery's own tasks and the sweep stay plain Celery
tasks, as without OJS. As a plain one set as ``app.Task`` (Flask's older ``make_celery``), the
migration report names it as it names a ``task_cls``."""

from __future__ import annotations

import pathlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task

from ojs_celery import InvalidJob, OJSTask, enqueue, install
from ojs_celery.migration import build_report
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import SWEEP_TASK
from tests.conftest import start_env
from tests.e2eapp import AppContextTask, flask_app_context
from tests.workers import wait_for


def nowhere_app(**options: Any) -> Celery:
    """An eager app whose broker and store point where nothing listens: a refusal must come
    before both."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    app = Celery("task_cls", set_as_current=False, **options)
    app.conf.update(broker_url=f"redis://127.0.0.1:{port}/0", task_always_eager=True,
                    ojs={"store_url": f"redis://127.0.0.1:{port}/0"})
    return app


@pytest.fixture
def app() -> Iterator[Celery]:
    app = nowhere_app(task_cls=AppContextTask)
    install(app)

    @app.task(shared=False, name="cls.mine")
    def mine(x: int) -> int:
        return x

    @app.task(shared=False, name="cls.based", base=OJSTask)
    def based(x: int) -> int:
        return x

    app.finalize()
    yield app


def test_celerys_own_tasks_and_the_sweep_stay_plain_celery_tasks(app: Celery) -> None:
    own = [name for name in app.tasks if name.startswith("celery.")]
    assert "celery.starmap" in own and "celery.chord_unlock" in own
    for name in [*own, SWEEP_TASK]:
        assert not isinstance(app.tasks[name], OJSTask), name
        assert isinstance(app.tasks[name], Task)
    assert app.tasks["celery.chord_unlock"].max_retries is None  # its options kept
    assert isinstance(app.tasks["cls.mine"], AppContextTask)


def test_an_envelope_cannot_reach_celerys_own_tasks(app: Celery) -> None:
    """As OJS tasks, ``celery.starmap`` and its kind would run any task an envelope names."""
    envelope: dict[str, Any] = {"type": "celery.starmap",
                                "args": [{"task": "cls.mine", "args": []}, [[1]]]}
    with pytest.raises(InvalidJob) as refused:
        enqueue(envelope, app=app)
    assert [field for field, _ in refused.value.violations] == ["type"]


def test_the_migration_report_says_to_leave_out_base_ojstask(app: Celery) -> None:
    """``class OJSAppContextTask(OJSTask, AppContextTask)`` would be no class at all (no
    method order has OJSTask both before and after AppContextTask)."""
    tasks = {task.name: task for task in build_report(app).tasks}
    [lost] = [w for w in tasks["cls.based"].warnings if "task_cls" in w]
    assert "leave out base=OJSTask" in lost and "(OJSTask, AppContextTask)" not in lost
    assert not any("task_cls" in w for w in tasks["cls.mine"].warnings)


def test_a_plain_task_class_set_as_app_task_is_named_as_a_task_cls_is() -> None:
    """Flask's older ``make_celery``: ``celery.Task = ContextTask``. A task given
    ``base=OJSTask`` loses its app context; one whose base has both keeps it."""
    app = nowhere_app()

    class ContextTask(app.Task):  # type: ignore[name-defined,misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            reset = flask_app_context.set("app.Task")
            try:
                return self.run(*args, **kwargs)
            finally:
                flask_app_context.reset(reset)

    app.Task = ContextTask
    install(app)
    both = type("OJSContextTask", (OJSTask, ContextTask), {})

    def context() -> str | None:
        return flask_app_context.get()

    lost = app.task(shared=False, name="c.lost", base=OJSTask)(context)
    kept = app.task(shared=False, name="c.kept", base=both)(context)
    tasks = {task.name: task for task in build_report(app).tasks}
    [named] = [w for w in tasks["c.lost"].warnings if "task_cls" in w]
    assert "ContextTask" in named and "class OJSContextTask(OJSTask, ContextTask)" in named
    assert not any("task_cls" in w for w in tasks["c.kept"].warnings)
    assert (lost.delay().get(), kept.delay().get()) == (None, "app.Task")


def test_its_tasks_run_as_jobs_in_its_call_and_beat_sends_the_sweeps(
        tmp_path: pathlib.Path) -> None:
    with start_env("redis", tmp_path, config={"ojs_task_cls": True}, beat=True) as env:
        result = env.app.tasks["e2e.app_class"].delay(5)
        job = env.wait_state(result.id, "completed")
        assert job.result == {"x": 5, "context": "task_cls", "job": result.id}
        wait_for(get_runtime(env.app).store.meta.last_sweep, 30, "a sweep sent by celery beat")
