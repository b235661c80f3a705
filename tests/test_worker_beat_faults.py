"""No error ends the BEAT thread: a real fault (the job store's Redis made read-only with
``REPLICAOF``, as after a failover) for a few beats, then healed. The worker keeps beating, a
sweeper running all along never declares it dead, and the job it runs completes once."""

from __future__ import annotations

import logging
import pathlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from ojs_celery import enqueue
from ojs_celery.faults import OncePerKind
from ojs_celery.runtime import get_runtime
from ojs_celery.store import StoreError, WorkerInfo
from ojs_celery.sweeper import sweep
from tests import services
from tests.e2eapp import make_app
from tests.workers import Worker, lines, redis_config, unique, wait_for

BEAT = 0.3
DEAD_AFTER = 4.0
FAULT = 6 * BEAT  # a few beats, well under DEAD_AFTER: a worker that beats again stays alive


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def private_redis(tmp_path: pathlib.Path) -> Iterator[str]:
    """A redis-server of this test's own (never the shared one: it is made to fail)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        wait_for(lambda: _pings(client), 10, "the private redis-server")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_beats_survive_a_read_only_store(tmp_path: pathlib.Path, private_redis: str) -> None:
    config = redis_config(tmp_path, services.redis_url())
    config["ojs"] = {**config["ojs"], "store_url": private_redis, "heartbeat_interval": BEAT,
                     "worker_heartbeat_timeout": DEAD_AFTER, "sweep_interval": 0.5}
    config["worker_queues"] = [unique("own")]
    app = make_app(config)
    store = get_runtime(app).store
    worker = Worker(config, tmp_path / "worker.log", concurrency=1)
    sweeping = threading.Event()
    watched: list[str] = []
    dead: list[str] = []

    def sweeper() -> None:
        """A sweeper running all along (it fails too while the store is read-only), and a
        check after each pass that the worker is still registered."""
        while not sweeping.is_set():
            try:
                sweep(get_runtime(app))
                if watched and store.workers.get(watched[0]) is None:
                    dead.append(watched[0])
            except Exception:
                pass
            sweeping.wait(0.5)

    thread = threading.Thread(target=sweeper, daemon=True)
    try:
        worker.wait_ready()
        info: WorkerInfo = wait_for(
            lambda: next((w for w in store.workers.all() if w.pid == worker.process.pid), None),
            10, "registration")
        watched.append(info.worker_id)
        thread.start()
        job = enqueue({"type": "e2e.sleep", "args": [3 * FAULT, "done"],
                       "queue": config["worker_queues"][0]}, app=app)
        wait_for(lambda: (j := store.get(job.id)) is not None and j.state == "active", 15,
                 "the job to start")
        client = redis.Redis.from_url(private_redis)
        client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # read-only now
        try:
            time.sleep(FAULT)  # the fault lasts a few beats (this is the fault, not a check)
        finally:
            client.execute_command("REPLICAOF", "NO", "ONE")
        healed_at = time.time()
        wait_for(lambda: (w := store.workers.get(info.worker_id)) is not None
                 and w.last_beat > healed_at, 5 * BEAT + 5, "a beat after healing")
        done = wait_for(lambda: (j := store.get(job.id)) is not None
                        and j.state == "completed" and j, 3 * FAULT + 15, "the job to complete")
        assert done.result == "done" and done.attempt == 1 and done.errors == []
        assert len([r for r in lines(config["dir"], "runs") if job.id in r]) == 1
        # beats go on, and a sweeper running meanwhile never declared the worker dead
        last = store.workers.get(info.worker_id)
        assert last is not None
        wait_for(lambda: (w := store.workers.get(info.worker_id)) is not None
                 and w.last_beat > last.last_beat, 5 * BEAT + 5, "beats to go on")
        assert not dead
    finally:
        sweeping.set()
        worker.stop()
        store.clear()



def test_a_loops_failures_are_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    log = OncePerKind(logging.getLogger("ojs_celery.test"), "a loop")
    with caplog.at_level(logging.WARNING, logger="ojs_celery.test"):
        for _ in range(5):
            log.failed(redis.ReadOnlyError("READONLY You can't write against a read only replica"))
        log.failed(_caused(StoreError("unavailable"), ConnectionError("refused")))
        log.failed(_caused(StoreError("unavailable"), ConnectionError("refused")))
        log.succeeded()
        log.succeeded()
        log.failed(redis.ReadOnlyError("READONLY again"))
    # a store's failure in one line; the others (here redis-py's own error) with a traceback
    assert [(r.levelno, r.exc_info is not None) for r in caplog.records] == [
        (logging.WARNING, True), (logging.WARNING, False), (logging.WARNING, False),
        (logging.WARNING, True)]


def _caused(exc: Exception, cause: Exception) -> Exception:
    exc.__cause__ = cause
    return exc
