"""The shims of ``ojs_celery.compat``, against whichever Celery, kombu and redis-py are installed
(``scripts/compat.sh`` and ``scripts/floors.sh`` run them on each supported version)."""

from __future__ import annotations

import logging
import pathlib
import socket
import sys
import threading
import time
from queue import Empty
from types import SimpleNamespace
from typing import Any

import kombu
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Connection

from ojs_celery import compat
from ojs_celery.worker.node import bucket_held, eta_held
from tests import services
from tests.workers import wait_for


def test_a_message_being_written_is_invisible_to_kombus_filesystem_consumer(
    tmp_path: pathlib.Path,
) -> None:
    folder = tmp_path / "broker"
    folder.mkdir()
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder),
               "processed_folder": str(tmp_path), "control_folder": str(tmp_path)}
    final, temporary = compat.filesystem_message_names("jobs")
    payload = b'{"body": "x", "headers": {}, "properties": {"delivery_tag": "t"}}'
    (folder / temporary).write_bytes(payload[:10])  # half written
    with Connection("filesystem://localhost/", transport_options=options) as conn:
        channel: Any = conn.default_channel
        with pytest.raises(Empty):
            channel._get("jobs")
        (folder / temporary).write_bytes(payload)
        (folder / temporary).rename(folder / final)
        assert channel._get("jobs")["body"] == "x"


@pytest.mark.parametrize("native", [True, False])
def test_jitter_backoff_stays_under_its_cap(native: bool) -> None:
    backoff = (compat.jitter_backoff(0.01, 0.2) if native
               else compat._JitterBackoff(0.01, 0.2))
    backoff.reset()
    delays = [backoff.compute(failures) for failures in range(12) for _ in range(20)]
    assert all(0 <= delay <= 0.2 for delay in delays)
    assert max(delays[:20]) <= 0.01
    assert max(delays[-20:]) > 0.01  # it grows


def test_pool_connection_checks_out_a_working_connection() -> None:
    import redis

    client = redis.Redis.from_url(services.redis_url())
    pool = client.connection_pool
    connection = compat.pool_connection(pool)
    try:
        connection.send_command("PING")
        assert connection.read_response() in (b"PONG", "PONG")
    finally:
        pool.release(connection)
        client.close()


def test_a_missing_store_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.require_store_extra("sqlite:///x.sqlite3")
    compat.require_store_extra("redis://127.0.0.1:6379/0")
    compat.require_store_extra("postgresql://u@h/db")
    compat.require_store_extra("postgres+psycopg://u:secret@h/db")  # the store's spelling too
    with pytest.raises(compat.MissingExtra, match="is not a valid URL") as malformed:
        compat.require_store_extra("postgresql+psycopg2:/u:secret@h/db")
    assert "secret" not in str(malformed.value)
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(compat.MissingExtra) as raised:
        compat.require_store_extra("redis://:secret@127.0.0.1:6379/0")
    assert "ojs-celery[redis]" in str(raised.value)
    assert "secret" not in str(raised.value)
    with pytest.raises(compat.MissingExtra, match=r"ojs-celery\[postgres\]"):
        compat.require_store_extra("postgres://u@h/db")
    with pytest.raises(compat.MissingExtra, match=r"names the driver 'nosuchdriver', which "
                                                  r"cannot be loaded") as unknown:
        compat.require_store_extra("postgresql+nosuchdriver://u:secret@h/db")
    assert "secret" not in str(unknown.value)
    compat.require_store_extra("sqlite:///x.sqlite3")


def test_a_missing_broker_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.require_broker_extra("redis://127.0.0.1:6379/0")
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(compat.MissingExtra) as raised:
        compat.require_broker_extra("redis://user:secret@127.0.0.1:6379/0")
    assert "ojs-celery[redis]" in str(raised.value)
    assert "secret" not in str(raised.value)
    compat.require_broker_extra("amqp://guest:guest@127.0.0.1:5672//")
    compat.require_broker_extra("ojsfs://localhost/")
    compat.require_broker_extra(None)


@pytest.mark.skipif(tuple(int(p) for p in kombu.__version__.split(".")[:2]) < (5, 5),
                    reason="kombu 5.4's Redis transport does not import packaging")
def test_kombus_redis_transport_needs_packaging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "packaging", None)
    with pytest.raises(compat.MissingExtra, match="packaging"):
        compat.require_broker_extra("redis://127.0.0.1:6379/0")


def test_a_missing_result_backend_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.require_backend_extra("redis://127.0.0.1:6379/0")
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(compat.MissingExtra, match=r"result backend .*ojs-celery\[redis\]"):
        compat.require_backend_extra("redis://127.0.0.1:6379/0")
    compat.require_backend_extra("db+sqlite:///results.sqlite3")
    compat.require_backend_extra(None)


def test_scheduled_requests_lists_a_countdown_job_held_by_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = Celery("compat", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.worker_hijack_root_logger = False
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # start_worker sets it to ERROR for good

    @app.task(name="compat.later", shared=False)
    def later() -> None:
        return None

    with start_worker(app, pool="solo", perform_ping_check=False) as worker:
        result = later.apply_async(countdown=60)
        held = wait_for(lambda: eta_held(worker.consumer.timer), 20,
                        "the countdown job to be held")
        assert [request.id for request in held] == [result.id]
        result.revoke()


def test_a_rate_limits_bucket_holds_requests_no_other_set_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task's ``rate_limit`` keeps the requests past it in the consumer's bucket, in neither
    ``reserved_requests`` nor the timer's entries: the worker's beats list them from there."""
    app = Celery("compat", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.worker_hijack_root_logger = False
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # start_worker sets it to ERROR for good

    @app.task(name="compat.limited", shared=False, rate_limit="1/h")
    def limited() -> None:
        return None

    with start_worker(app, pool="solo", perform_ping_check=False) as worker:
        results = [limited.delay() for _ in range(3)]
        held = wait_for(lambda: len(bucket_held(worker.consumer)) == 2 and
                        bucket_held(worker.consumer), 20, "two calls in the rate limit's bucket")
        assert [request.id for request in held] == [r.id for r in results[1:]]
        for result in results:
            result.revoke()


def test_call_soon_runs_promptly_while_the_hub_waits_in_poll() -> None:
    from kombu.asynchronous import Hub
    from kombu.asynchronous.timer import Timer

    hub = Hub(timer=Timer(max_interval=60))  # a timer's wait is not cut to 2 s (see prime)
    idle_reader, idle_writer = socket.socketpair()  # never written: polls wait in full
    hub.add_reader(idle_reader, lambda: None)
    consumer = SimpleNamespace(hub=hub, call_soon=hub.call_soon)
    running = True

    def loop() -> None:
        steps = hub.create_loop()
        while running:
            next(steps)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        primed = threading.Event()

        def prime() -> None:
            # a timer a minute away makes every later poll wait kombu's longest, 10 s, so that
            # "promptly" can be told from "at the poll's end" with a bound a loaded machine meets
            hub.call_later(60, lambda: None)
            primed.set()

        compat.call_soon(consumer, prime)  # kombu < 5.7: registers the waker on this turn
        assert primed.wait(5)
        for _ in range(3):
            ran = threading.Event()
            time.sleep(0.05)  # let the loop go back into its poll
            started = time.monotonic()
            compat.call_soon(consumer, ran.set)
            assert ran.wait(15)
            assert time.monotonic() - started < 5
    finally:
        running = False
        compat.call_soon(consumer, lambda: None)  # out of its 10 s poll
        thread.join(5)
        hub.close()
        idle_reader.close()
        idle_writer.close()


class _DjangoStyleSettings:
    """Settings as Django keeps them, read with ``namespace="CELERY"``."""

    CELERY_TASK_DEFAULT_QUEUE = "from-django"
    CELERY_TASK_SOFT_TIME_LIMIT = 12


_KEYS = ("task_default_queue", "task_time_limit", "task_soft_time_limit", "task_always_eager",
         "task_protocol", "broker_url")


def test_a_setting_is_read_as_celery_reads_it_whatever_its_spelling_and_changes() -> None:
    """``compat.celery_setting`` is a faster ``app.conf[key]``: it must agree with Celery's
    lookup for new, old and namespaced spellings, before and after the settings change."""
    plain = Celery("plain", set_as_current=False)
    old_style = Celery("old", set_as_current=False)
    old_style.conf.update(CELERY_DEFAULT_QUEUE="old-name", CELERYD_TASK_TIME_LIMIT=30)
    django = Celery("django", set_as_current=False)
    django.config_from_object(_DjangoStyleSettings, namespace="CELERY")
    for app in (plain, old_style, django):
        assert {key: compat.celery_setting(app, key) for key in _KEYS} == {
            key: app.conf[key] for key in _KEYS}, app.main
        app.conf.task_default_queue = "changed"  # after the first read, as tests do
        app.conf.update(task_time_limit=99)
        assert compat.celery_setting(app, "task_default_queue") == app.conf.task_default_queue
        assert compat.celery_setting(app, "task_time_limit") == app.conf.task_time_limit
    assert compat.celery_setting(django, "task_soft_time_limit") == 12
    assert compat.celery_setting(old_style, "task_time_limit") == 99


def test_a_setting_read_before_the_configuration_is_loaded_follows_its_namespace() -> None:
    """Celery loads a Django-style configuration into the same settings object, whose
    namespace changes then: what was read before must not fix the key's spellings."""
    app = Celery("early", set_as_current=False)
    app.config_from_object(_DjangoStyleSettings, namespace="CELERY")
    assert not app.configured
    for _ in range(2):  # the first read loads the configuration; the second uses the cache
        assert compat.celery_setting(app, "task_default_queue") == "from-django"
        assert compat.celery_setting(app, "task_soft_time_limit") == 12
