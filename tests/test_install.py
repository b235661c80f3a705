"""``install(app)`` and settings the Celery and Django ways; in-process signals."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from ojs_celery import OJSTask, enqueue, install, signals
from ojs_celery.embedded import embedded_settings
from ojs_celery.install import SweepWatch
from ojs_celery.runtime import get_runtime
from ojs_celery.store import StoreError
from tests.e2eapp import make_app
from tests.services import postgres_url
from tests.workers import filesystem_config, lines, running_worker, unique, wait_for


class DjangoSettings:
    """What ``django.conf.settings`` looks like to ``config_from_object(namespace="CELERY")``."""

    def __init__(self, directory: pathlib.Path) -> None:
        base = embedded_settings(directory)
        self.CELERY_BROKER_URL = base["broker_url"]
        self.CELERY_BROKER_TRANSPORT_OPTIONS = base["broker_transport_options"]
        self.CELERY_OJS = {"store_url": base["ojs"]["store_url"], "sweep_interval": 0.25,
                           "labels": ["django"]}


def test_django_style_settings_are_read_and_validated(tmp_path: pathlib.Path) -> None:
    app = Celery("django_proj", set_as_current=False)
    app.config_from_object(DjangoSettings(tmp_path), namespace="CELERY")
    runtime = install(app)
    assert runtime.settings.sweep_interval == 0.25
    assert runtime.settings.labels == ["django"]
    assert install(app) is runtime  # idempotent
    assert app.conf.beat_schedule["ojs-sweep"]["schedule"] == 0.25


def test_a_bad_setting_raises_improperly_configured_naming_the_key(
    tmp_path: pathlib.Path,
) -> None:
    app = Celery("bad", set_as_current=False)
    app.conf.ojs = {"sweep_intervall": 2, "heartbeat_interval": -1}
    runtime = install(app)  # not configured yet: Celery reads the settings later
    with pytest.raises(ImproperlyConfigured) as raised:
        runtime.settings  # noqa: B018 - first use
    assert "ojs.sweep_intervall: unknown setting" in str(raised.value)
    assert "ojs.heartbeat_interval" in str(raised.value)
    with pytest.raises(ImproperlyConfigured):
        enqueue({"type": "x.y", "args": []}, app=app)  # never a silent default


def test_a_bad_setting_of_a_configured_app_raises_at_install() -> None:
    app = Celery("bad_configured", set_as_current=False)
    app.conf.ojs = {"sweep_intervall": 2}
    assert app.conf.ojs  # configures the app
    with pytest.raises(ImproperlyConfigured, match=r"ojs\.sweep_intervall: unknown setting"):
        install(app)


def test_install_before_config_from_object_reads_the_configured_settings(
    tmp_path: pathlib.Path,
) -> None:
    """A Django settings module that imports the Celery app (which calls ``install``) before
    ``config_from_object`` runs: the settings and the beat entry come from the configuration."""
    app = Celery("django_late", set_as_current=False)
    runtime = install(app)
    app.config_from_object(DjangoSettings(tmp_path), namespace="CELERY")
    assert runtime.settings.sweep_interval == 0.25
    assert runtime.settings.store_url.endswith("store.sqlite3")
    assert app.conf.beat_schedule["ojs-sweep"]["schedule"] == 0.25


def test_reconfiguring_replaces_the_settings_and_keeps_the_beat_entry(
    tmp_path: pathlib.Path,
) -> None:
    app = Celery("reconfigured", set_as_current=False)
    app.conf.beat_schedule = {"mine": {"task": "a", "schedule": 5}}
    runtime = install(app)
    assert runtime.settings.sweep_interval == 2.0  # the defaults, configured on first use
    app.config_from_object(DjangoSettings(tmp_path), namespace="CELERY")
    assert runtime.settings.sweep_interval == 0.25
    assert set(app.conf.beat_schedule) == {"mine", "ojs-sweep"}


def test_a_namespaced_projects_later_beat_schedule_is_read_as_celery_reads_it() -> None:
    """Settings read with ``namespace="CELERY"`` that have a ``CELERY_BEAT_SCHEDULE``, and a
    ``conf.beat_schedule = ...`` of the project's own after ``install``: Celery reads the same
    entries as without OJS (the project's setting on Celery 5.4 to 5.6, the later write on
    5.7), beside the sweep (beat's start adds it again to what Celery reads). On 5.7 the sweep's
    entry, once set under the namespaced spelling, hid the later write: the project's own
    entries were never scheduled."""

    def made(with_ojs: bool) -> Celery:
        class Settings:
            CELERY_BROKER_URL = "memory://"
            CELERY_OJS = {"store_url": "sqlite:///:memory:"}
            CELERY_BEAT_SCHEDULE = {"tick": {"task": "tick", "schedule": 5}}

        app = Celery("later_schedule", set_as_current=False)
        app.config_from_object(Settings, namespace="CELERY")
        if with_ojs:
            install(app)
            assert "ojs-sweep" in app.conf.beat_schedule
        app.conf.beat_schedule = {"later": {"task": "later", "schedule": 5}}
        return app

    assert (set(made(with_ojs=True).conf.beat_schedule) - {"ojs-sweep"}
            == set(made(with_ojs=False).conf.beat_schedule))


NAMESPACED_APP = """
import json, os
from celery import Celery
from kombu import Queue
import ojs_celery

_EMBEDDED = json.loads(os.environ["NS_EMBEDDED"])


class Settings:
    # a Django project's settings: its own beat schedule and declared queues, CELERY_*
    CELERY_BROKER_URL = _EMBEDDED["broker_url"]
    CELERY_BROKER_TRANSPORT_OPTIONS = _EMBEDDED["broker_transport_options"]
    CELERY_RESULT_BACKEND = _EMBEDDED["result_backend"]
    CELERY_OJS = {**_EMBEDDED["ojs"], "sweep_interval": 0.5}
    CELERY_BEAT_SCHEDULE = {"tick": {"task": "nsapp.tick", "schedule": 0.5}}
    CELERY_TASK_QUEUES = [Queue("celery")]
    CELERY_TASK_CREATE_MISSING_QUEUES = False


app = Celery("nsapp")
app.config_from_object(Settings, namespace="CELERY")
ojs_celery.install(app)


@app.task(name="nsapp.tick")
def tick():
    return None
"""


@pytest.mark.e2e
def test_a_django_projects_own_beat_schedule_and_queues_get_the_sweep(
    tmp_path: pathlib.Path,
) -> None:
    """Settings read with ``namespace="CELERY"`` that have a ``CELERY_BEAT_SCHEDULE`` and a
    ``CELERY_TASK_QUEUES`` of their own (with ``task_create_missing_queues`` off): beat sends
    the sweep beside the project's entries, and a worker consuming ``celery,ojs.sweep`` starts.
    On Celery 5.4 to 5.6 the project's spellings were read before what ``install`` set, so
    beat never scheduled a sweep and the worker exited naming the missing queue."""
    import json
    import os

    from ojs_celery.testing import CeleryProcess

    (tmp_path / "nsapp.py").write_text(NAMESPACED_APP)
    env = {**os.environ, "PYTHONPATH": str(tmp_path),
           "NS_EMBEDDED": json.dumps(embedded_settings(tmp_path / "ojs"))}
    worker = CeleryProcess(["-A", "nsapp", "worker", "-Q", "celery,ojs.sweep", "-c", "1",
                            "--loglevel", "INFO", "-n", f"{unique('ns')}@%h"],
                           tmp_path / "worker.log", env, cwd=tmp_path)
    beat = CeleryProcess(["-A", "nsapp", "beat", "--loglevel", "INFO",
                          "-s", str(tmp_path / "schedule"), "--pidfile", ""],
                         tmp_path / "beat.log", env, cwd=tmp_path)
    try:
        worker.wait_ready()
        wait_for(lambda: "Sending due task ojs-sweep" in beat.log(), 30, "beat to send a sweep")
        # the project's own entry too (beat logs its due entries one after the other)
        wait_for(lambda: "Sending due task tick" in beat.log(), 30, "beat to send a tick")
        wait_for(lambda: "Task nsapp.tick[" in worker.log(), 30, "the worker to run a tick")
    finally:
        beat.stop()
        worker.stop()


def test_heartbeat_settings_are_checked_against_each_other() -> None:
    app = Celery("beats", set_as_current=False)
    app.conf.ojs = {"heartbeat_interval": 10, "worker_heartbeat_timeout": 3}
    with pytest.raises(ImproperlyConfigured, match="live workers are declared dead"):
        install(app).settings  # noqa: B018
    app = Celery("beats_warn", set_as_current=False)
    app.conf.ojs = {"heartbeat_interval": 20, "worker_heartbeat_timeout": 50}
    warnings = install(app).settings.warnings()  # logged when the settings are read
    assert [w.split(" ", 1)[0] for w in warnings] == [
        "ojs.worker_heartbeat_timeout", "ojs.heartbeat_interval"]
    assert Celery("beats_ok", set_as_current=False).conf and not install(
        Celery("beats_ok", set_as_current=False)).settings.warnings()


def test_signals_fire_in_the_process_where_the_event_happens(tmp_path: pathlib.Path) -> None:
    app = Celery("signals", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    app.conf.ojs = {**app.conf.ojs, "events": False}
    install(app)

    @app.task(shared=False, name="sig.job", base=OJSTask)
    def job_task() -> None:
        return None

    seen: list[tuple[str, str]] = []

    def on_any(sender: Any = None, event: dict[str, Any] | None = None, **_: Any) -> None:
        assert event is not None
        seen.append(("any", event["type"]))

    def on_enqueued(sender: Any = None, event: dict[str, Any] | None = None, **_: Any) -> None:
        assert event is not None
        seen.append(("enqueued", event["data"]["job_type"]))

    signals.ojs_event.connect(on_any)
    signals.job_enqueued.connect(on_enqueued)
    try:
        job = enqueue({"type": "sig.job", "args": []}, app=app)
    finally:
        signals.ojs_event.disconnect(on_any)
        signals.job_enqueued.disconnect(on_enqueued)
    assert seen == [("any", "job.enqueued"), ("enqueued", "sig.job")]
    assert get_runtime(app).store.get(job.id) is not None


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["worker", "--pool", "solo"], ["beat"]])
def test_worker_and_beat_refuse_to_start_on_invalid_settings(
    tmp_path: pathlib.Path, command: list[str]
) -> None:
    """Settings given after ``install`` are validated at start: the process exits with the
    setting named, instead of running on defaults or without its sweep entry."""
    (tmp_path / "badsettings_app.py").write_text(
        "from celery import Celery\n"
        "import ojs_celery\n"
        "from ojs_celery.embedded import embedded_settings\n"
        "app = Celery('badsettings_app')\n"
        "ojs_celery.install(app)\n"
        f"app.conf.update(embedded_settings({str(tmp_path / 'files')!r}))\n"
        "app.conf.ojs = {**app.conf.ojs, 'heartbeat_interval': 10,"
        " 'worker_heartbeat_timeout': 3}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "badsettings_app", *command,
         "-s" if command == ["beat"] else "-n",
         str(tmp_path / "schedule") if command == ["beat"] else "bad@%h"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert "ojs.worker_heartbeat_timeout" not in done.stdout
    assert "worker_heartbeat_timeout (3.0s) must be longer" in done.stderr


@pytest.mark.e2e
def test_a_worker_whose_store_driver_cannot_be_loaded_exits_naming_it(
    tmp_path: pathlib.Path,
) -> None:
    """A driver SQLAlchemy cannot load would fail every job's start: the worker says so once
    and exits, before its pool starts (when its settings are read)."""
    (tmp_path / "nodriver_app.py").write_text(
        "from celery import Celery\n"
        "import ojs_celery\n"
        "from ojs_celery.embedded import embedded_settings\n"
        "app = Celery('nodriver_app')\n"
        f"app.conf.update(embedded_settings({str(tmp_path / 'files')!r}))\n"
        "app.conf.ojs = {'store_url': 'postgresql+nosuchdriver://u@127.0.0.1:1/x'}\n"
        "ojs_celery.install(app)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "nodriver_app", "worker", "--pool", "solo",
         "-n", "nodriver@%h"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "ojs.store_url: the job store postgresql+nosuchdriver://" in done.stderr
    assert "names the driver 'nosuchdriver', which cannot be loaded" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.e2e
def test_a_new_pool_process_has_the_store_driver_before_its_first_job(
    tmp_path: pathlib.Path,
) -> None:
    """The worker imports the job store's driver before its pool forks, so the first job of a
    new pool process does not import it on its own time limit (a quarter of a second for
    psycopg and SQLAlchemy's dialect)."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {**config["ojs"], "store_url": postgres_url(), "store_prefix": unique("t")}
    config["prerun_modules"] = ["psycopg", "ojs_celery.store.pg_lane"]
    app = make_app(config)
    try:
        with running_worker(config, tmp_path / "worker.log", concurrency=1):
            job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
            wait_for(lambda: lines(config["dir"], "prerun"), 30, "the first job's prerun")
        assert lines(config["dir"], "prerun") == [
            f"{job.id} psycopg=True ojs_celery.store.pg_lane=True"]
    finally:
        runtime = get_runtime(app)
        runtime.flush()  # the outbox acknowledgement, or it would make the tables again
        runtime.store.clear()
        runtime.store.drop_tables()  # type: ignore[attr-defined]


def test_importing_the_package_connects_no_celery_signal() -> None:
    """Importing ``ojs_celery`` changes nothing in Celery (issue 13 item 5); ``install``
    connects the worker-start warning about tasks without a time limit."""
    done = subprocess.run([sys.executable, "-c", (
        "from celery import Celery, signals\n"
        "import ojs_celery, ojs_celery.producer, ojs_celery.task\n"
        "before = len(signals.worker_ready.receivers)\n"
        "ojs_celery.install(Celery('x', set_as_current=False))\n"
        "print(before, len(signals.worker_ready.receivers))\n")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]


class _Store:
    """What a worker reads of the last sweep, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.last: float | None = None
        self.down = False
        self.answer_takes = 0.0

    def clock(self) -> float:
        return self.now

    def read_last(self) -> float | None:
        self.now += self.answer_takes
        if self.down:
            raise StoreError("job store error: TimeoutError: Timeout reading from socket")
        return self.last


def test_sweeps_are_overdue_only_once_the_store_answered_for_a_while() -> None:
    """The worker's stale-sweep warning: due when no sweep ran for ``stale_after``, but not
    while the store does not answer (nor answers late), nor at once when it answers again
    with the last sweep from before the outage: sweeps could not run meanwhile either."""
    store = _Store()
    watch = SweepWatch(store.read_last, interval=1.0, stale_after=5.0, clock=store.clock)
    assert watch.overdue() == 5.0  # none ever ran
    store.last = store.now
    store.now += 4
    assert watch.overdue() is None
    store.now += 2
    assert watch.overdue() == 6.0
    store.last = store.now
    store.down = True  # frozen for 20 s: every read times out
    for _ in range(10):
        store.now += 2
        assert watch.overdue() is None
    store.down = False  # back, the last sweep 20 s old
    assert watch.overdue() is None
    store.answer_takes = 3.0  # a read that waited for the store: excused as well
    store.now += 4
    assert watch.overdue() is None
    store.answer_takes = 0.0
    store.now += 6  # answering for 6 s now, still no sweep
    assert watch.overdue() == 6.0


def test_only_prefork_pools_are_known_to_end_attempts_at_the_hard_limit() -> None:
    """What a worker registers as ``time_limits`` (the sweeper waits for a silent worker of
    such a pool to be declared dead before it judges an execution timeout)."""
    from celery.concurrency import prefork, solo, thread

    from ojs_celery.worker.pools import enforces_time_limits

    class OwnPrefork(prefork.TaskPool):  # type: ignore[misc]
        pass

    assert enforces_time_limits(prefork.TaskPool) and enforces_time_limits(OwnPrefork)
    assert not enforces_time_limits(solo.TaskPool) and not enforces_time_limits(thread.TaskPool)
    assert enforces_time_limits("prefork") and not enforces_time_limits("gevent")


def test_a_sweep_nobody_takes_expires_in_rabbitmq_not_by_the_workers_clock(
    tmp_path: pathlib.Path,
) -> None:
    """The beat entry's sweeps carry RabbitMQ's own message TTL (one interval, kept by the
    broker's clock), so a beat without a sweep worker piles none up, and no Celery ``expires``,
    which a sweep worker whose clock is ahead of beat's would take as expired for every one."""
    from tests.services import amqp_url

    queue = unique("sweepttl")
    app = Celery("sweepttl", broker=amqp_url(), set_as_current=False)
    # long enough for a loaded machine to read the message before RabbitMQ drops it
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'ojs.sqlite3'}", "sweep_queue": queue,
                    "sweep_interval": 5.0}
    install(app)
    entry = app.conf.beat_schedule["ojs-sweep"]
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            app.tasks[entry["task"]].apply_async(**entry["options"])
            taken = wait_for(lambda: channel.basic_get(queue, no_ack=True), 4,
                             "the sweep message in its queue")
            assert taken.properties["expiration"] == "5000"
            assert taken.headers["expires"] is None
            app.tasks[entry["task"]].apply_async(**entry["options"])
            wait_for(lambda: channel.queue_declare(queue, passive=True).message_count == 1, 4,
                     "the second sweep message in its queue")
            wait_for(lambda: channel.queue_declare(queue, passive=True).message_count == 0, 20,
                     "RabbitMQ to drop the sweep nobody took")
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
            conn.default_channel.exchange_delete(queue)
        get_runtime(app).close()
