"""Publish options of an attempt: queue, broker priority, time limits and the ``ojs`` header."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from celery import Celery

from ojs_celery import OJSTask, enqueue, install
from ojs_celery.envelope import Job, from_epoch, parse_envelope
from ojs_celery.header import build as ojs_header
from ojs_celery.header import snapshot as record_from_header
from ojs_celery.producer import broker_priority, celery_queue, time_limits
from ojs_celery.runtime import Runtime

T0 = 1_800_000_000.0


@pytest.fixture(autouse=True)
def _no_broker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CELERY_BROKER_URL", "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL"):
        monkeypatch.delenv(name, raising=False)


def app_for(broker: str | None) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    install(app)
    return app


def job(created_at: float | None = T0, **fields: Any) -> Job:
    data: dict[str, Any] = {"type": "email.send", "args": []}
    data.update(fields)
    j = parse_envelope(data)
    j.created_at = from_epoch(created_at) if created_at is not None else None
    return j


# --------------------------------------------------------------------------- queue


def test_celery_queue_default_maps_to_app_default_queue() -> None:
    app = app_for("memory://")
    assert celery_queue(app, "default") == "celery"
    app.conf.task_default_queue = "jobs"
    assert celery_queue(app, "default") == "jobs"


@pytest.mark.parametrize("name", ["emails", "emails.high", "celery", "q-1"])
def test_celery_queue_other_names_unchanged(name: str) -> None:
    app = app_for("memory://")
    app.conf.task_default_queue = "jobs"
    assert celery_queue(app, name) == name


# --------------------------------------------------------------------------- priority


@pytest.mark.parametrize(
    "broker", ["amqp://guest@localhost//", "pyamqp://localhost//", "amqps://localhost//"]
)
def test_priority_amqp_higher_first_and_normal_is_celerys_default(broker: str) -> None:
    """Normal (0) is sent without a priority, as plain Celery sends a task without one (0 on
    RabbitMQ, its lowest): a positive priority goes ahead of it, a negative one cannot go
    lower and stays with it."""
    app = app_for(broker)
    assert broker_priority(app, 0, 10) is None
    assert broker_priority(app, 100, 10) == 10
    assert broker_priority(app, 1, 10) == 1
    assert broker_priority(app, -100, 10) is None
    assert broker_priority(app, 100, 255) == 255


def test_priority_amqp_monotonic_and_in_range() -> None:
    app = app_for("amqp://localhost//")
    values = [broker_priority(app, p, 10) or 0 for p in range(-100, 101)]
    assert all(0 <= v <= 10 for v in values)
    assert values == sorted(values)


@pytest.mark.parametrize(
    "broker",
    ["redis://localhost:6379/0", "rediss://localhost:6380/0", "sentinel://localhost:26379"],
)
def test_priority_redis_zero_first_and_normal_is_celerys_default(broker: str) -> None:
    """Normal (0) is sent without a priority (0 on Redis, served first): a negative priority
    goes behind it, a positive one cannot go further ahead and stays with it."""
    app = app_for(broker)
    assert broker_priority(app, 0, 10) is None
    assert broker_priority(app, -100, 10) == 9
    assert broker_priority(app, -1, 10) == 1
    assert broker_priority(app, 100, 10) is None
    assert broker_priority(app, -100, 255) == 9  # amqp_max does not matter for Redis


def test_priority_redis_monotonic_and_in_range() -> None:
    app = app_for("redis://localhost:6379/0")
    values = [broker_priority(app, p, 10) or 0 for p in range(-100, 101)]
    assert all(0 <= v <= 9 for v in values)
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("broker", ["filesystem://", "memory://", "sqs://"])
def test_priority_ignored_by_other_transports(broker: str) -> None:
    app = app_for(broker)
    assert broker_priority(app, 100, 10) is None
    assert broker_priority(app, 0, 10) is None


def test_priority_scheme_case_insensitive() -> None:
    assert broker_priority(app_for("REDIS://localhost"), -100, 10) == 9


def test_priority_default_broker_is_amqp() -> None:
    app = app_for(None)
    assert app.connection_for_write().transport_cls == "amqp"  # no connection is made
    assert broker_priority(app, 100, 10) == 10


def test_priority_redis_socket_url() -> None:
    assert broker_priority(app_for("redis+socket:///tmp/redis.sock"), -100, 10) == 9


# --------------------------------------------------------------------------- time limits


def test_time_limits_soft_is_timeout_hard_adds_grace() -> None:
    assert time_limits(job(timeout=60, grace_period=30), T0) == (60.0, 90.0)
    assert time_limits(job(), T0) == (1800.0, 1830.0)


def test_time_limits_no_soft_with_zero_grace() -> None:
    assert time_limits(job(timeout=60, grace_period=0), T0) == (None, 60.0)


def test_time_limits_unclamped_when_total_leaves_room() -> None:
    j = job(timeout=60, grace_period=30, total_timeout=1000)
    assert time_limits(j, T0 + 100) == (60.0, 90.0)
    assert time_limits(j, T0 + 910) == (60.0, 90.0)  # exactly 90 s left


def test_time_limits_hard_clamped_to_total_remaining() -> None:
    j = job(timeout=60, grace_period=30, total_timeout=1000)
    assert time_limits(j, T0 + 930) == (60.0, 70.0)


def test_time_limits_soft_clamped_too() -> None:
    j = job(timeout=60, grace_period=30, total_timeout=1000)
    # 40 s left: both limits are clamped to 40 s, so no separate soft limit is sent.
    assert time_limits(j, T0 + 960) == (None, 40.0)
    # 65 s left: hard clamped, soft (60 s) still below it.
    assert time_limits(j, T0 + 935) == (60.0, 65.0)


def test_time_limits_clamp_with_zero_grace() -> None:
    j = job(timeout=60, grace_period=0, total_timeout=100)
    assert time_limits(j, T0 + 70) == (None, 30.0)


def test_time_limits_at_least_one_second() -> None:
    j = job(timeout=60, grace_period=30, total_timeout=100)
    soft, hard = time_limits(j, T0 + 500)  # already past the total deadline
    assert hard == 1.0
    assert soft is None


def test_time_limits_future_start_uses_start_time() -> None:
    j = job(timeout=60, grace_period=30, total_timeout=200)
    assert time_limits(j, T0) == (60.0, 90.0)
    assert time_limits(j, T0 + 150) == (None, 50.0)


def test_time_limits_without_created_at_not_clamped() -> None:
    j = job(created_at=None, timeout=60, grace_period=30, total_timeout=100)
    assert time_limits(j, T0 + 10_000) == (60.0, 90.0)


# --------------------------------------------------------------------------- header


def test_ojs_header_without_deadlines() -> None:
    assert ojs_header(job(), 3) == {
        "token": 3,
        "created_at": T0,
        "ttl_deadline": None,
        "total_deadline": None,
    }


def test_ojs_header_with_deadlines() -> None:
    j = job(timeout=10, total_timeout=600, enqueue_ttl=30)
    assert ojs_header(j, 1) == {
        "token": 1,
        "created_at": T0,
        "ttl_deadline": T0 + 30,
        "total_deadline": T0 + 600,
    }


def test_ojs_header_deadlines_fixed_from_created_at() -> None:
    j = job(timeout=10, total_timeout=600, enqueue_ttl=30)
    assert ojs_header(j, 2)["total_deadline"] == ojs_header(j, 7)["total_deadline"]
    assert ojs_header(j, 7)["token"] == 7


def test_ojs_header_carries_a_record_snapshot_the_worker_can_start_from() -> None:
    from ojs_celery import lifecycle

    created = lifecycle.create(job(timeout=10, args=[1, {"k": None}]), T0, lifecycle.Policy())
    record = created.record
    assert record is not None
    record.version = 1
    header = ojs_header(record.job, 1, record)
    assert {k: v for k, v in header.items() if k not in ("snapshot", "origin")} == ojs_header(
        record.job, 1)
    assert header["origin"] == record.origin
    assert record_from_header(header, record.job.id) == record
    assert record_from_header(header, "01890a5d-ac96-774b-bcce-b302099a8057") is None
    assert record_from_header({**header, "token": 2}, record.job.id) is None
    assert record_from_header(ojs_header(record.job, 1), record.job.id) is None  # none sent
    fields, _, job_json = header["snapshot"].partition("\n")
    for broken_text in (f"{fields}\n{{not json", "[1, 2]\n" + job_json, "not json\n" + job_json,
                        fields + job_json, ""):
        assert record_from_header({**header, "snapshot": broken_text}, record.job.id) is None
    big = lifecycle.create(job(args=["x" * 10_000]), T0, lifecycle.Policy()).record
    assert big is not None and "snapshot" not in ojs_header(big.job, 1, big)


def test_the_nested_snapshot_of_messages_published_before_an_upgrade_is_still_read() -> None:
    from ojs_celery import lifecycle
    from ojs_celery.store.base import RECORD_FIELDS, encode_job

    record = lifecycle.create(job(timeout=10), T0, lifecycle.Policy()).record
    assert record is not None
    record.version = 1
    header = {k: v for k, v in ojs_header(record.job, 1, record).items() if k != "snapshot"}
    nested = {name: getattr(record, name) for name in RECORD_FIELDS}
    header["record"] = {**nested, "job": encode_job(record.job)}
    assert record_from_header(header, record.job.id) == record


def test_a_snapshot_is_the_text_the_store_wrote_and_a_copy_forgets_it() -> None:
    """The store's write keeps the job's JSON on the record for the message's snapshot (one
    encoding per write); the next version, built in a copy, is encoded afresh."""
    from ojs_celery import lifecycle
    from ojs_celery.store.base import decode_job, encode_job

    record = lifecycle.create(job(args=[1]), T0, lifecycle.Policy()).record
    assert record is not None and record.written_json is None
    record.written_json = encode_job(record.job)  # as the store's write leaves it
    assert ojs_header(record.job, 1, record)["snapshot"].endswith("\n" + record.written_json)
    following = record.copy()
    following.job.attempt = 3
    assert following.written_json is None
    snapshot = ojs_header(following.job, 1, following)["snapshot"]
    assert decode_job(snapshot.partition("\n")[2]).attempt == 3


def test_client_chose_id_is_decided_from_the_parsed_envelope() -> None:
    from ojs_celery.api import client_chose_id

    id_ = "01a1fc00-0000-7000-8000-000000000001"
    assert not client_chose_id(parse_envelope({"type": "a", "args": []}))
    assert not client_chose_id(parse_envelope({"type": "a", "args": [], "id": None}))
    assert client_chose_id(parse_envelope({"type": "a", "args": [], "id": id_}))
    assert not client_chose_id(parse_envelope('{"type": "a", "args": ["id"]}'))
    assert client_chose_id(parse_envelope('{"\\u0069d": "%s", "type": "a", "args": []}'
                                          .replace("%s", id_)))
    assert client_chose_id(parse_envelope(job()))  # a Job given whole keeps its id


# --------------------------------------------------------------------------- task defaults


def folder_app(tmp_path: pathlib.Path) -> tuple[Celery, pathlib.Path, Runtime]:
    """An installed app on the filesystem transport (its messages are files in the folder
    returned) and a SQLite store."""
    folder = tmp_path / "broker"
    folder.mkdir()
    app = Celery("t", broker="filesystem://", set_as_current=False)
    app.conf.broker_transport_options = {"data_folder_in": str(folder),
                                         "data_folder_out": str(folder),
                                         "control_folder": str(tmp_path / "control")}
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}", "events": False}
    return app, folder, install(app)


def test_a_task_whose_soft_limit_is_past_its_hard_one_is_called_as_in_celery(
    tmp_path: pathlib.Path,
) -> None:
    """Celery 5.5 and later refuse such a call (``ValueError`` from ``apply_async``), before
    anything is sent; Celery 5.4 sends it, and its job gets the hard limit as its timeout."""
    from ojs_celery import compat
    from ojs_celery.lifecycle import REDISPATCH

    app, folder, runtime = folder_app(tmp_path)

    app.conf.task_time_limit = 2  # the setting counts as the task's own, as in Celery

    @app.task(shared=False, name="t.inverted", base=OJSTask, soft_time_limit=5, time_limit=1)
    def inverted() -> None: ...

    @app.task(shared=False, name="t.by_setting", base=OJSTask, soft_time_limit=5)
    def by_setting() -> None: ...

    try:
        if compat.REFUSES_SOFT_LIMIT_PAST_HARD:
            with pytest.raises(ValueError, match="soft_time_limit must be less than or equal"):
                inverted.delay()
            with pytest.raises(ValueError, match="soft_time_limit must be less than or equal"):
                by_setting.s().delay()
            assert list(folder.glob("*.msg")) == []
            assert runtime.store.scan(REDISPATCH.name, None, 10)[0] == []  # nothing stored
        else:
            job = runtime.store.get(inverted.delay().id)
            assert job is not None and (job.timeout, job.grace_period) == (1, 0)
        assert enqueue({"type": "t.inverted", "args": []}, app=app).timeout  # its own limits
    finally:
        runtime.close()
        app.close()


def test_the_tasks_own_expires_and_soft_limit_do_not_reach_the_message(
    tmp_path: pathlib.Path,
) -> None:
    """Celery 5.7's ``send_task`` fills options the call did not give from the task's own. An
    OJS message carries the job's limits alone, and never a Celery ``expires``: the task's
    ``expires`` is the job's ``expires_at`` (with it in the message, the worker would drop
    the message and the job would wait on, ``scheduled``, for the sweeper's backstop)."""
    app, folder, runtime = folder_app(tmp_path)

    @app.task(shared=False, name="t.limited", base=OJSTask, expires=5, soft_time_limit=100,
              time_limit=110)
    def limited(n: int) -> int:
        return n

    try:
        called = limited.apply_async((1,), countdown=10)
        stored = runtime.store.get(called.id)
        assert stored is not None and stored.expires_at is not None
        envelope = enqueue({"type": "t.limited", "args": [2], "timeout": 5, "grace_period": 0},
                           app=app)
        sent = {message["headers"]["id"]: message["headers"]
                for message in (json.loads(path.read_text()) for path in folder.glob("*.msg"))}
        assert sent[called.id]["expires"] is None
        assert sent[called.id]["timelimit"] == [110, 100]
        assert sent[envelope.id]["expires"] is None
        assert sent[envelope.id]["timelimit"] == [5, None]  # grace 0: no soft limit
    finally:
        runtime.close()
        app.close()
