"""``app.send_task`` by name and ``celery beat`` entries make OJS jobs (issue 11 item 1), with the
mapping ``OJSTask.apply_async`` uses: routing, time limits, ``expires``, Celery semantics; the
job is stored before its message, and a broker that is down leaves it in the outbox. A plain
task sent by name stays a plain Celery task. Real prefork workers on Redis and RabbitMQ."""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from ojs_celery import OJSTask, get_job, install
from ojs_celery.envelope import CELERY_SEMANTICS_FIELD
from ojs_celery.runtime import get_runtime
from tests.conftest import Env, start_env
from tests.workers import unique, wait_for


@pytest.fixture(scope="module", params=["redis", "amqp"])
def sent(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Env, str]]:
    """A worker consuming the default queue and one that ``task_routes`` routes to."""
    base = unique("q")
    routed = f"{base}_routed"
    config: dict[str, Any] = {
        "queue": base, "worker_queues": [base, routed],
        "celery": {"task_routes": {"e2e.routed_dict": {"queue": routed}}},
    }
    tmp = pathlib.Path(tmp_path_factory.mktemp(f"send-task-{request.param}"))
    with start_env(request.param, tmp, config=config, concurrency=2) as env:
        try:
            yield env, routed
        finally:
            with env.app.connection_for_write() as connection:
                try:
                    connection.default_channel.queue_delete(routed)
                except Exception:  # a queue the broker never made
                    pass


def test_send_task_by_name_is_an_ojs_job(sent: tuple[Env, str]) -> None:
    env, _ = sent
    result = env.app.send_task("e2e.add", args=[2, 3])
    assert isinstance(result, AsyncResult)
    assert result.get(timeout=30) == 5
    job = env.wait_state(result.id, "completed")
    assert job.attempt == 1 and job.result == 5
    assert (job.model_extra or {})[CELERY_SEMANTICS_FIELD] == {
        "max_retries": 3, "default_retry_delay": 180.0}
    assert job.timeout == get_runtime(env.app).settings.default_timeout  # no Celery limit
    assert "task e2e.add has no time limit" in env.worker.log()  # said at worker start


def test_send_task_keeps_celery_semantics_limits_and_expires(sent: tuple[Env, str]) -> None:
    env, _ = sent
    tag = unique("sent")
    failing = env.app.send_task("e2e.celery_fails", args=[tag], expires=120)
    limited = env.app.send_task("e2e.celery_time_limit", kwargs={"tag": tag})
    job = env.wait_state(failing.id, "discarded")
    assert job.attempt == 1  # an exception ends the job, as in Celery
    assert job.expires_at is not None
    wait_for(lambda: failing.state == "FAILURE", 20, "FAILURE")
    assert isinstance(failing.result, ValueError)
    job = env.wait_state(limited.id, "discarded", timeout=40)
    assert (job.timeout, job.grace_period) == (1, 1)  # soft_time_limit=1, time_limit=2
    assert job.error is not None and job.error["type"] == "timeout"


def test_send_task_routes_and_keeps_a_chosen_id(sent: tuple[Env, str]) -> None:
    env, routed = sent
    result = env.app.send_task("e2e.routed_dict")
    job = env.wait_state(result.id, "completed")
    assert job.queue == routed and job.result["routing_key"] == routed
    task_id = str(uuid.uuid4())  # a Celery id, not a UUIDv7
    assert env.app.send_task("e2e.add", args=[1, 1], task_id=task_id).id == task_id
    assert env.wait_state(task_id, "completed").result == 2


def test_a_plain_task_sent_by_name_stays_plain(sent: tuple[Env, str]) -> None:
    env, _ = sent
    result = env.app.send_task("e2e.plain", args=[7])
    assert result.get(timeout=30) == 7
    assert get_job(result.id, app=env.app) is None


def test_send_task_with_the_broker_down_leaves_the_job_in_the_outbox(
    tmp_path: pathlib.Path,
) -> None:
    app = Celery("down", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}"}
    install(app)

    @app.task(shared=False, name="down.job", base=OJSTask)
    def job_task() -> None:
        return None

    job_id = app.send_task("down.job").id  # stored before the publish: it will run
    stored = get_job(job_id, app=app)
    assert stored is not None and stored.state == "available"
    owed = get_runtime(app).store.due("dispatch", now=4e9, limit=10)
    assert [entry[0] for entry in owed] == [job_id]  # the sweeper will publish it


def test_a_beat_entry_makes_ojs_jobs(tmp_path: pathlib.Path) -> None:
    """A real ``celery beat`` with a one-second entry: each run is an OJS job."""
    config = {"celery": {"beat_schedule": {
        "every-second": {"task": "e2e.add", "schedule": 1.0, "args": [2, 3]}}}}
    with start_env("redis", tmp_path, config=config, beat=True) as env:
        runs = wait_for(lambda: (r := env.lines("runs")) and len(r) >= 2 and r, 30,
                        "two runs of the beat entry")
        for line in runs[:2]:
            job = env.wait_state(line.split()[1], "completed")
            assert job.type == "e2e.add" and job.result == 5 and job.attempt == 1
            assert CELERY_SEMANTICS_FIELD in (job.model_extra or {})
            assert AsyncResult(job.id, app=env.app).get(timeout=10) == 5
