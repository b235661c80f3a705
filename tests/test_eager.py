"""Eager mode (``task_always_eager``, ``.apply()``): OJS tasks run in-process as Celery runs them,
with no server. The broker and the store point at a port nothing listens on, so any publish,
outbox entry or store write would fail the test."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any
from unittest import mock
from uuid import UUID

import pytest
from celery import Celery, Task, chain, group
from celery.exceptions import MaxRetriesExceededError
from kombu.exceptions import EncodeError
from pydantic import BaseModel

from ojs_celery import InvalidJob, JobError, OJSTask, current_job, install
from ojs_celery.runtime import NotInstalled


class Item(BaseModel):
    """A ``pydantic=True`` task's argument (at module level: the annotations are strings)."""

    name: str
    qty: int


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def app() -> Iterator[Celery]:
    port = dead_port()
    app = Celery("eager_test", set_as_current=False)
    app.conf.update(
        broker_url=f"redis://127.0.0.1:{port}/0",
        result_backend=f"redis://127.0.0.1:{port}/0",
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        task_always_eager=True,
        task_eager_propagates=False,  # as Celery, which raises Retry itself with True
        ojs={"store_url": f"redis://127.0.0.1:{port}/0"},
    )
    install(app)
    calls: list[Any] = []
    app.runs = calls  # type: ignore[attr-defined]

    @app.task(shared=False, name="eager.add", base=OJSTask)
    def add(a: int, b: int) -> int:
        ctx = current_job()
        calls.append(("add", ctx.job_id, ctx.attempt))
        ctx.progress(0.5, checkpoint={"at": a})
        assert ctx.record.job.last_checkpoint == {"at": a}  # ctx.job: as the attempt began
        return a + b

    @app.task(shared=False, name="eager.flaky", base=OJSTask, bind=True, max_retries=3)
    def flaky(self: OJSTask, succeed_on: int, when: datetime | None = None) -> str:
        ctx = current_job()
        calls.append(("flaky", self.request.retries, ctx.attempt))
        if self.request.retries + 1 < succeed_on:
            raise self.retry(exc=ConnectionError("not yet"), countdown=60)
        assert when is None or isinstance(when, datetime)
        return f"ok on {ctx.attempt}"

    @app.task(shared=False, name="eager.when", base=OJSTask)
    def when(year: int) -> dict[str, Any]:
        return {"when": datetime(year, 1, 1, tzinfo=timezone.utc)}  # a typed value of JSON

    @app.task(shared=False, name="eager.pair", base=OJSTask)
    def pair(a: int, b: int) -> set[int]:
        return {a, b}  # neither JSON data nor a typed value of Celery's JSON serializer

    @app.task(shared=False, name="eager.echo", base=OJSTask)
    def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(("echo", args, kwargs))
        return {"args": list(args), "kwargs": kwargs}

    @app.task(shared=False, name="eager.joins", base=OJSTask)
    def joins() -> int:
        return int(add.delay(1, 1).get())

    @app.task(shared=False, name="eager.resumes", base=OJSTask, bind=True, max_retries=3)
    def resumes(self: OJSTask) -> Any:
        ctx = current_job()
        calls.append(("resumes", ctx.attempt, ctx.last_checkpoint))
        if ctx.attempt < 3:
            ctx.progress(0.3 * ctx.attempt, data={"a": 1}, checkpoint={"at": ctx.attempt})
            raise self.retry(exc=ConnectionError("again"), countdown=1)
        return ctx.record.job.progress

    @app.task(shared=False, name="eager.replaces", base=OJSTask, bind=True)
    def replaces(self: OJSTask) -> None:
        raise self.replace(add.s(1, 2))

    yield app


def test_delay_runs_in_process_with_current_job(app: Celery) -> None:
    result = app.tasks["eager.add"].delay(2, 3)
    assert result.get() == 5 and result.state == "SUCCESS"
    assert app.runs == [("add", result.id, 1)]  # type: ignore[attr-defined]


def test_apply_runs_in_process_without_always_eager(app: Celery) -> None:
    app.conf.task_always_eager = False
    result = app.tasks["eager.add"].apply((1, 1), task_id="my-id")
    assert result.get() == 2
    assert app.runs == [("add", "my-id", 1)]  # type: ignore[attr-defined]


def test_self_retry_reruns_at_once_bounded_by_max_retries(app: Celery) -> None:
    flaky = app.tasks["eager.flaky"]
    assert flaky.delay(3).get() == "ok on 3"
    assert app.runs == [("flaky", 0, 1), ("flaky", 1, 2), ("flaky", 2, 3)]  # type: ignore[attr-defined]
    app.runs.clear()  # type: ignore[attr-defined]
    with pytest.raises((ConnectionError, MaxRetriesExceededError)):
        flaky.delay(99).get()
    assert len(app.runs) == 4  # type: ignore[attr-defined]  # the first run and max_retries=3


def test_a_mock_of_retry_sees_celerys_call_shape(app: Celery) -> None:
    flaky = app.tasks["eager.flaky"]
    with (mock.patch.object(flaky, "retry", side_effect=RuntimeError("stop")) as retry,
          pytest.raises(RuntimeError, match="stop")):
        flaky.delay(2).get()
    retry.assert_called_once()
    assert set(retry.call_args.kwargs) == {"exc", "countdown"}
    assert isinstance(retry.call_args.kwargs["exc"], ConnectionError)


def test_canvas_runs_eagerly(app: Celery) -> None:
    add = app.tasks["eager.add"]
    assert chain(add.s(1, 2), add.s(3)).apply_async().get() == 6
    assert group(add.s(i, i) for i in range(3)).apply_async().get() == [0, 2, 4]


def test_a_call_with_arguments_json_cannot_carry_is_refused_as_on_a_worker(app: Celery) -> None:
    """A published call would raise InvalidJob at the call: an eager test must not pass. It
    is also kombu's EncodeError, as plain Celery's call raises, for an ``except`` of either."""
    add = app.tasks["eager.add"]
    with pytest.raises(EncodeError) as caught:
        add.delay(object(), 1)
    assert isinstance(caught.value, InvalidJob)
    assert [path for path, _ in caught.value.violations] == ["args[0]"]
    with pytest.raises(InvalidJob, match="x_celery_kwargs"):
        add.apply_async((1,), {"b": {b"a set"}})
    assert app.runs == []  # type: ignore[attr-defined]


def test_typed_arguments_reach_the_handler_as_in_celery(app: Celery) -> None:
    """A ``datetime``, ``Decimal``, ``UUID`` or ``bytes`` argument (nested too), which Celery's
    JSON serializer carries as a typed value, runs as in plain Celery, its retries too (they
    used to refuse the call with ``InvalidJob``)."""
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    args = [at, {"amount": Decimal("1.50")}]
    kwargs = {"id": UUID(int=7), "raw": [b"\xff", date(2030, 1, 1)]}
    result = app.tasks["eager.echo"].delay(*args, **kwargs)
    assert result.get() == {"args": args, "kwargs": kwargs}
    assert app.runs == [("echo", tuple(args), kwargs)]  # type: ignore[attr-defined]
    assert app.tasks["eager.flaky"].delay(2, when=at).get() == "ok on 2"


def test_a_result_json_cannot_carry_fails_the_call_as_on_a_worker(app: Celery) -> None:
    """A set fails the call, as on a worker; a datetime is returned, as Celery's JSON
    serializer carries it."""
    when = app.tasks["eager.when"].delay(2026)
    assert when.get() == {"when": datetime(2026, 1, 1, tzinfo=timezone.utc)}
    result = app.tasks["eager.pair"].delay(1, 2)
    assert result.state == "FAILURE"
    assert isinstance(result.result, TypeError)
    assert "not JSON-serialisable" in str(result.result)


def test_an_explicit_apply_keeps_any_result(app: Celery) -> None:
    """``.apply()`` publishes nothing on a worker either: Celery's freedom stays."""
    app.conf.task_always_eager = False
    assert app.tasks["eager.when"].apply((2026,)).get() == {
        "when": datetime(2026, 1, 1, tzinfo=timezone.utc)}
    assert app.tasks["eager.add"].apply((datetime.now(timezone.utc), 1), throw=False).state in {
        "SUCCESS", "FAILURE"}  # runs (datetime + int fails in the handler, not at the call)


def test_arguments_reach_the_handler_as_from_a_message(app: Celery) -> None:
    """Serialized and read back, as Celery's eager apply_async does and a worker gets them."""
    app.tasks["eager.echo"].delay((1, 2), {1: "a"}, k=(3,))
    assert app.runs == [("echo", ([1, 2], {"1": "a"}), {"k": [3]})]  # type: ignore[attr-defined]


def test_result_get_inside_a_handler_raises_as_on_a_worker(app: Celery) -> None:
    result = app.tasks["eager.joins"].delay()
    assert result.state == "FAILURE"
    assert "Never call result.get() within a task" in str(result.result)


@pytest.mark.parametrize("task_id", ["Order-42", "order/42", "x" * 256])
def test_a_task_id_a_worker_refuses_is_refused(app: Celery, task_id: str) -> None:
    with pytest.raises(InvalidJob) as caught:
        app.tasks["eager.add"].apply_async((1, 2), task_id=task_id)
    assert [path for path, _ in caught.value.violations] == ["id"]
    assert app.runs == []  # type: ignore[attr-defined]


def test_a_task_id_is_lower_cased_as_on_a_worker(app: Celery) -> None:
    upper = "0190A5B2-7C3D-7E4F-8A9B-0C1D2E3F4A5B"
    result = app.tasks["eager.add"].apply_async((1, 2), task_id=upper)
    assert result.id == upper.lower()
    assert app.runs == [("add", upper.lower(), 1)]  # type: ignore[attr-defined]


def test_checkpoints_and_progress_carry_over_retries_as_on_a_worker(app: Celery) -> None:
    progress = app.tasks["eager.resumes"].delay().get()
    assert app.runs == [("resumes", 1, None), ("resumes", 2, {"at": 1}),  # type: ignore[attr-defined]
                        ("resumes", 3, {"at": 2})]
    assert progress is None  # a new attempt's record starts without the last one's progress


def test_progress_reads_as_on_a_worker(app: Celery) -> None:
    app.conf.task_always_eager = False

    @app.task(shared=False, name="eager.progress", base=OJSTask)
    def report() -> Any:
        ctx = current_job()
        ctx.progress(0.5, data={"a": 1})
        ctx.progress(0.25)
        assert ctx.job.progress is None  # the job as the attempt began
        return ctx.record.job.progress

    progress = report.apply().get()
    assert progress["progress"] == 0.5 and progress["data"] == {"a": 1}
    assert "updated_at" in progress


def test_self_replace_is_refused_as_on_a_worker(app: Celery) -> None:
    result = app.tasks["eager.replaces"].delay()
    assert result.state == "FAILURE"
    assert "self.replace() is not supported" in str(result.result)


@pytest.mark.skipif(not hasattr(Task, "_dump_pydantic_arguments"),
                    reason="Celery dumps a pydantic=True task's models at the call from 5.7")
def test_a_pydantic_task_gets_its_models_as_with_celery(app: Celery) -> None:
    """``pydantic=True``: the caller's models travel as JSON data and come back as models."""

    @app.task(shared=False, name="eager.typed", base=OJSTask, pydantic=True)
    def typed(item: Item) -> Item:
        assert isinstance(item, Item)
        return Item(name=item.name.upper(), qty=item.qty * 2)

    assert typed.delay(Item(name="a", qty=2)).get() == {"name": "A", "qty": 4}


def test_an_app_without_install_raises_not_installed_as_a_worker_call_would() -> None:
    bare = Celery("not_installed", set_as_current=False)
    bare.conf.task_always_eager = True

    @bare.task(shared=False, name="bare.add", base=OJSTask)
    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(NotInstalled, match="install"):
        add.delay(1, 2)


def test_a_callback_json_cannot_carry_is_refused_at_the_call_as_on_a_worker(app: Celery) -> None:
    add = app.tasks["eager.add"]
    with pytest.raises(InvalidJob) as caught:
        add.apply_async((1, 2), link=add.s({1}))
    assert [path for path, _ in caught.value.violations] == ["link[0].args[0]"]
    assert app.runs == []  # type: ignore[attr-defined]


def test_a_final_job_error_is_not_retried_by_autoretry_for_exception(app: Celery) -> None:
    """``JobError(retryable=False)`` (self.replace()'s refusal among them) ends the job
    whatever retries it: Celery's autoretry_for=(Exception,) would otherwise run it again."""

    @app.task(shared=False, name="eager.final", base=OJSTask, bind=True,
              autoretry_for=(Exception,), max_retries=3)
    def final(self: OJSTask) -> None:
        app.runs.append(("final", self.request.retries))  # type: ignore[attr-defined]
        raise JobError("declined", type="declined", retryable=False)

    result = final.delay()
    assert result.state == "FAILURE" and isinstance(result.result, JobError)
    assert app.runs == [("final", 0)]  # type: ignore[attr-defined]
