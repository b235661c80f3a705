"""Helpers for end-to-end tests: broker configs, real ``celery worker`` subprocesses, waiting."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ojs_celery.embedded import embedded_settings
from ojs_celery.runtime import Runtime
from ojs_celery.sweeper import run_loop
from ojs_celery.testing import CeleryProcess

ROOT = pathlib.Path(__file__).resolve().parent.parent
T = TypeVar("T")


#: Every name this test process made with :func:`unique` or gave a worker (queues, exchanges,
#: key prefixes): what the session's end removes from the shared Redis and RabbitMQ
#: (:func:`forget_made`), whatever a test's own cleanup missed.
MADE: set[str] = set()


def unique(prefix: str) -> str:
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    MADE.add(name)
    return name


def forget_made(redis_url: str | None, amqp_url: str | None) -> None:
    """Remove what carries a name of :data:`MADE` from the shared servers (None: not
    reachable, skipped): Redis keys and binding-expiry members (:func:`forget_redis_names`);
    RabbitMQ queues and exchanges of those names. Other runs' names are never touched. Best
    effort: a failure is reported, not raised."""
    names = sorted(name for name in MADE if name)
    if not names:
        return
    if redis_url is not None:
        try:
            forget_redis_names(redis_url, names)
        except Exception as exc:
            print(f"tests: could not remove this run's Redis keys: {exc!r}")
    if amqp_url is not None:
        _forget_in_rabbitmq(amqp_url, names)


def _forget_in_rabbitmq(amqp_url: str, names: list[str]) -> None:
    from kombu.connection import Connection

    try:
        with Connection(amqp_url, connect_timeout=5) as connection:
            channel = connection.channel()
            for name in names:
                for delete in ("queue_delete", "exchange_delete"):
                    try:
                        getattr(channel, delete)(name)
                    except connection.channel_errors:  # not there: the channel is closed
                        channel = connection.channel()
    except Exception as exc:
        print(f"tests: could not remove this run's RabbitMQ queues: {exc!r}")


def filesystem_config(tmp: pathlib.Path) -> dict[str, Any]:
    """Embedded default: filesystem broker, SQLite store and results. No server."""
    (tmp / "files").mkdir(parents=True, exist_ok=True)
    settings = embedded_settings(tmp)
    return {
        "queue": unique("q"),
        "dir": str(tmp / "files"),
        "broker_url": settings["broker_url"],
        "broker_transport_options": settings["broker_transport_options"],
        "result_backend": settings["result_backend"],
        "ojs": settings["ojs"],
    }


#: Results of test jobs expire from the shared Redis soon after the run (Celery's default is
#: a day); a test reads a job's result within seconds of its end.
TEST_RESULT_EXPIRES = 600


def redis_config(tmp: pathlib.Path, redis_url: str) -> dict[str, Any]:
    """Redis broker, Redis result backend, Redis job store (unique prefix and queue)."""
    (tmp / "files").mkdir(parents=True, exist_ok=True)
    queue = unique("q")
    return {
        "queue": queue,
        "dir": str(tmp / "files"),
        "broker_url": redis_url,
        "broker_transport_options": {},
        "result_backend": redis_url,
        "event_exchange": unique("ev"),
        "ojs": {"store_url": redis_url, "store_prefix": unique("t")},
        "celery": {"result_expires": TEST_RESULT_EXPIRES},
    }


def forget_redis_names(redis_url: str, names: list[str]) -> None:
    """Delete what a test left in the shared Redis under its unique ``names`` (kombu's
    queue and binding keys, event exchanges, job stores), and those names' members of kombu's
    binding-expiry index; other runs' keys are never touched. Keys are matched as bytes: a
    shared Redis may hold keys that are not UTF-8."""
    import redis

    if not names:
        return
    pattern = re.compile(b"|".join(re.escape(name.encode()) for name in names))
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [key for key in client.scan_iter(count=1000) if pattern.search(key)]
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])
        index = "_kombu.binding_deadlines"  # kombu 5.7's expiry times of fanout bindings
        if client.type(index) == b"zset":
            members = [m for m in client.zrange(index, 0, -1) if pattern.search(m)]
            if members:
                client.zrem(index, *members)
        # kombu's record of the messages a killed worker held (one for the whole database):
        # left there, a later run's consumer would put them back on these queues
        if client.type("unacked") == b"hash":
            tags = [tag for tag, held in client.hscan_iter("unacked") if pattern.search(held)]
            if tags:
                client.hdel("unacked", *tags)
                client.zrem("unacked_index", *tags)
    finally:
        client.close()


def amqp_config(tmp: pathlib.Path, amqp_url: str, postgres_url: str) -> dict[str, Any]:
    """RabbitMQ broker, SQLite result backend, PostgreSQL job store."""
    (tmp / "files").mkdir(parents=True, exist_ok=True)
    return {
        "queue": unique("q"),
        "dir": str(tmp / "files"),
        "broker_url": amqp_url,
        "broker_transport_options": {},
        "result_backend": f"db+sqlite:///{tmp / 'results.sqlite3'}",
        "event_exchange": unique("ev"),
        "ojs": {"store_url": postgres_url, "store_prefix": unique("t")},
    }


def _env(config: dict[str, Any]) -> dict[str, str]:
    """The environment ``tests.e2eapp`` reads its config from."""
    return {**os.environ, "OJS_E2E_CONFIG": json.dumps(config), "PYTHONPATH": str(ROOT)}


def ojs_cli(config: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """``ojs-celery -A tests.e2eapp:app ARGS`` on ``config``, as a user runs it."""
    program = pathlib.Path(sys.executable).with_name("ojs-celery")
    return subprocess.run([str(program), "-A", "tests.e2eapp:app", *args], capture_output=True,
                          text=True, cwd=ROOT, env=_env(config), timeout=60)


class Worker(CeleryProcess):
    """A ``celery worker`` subprocess running ``tests.e2eapp``."""

    def __init__(self, config: dict[str, Any], log: pathlib.Path, pool: str = "prefork",
                 concurrency: int = 2, extra: list[str] | None = None,
                 program: list[str] | None = None, env: dict[str, str] | None = None,
                 cwd: pathlib.Path = ROOT) -> None:
        self.config = config
        MADE.update(config.get("worker_queues") or [config["queue"]])
        super().__init__(
            ["-A", "tests.e2eapp:app", "worker", "--pool", pool, "--concurrency",
             str(concurrency), "--loglevel", "INFO",
             "--queues", ",".join(config.get("worker_queues") or [config["queue"]]),
             "--hostname", f"{unique('w')}@%h", "--without-gossip", "--without-mingle",
             *(extra or [])], log, {**_env(config), **(env or {})}, cwd=cwd, program=program)

    def wait_ready(self, timeout: float = 30.0) -> None:
        super().wait_ready(timeout)

    def stop(self, timeout: float = 20.0) -> int | None:
        return super().stop(timeout)


class Beat(CeleryProcess):
    """A ``celery beat`` subprocess for ``tests.e2eapp`` (it schedules ``ojs_celery.sweep``)."""

    def __init__(self, config: dict[str, Any], tmp: pathlib.Path) -> None:
        super().__init__(
            ["-A", "tests.e2eapp:app", "beat", "--loglevel", "INFO",
             "--schedule", str(tmp / f"beat-{unique('')}"), "--pidfile", ""],
            tmp / f"beat-{unique('')}.log", _env(config), cwd=ROOT)

    def stop(self, timeout: float = 10.0) -> int | None:
        return super().stop(timeout)


@contextmanager
def running_worker(config: dict[str, Any], log: pathlib.Path, **options: Any) -> Iterator[Worker]:
    worker = Worker(config, log, **options)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll until ``predicate`` returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def lines(directory: str, name: str) -> list[str]:
    path = pathlib.Path(directory) / name
    return path.read_text().splitlines() if path.exists() else []


class SweepLoop(threading.Thread):
    """A sweep loop in a thread of the test's process (what ``ojs-celery sweep --loop`` runs),
    started by the test when it wants sweeps; :meth:`stop` ends it."""

    def __init__(self, runtime: Runtime) -> None:
        self._stopping = threading.Event()
        super().__init__(target=run_loop, args=(runtime,),
                         kwargs={"stop": self._stopping.is_set, "pause": self._stopping.wait},
                         daemon=True)

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(10)
