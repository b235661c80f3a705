"""The switch-over (issue 11 item 5): messages published before ``install()`` still run, with
their Celery retries; ``task_create_missing_queues=False``; stale sweep messages are dropped.

Real ``celery worker`` and ``celery beat`` subprocesses run ``tests/switchover_app.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

import ojs_celery
from ojs_celery.install import check_sweep_queue, is_stale_sweep
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import SWEEP_TASK
from tests import services
from tests.switchover_app import make_app
from tests.workers import (
    ROOT,
    amqp_config,
    filesystem_config,
    forget_redis_names,
    lines,
    redis_config,
    unique,
    wait_for,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["filesystem", "redis", "amqp"])
def config(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[dict[str, Any]]:
    kind = request.param
    if kind == "filesystem":
        yield filesystem_config(tmp_path)
        return
    urls = ([services.redis_url()] if kind == "redis"
            else [services.amqp_url(), services.postgres_url()])
    for url, port in zip(urls, (6379,) if kind == "redis" else (5672, 5432), strict=True):
        reason = services.unreachable(url, port)
        if reason:
            if services.services_required():
                pytest.fail(reason)
            pytest.skip(reason)
    cfg = (redis_config(tmp_path, urls[0]) if kind == "redis"
           else amqp_config(tmp_path, urls[0], urls[1]))
    cfg["ojs"]["sweep_queue"] = unique("sweep")  # shared servers: no other run's sweeps
    yield cfg
    store = get_runtime(make_app(cfg)).store
    store.clear()
    drop = getattr(store, "drop_tables", None)
    if drop is not None:
        drop()
    names = [cfg["queue"], cfg["event_exchange"], cfg["ojs"]["sweep_queue"]]
    if kind == "redis":
        forget_redis_names(urls[0], [*names, cfg["ojs"]["store_prefix"]])
    else:
        with Connection(urls[0]) as connection:
            channel = connection.default_channel
            for name in names[::2]:
                try:
                    channel.queue_delete(name)
                except Exception:
                    channel = connection.channel()


@contextmanager
def celery(config: dict[str, Any], *args: str, ready: str | None = " ready.") -> Iterator[
        subprocess.Popen[bytes]]:
    """``celery -A tests.switchover_app:app ARGS`` as a subprocess (stopped with SIGTERM)."""
    log = pathlib.Path(config["dir"]) / f"{args[0]}-{unique('')}.log"
    env = {**os.environ, "OJS_SWITCH_CONFIG": json.dumps(config), "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.switchover_app:app", *args,
             "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    process.log = log  # type: ignore[attr-defined]
    try:
        if ready:
            wait_for(lambda: ready in log.read_text(errors="replace")
                     or process.poll() is not None, 30, f"{args[0]} ready")
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)


def worker_args(config: dict[str, Any], *queues: str) -> list[str]:
    return ["worker", "--pool", "solo", "--queues", ",".join(queues or [config["queue"]]),
            "--hostname", f"{unique('w')}@%h", "--without-gossip", "--without-mingle"]


def plain_app(config: dict[str, Any]) -> Celery:
    """The app as it was before the switch: the same tasks, ``install`` never called."""
    return make_app(config, ojs=False)


def test_messages_published_before_install_run_with_their_retries(
        config: dict[str, Any]) -> None:
    """A message without an ``ojs`` header runs as the plain Celery task it was sent as: its
    ``self.retry()`` publishes plain messages again (it raised InvalidJob in the child before),
    bounded by Celery's ``max_retries``; the worker goes on consuming OJS jobs."""
    before = plain_app(config)
    ok = before.tasks["switch.flaky"].delay(2)
    exhausted = before.tasks["switch.flaky"].delay(10)  # max_retries=3
    app = make_app(config)
    with celery(config, *worker_args(config)):
        assert ok.get(timeout=60) == "ok after 2"
        with pytest.raises(ValueError, match="not yet"):
            exhausted.get(timeout=60, propagate=True)
        runs = [line for line in lines(config["dir"], "runs") if ok.id in line]
        assert runs == [f"flaky {ok.id} retries={n}" for n in range(3)]
        assert len([line for line in lines(config["dir"], "runs") if exhausted.id in line]) == 4
        assert ojs_celery.get_job(ok.id, app=app) is None  # not adopted: a plain task
        job = app.tasks["switch.add"].delay(2, 3)  # an OJS job after the plain ones
        assert job.get(timeout=60) == 5
        assert ojs_celery.get_job(job.id, app=app).state == "completed"  # type: ignore[union-attr]


def test_missing_queues_off_sweep_queue_declared(config: dict[str, Any]) -> None:
    """With ``task_create_missing_queues=False`` a worker consuming the sweep queue starts and
    beat's sweeps reach it (before, both stopped at start)."""
    config = {**config, "ojs": {**config["ojs"], "sweep_interval": 0.5},
              "celery": {**config.get("celery", {}), "task_create_missing_queues": False}}
    app = make_app(config)
    sweep_queue = get_runtime(app).settings.sweep_queue
    assert sweep_queue in app.amqp.queues and config["queue"] in app.amqp.queues
    schedule = pathlib.Path(config["dir"]) / "beat-schedule"
    with celery(config, *worker_args(config, config["queue"], sweep_queue)), \
            celery(config, "beat", "--schedule", str(schedule), "--pidfile", "",
                   ready="beat: Starting"):
        wait_for(lambda: any("applied" in line for line in lines(config["dir"], "sweeps")),
                 30, "a sweep pass from beat")


def test_declared_queues_gain_the_sweep_queue(tmp_path: pathlib.Path) -> None:
    config = filesystem_config(tmp_path)
    config["declared_queues"] = [config["queue"], "reports_daily"]
    config["celery"] = {"task_create_missing_queues": False}
    app = make_app(config)
    assert [q.name for q in app.conf.task_queues] == [config["queue"], "reports_daily",
                                                      "ojs.sweep"]
    assert check_sweep_queue(app, "ojs.sweep") is None
    problem = check_sweep_queue(app, "elsewhere")
    assert problem is not None and "Queue('elsewhere')" in problem and "task_queues" in problem


def test_stale_sweep_messages_collapse_into_one_pass(config: dict[str, Any]) -> None:
    """Sweep messages that waited longer than an interval (a sweep worker that was down, a
    scheduler such as django-celery-beat's that drops ``expires``) do not run late in a burst:
    the oldest runs one pass, the rest, published before it started, are dropped."""
    config = {**config, "ojs": {**config["ojs"], "sweep_interval": 1}}
    app = make_app(config)
    sweep_queue = get_runtime(app).settings.sweep_queue
    for _ in range(5):  # no expires: as DatabaseScheduler sends them
        app.send_task(SWEEP_TASK, queue=sweep_queue)
    time.sleep(1.5)  # older than one interval before any worker sees them
    with celery(config, *worker_args(config, sweep_queue)):
        wait_for(lambda: len(lines(config["dir"], "sweeps")) >= 5, 30, "five sweep messages")
        outcomes = [json.loads(line) for line in lines(config["dir"], "sweeps")]
    assert sum(1 for o in outcomes if o.get("skipped") == "stale") == 4
    assert sum(1 for o in outcomes if "applied" in o) == 1


def test_late_sweep_without_a_newer_pass_still_runs(tmp_path: pathlib.Path) -> None:
    """A late message is dropped only when a pass started after it was sent: a sweep worker
    that is always behind is never starved."""
    app = make_app(filesystem_config(tmp_path))
    runtime = get_runtime(app)
    now = time.time()
    assert not is_stale_sweep(runtime, now - 100, now)  # no sweep ever ran
    runtime.store.meta.record_sweep(now - 50)
    assert is_stale_sweep(runtime, now - 100, now)
    assert not is_stale_sweep(runtime, now - 40, now)  # no pass since it was sent
    assert not is_stale_sweep(runtime, now - 0.5, now)  # fresh
    assert not is_stale_sweep(runtime, None, now)  # sent without the stamp
