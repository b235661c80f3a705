"""Settings: defaults, and every bad key reported as ImproperlyConfigured naming ``ojs.<key>``."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import ImproperlyConfigured

from ojs_celery.conf import Retention, Settings, raw_settings, read_settings
from ojs_celery.lifecycle import DAY, Policy


def bad(raw: Any) -> str:
    with pytest.raises(ImproperlyConfigured) as info:
        read_settings(raw)
    return str(info.value)


def test_defaults() -> None:
    s = read_settings({})
    assert s.store_url == "sqlite:///ojs.sqlite3"
    assert s.store_prefix == "ojs"
    assert s.type_map == {}
    assert s.events is True
    assert s.amqp_max_priority == 10
    assert s.dispatch_grace == 10.0
    assert s.schedule_horizon == 60.0
    assert s.sweep_interval == 2.0
    assert s.sweep_queue == "ojs.sweep"
    assert s.sweep_batch == 500
    assert s.execution_tolerance == 1.5
    assert s.heartbeat_interval == 5.0
    assert s.worker_heartbeat_timeout == 30.0
    assert s.shutdown_grace_period == 25.0
    assert s.labels == []
    assert s.retention == Retention(
        completed=7 * DAY, cancelled=30 * DAY, discarded=30 * DAY, dead_letter=180 * DAY
    )


def test_none_means_defaults() -> None:
    assert read_settings(None) == read_settings({}) == Settings.model_validate({})


def test_default_policy_matches_lifecycle_defaults() -> None:
    assert read_settings({}).policy == Policy()


def test_policy_from_settings() -> None:
    s = read_settings(
        {
            "dispatch_grace": 3,
            "schedule_horizon": 0.5,
            "retention": {"completed": 1, "cancelled": 2, "discarded": 3, "dead_letter": 4},
        }
    )
    assert s.policy == Policy(
        dispatch_grace=3.0,
        schedule_horizon=0.5,
        retention_completed=1.0,
        retention_cancelled=2.0,
        retention_discarded=3.0,
        retention_dead_letter=4.0,
    )


def test_partial_retention_keeps_other_defaults() -> None:
    r = read_settings({"retention": {"completed": 60}}).retention
    assert r.completed == 60
    assert r.cancelled == 30 * DAY
    assert r.dead_letter == 180 * DAY


@pytest.mark.parametrize(
    "key",
    [
        "sweep_interval",
        "heartbeat_interval",
        "worker_heartbeat_timeout",
        "dispatch_grace",
        "schedule_horizon",
        "shutdown_grace_period",
    ],
)
def test_floats_accepted_for_intervals(key: str) -> None:
    # a worker heartbeat timeout must outlast one beat interval plus one sweep interval
    fast = {"heartbeat_interval": 0.01, "sweep_interval": 0.01}
    others = fast if key == "worker_heartbeat_timeout" else {}
    assert getattr(read_settings({key: 0.05, **others}), key) == 0.05
    assert getattr(read_settings({key: 3, **others}), key) == 3.0


def test_zero_shutdown_grace_allowed() -> None:
    assert read_settings({"shutdown_grace_period": 0}).shutdown_grace_period == 0


@pytest.mark.parametrize(
    "typo", ["sweep_intervall", "store", "heartbeat_timeout", "SWEEP_INTERVAL"]
)
def test_unknown_key_names_ojs_key(typo: str) -> None:
    message = bad({typo: 1})
    assert f"ojs.{typo}" in message
    assert "unknown setting" in message


def test_unknown_nested_retention_key() -> None:
    message = bad({"retention": {"complete": 10}})
    assert "ojs.retention.complete" in message
    assert "unknown setting" in message


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"sweep_interval": 0}, "ojs.sweep_interval"),
        ({"sweep_interval": -1.5}, "ojs.sweep_interval"),
        ({"sweep_interval": "often"}, "ojs.sweep_interval"),
        ({"sweep_interval": None}, "ojs.sweep_interval"),
        ({"heartbeat_interval": 0}, "ojs.heartbeat_interval"),
        ({"worker_heartbeat_timeout": 0}, "ojs.worker_heartbeat_timeout"),
        ({"dispatch_grace": 0}, "ojs.dispatch_grace"),
        ({"schedule_horizon": 0}, "ojs.schedule_horizon"),
        ({"shutdown_grace_period": -1}, "ojs.shutdown_grace_period"),
        ({"execution_tolerance": 1.0}, "ojs.execution_tolerance"),
        ({"amqp_max_priority": 0}, "ojs.amqp_max_priority"),
        ({"amqp_max_priority": 256}, "ojs.amqp_max_priority"),
        ({"sweep_batch": 0}, "ojs.sweep_batch"),
        ({"sweep_batch": 1.5}, "ojs.sweep_batch"),
        ({"dispatch_failure_limit": 0}, "ojs.dispatch_failure_limit"),
        ({"dispatch_failure_limit": 101}, "ojs.dispatch_failure_limit"),  # > ERRORS_KEPT
        ({"store_prefix": "1abc"}, "ojs.store_prefix"),
        ({"store_prefix": "a" * 41}, "ojs.store_prefix"),
        ({"store_timeout": 0}, "ojs.store_timeout"),
        ({"store_timeout": 0.01}, "ojs.store_timeout"),
        ({"store_timeout": 3601}, "ojs.store_timeout"),
        ({"store_timeout": "soon"}, "ojs.store_timeout"),
        ({"publish_timeout": 0}, "ojs.publish_timeout"),
        ({"publish_timeout": 3601}, "ojs.publish_timeout"),
        ({"store_synchronous_commit": "fast"}, "ojs.store_synchronous_commit"),
        ({"store_synchronous_commit": False}, "ojs.store_synchronous_commit"),
        ({"store_url": "redis://localhost/0", "store_synchronous_commit": "off"},
         "ojs.store_synchronous_commit"),
        ({"events": "maybe"}, "ojs.events"),
        ({"labels": "gpu"}, "ojs.labels"),
        ({"type_map": ["email.send"]}, "ojs.type_map"),
        ({"retention": {"completed": 0}}, "ojs.retention.completed"),
        ({"retention": {"completed": -1}}, "ojs.retention.completed"),
        ({"retention": {"dead_letter": "long"}}, "ojs.retention.dead_letter"),
        ({"retention": 5}, "ojs.retention"),
    ],
)
def test_bad_values_name_the_key(raw: dict[str, Any], key: str) -> None:
    message = bad(raw)
    assert f"{key}:" in message


def test_range_message_states_rule() -> None:
    assert "greater than 0" in bad({"sweep_interval": 0})
    assert "greater than 0" in bad({"retention": {"completed": -1}})


def test_several_problems_reported_together() -> None:
    message = bad({"sweep_interval": 0, "typo": 1, "retention": {"completed": -1}})
    for key in ("ojs.sweep_interval", "ojs.typo", "ojs.retention.completed"):
        assert key in message


@pytest.mark.parametrize("raw", [[1], "sweep_interval=1", 5])
def test_settings_must_be_a_dict(raw: Any) -> None:
    assert bad(raw).startswith("ojs:")


def test_type_map_valid() -> None:
    s = read_settings({"type_map": {"email.send": "proj.tasks.send_email", "report": "r"}})
    assert s.type_map == {"email.send": "proj.tasks.send_email", "report": "r"}


@pytest.mark.parametrize("key", ["email send", "-email", "1email", "email.", ""])
def test_type_map_key_must_be_ojs_type(key: str) -> None:
    message = bad({"type_map": {key: "proj.tasks.x"}})
    assert "ojs.type_map" in message
    assert repr(key) in message
    assert "OJS type" in message
    # the rule named is the one applied (the envelope's: upper case, - and : allowed)
    assert "a letter then letters, digits, _, - or :" in message
    assert "lowercase" not in message


def test_type_map_accepts_what_an_envelope_type_accepts() -> None:
    s = read_settings({"type_map": {"Retry.test.exponential-backoff": "t", "proj:Mail": "m"}})
    assert set(s.type_map) == {"Retry.test.exponential-backoff", "proj:Mail"}


def test_type_map_value_must_be_task_name() -> None:
    assert "ojs.type_map" in bad({"type_map": {"email.send": ""}})
    assert "ojs.type_map" in bad({"type_map": {"email.send": 3}})


def test_settings_frozen() -> None:
    s = read_settings({})
    with pytest.raises(ValueError):
        s.sweep_interval = 1.0


def test_store_url_scheme_is_checked_when_the_settings_are_read() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"ojs\.store_url: unsupported scheme 'mongodb'"):
        read_settings({"store_url": "mongodb://localhost/ojs"})


def test_a_store_url_naming_a_driver_that_cannot_be_loaded_is_a_settings_error() -> None:
    """``postgresql+psycopg2://`` without psycopg2 (which no extra installs): a clear line
    when the settings are read, not a traceback at the first enqueue."""
    pytest.importorskip("sqlalchemy")
    try:
        import psycopg2  # noqa: F401
        pytest.skip("psycopg2 is installed here")
    except ImportError:
        pass
    with pytest.raises(ImproperlyConfigured,
                       match=r"ojs\.store_url: .*names the driver 'psycopg2', which cannot be "
                             r"loaded \(No module named 'psycopg2'\)"):
        read_settings({"store_url": "postgresql+psycopg2://postgres:secret@127.0.0.1/test"})


def test_a_store_url_whose_extra_is_missing_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ojs_celery import compat

    monkeypatch.setattr(compat, "_missing", lambda modules: list(modules))
    with pytest.raises(ImproperlyConfigured, match=r"ojs\.store_url: .*ojs-celery\[redis\]"):
        read_settings({"store_url": "redis://:secret@127.0.0.1:6379/0"})
    try:
        read_settings({"store_url": "redis://:secret@127.0.0.1:6379/0"})
    except ImproperlyConfigured as exc:
        assert "secret" not in str(exc)


def test_a_store_prefix_too_long_for_postgresql_names_is_refused_on_postgresql_only() -> None:
    """PostgreSQL cuts names over 63 bytes: with a 40-character prefix the store's index names
    were cut and every store call failed (the CLI said the job "may or may not be stored")."""
    postgres = "postgresql://postgres@127.0.0.1:5432/test"
    with pytest.raises(ImproperlyConfigured,
                       match=r"ojs\.store_prefix: at most 39 characters with a PostgreSQL store"):
        read_settings({"store_url": postgres, "store_prefix": "p" * 40})
    assert read_settings({"store_url": postgres, "store_prefix": "p" * 39}).store_prefix
    assert read_settings({"store_url": "sqlite:///x.db", "store_prefix": "p" * 40}).store_prefix


@pytest.mark.parametrize("value", [86401, 1e9])
def test_a_worker_heartbeat_timeout_over_a_day_is_refused(value: float) -> None:
    """A worker records its own timeout and sweepers wait for it: a huge one would leave a
    dead worker's jobs unrecovered that long."""
    with pytest.raises(ImproperlyConfigured,
                       match=r"ojs\.worker_heartbeat_timeout: at most a day \(86400s\)"):
        read_settings({"worker_heartbeat_timeout": value})


@pytest.mark.parametrize("value", [86401, 10 * 365 * DAY])
def test_a_shutdown_drain_over_a_day_is_refused(value: float) -> None:
    """A stopping worker waits this long for its jobs, and its deploy with it: a drain of
    years is the unbounded drain an infinite one was, in all but name."""
    assert read_settings({"shutdown_grace_period": DAY}).shutdown_grace_period == DAY
    with pytest.raises(ImproperlyConfigured,
                       match=r"ojs\.shutdown_grace_period: at most a day \(86400s\): a stopping "
                             r"worker waits this long for its running jobs"):
        read_settings({"shutdown_grace_period": value})


@pytest.mark.parametrize("value", [float("inf"), "inf", "Infinity", "1e400"])
@pytest.mark.parametrize(
    "key",
    ["dispatch_grace", "redispatch_after", "shutdown_grace_period", "schedule_horizon",
     "sweep_interval", "heartbeat_interval", "execution_tolerance", "shutdown_cancel_window",
     "retention.completed", "retention.dead_letter", "worker_heartbeat_timeout", "store_timeout",
     "publish_timeout"],
)
def test_an_infinite_duration_is_refused_not_read_as_never(key: str, value: Any) -> None:
    """pydantic reads ``inf`` (and ``1e400``, beyond a double) as a float: a drain, a
    republish or a deadline that never came, where nothing may wait for ever."""
    outer, _, inner = key.partition(".")
    message = bad({outer: {inner: value}} if inner else {key: value})
    assert f"ojs.{key}: must be a finite number of seconds, not inf: nothing waits for ever" \
        in message


@pytest.mark.parametrize("value", [1e300, "1e300", 101 * 365 * DAY])
@pytest.mark.parametrize(
    "key", ["dispatch_grace", "redispatch_after", "schedule_horizon", "execution_tolerance",
            "retention.completed", "retention.dead_letter"],
)
def test_a_duration_over_a_hundred_years_is_refused_not_read_as_never(
    key: str, value: Any
) -> None:
    """``1e300`` is never too, by another name, and past what a wait can take
    (``threading.TIMEOUT_MAX``): the envelope's bound on a duration, a hundred years."""
    outer, _, inner = key.partition(".")
    message = bad({outer: {inner: value}} if inner else {key: value})
    assert (f"ojs.{key}: must be at most 3153600000 seconds (a hundred years), not "
            f"{float(value)}: nothing waits for ever") in message
    assert read_settings({outer: {inner: 3153600000}} if inner else {key: 3153600000})


def test_a_default_timeout_over_a_hundred_years_is_refused_at_start() -> None:
    """It is a job's timeout, bounded as an envelope's: accepted here, it failed every Celery
    call of a task with no time limit (``InvalidJob`` naming ``timeout``)."""
    assert ("ojs.default_timeout: must be at most 3153600000 seconds (a hundred years), not "
            "1000000000000") in bad({"default_timeout": 10**12})
    assert read_settings({"default_timeout": 3153600000}).default_timeout == 3153600000


@pytest.mark.parametrize("key", ["dispatch_grace", "shutdown_grace_period", "sweep_interval",
                                 "worker_heartbeat_timeout", "store_timeout", "publish_timeout",
                                 "retention.completed"])
def test_nan_is_named_for_what_it_is_not_as_a_bound(key: str) -> None:
    """NaN failed the field's lower bound first ("Input should be greater than 0"), which
    named a rule NaN does not break as the problem (``store_timeout``: "less than or equal to
    3600"): the finite rule is checked before."""
    outer, _, inner = key.partition(".")
    for value in (float("nan"), "nan", "NaN"):
        message = bad({outer: {inner: value}} if inner else {key: value})
        assert f"ojs.{key}: must be a finite number of seconds, not nan" in message


def test_celery_ojs_is_read_from_an_upper_case_configuration(tmp_path: Any) -> None:
    """An app configured in Celery's old upper-case style (``BROKER_URL``,
    ``CELERY_RESULT_BACKEND``; or a Django settings module read without a namespace) keeps
    ``CELERY_OJS`` under that name: it was ignored, and the app ran on the default store."""
    import types

    from celery import Celery

    from ojs_celery import install
    from ojs_celery.runtime import get_runtime

    store = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    config = types.SimpleNamespace(
        BROKER_URL="memory://", CELERY_RESULT_BACKEND="cache+memory://",
        CELERY_DEFAULT_QUEUE="old", CELERY_OJS={"store_url": store, "sweep_interval": 7})
    app = Celery("old", set_as_current=False)
    app.config_from_object(config)
    install(app)
    assert app.conf.task_default_queue == "old"  # Celery read the old-style names
    settings = get_runtime(app).settings
    assert (settings.store_url, settings.sweep_interval) == (store, 7)

    bad_config = types.SimpleNamespace(
        BROKER_URL="memory://", CELERY_OJS={"store_url": store, "sweep_intervall": 7})
    app = Celery("old", set_as_current=False)
    app.config_from_object(bad_config)
    install(app)
    with pytest.raises(ImproperlyConfigured, match=r"ojs\.sweep_intervall: unknown setting"):
        get_runtime(app).settings  # noqa: B018


def test_ojs_wins_over_celery_ojs() -> None:
    conf = {"ojs": {"sweep_interval": 3}, "CELERY_OJS": {"sweep_interval": 9}}
    assert read_settings(raw_settings(conf)).sweep_interval == 3
    assert read_settings(raw_settings({"CELERY_OJS": {"sweep_interval": 9}})).sweep_interval == 9
    assert raw_settings({}) is None
