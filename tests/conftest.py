"""Shared fixtures: a client app, a real worker subprocess and an event collector per broker."""

from __future__ import annotations

import pathlib
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from ojs_celery import Job, get_job, signals
from ojs_celery.events import listen
from ojs_celery.runtime import get_runtime
from tests import services
from tests.e2eapp import make_app
from tests.pgserver import PrivatePostgres
from tests.test_store_faults import PrivateRedis
from tests.workers import (
    MADE,
    Beat,
    Worker,
    amqp_config,
    filesystem_config,
    forget_made,
    forget_redis_names,
    lines,
    redis_config,
    unique,
    wait_for,
)

BROKERS = ("filesystem", "redis", "amqp")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove from the shared Redis and RabbitMQ what this process's tests named and left
    (queues a worker was given, stores, exchanges): each xdist worker its own names, and the
    xdist controller, once every worker is done, all of them again. kombu's Redis transport
    keeps one record of unacknowledged messages for the whole database, so a message that a
    killed worker of one xdist worker held is put back on its queue by whichever consumer
    restores it, perhaps another xdist worker's, after the first has cleaned up."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["ojs_made"] = sorted(MADE)
    forget_made(services.reachable_url("OJS_TEST_REDIS_URL", services.DEFAULT_REDIS_URL, 6379),
                services.reachable_url("OJS_TEST_AMQP_URL", services.DEFAULT_AMQP_URL, 5672))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: collect a finished worker's names for its own clean-up."""
    MADE.update(getattr(node, "workeroutput", {}).get("ojs_made", ()))


def broker_config(kind: str, tmp: pathlib.Path) -> dict[str, Any]:
    if kind == "filesystem":
        return filesystem_config(tmp)
    if kind == "redis":
        return redis_config(tmp, services.redis_url())
    if kind == "amqp":
        return amqp_config(tmp, services.amqp_url(), services.postgres_url())
    raise ValueError(kind)


@dataclass
class Events:
    """Every OJS event seen on the bus since the collector started."""

    items: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.items.append(event)

    def of(self, job_id: str, type_: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.items
                    if e.get("subject") == job_id and (type_ is None or e["type"] == type_)]

    def types(self, job_id: str) -> list[str]:
        return [e["type"] for e in self.of(job_id)]


@dataclass
class Env:
    kind: str
    config: dict[str, Any]
    app: Celery
    worker: Worker
    events: Events

    def job(self, job_id: str) -> Job:
        job = get_job(job_id, app=self.app)
        assert job is not None, f"job {job_id} not in the store"
        return job

    def wait_state(self, job_id: str, *states: str, timeout: float = 30.0,
                   worker: Worker | None = None) -> Job:
        """Wait for ``job_id`` to reach one of ``states``; on a timeout, print the log of
        ``worker`` (the job's own worker; default: the module's) and fail with the job's state."""

        def reached() -> Job | None:
            job = get_job(job_id, app=self.app)
            return job if job is not None and job.state in states else None

        try:
            return wait_for(reached, timeout, f"job {job_id} to reach {states}")
        except AssertionError:
            job = get_job(job_id, app=self.app)
            print((worker or self.worker).log()[-6000:])
            raise AssertionError(
                f"job {job_id} is {job.state if job else None}, wanted {states}"
            ) from None

    def wait_events(self, job_id: str, predicate: Callable[[list[str]], bool],
                    timeout: float = 15.0) -> list[str]:
        return wait_for(lambda: (t := self.events.types(job_id)) and predicate(t) and t,
                        timeout, f"events of {job_id}")

    def lines(self, name: str) -> list[str]:
        return lines(self.config["dir"], name)


@contextmanager
def start_env(kind: str, tmp: pathlib.Path, *, config: dict[str, Any] | None = None,
              beat: bool = False, **worker_options: Any) -> Iterator[Env]:
    """A client app, an event collector and a worker; with ``beat``, also ``celery beat`` and
    the worker consuming the sweep queue."""
    changes = config or {}
    config = broker_config(kind, tmp)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    if beat:
        config["ojs"].setdefault("sweep_queue", unique("sweep"))
        config["worker_queues"] = [config["queue"], config["ojs"]["sweep_queue"]]
    app = make_app(config)
    events = Events()
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(target=listen, args=(app, events.add),
                                kwargs={"ready": ready, "stop": stop}, daemon=True)
    listener.start()
    assert ready.wait(15), "event listener did not start"
    worker = Worker(config, tmp / "worker.log", **worker_options)
    beat_process = Beat(config, tmp) if beat else None
    try:
        worker.wait_ready()
        yield Env(kind, config, app, worker, events)
    finally:
        stop.set()  # before the broker may go away (a test's own vhost)
        if beat_process is not None:
            beat_process.stop()
        worker.stop()
        listener.join(5)
        store = app._ojs_runtime.store
        store.clear()
        drop = getattr(store, "drop_tables", None)
        if drop is not None:
            drop()
        if kind == "redis":
            names = [config["queue"], config["event_exchange"], config["ojs"]["store_prefix"],
                     config["ojs"].get("sweep_queue", config["queue"])]
            forget_redis_names(config["broker_url"], names)


@pytest.fixture(scope="module", params=BROKERS)
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A prefork worker (concurrency 3) on each broker, shared by a module's tests."""
    tmp = tmp_path_factory.mktemp(f"e2e-{request.param}")
    with start_env(request.param, tmp, concurrency=3) as started:
        yield started


# The sweeper's and the store's in-process tests: an app on the embedded broker folder with a
# SQLite or Redis job store, the events it emits, and the messages it published.


@pytest.fixture(params=["sqlite", "redis"])
def app(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Celery]:
    with store_app(request.param, tmp_path) as celery_app:
        yield celery_app


@contextmanager
def store_app(store: str, tmp_path: pathlib.Path) -> Iterator[Celery]:
    """An app on the embedded broker folder, with no events, whose job store is ``store``
    ("sqlite", "redis" or "postgres", under a prefix of its own); its records are removed
    at the end."""
    config = filesystem_config(tmp_path)
    if store != "sqlite":
        url = services.redis_url() if store == "redis" else services.postgres_url()
        config["ojs"] = {"store_url": url, "store_prefix": unique("t")}
    config["ojs"]["events"] = False
    celery_app = make_app(config)
    try:
        yield celery_app
    finally:
        job_store = get_runtime(celery_app).store
        job_store.clear()
        drop = getattr(job_store, "drop_tables", None)
        if drop is not None:
            drop()


@pytest.fixture
def redis_server(tmp_path: pathlib.Path) -> Iterator[PrivateRedis]:
    """A ``redis-server`` of the test's own (its counts and faults are the test's), stopped
    after it."""
    server = PrivateRedis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_server() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL server of this test's (``tests/pgserver.py``)."""
    server = PrivatePostgres()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener never accepts: the kernel completes the connection, and no
    server ever answers on it (a hung server, as a client sees it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


@pytest.fixture
def seen() -> Iterator[Counter[str]]:
    """OJS events emitted in this process, by type and job."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def receiver(sender: Any = None, event: dict[str, Any] | None = None, **_: Any) -> None:
        assert event is not None
        with lock:
            counts[event["type"]] += 1

    signals.ojs_event.connect(receiver)
    yield counts
    signals.ojs_event.disconnect(receiver)


def messages(app: Celery) -> list[str]:
    folder = pathlib.Path(app.conf.broker_transport_options["data_folder_in"])
    return sorted(p.name for p in folder.glob("*.msg"))
