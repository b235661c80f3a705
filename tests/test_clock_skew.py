"""Hosts whose wall clocks disagree: a worker's beats carry its own clock, a sweeper judges them
by its own (README: "Clock skew between hosts")."""

from __future__ import annotations

import pathlib
import threading

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import run_loop
from tests import services
from tests.e2eapp import make_app
from tests.workers import ROOT, redis_config, running_worker, wait_for

SKEWED = str(ROOT / "tests" / "clockskew")


def test_a_worker_whose_clock_is_behind_is_told_why_it_is_declared_dead(
    tmp_path: pathlib.Path,
) -> None:
    """A worker whose clock is behind the sweeper's by more than ``worker_heartbeat_timeout``
    beats on schedule, yet each sweep finds its last beat too old and declares it dead. The
    worker knows its beats were not late (its monotonic clock): it says the clocks disagree,
    not that it was frozen or cut off."""
    config = redis_config(tmp_path, services.redis_url())
    config["ojs"].update({"heartbeat_interval": 0.5, "worker_heartbeat_timeout": 3.0,
                          "sweep_interval": 0.5})
    app = make_app(config)
    runtime = get_runtime(app)
    stop = threading.Event()
    sweeper = threading.Thread(target=run_loop, args=(runtime,), kwargs={"stop": stop.is_set},
                               daemon=True)
    env = {"PYTHONPATH": f"{SKEWED}:{ROOT}", "OJS_TEST_CLOCK_SKEW": "-10"}
    try:
        with running_worker(config, tmp_path / "worker.log", concurrency=1,
                            env=env) as worker:
            sweeper.start()
            job = enqueue({"type": "e2e.sleep", "args": [3.0]}, app=app)
            wait_for(lambda: "declared dead although its last beat" in worker.log(), 20,
                     "the worker to say it was declared dead although it beat")
            log = worker.log()
            assert "a sweeper's clock is ahead of this host's" in log
            assert "frozen or cut off" not in log
            wait_for(lambda: (found := runtime.store.get(job.id)) is not None
                     and found.errors, 20, "the job's attempt to fail")
            assert runtime.store.get(job.id).errors[0]["type"] == "worker_death"
    finally:
        stop.set()
        if sweeper.is_alive():
            sweeper.join(10)
        runtime.store.clear()
        runtime.close()
        app.close()
