"""A Celery caller's arguments that Celery's JSON serializer carries as typed values (a
``datetime``, ``date``, ``time``, ``Decimal``, ``UUID``, ``bytes``): kept in the record as that
serializer's JSON, sent as the values in every message, whoever publishes it (the call, a
retry, the sweeper), and matched by the worker against the record. An envelope from outside
still may not hold such JSON. In-process, against the broker folder; the worker's side is in
tests/test_celery_semantics.py and tests/test_eager.py."""

from __future__ import annotations

import base64
import json
import pathlib
from collections.abc import Iterator
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import pytest
from celery import Celery
from click.testing import CliRunner
from kombu import serialization
from kombu.exceptions import EncodeError

from ojs_celery import InvalidJob, enqueue, get_job
from ojs_celery.arrival import carries_call
from ojs_celery.canvas import celery_context
from ojs_celery.cli import commands
from ojs_celery.producer import trusted_options
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import sweep
from tests.e2eapp import make_app
from tests.workers import filesystem_config

AT = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
ARGS = ["t", AT, [Decimal("1.10"), b"\xff"]]
KWARGS = {"ref": UUID(int=7), "day": {"d": date(2030, 1, 1)}}
#: How the record keeps them: kombu's typed JSON, as a typed result is kept.
STORED_ARGS = ["t", {"__type__": "datetime", "__value__": "2030-01-02T03:04:05+00:00"},
               [{"__type__": "decimal", "__value__": "1.10"},
                {"__type__": "base64", "__value__": "/w=="}]]
STORED_KWARGS = {"ref": {"__type__": "uuid",
                         "__value__": {"hex": "00000000000000000000000000000007"}},
                 "day": {"d": {"__type__": "date", "__value__": "2030-01-01"}}}


@pytest.fixture()
def app(tmp_path: pathlib.Path) -> Iterator[Celery]:
    yield make_app(filesystem_config(tmp_path))


def sent(app: Celery) -> list[tuple[Any, Any]]:
    """The ``(args, kwargs)`` of each message in the broker folder, as the worker decodes
    them."""
    folder = pathlib.Path(app.conf.broker_transport_options["data_folder_in"])
    found = []
    for path in sorted(folder.glob("*.msg")):
        message = json.loads(path.read_text())
        body = base64.b64decode(message["body"])
        args, kwargs, _ = serialization.loads(  # type: ignore[no-untyped-call]
            body, message["content-type"], message["content-encoding"],
            accept=[message["content-type"]])
        found.append((args, kwargs))
    return found


def drop_messages(app: Celery) -> None:
    folder = pathlib.Path(app.conf.broker_transport_options["data_folder_in"])
    for path in folder.glob("*.msg"):
        path.unlink()


def test_the_sweeper_publishes_a_lost_message_again_with_the_typed_values(app: Celery) -> None:
    """Published from the record (the redispatch of a lost message, as a retry is), the
    message carries the values the call gave; the record keeps kombu's typed JSON."""
    call = app.tasks["e2e.typed_echo"].delay(*ARGS, **KWARGS)
    assert sent(app) == [(ARGS, KWARGS)]
    job = get_job(call.id, app=app)
    assert job is not None
    assert job.args == STORED_ARGS
    assert (job.model_extra or {})["x_celery_kwargs"] == STORED_KWARGS
    drop_messages(app)
    created = job.created_at.timestamp()  # type: ignore[union-attr]
    assert sweep(get_runtime(app), now=created + 3601).published == 1
    assert sent(app) == [(ARGS, KWARGS)]


def test_the_worker_matches_the_messages_typed_values_with_the_record(app: Celery) -> None:
    """The worker drops a message whose arguments are not its job's: decoded, a typed
    message's arguments are the record's, and other values are not."""
    job = get_job(app.tasks["e2e.typed_echo"].delay(*ARGS, **KWARGS).id, app=app)
    assert job is not None
    [(args, kwargs)] = sent(app)
    assert carries_call(args, kwargs, job)
    assert carries_call(tuple(args), kwargs, job)
    assert not carries_call(["t", AT.replace(year=2031), args[2]], kwargs, job)
    assert not carries_call(args, {**kwargs, "ref": UUID(int=8)}, job)
    assert not carries_call(args, {**kwargs, "ref": {1}}, job)


def test_a_serializer_other_than_json_gets_the_values(tmp_path: pathlib.Path) -> None:
    """With ``task_serializer = "pickle"`` the message holds the values themselves, as plain
    Celery's does, not kombu's typed JSON as dicts (the record keeps that JSON)."""
    config = filesystem_config(tmp_path)
    config["celery"] = {"task_serializer": "pickle", "accept_content": ["json", "pickle"]}
    app = make_app(config)
    call = app.tasks["e2e.typed_echo"].delay(*ARGS, **KWARGS)
    assert sent(app) == [(ARGS, KWARGS)]
    job = get_job(call.id, app=app)
    assert job is not None and job.args == STORED_ARGS


def test_a_serializer_that_cannot_write_them_refuses_the_call(tmp_path: pathlib.Path) -> None:
    """A serializer that has no ``datetime`` (``msgpack``) would fail every message of the
    job after it is stored: the call raises ``EncodeError``, as plain Celery's does."""
    serialization.register("h83strict", lambda value: json.dumps(value), json.loads,
                           content_type="application/x-h83strict", content_encoding="utf-8")
    try:
        config = filesystem_config(tmp_path)
        config["celery"] = {"task_serializer": "h83strict"}
        app = make_app(config)
        with pytest.raises(EncodeError) as refused:
            app.tasks["e2e.typed_echo"].delay(*ARGS)
        assert isinstance(refused.value, InvalidJob)
        assert [path for path, _ in refused.value.violations] == ["args"]
        assert sent(app) == []
        assert get_runtime(app).store.due("dispatch", 1e12, 10) == []  # nothing stored
        app.tasks["e2e.typed_echo"].delay("plain", 1)  # JSON data: as before
    finally:
        serialization.registry._encoders.pop("h83strict", None)
        serialization.registry._decoders.pop("application/x-h83strict", None)


def test_an_envelope_may_not_hold_typed_json_that_a_celery_caller_gets_stored(
        app: Celery) -> None:
    """Only a Celery caller's Python values become typed JSON: the same JSON in an envelope
    from outside (another language, the CLI) is refused, as before; and so is a Python dict
    shaped as a tag in a Celery call. ``ojs-celery get`` shows the record's JSON."""
    call = app.tasks["e2e.typed_echo"].delay(*ARGS, **KWARGS)
    for envelope in ({"type": "e2e.typed_echo", "args": STORED_ARGS},
                     {"type": "e2e.typed_echo", "args": [], "x_celery_kwargs": STORED_KWARGS}):
        with pytest.raises(InvalidJob, match="__type__"):
            enqueue(envelope, app=app)
    with pytest.raises(InvalidJob, match="__type__"):
        app.tasks["e2e.typed_echo"].delay(AT, STORED_ARGS[1])
    shown = CliRunner().invoke(commands, ["get", call.id], obj=app)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["args"] == STORED_ARGS


def test_an_outcome_the_sweeper_reports_calls_canvas_with_the_values(app: Celery) -> None:
    """A chord body or an errback that the sweeper's report of an outcome calls gets its
    arguments as values, as from a worker's request (its options keep typed JSON)."""
    echo = app.tasks["e2e.typed_echo"]
    call = echo.apply_async(ARGS, KWARGS, link_error=echo.si(AT, b"raw"))
    job = get_job(call.id, app=app)
    assert job is not None
    request = celery_context(job, "e2e.typed_echo", trusted_options(job))
    assert request.args == ARGS and request.kwargs == KWARGS
    errback = request.errbacks  # one signature, as the call gave it
    assert (errback["args"], errback["kwargs"]) == ([AT, b"raw"], {})


def test_a_refusal_names_what_is_wrong_not_the_typed_values(app: Celery) -> None:
    """A call with a typed argument and something else wrong is refused for that only: its
    datetime is not named as an invalid JSON value beside it."""
    echo = app.tasks["e2e.typed_echo"]
    cases = [
        (lambda: echo.apply_async((AT,), task_id="bad/id"), ["id"]),
        (lambda: echo.apply_async((AT, float("nan")), {"k": {1}}), ["args"]),
        (lambda: echo.apply_async((AT, {1}), {"k": AT}), ["args[1]"]),
        (lambda: echo.apply_async((AT,), {"k": [AT, object()]}), ["x_celery_kwargs.k[1]"]),
    ]
    for call, paths in cases:
        with pytest.raises(InvalidJob) as refused:
            call()
        assert [path for path, _ in refused.value.violations] == paths
    assert sent(app) == []
