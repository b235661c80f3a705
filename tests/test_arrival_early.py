"""A message that reaches a worker before its job's record is written (the overlapped Redis
enqueue publishes while its insert is in flight) is not dropped while the record may still
come: it waits, or goes back to the broker, and the job runs once. Only a message older than
``arrival.ORPHAN_AFTER`` whose record never comes is dropped, as an orphan."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ojs_celery import arrival, enqueue, parse_envelope
from ojs_celery import header as ojs_header
from ojs_celery.runtime import get_runtime
from tests.conftest import Env, start_env
from tests.workers import wait_for


@pytest.fixture(scope="module", params=["filesystem", "redis"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One worker per broker for the module: each test counts only its own job's lines."""
    tmp = tmp_path_factory.mktemp(f"early-{request.param}")
    with start_env(request.param, tmp, concurrency=1) as started:
        yield started


def received(env: Env, job_id: str) -> int:
    return sum(1 for line in env.lines("received") if line.startswith(job_id))


def test_a_message_ahead_of_its_record_runs_once_the_record_is_written(env: Env) -> None:
    job = parse_envelope({"type": "e2e.add", "args": [5, 6]})
    header = ojs_header.build(job, 1)
    env.app.send_task("e2e.add", args=job.args, task_id=job.id, queue=env.config["queue"],
                      headers={"ojs": header})
    wait_for(lambda: received(env, job.id) >= 2, 20, "the message to go back and come again")
    store = get_runtime(env.app).store
    created = store.create(job)  # the insert lands late
    assert created.record is not None
    store.ack_dispatch(job.id, created.record.token)

    done = env.wait_state(job.id, "completed")
    assert done.result == 11 and done.attempt == 1
    assert env.lines("runs").count(f"add {job.id}") == 1


def test_an_old_message_without_a_record_is_dropped_as_an_orphan(env: Env) -> None:
    job = parse_envelope({"type": "e2e.add", "args": [1, 1]})
    header = {**ojs_header.build(job, 1), "created_at": time.time() - arrival.ORPHAN_AFTER - 5}
    env.app.send_task("e2e.add", args=job.args, task_id=job.id, queue=env.config["queue"],
                      headers={"ojs": header})
    wait_for(lambda: any(line.startswith(job.id) for line in env.lines("postrun")), 20,
             "the orphan to be dropped")
    after = enqueue({"type": "e2e.add", "args": [2, 2]}, app=env.app)
    assert env.wait_state(after.id, "completed").result == 4  # the worker keeps consuming
    assert [line.split()[1] for line in env.lines("postrun") if line.startswith(job.id)] == [
        "IGNORED"]
    assert received(env, job.id) == 1
    assert get_runtime(env.app).store.get(job.id) is None
