"""Routing and names for Celery callers (issue 11 item 2): ``task_routes`` (dict, glob, router
function) and a per-call ``queue`` decide a ``.delay()`` job's queue as in Celery, and any
Celery queue or task name works, from ``.delay()`` and from an envelope."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from ojs_celery import enqueue
from tests.conftest import BROKERS, Env, start_env
from tests.workers import unique


@pytest.fixture(scope="module", params=BROKERS)
def routed(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Env, dict[str, str]]]:
    """A worker consuming the default queue and three routed queues whose names OJS core
    would refuse (``_``, ``:``, upper case). kombu's filesystem transport refuses a ``:`` in
    an exchange name (and a missing queue's exchange has the queue's name): ``.`` there."""
    base = unique("q")
    colon = "." if request.param == "filesystem" else ":"
    queues = {"dict": f"{base}_dict", "glob": f"{base}{colon}glob", "fn": f"{base}{colon}Fn_x"}
    config: dict[str, Any] = {
        "queue": base,
        "worker_queues": [base, *queues.values()],
        "celery": {"task_routes": [
            {"e2e.routed_dict": {"queue": queues["dict"]}},
            {"e2e.glob_*": {"queue": queues["glob"]}},
            "tests.e2eapp.route_by_kwarg",
        ]},
    }
    tmp = pathlib.Path(tmp_path_factory.mktemp(f"routing-{request.param}"))
    with start_env(request.param, tmp, config=config, concurrency=2) as env:
        try:
            yield env, queues
        finally:
            with env.app.connection_for_write() as connection:
                for name in queues.values():
                    try:
                        connection.default_channel.queue_delete(name)
                    except Exception:  # a queue the broker never made
                        pass


def _ran_on(env: Env, job_id: str, queue: str) -> dict[str, Any]:
    job = env.wait_state(job_id, "completed")
    assert job.queue == queue  # the record
    assert isinstance(job.result, dict)
    assert job.result["job_queue"] == queue
    assert job.result["routing_key"] == queue  # the broker queue the worker consumed
    return job.result


def test_task_routes_dict_glob_and_function(routed: tuple[Env, dict[str, str]]) -> None:
    env, queues = routed
    _ran_on(env, env.app.tasks["e2e.routed_dict"].delay().id, queues["dict"])
    _ran_on(env, env.app.tasks["e2e.glob_routed"].delay().id, queues["glob"])
    fn = env.app.tasks["e2e.fn_routed"]
    _ran_on(env, fn.delay(route_to=queues["fn"]).id, queues["fn"])


def test_a_per_call_queue_wins_over_the_routes(routed: tuple[Env, dict[str, str]]) -> None:
    env, queues = routed
    result = env.app.tasks["e2e.routed_dict"].apply_async(queue=queues["fn"])
    _ran_on(env, result.id, queues["fn"])


@pytest.mark.parametrize("name", ["proj.tasks:send_mail", "proj_tasks.send_mail"])
def test_any_task_name_via_delay_and_via_an_envelope(
    routed: tuple[Env, dict[str, str]], name: str
) -> None:
    env, queues = routed
    by_delay = env.wait_state(env.app.tasks[name].delay("a@x").id, "completed")
    assert by_delay.type == name
    assert by_delay.queue == "default"
    assert isinstance(by_delay.result, dict) and by_delay.result["to"] == "a@x"
    job = enqueue({"type": name, "args": ["b@x"], "queue": queues["glob"]}, app=env.app)
    result = _ran_on(env, job.id, queues["glob"])
    assert result["to"] == "b@x"
