"""Celery canvas with OJS tasks end to end, on Redis and RabbitMQ: ``chain``, ``group``,
``chord``, ``chunks``, ``starmap``, ``link_error``, ``si()``, with the ids Celery assigns; a
chord whose header member the sweeper times out fails instead of hanging."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from ojs_celery import callers as callers_module
from ojs_celery import get_job
from tests.conftest import Env, start_env
from tests.workers import Worker, unique, wait_for

INTERVAL = 0.5


@pytest.fixture(scope="module", params=["redis", "amqp"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp(f"canvas-{request.param}")
    overrides = {"ojs": {"sweep_interval": INTERVAL}}
    with start_env(request.param, tmp, concurrency=3, config=overrides, beat=True) as started:
        yield started


def job_of(env: Env, result: AsyncResult) -> Any:
    job = get_job(result.id, app=env.app)
    assert job is not None, f"{result.id} is not an OJS job"
    return job


def test_chain_each_link_is_an_ojs_job(env: Env) -> None:
    add = env.app.tasks["e2e.add"]
    result = chain(add.s(1, 2), add.s(3), add.s(4)).apply_async()
    assert result.get(timeout=30) == 10
    links = [result, result.parent, result.parent.parent]
    assert [job_of(env, r).state for r in links] == ["completed"] * 3
    assert [job_of(env, r).result for r in reversed(links)] == [3, 6, 10]


def test_chain_link_retries_as_its_own_job(env: Env) -> None:
    """``si()`` links: the first retries (``self.retry``), the next runs once it completed."""
    retrying, add = env.app.tasks["e2e.self_retry"], env.app.tasks["e2e.add"]
    result = chain(retrying.si(2), add.si(20, 22)).apply_async()
    assert result.get(timeout=30) == 42
    first = job_of(env, result.parent)
    assert first.state == "completed" and first.attempt == 2 and first.result == "ok on 2"
    assert job_of(env, result).attempt == 1


def test_group_chunks_and_starmap(env: Env) -> None:
    add, mul = env.app.tasks["e2e.add"], env.app.tasks["e2e.mul"]
    grouped = group(add.s(i, i) for i in range(4)).apply_async()
    assert grouped.get(timeout=30) == [0, 2, 4, 6]
    assert all(job_of(env, r).state == "completed" for r in grouped.results)
    pairs = [(i, i) for i in range(4)]
    assert mul.chunks(pairs, 2).apply_async().get(timeout=30) == [[0, 1], [4, 9]]
    assert mul.starmap([(2, 3), (4, 5)]).apply_async().get(timeout=30) == [6, 20]


def test_chord_callback_runs_once(env: Env) -> None:
    add, tsum = env.app.tasks["e2e.add"], env.app.tasks["e2e.tsum"]
    result = chord([add.s(i, i) for i in range(4)], tsum.s()).apply_async()
    assert result.get(timeout=30) == 12
    body = job_of(env, result)
    assert body.state == "completed" and body.result == 12
    runs = [line for line in env.lines("chord_bodies") if line.startswith(result.id)]
    assert runs == [f"{result.id} 12"]


def test_chord_fails_when_the_sweeper_times_out_a_header_task(
    env: Env, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker pool that cannot enforce time limits (threads): the sweeper's overdue clock
    ends the header task; the chord's body fails and its ``link_error`` runs, no hang."""
    real_parse = callers_module.parse_input

    def one_short_attempt(data: Any, **options: Any) -> Any:
        # The client side of a task with ``time_limit=1, max_retries=0`` (the option mapping
        # is the semantics item's): one attempt of 1 s.
        if isinstance(data, dict) and data.get("type") == "e2e.sleep":
            data = {**data, "timeout": 1, "grace_period": 0, "retry": {"max_attempts": 1}}
        return real_parse(data, **options)

    monkeypatch.setattr(callers_module, "parse_input", one_short_attempt)
    queue = unique("stuck")
    worker = Worker({**env.config, "worker_queues": [queue]}, tmp_path / "threads.log",
                    pool="threads")
    try:
        worker.wait_ready()
        add, sleep = env.app.tasks["e2e.add"], env.app.tasks["e2e.sleep"]
        tsum, errback = env.app.tasks["e2e.tsum"], env.app.tasks["e2e.errback"]
        header = [add.s(1, 1), sleep.s(8).set(queue=queue)]
        result = chord(header, tsum.s().on_error(errback.s())).apply_async()
        stuck_id = result.parent.results[1].id if result.parent is not None else None
        stuck = env.wait_state(stuck_id or header[1].id, "discarded", timeout=20)
        assert stuck.error is not None and stuck.error["type"] == "timeout"
        wait_for(lambda: AsyncResult(stuck.id, app=env.app).state == "FAILURE", 10,
                 "the sweeper's FAILURE in the result backend")
        wait_for(lambda: result.state == "FAILURE", 20, "the chord body to fail")
        wait_for(lambda: any(result.id in line for line in env.lines("errbacks")), 20,
                 "the chord's errback")
        assert get_job(result.id, app=env.app) is None  # the body never ran
        assert env.lines("chord_bodies") == [] or all(
            not line.startswith(result.id) for line in env.lines("chord_bodies"))
    finally:
        worker.stop()


def test_link_and_link_error_with_celery_ids(env: Env) -> None:
    """Callbacks fire once per job outcome, with the ids Celery assigned."""
    add, job_error = env.app.tasks["e2e.add"], env.app.tasks["e2e.job_error"]
    callback, errback = env.app.tasks["e2e.callback"], env.app.tasks["e2e.errback"]
    ok = add.apply_async((2, 2), link=callback.s(tag="linked"))
    failed = job_error.apply_async(("Fatal", False), link_error=errback.s())
    assert ok.get(timeout=30) == 4
    wait_for(lambda: "linked 4" in env.lines("callbacks"), 20, "the link")
    env.wait_state(failed.id, "discarded")
    wait_for(lambda: failed.id in env.lines("errbacks"), 20, "the link_error")
    assert env.lines("errbacks").count(failed.id) == 1
    assert env.lines("callbacks").count("linked 4") == 1


def test_chord_with_a_retrying_header_task_calls_its_body_once(env: Env) -> None:
    """A retried attempt writes RETRY, which does not count towards the chord: the body runs
    once, after the header task's final attempt."""
    retrying, add = env.app.tasks["e2e.self_retry"], env.app.tasks["e2e.add"]
    collect = env.app.tasks["e2e.collect"]
    result = chord([retrying.si(3), add.si(1, 1)], collect.s()).apply_async()
    assert result.get(timeout=30) == ["ok on 3", 2]
    runs = [line for line in env.lines("chord_bodies") if line.startswith(result.id)]
    assert len(runs) == 1
