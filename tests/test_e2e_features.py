"""End to end on Redis: Celery's own call and retry paths, fencing of duplicates and late
outcomes, and what a producer sees when something is wrong."""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Iterator

import celery.worker.loops
import pytest
from celery import Celery
from celery.result import AsyncResult

from ojs_celery import (
    DuplicateJob,
    InvalidJob,
    cancel,
    enqueue,
    enqueue_batch,
    get_job,
    install,
)
from ojs_celery.api import PUBLISH_CHUNK
from ojs_celery.effects import carry_out
from ojs_celery.envelope import CELERY_OPTIONS_FIELD, new_job_id, parse_envelope
from ojs_celery.lifecycle import Publish
from ojs_celery.producer import publish
from ojs_celery.runtime import get_runtime
from tests import services
from tests.conftest import Env, start_env
from tests.e2eapp import make_app
from tests.workers import Worker, amqp_config, filesystem_config, wait_for


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with start_env("redis", tmp_path_factory.mktemp("features"), concurrency=3) as started:
        yield started


def test_delay_on_an_ojs_task_produces_an_envelope(env: Env) -> None:
    task = env.app.tasks["e2e.echo_kwargs"]
    result = task.delay((1, 2), "x", flag=True, nested={"a": [1]})
    job = env.wait_state(result.id, "completed")
    assert job.type == "e2e.echo_kwargs"
    assert job.args == [[1, 2], "x"]
    assert job.extensions["x_celery_kwargs"] == {"flag": True, "nested": {"a": [1]}}
    assert result.get(timeout=10) == {"args": [[1, 2], "x"],
                                      "kwargs": {"flag": True, "nested": {"a": [1]}}}


def test_self_retry_and_autoretry_follow_the_ojs_policy(env: Env) -> None:
    policy = {"max_attempts": 5, "initial_interval": "PT0.1S"}
    manual = enqueue({"type": "e2e.self_retry", "args": [3], "retry": policy}, app=env.app)
    auto = enqueue({"type": "e2e.autoretry", "args": [2], "retry": policy}, app=env.app)
    capped = enqueue({"type": "e2e.autoretry", "args": [9],
                      "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}}, app=env.app)

    done = env.wait_state(manual.id, "completed")
    assert done.attempt == 3 and done.result == "ok on 3"
    assert [e["type"] for e in done.errors] == ["ValueError", "ValueError"]
    done = env.wait_state(auto.id, "completed")
    assert done.attempt == 2 and [e["type"] for e in done.errors] == ["KeyError"]
    done = env.wait_state(capped.id, "discarded")
    assert done.attempt == 2  # OJS max_attempts, not Celery's max_retries
    assert AsyncResult(manual.id, app=env.app).get(timeout=10) == "ok on 3"


def test_ignore_keeps_the_result_state_the_handler_set_else_reads_revoked(env: Env) -> None:
    """``update_state(FAILURE, ...)`` then ``Ignore`` (Celery's custom failure) keeps the
    handler's state; a bare ``Ignore`` reads REVOKED, so nothing waits on a PENDING result."""
    custom = env.app.tasks["e2e.ignore_with_state"].apply_async(args=["FAILURE"])
    progress = env.app.tasks["e2e.ignore_with_state"].apply_async(args=["PROGRESS"])
    bare = env.app.tasks["e2e.ignore"].apply_async()
    for result in (custom, progress, bare):
        env.wait_state(result.id, "cancelled")
    for result in (progress, bare):  # a report on the way is not an end: REVOKED
        wait_for(lambda r=result: AsyncResult(r.id, app=env.app).state == "REVOKED", 15,
                 "REVOKED")
    kept = AsyncResult(custom.id, app=env.app)
    assert kept.state == "FAILURE"
    assert "custom failure" in str(kept.result)


def test_reject_ignore_and_job_errors(env: Env) -> None:
    policy = {"max_attempts": 3, "initial_interval": "PT0.1S",
              "non_retryable_errors": ["billing.*"]}
    no_requeue = enqueue({"type": "e2e.reject", "args": [False], "retry": policy}, app=env.app)
    requeue = enqueue({"type": "e2e.reject", "args": [True], "retry": policy}, app=env.app)
    ignored = enqueue({"type": "e2e.ignore", "args": []}, app=env.app)
    final = enqueue({"type": "e2e.job_error", "args": ["quota", False], "retry": policy},
                    app=env.app)
    listed = enqueue({"type": "e2e.job_error", "args": ["billing.declined", True],
                      "retry": policy}, app=env.app)

    job = env.wait_state(no_requeue.id, "discarded")
    assert job.attempt == 1 and job.error is not None and job.error["type"] == "Reject"
    job = env.wait_state(requeue.id, "discarded")
    assert job.attempt == 3  # retried per policy, never requeued with a stale token
    job = env.wait_state(ignored.id, "cancelled")
    assert job.attempt == 1
    job = env.wait_state(final.id, "discarded")
    assert job.attempt == 1 and job.error is not None and job.error["type"] == "quota"
    job = env.wait_state(listed.id, "discarded")
    assert job.attempt == 1 and job.error is not None and job.error["type"] == "billing.declined"


def test_message_published_twice_runs_the_handler_once(env: Env) -> None:
    callback = env.app.tasks["e2e.callback"].s(tag="twice")
    result = env.app.tasks["e2e.sleep"].apply_async(args=[1.0, "once"], link=callback)
    job = env.job(result.id)
    publish(get_runtime(env.app), job, Publish(job.id, token=1))  # the same message again

    env.wait_state(job.id, "completed")
    wait_for(lambda: len([r for r in env.lines("received") if job.id in r]) == 2, 10,
             "both copies received")
    assert len([r for r in env.lines("runs") if job.id in r]) == 1
    wait_for(lambda: any(c.startswith("twice ") for c in env.lines("callbacks")), 10, "link")
    assert [c for c in env.lines("callbacks") if c.startswith("twice ")] == ['twice "once"']
    assert result.get(timeout=10) == "once"


def test_a_batch_over_one_pipeline_runs_every_job_once(env: Env) -> None:
    """A batch reaches a Redis broker in pipelines of ``PUBLISH_CHUNK`` messages (kombu 5.7 and
    later): every job of a batch over that size runs once, and no outbox entry is left."""
    count = PUBLISH_CHUNK + 10
    jobs = enqueue_batch([{"type": "e2e.add", "args": [n, 1000]} for n in range(count)],
                         app=env.app)
    for job in jobs:
        assert env.wait_state(job.id, "completed", timeout=120).result == job.args[0] + 1000
    ids = {job.id for job in jobs}
    assert sorted(line for line in env.lines("runs") if line.split()[-1] in ids) == sorted(
        f"add {job_id}" for job_id in ids)
    runtime = get_runtime(env.app)
    runtime.flush()
    assert not ids & {job_id for job_id, _ in runtime.store.due("dispatch", 1e12, 10_000)}


def test_cancel_stops_the_running_attempt_and_reports_revoked(env: Env) -> None:
    callback = env.app.tasks["e2e.callback"].s(tag="cancelled")
    result = env.app.tasks["e2e.sleep"].apply_async(args=[60, "late"], link=callback)
    env.wait_state(result.id, "active")
    wait_for(lambda: [r for r in env.lines("runs") if result.id in r], 15, "the handler to run")
    pid = int(next(r for r in env.lines("runs") if result.id in r).rsplit("pid=", 1)[1])

    cancelled = cancel(result.id, app=env.app)
    assert cancelled.state == "cancelled"
    assert AsyncResult(result.id, app=env.app).state == "REVOKED"  # as after Celery's revoke

    wait_for(lambda: not _alive(pid), 15, "the pool process running the attempt to be stopped")
    assert not [f for f in env.lines("finished") if result.id in f]
    assert env.job(result.id).state == "cancelled"
    assert not [c for c in env.lines("callbacks") if c.startswith("cancelled ")]
    # the bus is batched: the event is awaited, not assumed delivered by now
    wait_for(lambda: "job.cancelled" in env.events.types(result.id), 15, "job.cancelled")
    assert "job.completed" not in env.events.types(result.id)
    after = env.app.tasks["e2e.add"].delay(1, 2)  # the worker replaced the pool process
    assert env.wait_state(after.id, "completed").result == 3


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_unknown_type_and_plain_task_are_rejected_before_anything_is_stored(env: Env) -> None:
    for job_type in ("e2e.missing", "e2e.plain"):
        with pytest.raises(InvalidJob) as raised:
            enqueue({"type": job_type, "args": [1], "id": "01a1fc00-0000-7000-8000-000000000001"},
                    app=env.app)
        assert raised.value.violations[0][0] == "type"
        assert "not an OJS task" in str(raised.value)
    assert get_job("01a1fc00-0000-7000-8000-000000000001", app=env.app) is None


def test_duplicate_id_is_rejected(env: Env) -> None:
    job = enqueue({"type": "e2e.add", "args": [1, 1]}, app=env.app)
    with pytest.raises(DuplicateJob, match="exists already"):
        enqueue({"type": "e2e.add", "args": [1, 2], "id": job.id.upper()}, app=env.app)
    again = enqueue({"type": "e2e.add", "args": [1, 1], "id": job.id.upper()}, app=env.app)
    assert again.id == job.id  # the same envelope again: the job that exists


def test_an_envelope_cannot_choose_a_callback(env: Env) -> None:
    job_id = new_job_id()
    link = {"task": "e2e.callback", "args": [], "kwargs": {"tag": "hijack"}, "options": {},
            "subtask_type": None, "immutable": False}
    with pytest.raises(InvalidJob) as raised:
        enqueue({"type": "e2e.add", "args": [1, 2], "id": job_id, "x_celery_link": link},
                app=env.app)
    assert [path for path, _ in raised.value.violations] == ["x_celery_link"]
    assert get_job(job_id, app=env.app) is None

    after = enqueue({"type": "e2e.add", "args": [2, 2]}, app=env.app)
    env.wait_state(after.id, "completed")
    assert not [r for r in env.lines("received") if job_id in r]  # nothing was published
    assert not [c for c in env.lines("callbacks") if c.startswith("hijack")]


def test_apply_async_links_travel_with_the_job_and_fire_once(env: Env) -> None:
    callback = env.app.tasks["e2e.callback"].s(tag="retried")
    result = env.app.tasks["e2e.self_retry"].apply_async(args=[2], link=callback)
    job = env.wait_state(result.id, "completed")
    assert job.attempt == 2  # the second attempt's message was published from the store
    assert job.extensions[CELERY_OPTIONS_FIELD]["link"]["task"] == "e2e.callback"
    wait_for(lambda: any(c.startswith("retried ") for c in env.lines("callbacks")), 10, "link")
    assert [c for c in env.lines("callbacks") if c.startswith("retried ")] == [
        'retried "ok on 2"']


def test_package_exceptions_raised_in_a_prefork_child_do_not_stop_the_worker(env: Env) -> None:
    names = ["InvalidJob", "DuplicateJob", "JobError", "StoreError", "BrokerUnavailable",
             "JobNotFound", "NotInstalled", "NoCurrentJob"]
    jobs = [enqueue({"type": "e2e.raise_package_error", "args": [name],
                     "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}},
                    app=env.app) for name in names]
    for job, name in zip(jobs, names, strict=True):
        done = env.wait_state(job.id, "discarded")
        assert done.error is not None
        assert done.error["type"] == ("declined" if name == "JobError" else name)
    for job in jobs:  # the main process got each outcome whole and reported it to Celery
        wait_for(lambda j=job: AsyncResult(j.id, app=env.app).state == "FAILURE", 15,
                 "the result backend to show the failure")
    after = enqueue({"type": "e2e.add", "args": [3, 4]}, app=env.app)
    assert env.wait_state(after.id, "completed").result == 7


def test_an_exception_awkward_to_record_fails_the_attempt_with_its_own_error(env: Env) -> None:
    """Its text escaped or cut to OJS's bounds: not a job left active until it stalls."""
    kinds = ["surrogate", "unprintable", "huge"]
    jobs = [enqueue({"type": "e2e.raise_awkward", "args": [kind], "retry": {"max_attempts": 1}},
                    app=env.app) for kind in kinds]
    errors = {kind: env.wait_state(job.id, "discarded").error
              for kind, job in zip(kinds, jobs, strict=True)}
    assert errors["surrogate"] is not None and errors["unprintable"] is not None
    assert errors["surrogate"]["type"] == "ValueError"
    assert errors["surrogate"]["message"] == "bad \\udc80 text"
    assert errors["unprintable"]["type"] == "Unprintable"
    assert "could not be read" in str(errors["unprintable"]["message"])
    huge = errors["huge"]
    assert huge is not None and huge["type"] == "ValueError"
    assert 1000 < len(str(huge["message"])) <= 10_000
    backtrace = huge["backtrace"]
    assert isinstance(backtrace, list) and sum(len(str(line)) for line in backtrace) <= 10_000


def test_a_result_utf8_cannot_encode_fails_the_attempt_as_any_result_json_cannot_carry(
        env: Env) -> None:
    """A result with a lone surrogate (a file name that is not UTF-8, as ``os.fsdecode`` gives
    it) is JSON to Python's ASCII-only encoder but not UTF-8 text the store can write: it
    fails the attempt with the result's ``TypeError``, as a NaN does, not with a
    ``UnicodeEncodeError`` quoting the job's JSON while the job stays active."""
    result = env.app.tasks["e2e.return_undecodable_name"].delay()
    job = env.wait_state(result.id, "discarded", timeout=30)
    assert job.error is not None and job.error["type"] == "TypeError"
    assert "UTF-8" in str(job.error["message"])
    wait_for(lambda: result.state == "FAILURE", 20, "the result backend to show the failure")
    assert isinstance(result.result, TypeError)
    assert str(result.result).startswith("result is not JSON-serialisable: ")


def test_a_task_called_directly_in_a_job_retries_as_celery_does_not_the_job(env: Env) -> None:
    """A task called as a function inside a job's handler: its ``self.retry`` raises the
    ``exc`` as Celery's does in a direct call. It took the running job for its own: the job's
    attempt was retried with the called task's new arguments."""
    job_id = env.app.tasks["e2e.calls_directly"].delay(1).id
    job = env.wait_state(job_id, "completed", "retryable", "discarded")
    assert (job.state, job.attempt, job.result) == ("completed", 1, "caught could not with 1")


def test_a_final_job_error_is_final_under_autoretry_for_exception(env: Env) -> None:
    result = env.app.tasks["e2e.final_under_autoretry"].apply_async()
    job = env.wait_state(result.id, "discarded")
    assert job.attempt == 1 and job.error is not None and job.error["type"] == "declined"
    assert [line for line in env.lines("runs") if result.id in line] == [
        f"final_under_autoretry {result.id}"]


def test_self_replace_fails_the_job_at_once_saying_it_is_not_supported(env: Env) -> None:
    """Not a DuplicateJob of the replacement, nor a job cancelled behind a result that waits
    for ever."""
    result = env.app.tasks["e2e.replacer"].apply_async(args=[5])
    job = env.wait_state(result.id, "discarded")
    assert job.attempt == 1 and job.error is not None
    assert job.error["type"] == "replace_unsupported"
    assert "self.replace() is not supported" in str(job.error["message"])
    with pytest.raises(Exception, match=r"self\.replace"):
        result.get(timeout=15)


def test_invalid_job_from_a_retry_of_an_unmigrated_message_does_not_stop_the_worker(
    env: Env,
) -> None:
    tag = new_job_id()
    env.app.send_task("e2e.retry_unmigrated", args=[tag], queue=env.config["queue"])
    wait_for(lambda: f"retry_unmigrated {tag}" in env.lines("runs"), 15, "the handler to run")
    after = enqueue({"type": "e2e.add", "args": [5, 6]}, app=env.app)
    assert env.wait_state(after.id, "completed").result == 11  # the worker still consumes


def test_enqueue_stores_a_job_whose_broker_is_down_for_the_sweeper(tmp_path: pathlib.Path) -> None:
    app = Celery("down", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}"}
    install(app)

    @app.task(shared=False, name="down.job", base=__import__("ojs_celery").OJSTask)
    def job_task() -> None:
        return None

    job_id = enqueue({"type": "down.job", "args": []}, app=app).id  # stored: it will run
    stored = get_job(job_id, app=app)
    assert stored is not None and stored.state == "available"
    owed = get_runtime(app).store.due("dispatch", now=4e9, limit=10)
    assert [entry[0] for entry in owed] == [job_id]  # the sweeper will publish it


def test_solo_pool_worker_warns_that_time_limits_are_not_enforced(
    tmp_path: pathlib.Path,
) -> None:
    worker = Worker(filesystem_config(tmp_path), tmp_path / "solo.log", pool="solo")
    try:
        worker.wait_ready()
        assert "the solo pool does not enforce soft and hard time limits" in worker.log()
    finally:
        worker.stop()


@pytest.mark.parametrize("heartbeat", [None, 0])
def test_a_gevent_worker_on_rabbitmq_warns_of_celerys_stall_unless_heartbeats_are_off(
    tmp_path: pathlib.Path, heartbeat: int | None,
) -> None:
    """Celery 5.7's synloop waits 0.1 s after each message on a green pool with AMQP heartbeats
    (about 10 tasks a second, docs/celery-notes.md): the worker says so at its start, with the
    setting that avoids it, and says nothing once it is set."""
    pytest.importorskip("gevent")
    config = amqp_config(tmp_path, services.amqp_url(), services.postgres_url())
    if heartbeat is not None:
        config["celery"] = {"broker_heartbeat": heartbeat}
    worker = Worker(config, tmp_path / "gevent.log", pool="gevent", concurrency=5)
    try:
        worker.wait_ready()
        stalls = hasattr(celery.worker.loops, "_quick_drain")
        warned = "worker will take about 10 tasks a second" in worker.log()
        assert warned == (stalls and heartbeat is None), worker.log()[-3000:]
        app = make_app(config)
        job = enqueue({"type": "e2e.add", "args": [2, 3]}, app=app)
        wait_for(lambda: (got := get_job(job.id, app=app)) is not None
                 and got.state == "completed", 30, "the job to run")
    finally:
        worker.stop()


def test_a_message_written_by_hand_with_a_jobs_id_and_token_does_not_run_it(env: Env) -> None:
    """The record is the authority: a message naming a stored job's id and token, but another
    task or other arguments (written by whoever can publish to the broker), is dropped without
    touching the job, which then runs from its own message with its own arguments."""
    runtime = get_runtime(env.app)
    created = runtime.store.create(parse_envelope({"type": "e2e.add", "args": [1, 2]}))
    assert created.record is not None
    job_id = created.record.job.id  # stored, its own message not published yet
    forged = {"ojs": {"token": 1, "created_at": time.time()}}
    env.app.send_task("e2e.sleep", args=[0.1], task_id=job_id, headers=forged)
    env.app.send_task("e2e.add", args=[100, 200], task_id=job_id, headers=forged)
    wait_for(lambda: sum(f"{job_id} IGNORED" in line for line in env.lines("postrun")) == 2,
             30, "both forged messages to be dropped")
    stored = env.job(job_id)
    assert (stored.state, stored.attempt) == ("available", 0)
    assert not [line for line in env.lines("runs") if job_id in line]

    carry_out(runtime, created)  # the job's own message
    assert env.wait_state(job_id, "completed").result == 3


def test_a_calls_ignore_result_is_kept_as_celery_keeps_it(env: Env) -> None:
    """``apply_async(ignore_result=True)``: the result backend is not written (the job's record
    keeps the result), and the ``AsyncResult`` says it is ignored, as under plain Celery."""
    add = env.app.tasks["e2e.add"]
    ignored = add.apply_async((2, 3), ignore_result=True)
    kept = add.apply_async((4, 5))
    assert ignored.ignored and not kept.ignored
    assert env.wait_state(ignored.id, "completed").result == 5
    assert kept.get(timeout=30) == 9
    wait_for(lambda: f"{ignored.id} SUCCESS" in env.lines("postrun"), 30,
             "task_postrun, which fires after Celery would have stored the result")
    assert AsyncResult(ignored.id, app=env.app).state == "PENDING"


def test_a_project_base_class_call_runs_as_under_celery(env: Env) -> None:
    """``class ProjectOJSTask(OJSTask, ProjectBase)``: the project's ``__call__`` (after OJSTask
    in the method order) wraps the handler in the worker, as Celery's worker calls it, and the
    handler still sees its request."""
    result = env.app.tasks["e2e.project"].delay(7)
    job = env.wait_state(result.id, "completed")
    assert job.result == {"a": 7, "id": result.id, "args": [7]}
    assert f"e2e.project {result.id}" in env.lines("project_calls")


@pytest.mark.parametrize("spelling", ["run", "super"])
def test_a_task_class_whose_own_call_comes_first_runs_its_jobs_fenced(env: Env,
                                                                     spelling: str) -> None:
    """Flask's task class with OJSTask as its base (``class FlaskTask(OJSTask)``, its own
    ``__call__`` before OJSTask's): each attempt starts and ends in the store, inside the
    class's ``__call__`` (the app context), once per attempt, Celery's retry included."""
    name = f"e2e.flask_{spelling}"
    result = env.app.tasks[name].delay(7, retries=1)
    job = env.wait_state(result.id, "completed")
    assert job.result == {"a": 7, "context": name, "job": result.id, "id": result.id}
    assert job.attempt == 2 and result.get(timeout=10) == job.result
    assert [line for line in env.lines("own_calls") if result.id in line] == [
        f"{name} {result.id}"] * 2
    assert [line for line in env.lines("runs") if result.id in line] == [
        f"{name} {result.id} attempt=1", f"{name} {result.id} attempt=2"]


def test_a_direct_call_has_its_request_as_under_celery(env: Env) -> None:
    project = env.app.tasks["e2e.project"]
    assert project(3) == {"a": 3, "id": None, "args": [3]}  # request.args set, as Celery sets it


def test_celerys_revoke_cancels_the_job_and_terminate_stops_it(env: Env) -> None:
    """``app.control.revoke(id)`` of an OJS job cancels it in the store (it would otherwise wait
    on, and run once the worker's revoked set is gone); with ``terminate=True`` the running
    attempt is stopped, although pool processes ignore Celery's SIGTERM for the drain."""
    waiting = env.app.tasks["e2e.add"].apply_async((1, 2), countdown=3)
    env.app.control.revoke(waiting.id)
    assert env.wait_state(waiting.id, "cancelled", timeout=30).state == "cancelled"
    assert AsyncResult(waiting.id, app=env.app).state == "REVOKED"
    assert not [line for line in env.lines("runs") if waiting.id in line]

    running = env.app.tasks["e2e.sleep"].apply_async(args=[60, "revoked"])
    env.wait_state(running.id, "active")
    wait_for(lambda: [r for r in env.lines("runs") if running.id in r], 15, "the handler to run")
    pid = int(next(r for r in env.lines("runs") if running.id in r).rsplit("pid=", 1)[1])
    env.app.control.revoke(running.id, terminate=True)
    wait_for(lambda: not _alive(pid), 15, "the pool process running the attempt to be stopped")
    assert env.wait_state(running.id, "cancelled").state == "cancelled"
    assert not [f for f in env.lines("finished") if running.id in f]


def test_a_plain_tasks_terminate_stops_it_as_in_celery(env: Env) -> None:
    """A task without OJSTask on a worker with ``install``: ``revoke(terminate=True)`` (and
    Flower's terminate, ``celery control terminate``) stops it, as under plain Celery, although
    the worker's pool processes ignore SIGTERM for the drain. It used to run on to its end,
    reported REVOKED, then SUCCESS over it."""
    running = env.app.tasks["e2e.plain_sleep"].apply_async(args=[60])
    wait_for(lambda: [r for r in env.lines("runs") if running.id in r], 15, "the task to run")
    pid = int(next(r for r in env.lines("runs") if running.id in r).rsplit("pid=", 1)[1])
    env.app.control.revoke(running.id, terminate=True)
    wait_for(lambda: not _alive(pid), 15, "the pool process running the task to be stopped")
    assert AsyncResult(running.id, app=env.app).state == "REVOKED"
    assert not [f for f in env.lines("finished") if running.id in f]


def test_a_terminate_with_the_soft_limit_signal_cancels_rather_than_times_out(
    env: Env,
) -> None:
    """``revoke(id, terminate=True, signal="SIGUSR1")``, Celery's way to let a handler clean
    up (it raises ``SoftTimeLimitExceeded`` in it): the job is cancelled and reads REVOKED,
    not discarded with a ``timeout`` it never had; the pool process lives on."""
    running = env.app.tasks["e2e.sleep"].apply_async(args=[60, "revoked"])
    env.wait_state(running.id, "active")
    wait_for(lambda: [r for r in env.lines("runs") if running.id in r], 15, "the handler to run")
    pid = int(next(r for r in env.lines("runs") if running.id in r).rsplit("pid=", 1)[1])
    env.app.control.revoke(running.id, terminate=True, signal="SIGUSR1")
    wait_for(lambda: f"{running.id} IGNORED" in env.lines("postrun"), 15,
             "the handler's late outcome to be rejected")
    done = env.job(running.id)
    assert done.state == "cancelled" and done.errors == []
    assert AsyncResult(running.id, app=env.app).state == "REVOKED"
    assert _alive(pid)


@pytest.mark.parametrize("kind", ["amqp", "redis"])
def test_the_rpc_result_backend_gets_the_result_of_a_job_retried_by_its_worker(
    kind: str, tmp_path: pathlib.Path,
) -> None:
    """``rpc://`` sends a result to the caller's queue named by the message's ``reply_to``.
    A retry's message is published by the worker: it must name the caller's queue, as
    Celery's own retry does, not the worker's (the caller then waited for ever)."""
    with start_env(kind, tmp_path, config={"result_backend": "rpc://"}, concurrency=1) as env:
        result = env.app.tasks["e2e.self_retry"].apply_async(args=[2])
        assert result.get(timeout=30) == "ok on 2"
        assert env.job(result.id).attempt == 2
