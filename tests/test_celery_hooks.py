"""Differential: the same tasks under plain Celery and with ``base=OJSTask`` (``install(app)``),
each on a real prefork ``celery worker`` (Redis broker and result backend), and what a user of
each sees compared: the task class's hooks and their arguments (an exception in
``before_start`` included), a project's own worker ``Request`` class at a hard time limit,
Celery's signals, the result backend (``track_started``, ``update_state``, ``ignore_result``,
``forget``, a failure's traceback) and the task events (``argsrepr``/``kwargsrepr``, Celery's
way to hide arguments).

The differences that are the OJS design (README, "Celery callers": ``shadow``, a terminated
attempt's ``task_postrun``, the traceback's OJS frames above the handler's) are not compared.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery

import ojs_celery
from ojs_celery import get_job
from ojs_celery.migration import build_report
from ojs_celery.testing import CeleryProcess
from tests import services
from tests.hooksapp import make_app, seen
from tests.test_task_events import task_events
from tests.workers import ROOT, forget_redis_names, unique, wait_for

pytestmark = pytest.mark.timeout(120)

MODES = ("plain", "ojs")


@dataclass
class Side:
    """One side of the comparison: its app, its worker and the task events it saw."""

    mode: str
    config: dict[str, Any]
    app: Celery
    worker: CeleryProcess
    events: list[dict[str, Any]]

    def observed(self) -> list[dict[str, Any]]:
        return seen(self.config["dir"])

    def events_of(self, task_id: str, type_: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("uuid") == task_id and e["type"] == type_]


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Side]]:
    """A plain Celery worker and an OJS one, started together, each with ``-E``."""
    url = services.redis_url()
    started: dict[str, Side] = {}
    with ExitStack() as stack:
        names: list[str] = []  # filled below; removed last, once the workers are stopped
        stack.callback(forget_redis_names, url, names)
        for mode in MODES:
            directory = tmp_path_factory.mktemp(f"hooks-{mode}")
            config = {"ojs": mode == "ojs", "queue": unique("q"), "broker_url": url,
                      "result_backend": url, "event_exchange": unique("ev"),
                      "dir": str(directory),
                      "store": {"store_url": url, "store_prefix": unique("t")}}
            names += [config["queue"], config["event_exchange"],
                      config["store"]["store_prefix"]]
            app = make_app(config)
            events = stack.enter_context(task_events(app))
            env = {**os.environ, "OJS_HOOKS_CONFIG": json.dumps(config),
                   "PYTHONPATH": str(ROOT)}
            worker = CeleryProcess(
                ["-A", "tests.hooksapp:app", "worker", "--pool", "prefork", "--concurrency",
                 "2", "--loglevel", "INFO", "-E", "--queues", config["queue"], "--hostname",
                 f"{unique('w')}@%h", "--without-gossip", "--without-mingle"],
                directory / "worker.log", env, cwd=ROOT)
            stack.callback(worker.stop)
            started[mode] = Side(mode, config, app, worker, events)
        for side in started.values():
            side.worker.wait_ready(60)
        yield started


def both(sides: dict[str, Side], call: Any) -> dict[str, Any]:
    """``call(app)`` on each side, the plain one first."""
    return {mode: call(sides[mode].app) for mode in MODES}


def comparable(observations: list[dict[str, Any]]) -> Counter[str]:
    """Observations as a multiset, without what differs between any two runs (ids, host
    names, the text of a traceback)."""
    counted: Counter[str] = Counter()
    for observation in observations:
        item = dict(observation)
        if isinstance(item.get("einfo"), list):
            item["einfo"] = item["einfo"][0]
        item.pop("frames", None)
        request = item.get("request")
        if isinstance(request, dict):
            item["request"] = {name: (value if name in ("retries", "delivery_info", "is_eager",
                                                        "ignore_result") else value is not None)
                               for name, value in request.items()}
        counted[json.dumps(item, sort_keys=True)] += 1
    return counted


def observed_alike(sides: dict[str, Side], call: Any, runs: int) -> dict[str, Any]:
    """Run ``call(app)`` on each side and return what it returned; assert that the hooks and
    signals of its ``runs`` task runs (attempts) were called alike on both sides, once the
    last run's ``task_postrun`` (the last of them) was seen."""
    first = {mode: len(side.observed()) for mode, side in sides.items()}
    returned = both(sides, call)
    seen_: dict[str, list[dict[str, Any]]] = {}
    for mode, side in sides.items():
        def done(side: Side = side, mode: str = mode) -> bool:
            seen_[mode] = side.observed()[first[mode]:]
            return sum(o["what"] == "task_postrun" for o in seen_[mode]) >= runs
        wait_for(done, 15, f"{runs} task_postrun ({mode})")
    plain, ojs = (comparable(seen_[mode]) for mode in MODES)
    assert ojs == plain, {"only plain": plain - ojs, "only ojs": ojs - plain}
    return returned


def test_hooks_and_signals_get_the_arguments_plain_celery_gives_them(
        sides: dict[str, Side]) -> None:
    """``before_start``, ``on_success``, ``on_failure``, ``on_retry``, ``after_return`` and
    ``task_received``/``prerun``/``postrun``/``success``/``failure``/``retry``: the same calls
    with the same arguments (the request's fields in a hook included), for a success, a
    failure, a ``self.retry``, a retry past ``max_retries`` and an exception in ``throws``."""

    def run(app: Celery) -> list[str]:
        calls = [app.tasks["d.ok"].apply_async((1, 2), {"k": 3}),
                 app.tasks["d.fail"].delay(5, k="x"),
                 app.tasks["d.retry_once"].delay(7),
                 app.tasks["d.always_retry"].delay(0),
                 app.tasks["d.expected"].delay()]
        return [repr(call.get(timeout=30, propagate=False)) for call in calls]

    results = observed_alike(sides, run, runs=7)
    assert results["ojs"] == results["plain"]
    failures = [o for o in sides["ojs"].observed() if o["what"] == "on_failure"]
    assert failures and all(o["frames"] for o in failures)  # the handler's own frames


def test_an_exception_in_before_start_fails_the_job_as_it_fails_the_task(
        sides: dict[str, Side]) -> None:
    """Celery fails a task whose class's ``before_start`` raises, without running it (and
    calls ``on_failure``, ``after_return``, ``task_failure``); the OJS job ends as it would on
    the handler's exception: discarded with that error, not waiting in the store for ever."""

    def run(app: Celery) -> dict[str, Any]:
        refused = app.tasks["d.guarded"].delay(3)
        return {"id": refused.id, "result": repr(refused.get(timeout=30, propagate=False)),
                "state": refused.state}

    results = observed_alike(sides, run, runs=1)
    assert results["plain"]["state"] == results["ojs"]["state"] == "FAILURE"
    assert results["plain"]["result"] == results["ojs"]["result"] == (
        "PermissionError('refused before start')")
    for side in sides.values():
        assert not [o for o in side.observed() if o == {"what": "ran", "name": "d.guarded"}]
    job = wait_for(lambda: (found := get_job(results["ojs"]["id"], app=sides["ojs"].app))
                   and found.state != "available" and found, 15, "the job's end")
    assert (job.state, job.attempt, (job.error or {}).get("type")) == (
        "discarded", 1, "PermissionError")


def test_a_retry_from_a_task_failure_receiver_is_said_to_retry_nothing(
        sides: dict[str, Side]) -> None:
    """A ``task_failure`` receiver that calls ``sender.retry()`` (a project's "retry every
    failed task", as ibutsu-server has) re-runs the task under plain Celery, whose retry
    publishes the same task id again. Under OJS the job's outcome is written when the receiver
    runs, and the same id is the same job: nothing runs again. That is said in an ERROR line
    naming the job (it was silent: the log said ``Retry in 0s`` and no attempt came)."""

    def run(app: Celery) -> str:
        result = app.tasks["d.retried_by_receiver"].delay()
        return result.id

    ids = both(sides, run)
    ran = {"what": "ran", "name": "d.retried_by_receiver"}
    wait_for(lambda: sides["plain"].observed().count(ran) == 3, 30, "plain Celery's 3 runs")
    job = wait_for(lambda: (found := get_job(ids["ojs"], app=sides["ojs"].app))
                   and found.state == "discarded" and found, 15, "the job's end")
    assert job.attempt == 1
    line = f"job {ids['ojs']}: self.retry() outside its handler"
    wait_for(lambda: line in sides["ojs"].worker.log(), 15, "the ERROR line")
    assert sides["ojs"].observed().count(ran) == 1


def test_the_result_backend_shows_what_it_shows_under_plain_celery(
        sides: dict[str, Side]) -> None:
    """``track_started`` (STARTED, its pid and hostname), ``update_state`` (PROGRESS and its
    meta in ``.info``), ``ignore_result`` with and without ``store_errors_even_if_ignored``,
    ``forget``, ``get(propagate=False)`` and ``.traceback`` of a failure, the ``children`` of
    a task that called another, ``starmap`` and ``chunks``."""

    def run(app: Celery) -> dict[str, Any]:
        seen_: dict[str, Any] = {}
        directory = pathlib.Path(app.conf.hooks_dir)
        for name, state in (("d.started", "STARTED"), ("d.progress", "PROGRESS")):
            flag = directory / unique("flag")
            running = app.tasks[name].delay(str(flag))
            wait_for(lambda running=running, state=state: running.state == state,
                     15, f"{name} {state}")
            info = running.info
            seen_[name] = [running.state, sorted(info) if name == "d.started" else info]
            flag.touch()
            seen_[name].append(running.get(timeout=20))
        failed = app.tasks["d.fail"].delay(1)
        seen_["failure"] = [repr(failed.get(timeout=20, propagate=False)), failed.state,
                            (failed.traceback or "").strip().splitlines()[-1]]
        quiet_fail, quiet_ok = app.tasks["d.quiet_fail"].delay(), app.tasks["d.quiet_ok"].delay()
        done = app.tasks["d.ok"].delay(4, 4)
        seen_["forgotten"] = done.get(timeout=20)
        done.forget()
        seen_["forgotten_state"] = done.state
        seen_["quiet_fail"] = [wait_for(lambda: quiet_fail.state != "PENDING" and quiet_fail.state,
                                        15, "quiet_fail's error"), repr(quiet_fail.result)]
        seen_["quiet_ok"] = [quiet_ok.ignored, quiet_ok.state]
        seen_["starmap"] = app.tasks["d.ok"].starmap([(1, 1), (2, 2)]).delay().get(timeout=20)
        parent = app.tasks["d.parent"].delay()
        parent.get(timeout=20)
        seen_["children"] = [child.get(timeout=20) for child in parent.children or []]
        seen_["chunks"] = app.tasks["d.ok"].chunks([(1, 1), (2, 2), (3, 3)], 2).delay().get(
            timeout=20)
        return seen_

    for side in sides.values():
        side.app.conf.hooks_dir = side.config["dir"]
    seen_ = both(sides, run)
    assert seen_["ojs"] == seen_["plain"]
    assert seen_["plain"]["d.progress"][:2] == ["PROGRESS", {"done": 1, "of": 2}]
    assert seen_["plain"]["d.started"][:2] == ["STARTED", ["hostname", "pid"]]


def test_a_calls_argsrepr_and_kwargsrepr_hide_its_arguments_as_in_celery(
        sides: dict[str, Side]) -> None:
    """Celery's way to keep sensitive arguments out of its events, logs, ``inspect`` and
    Flower: ``apply_async(argsrepr=..., kwargsrepr=...)``. The events of an OJS job show them,
    as plain Celery's do, and so do its retries' (Celery's own retry shows the arguments
    again); without them the arguments read as Celery writes a call's, ``(1, 2)``."""
    hidden = {"argsrepr": "(<secret>,)", "kwargsrepr": "{'token': <hidden>}"}

    def run(app: Celery) -> dict[str, str]:
        return {"hidden": app.tasks["d.ok"].apply_async((1, 2), {"k": 3}, **hidden).id,
                "shown": app.tasks["d.ok"].delay(1, 2).id,
                "retried": app.tasks["d.retry_once"].apply_async((7,), **hidden).id}

    ids = both(sides, run)
    for mode, side in sides.items():
        for task_id in ids[mode].values():
            side.app.AsyncResult(task_id).get(timeout=30)

    def shown(mode: str, key: str, type_: str) -> list[tuple[str, str]]:
        side = sides[mode]
        return wait_for(lambda: [(e["args"], e["kwargs"]) for e in side.events_of(
            ids[mode][key], type_)], 15, f"{type_} of {key} ({mode})")

    for type_ in ("task-sent", "task-received"):
        assert shown("plain", "hidden", type_) == [("(<secret>,)", "{'token': <hidden>}")]
        assert shown("ojs", "hidden", type_) == shown("plain", "hidden", type_)
        assert shown("ojs", "shown", type_) == shown("plain", "shown", type_) == [
            ("(1, 2)", "{}")]
    received = wait_for(lambda: len(sides["ojs"].events_of(ids["ojs"]["retried"],
                                                           "task-received")) == 2 and
                        shown("ojs", "retried", "task-received"), 15, "the retry's event")
    assert set(received) == {("(<secret>,)", "{'token': <hidden>}")}


def test_track_started_leaves_a_cancelled_jobs_result_revoked_when_its_message_arrives(
        sides: dict[str, Side]) -> None:
    """``track_started``: Celery's trace writes STARTED before the task's ``__call__``, where
    the store decides whether the attempt starts. A job cancelled while its message waits
    (``ojs_celery.cancel``: REVOKED at once) keeps REVOKED when the message reaches the worker
    and is dropped, as a plain task revoked by Celery keeps it; STARTED is written for an
    attempt that starts (the result backend test above)."""
    side = sides["ojs"]
    flag = pathlib.Path(side.config["dir"]) / unique("flag")
    flag.touch()
    waiting = side.app.tasks["d.started"].apply_async((str(flag),), countdown=1)
    ojs_celery.cancel(waiting.id, app=side.app)
    assert waiting.state == "REVOKED"
    wait_for(lambda: {"what": "task_postrun", "name": "d.started", "args": [str(flag)],
                      "kwargs": {}, "retval": ["Ignore", ""], "state": "IGNORED"}
             in side.observed(), 15, "the cancelled job's message to be dropped")
    assert side.app.AsyncResult(waiting.id).state == "REVOKED"


def test_the_migration_report_still_names_an_ojs_tasks_track_started() -> None:
    """OJS keeps an OJS task's ``track_started`` (option or ``task_track_started``) in
    ``ojs_track_started`` and turns Celery's off; the migration report reads the task's own."""
    app = Celery("tracked", set_as_current=False)
    app.conf.update(broker_url="memory://", task_track_started=True,
                    ojs={"store_url": "sqlite:///:memory:"})
    ojs_celery.install(app)

    @app.task(name="tracked.ojs", base=ojs_celery.OJSTask, time_limit=5, shared=False)
    def tracked() -> None:
        return None

    @app.task(name="tracked.plain", shared=False)
    def plain() -> None:
        return None

    app.finalize()
    task = app.tasks["tracked.ojs"]
    assert (task.track_started, task.ojs_track_started) == (False, True)
    assert app.tasks["tracked.plain"].track_started is True  # plain tasks keep Celery's
    report = {task.name: task.warnings for task in build_report(app).tasks}
    for name in ("tracked.ojs", "tracked.plain"):
        assert any(w.startswith("track_started=True") for w in report[name]), report[name]


def test_a_project_request_class_runs_its_hooks_and_the_ojs_job_still_ends(
        sides: dict[str, Side]) -> None:
    """A project's task class with its own worker ``Request`` (Celery's "custom requests"):
    at a hard time limit its ``on_timeout`` and ``on_failure`` run in the worker's main process
    as under plain Celery, whether OJSTask comes before the project class or after it, and the
    OJS job ends on its timeout (OJS's own request handles the attempt)."""
    names = ("d.timed_first", "d.timed_last")

    def run(app: Celery) -> list[tuple[str, str]]:
        calls = [app.tasks[name].delay(5) for name in names]
        return [(call.id, repr(call.get(timeout=30, propagate=False))) for call in calls]

    results = both(sides, run)
    for mode in MODES:  # the limit as the call gave it, 1 (not 1.0)
        assert [ended for _, ended in results[mode]] == ["TimeLimitExceeded(1)"] * 2

    def hooks(side: Side) -> Counter[str]:
        return Counter(f"{o['what']} {o['name']}" for o in side.observed()
                       if o["what"].startswith("request.") and o["name"] in names)

    expected = Counter(f"request.{hook} {name}" for hook in ("on_timeout", "on_failure")
                       for name in names)
    for side in sides.values():
        wait_for(lambda side=side: hooks(side) == expected, 15,
                 f"the request hooks ({side.mode}): {hooks(side)}")
    ojs = sides["ojs"]
    for job_id, _ in results["ojs"]:
        job = wait_for(lambda job_id=job_id: (found := get_job(job_id, app=ojs.app))
                       and found.state == "discarded" and found, 15, f"job {job_id}'s end")
        assert (job.error or {}).get("type") == "timeout"


# ------------------------------------------------------------------ the task class, unit by unit


def bound_task(base: type, name: str, **options: Any) -> Any:
    """A task of ``base`` on an app of its own (no broker is reached), bound as a worker's."""
    app = Celery(unique("hooks"), broker="memory://", set_as_current=False)

    def body() -> None:
        pass

    app.task(name=name, base=base, shared=False, **options)(body)
    app.finalize()
    return app.tasks[name]


def test_a_project_class_naming_celerys_own_request_gets_ojs_request() -> None:
    """A project base class that names Celery's own Request (``Request =
    "celery.worker.request:Request"``) before OJSTask made a class of both, which has no method
    order: the app did not load (TypeError)."""
    from celery import Task

    from ojs_celery.request import OJSRequest

    class Base(Task):  # type: ignore[misc]
        Request = "celery.worker.request:Request"

    task = bound_task(type("ProjectOJSTask", (Base, ojs_celery.OJSTask), {}), "h.celerys")
    assert task.Request is OJSRequest


def test_a_projects_own_subclass_of_ojs_request_is_used_wherever_its_class_stands() -> None:
    from celery import Task

    from ojs_celery.request import OJSRequest

    class ProjectRequest(OJSRequest):  # type: ignore[misc]
        pass

    class Base(Task):  # type: ignore[misc]
        Request = ProjectRequest

    task = bound_task(type("OJSProjectTask", (ojs_celery.OJSTask, Base), {}), "h.after")
    assert task.Request is ProjectRequest  # it was OJS's own: the project's hooks were dropped


def test_a_before_start_that_refuses_stops_its_subclasses_before_start_too() -> None:
    """Two class-based tasks, one a subclass of the other, each registered (so each class is
    bound): the subclass's ``before_start`` calls its base's, whose exception ends both, as in
    Celery (the base's own wrapper kept it, and the subclass's code went on)."""
    said: list[str] = []

    class Base(ojs_celery.OJSTask):
        name = "h.base"

        def run(self) -> None:
            pass

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            said.append("base")
            raise ValueError("refused")

    class Child(Base):
        name = "h.child"

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            super().before_start(task_id, args, kwargs)
            said.append("child went on")

    app = Celery(unique("hooks"), broker="memory://", set_as_current=False)
    app.register_task(Base())
    child = app.register_task(Child())
    child.push_request(id="t1", is_eager=False)
    try:
        child.before_start("t1", (), {})
        raised = getattr(child.request, "ojs_before_start_raised", None)
    finally:
        child.pop_request()
    assert said == ["base"]
    assert isinstance(raised, ValueError)


@pytest.mark.parametrize(("task_ignores", "call_asks", "ignored"), [
    (True, None, True), (True, False, False), (False, True, True), (False, None, False)])
def test_track_started_reads_ignore_result_as_celery_does(
    task_ignores: bool, call_asks: bool | None, ignored: bool
) -> None:
    """The call's own ``ignore_result``, else the task's: a message without one (Celery 5.7's
    ``send_task`` sends None) of a task with ``ignore_result=True`` wrote STARTED, which stayed
    for ever."""
    from ojs_celery.task import _ignores_result

    task = bound_task(ojs_celery.OJSTask, unique("h.ignore"), ignore_result=task_ignores)
    request: dict[str, Any] = {"id": "t2"}
    if call_asks is not None:
        request["ignore_result"] = call_asks
    task.push_request(**request)
    try:
        assert _ignores_result(task) is ignored
    finally:
        task.pop_request()
