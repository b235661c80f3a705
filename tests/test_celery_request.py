"""What a handler's ``self.request`` says of the call, as under plain Celery (probed on Celery
5.7 and 5.4 with a plain worker): ``ignore_result`` is the call's or the task's (``False``
by default, never ``None``), and with ``task_inherit_parent_priority`` a call made inside a
task with a priority gets that priority: its job's record keeps it, so every message of the
job has it, whoever publishes it."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from celery.result import AsyncResult

from tests.conftest import Env, start_env
from tests.workers import unique


@pytest.fixture(scope="module", params=["redis", "amqp"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp: pathlib.Path = tmp_path_factory.mktemp(f"request-{request.param}")
    with start_env(request.param, tmp, config={"celery": {"task_inherit_parent_priority": True}},
                   concurrency=2) as started:
        yield started


def _runs(env: Env, tag: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in env.lines("celery") if line.split(" ")[0] == tag]


def test_ignore_result_is_the_tasks_as_in_celery(env: Env) -> None:
    """Celery 5.7's worker showed ``None`` for an OJS job's message (its ``send_task`` sends
    what the call gave); plain Celery's ``apply_async`` sends the task's, ``False``."""
    tag = unique("flags")
    result = env.app.tasks["e2e.celery_request_flags"].delay(tag)
    assert result.get(timeout=30) == 0
    assert [line.rsplit(" ", 1)[0] for line in _runs(env, tag)] == [
        "retries=0 ignore_result=False", "retries=1 ignore_result=False"]


def test_a_call_inside_a_task_inherits_its_priority_with_the_setting(env: Env) -> None:
    """``task_inherit_parent_priority``: the child's job has its parent's priority in its
    record (it had none: the message of its first attempt got the priority from Celery's
    ``send_task``, and a message the sweeper publishes would not have it)."""
    tag = unique("inherits")
    parent = env.app.tasks["e2e.celery_spawns_flags"].apply_async((tag,), priority=5)
    child_id = parent.get(timeout=30)
    parent_priority = env.job(parent.id).priority
    assert parent_priority != 0
    assert AsyncResult(child_id, app=env.app).get(timeout=30) == parent_priority
    assert env.job(child_id).priority == parent_priority
    assert _runs(env, tag) == ["retries=0 ignore_result=False priority=5",
                               "retries=1 ignore_result=False priority=5"]
