"""``install(app)`` and settings the Celery and Django ways; in-process signals."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from ojs_celery import OJSTask, enqueue, install, signals
from ojs_celery.embedded import embedded_settings
from ojs_celery.runtime import get_runtime


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
    with pytest.raises(ImproperlyConfigured) as raised:
        install(app)
    assert "ojs.sweep_intervall: unknown setting" in str(raised.value)
    assert "ojs.heartbeat_interval" in str(raised.value)


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
