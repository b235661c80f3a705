"""Server-side enforcement end to end: real workers and a real ``celery beat`` scheduling the
sweep every 0.5 s, on Redis and RabbitMQ. Bounds are deadline + interval + generous slack."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from ojs_celery import enqueue
from ojs_celery.envelope import format_epoch, parse_envelope
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import MAX_BACKOFF
from tests.conftest import Env, start_env
from tests.e2eapp import make_app
from tests.workers import ROOT, Worker, filesystem_config, unique, wait_for

CLI = str(pathlib.Path(sys.executable).parent / "ojs-celery")

INTERVAL = 0.5
SLACK = 3.0


@pytest.fixture(scope="module", params=["redis", "amqp"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp(f"sweep-{request.param}")
    overrides = {"ojs": {"sweep_interval": INTERVAL, "schedule_horizon": 1.0}}
    with start_env(request.param, tmp, concurrency=3, config=overrides, beat=True) as started:
        yield started


def elapsed_since_created(env: Env, job_id: str) -> float:
    job = env.job(job_id)
    assert job.created_at is not None and job.completed_at is not None
    return job.completed_at.timestamp() - job.created_at.timestamp()


def test_enqueue_ttl_on_a_queue_no_worker_consumes(env: Env, tmp_path: pathlib.Path) -> None:
    lonely = unique("lonely")
    job = enqueue({"type": "e2e.add", "args": [1, 2], "queue": lonely, "enqueue_ttl": 1},
                  app=env.app)
    done = env.wait_state(job.id, "discarded", timeout=1 + INTERVAL + SLACK + 2)
    assert done.error is not None and done.error["type"] == "enqueue_ttl_expired"
    assert done.error["timeout_kind"] == "enqueue_ttl" and done.error["limit_seconds"] == 1
    assert elapsed_since_created(env, job.id) <= 1 + INTERVAL + SLACK
    env.wait_events(job.id, lambda t: "job.ttl_expired" in t)

    late = Worker({**env.config, "worker_queues": [lonely]}, tmp_path / "late.log")
    try:
        late.wait_ready()
        wait_for(lambda: any(job.id in line for line in env.lines("received")), 15,
                 "the late worker to receive the message")
        wait_for(lambda: f"{job.id} IGNORED" in env.lines("postrun"), 10,
                 "the message to be dropped (Celery's IGNORED: the handler never ran)")
    finally:
        late.stop()
    assert not [line for line in env.lines("runs") if job.id in line]
    assert env.job(job.id).state == "discarded"


def test_total_timeout_holds_across_attempts_and_backoffs(env: Env) -> None:
    job = enqueue({"type": "e2e.fail_until", "args": [99], "timeout": 1, "total_timeout": 3,
                   "retry": {"max_attempts": 50, "initial_interval": "PT0.3S",
                             "backoff_coefficient": 1.0, "jitter": False}}, app=env.app)
    done = env.wait_state(job.id, "discarded", timeout=3 + INTERVAL + SLACK + 2)
    assert done.error is not None and done.error["type"] == "total_timeout"
    assert done.error["timeout_kind"] == "total"
    assert 1 < done.attempt < 50  # total_timeout took precedence over max_attempts
    assert elapsed_since_created(env, job.id) <= 3 + INTERVAL + SLACK
    env.wait_events(job.id, lambda t: "job.total_timeout" in t and "job.discarded" in t)


def test_scheduled_job_beyond_the_horizon_is_published_when_due(env: Env) -> None:
    due = time.time() + 3
    job = enqueue({"type": "e2e.add", "args": [2, 2], "scheduled_at":
                   format_epoch(due)}, app=env.app)
    assert job.state == "scheduled"
    done = env.wait_state(job.id, "completed", timeout=3 + INTERVAL + SLACK + 2)
    assert done.started_at is not None
    assert due <= done.started_at.timestamp() <= due + INTERVAL + SLACK
    assert done.result == 4


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_execution_timeout_on_pools_without_time_limits(
    env: Env, pool: str, tmp_path: pathlib.Path
) -> None:
    queue = unique("stuck")
    config = {**env.config, "worker_queues": [queue]}
    workers = ([Worker(config, tmp_path / f"{pool}{i}.log", pool="solo") for i in range(2)]
               if pool == "solo" else [Worker(config, tmp_path / "threads.log", pool="threads")])
    try:
        for worker in workers:
            worker.wait_ready()
        # Stuck for 8 s: well past the timeout's enforcement (1 + 1.5 + a sweep interval).
        job = enqueue({"type": "e2e.stuck_first", "args": [8], "queue": queue, "timeout": 1,
                       "grace_period": 0, "retry": {"max_attempts": 2,
                                                    "initial_interval": "PT0.1S"}},
                      app=env.app)
        done = env.wait_state(job.id, "completed", timeout=1 + 1.5 + INTERVAL + SLACK + 3)
        assert done.attempt == 2 and done.result == "ok on 2"
        assert done.errors[0]["type"] == "timeout"
        assert done.errors[0]["timeout_kind"] == "execution"
        env.wait_events(job.id, lambda t: "job.timeout" in t)
        wait_for(lambda: any(job.id in line for line in env.lines("finished")), 20,
                 "the stuck attempt to finish")
        wait_for(lambda: f"{job.id} IGNORED" in env.lines("postrun"), 10,
                 "its late result to be rejected (Celery's IGNORED: nothing reported)")
        final = env.job(job.id)
        assert final.state == "completed" and final.result == "ok on 2" and final.attempt == 2
    finally:
        for worker in workers:
            worker.stop()


@contextlib.contextmanager
def private_redis(tmp: pathlib.Path) -> Iterator[tuple[str, redis.Redis]]:
    """A redis-server of this test alone, on a free port, that it may break."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    try:
        wait_for(lambda: _pings(client), 10, "the private redis-server to start")
        yield f"redis://127.0.0.1:{port}/0", client
    finally:
        client.close()
        server.terminate()
        server.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_the_sweep_loop_survives_a_read_only_store_and_sweeps_after_the_heal(
    tmp_path: pathlib.Path,
) -> None:
    """A failover leaves the store read-only (every write gets READONLY): the loop process
    stays up, and once the store is writable again it enforces the timeout it could not."""
    with private_redis(tmp_path) as (url, client):
        config = filesystem_config(tmp_path)
        config["ojs"] = {**config["ojs"], "store_url": url, "store_prefix": unique("ro"),
                         "events": False}
        app = make_app(config)
        store = get_runtime(app).store
        job = parse_envelope({"type": "e2e.add", "args": [1, 2], "timeout": 1,
                              "grace_period": 0, "retry": {"max_attempts": 1}})
        store.create(job)
        assert store.start(job.id, 1, "a-worker-that-froze").applied
        client.execute_command("REPLICAOF", "127.0.0.1", "1")  # nobody there: stays read-only
        loop = subprocess.Popen(
            [CLI, "-A", "tests.e2eapp:app", "sweep", "--loop", "--interval", "0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "OJS_E2E_CONFIG": json.dumps(config), "PYTHONPATH": str(ROOT)},
        )
        try:
            # The execution deadline (1 s + the 1.5 s tolerance) passes while writes fail.
            time.sleep(1 + 1.5 + 2)
            assert loop.poll() is None, loop.stderr.read() if loop.stderr else ""
            assert store.get(job.id).state == "active"  # type: ignore[union-attr]
            client.execute_command("REPLICAOF", "NO", "ONE")
            done = wait_for(lambda: (j := store.get(job.id)) and j.state == "discarded" and j,
                            MAX_BACKOFF + SLACK + 5, "the healed loop to enforce the timeout")
            assert done.error is not None and done.error["type"] == "timeout"
            assert loop.poll() is None
        finally:
            loop.terminate()
            loop.wait(10)
            store.clear()
            store.close()


def test_sweeps_send_no_celery_task_events(tmp_path: pathlib.Path) -> None:
    """A worker with Celery's task events on (``-E``, for Flower or ``celery events``) sends
    them for the app's tasks, not for a sweep every ``sweep_interval``, which would push the
    app's own tasks out of a monitor's memory."""
    with start_env("redis", tmp_path, beat=True, extra=["-E"]) as env:
        names: dict[str, str] = {}
        seen: list[dict[str, object]] = []

        def on_event(event: dict[str, object]) -> None:
            if event.get("type") == "task-received":
                names[str(event["uuid"])] = str(event.get("name"))
            seen.append(event)

        def listen() -> None:
            with env.app.connection_for_read() as connection:
                receiver = env.app.events.Receiver(connection, handlers={"*": on_event})
                with contextlib.suppress(TimeoutError, OSError):
                    receiver.capture(limit=None, timeout=20, wakeup=False)

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        runtime = get_runtime(env.app)
        first = wait_for(runtime.store.meta.last_sweep, 20, "a sweep")
        job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=env.app)
        env.wait_state(job.id, "completed")
        wait_for(lambda: (runtime.store.meta.last_sweep() or 0) > first + 2, 20,
                 "two more sweeps")
        wait_for(lambda: any(e.get("type") == "task-succeeded" and e.get("uuid") == job.id
                             for e in seen), 10, "the job's task-succeeded event")
        assert names.get(job.id) == "e2e.add"
        assert "ojs_celery.sweep" not in names.values()
