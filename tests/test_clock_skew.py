"""Hosts whose wall clocks disagree: a worker's beats carry its own clock, a sweeper judges them
by its own (README: "Clock skew between hosts")."""

from __future__ import annotations

import pathlib

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from tests import services
from tests.e2eapp import make_app
from tests.workers import (
    ROOT,
    Beat,
    SweepLoop,
    redis_config,
    running_worker,
    unique,
    wait_for,
)

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
    sweeper = SweepLoop(runtime)
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
        sweeper.stop()
        runtime.store.clear()
        runtime.close()
        app.close()


def test_a_sweep_worker_whose_clock_is_ahead_of_beats_still_sweeps(
    tmp_path: pathlib.Path,
) -> None:
    """``celery beat`` on one host, the worker consuming the sweep queue on another whose clock
    is ahead by more than ``sweep_interval``: sweeps still run (before, every sweep message
    carried Celery's ``expires`` of one interval, stamped by beat's clock, and the worker
    discarded each as expired: no timeout was ever enforced). A job on a queue nobody consumes
    is discarded for its ``enqueue_ttl``, late by at most about the skew (a pass runs at least
    once a skew: see README "Clock skew between hosts")."""
    skew = 8.0
    config = redis_config(tmp_path, services.redis_url())
    config["ojs"].update({"sweep_interval": 0.5, "sweep_queue": unique("sweep")})
    app = make_app(config)
    runtime = get_runtime(app)
    env = {"PYTHONPATH": f"{SKEWED}:{ROOT}", "OJS_TEST_CLOCK_SKEW": str(skew)}
    sweeping = {**config, "worker_queues": [config["ojs"]["sweep_queue"]]}
    beat = None
    try:
        with running_worker(sweeping, tmp_path / "sweeper.log", concurrency=1,
                            env=env) as worker:
            beat = Beat(config, tmp_path)
            job = enqueue({"type": "e2e.add", "args": [1, 2], "queue": unique("lonely"),
                           "enqueue_ttl": 1}, app=app)
            done = wait_for(lambda: (found := runtime.store.get(job.id)) is not None
                            and found.state == "discarded" and found, 1 + 2 * skew + 10,
                            "the sweeper to discard the job for its enqueue_ttl")
            assert done.error is not None and done.error["type"] == "enqueue_ttl_expired"
            later = enqueue({"type": "e2e.add", "args": [1, 2], "queue": unique("lonely"),
                             "enqueue_ttl": 1}, app=app)  # and later passes too
            wait_for(lambda: (found := runtime.store.get(later.id)) is not None
                     and found.state == "discarded", 1 + 2 * skew + 10,
                     "a later pass to discard the second job")
            assert "Discarding revoked task: ojs_celery.sweep" not in worker.log()
    finally:
        if beat is not None:
            beat.stop()
        runtime.store.clear()
        runtime.close()
        app.close()
