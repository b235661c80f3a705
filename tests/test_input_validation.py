"""What ``enqueue`` accepts can be published, and what it refuses it names, field by field,
with nothing stored or published. Runs against the embedded broker and store (no worker)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from kombu.exceptions import SerializerNotInstalled

from ojs_celery import DuplicateJob, InvalidJob, OJSTask, cancel, enqueue, enqueue_batch, get_job
from ojs_celery.api import JobNotFound
from ojs_celery.cli import EXIT_INVALID, commands
from ojs_celery.envelope import MAX_BATCH_BYTES, MAX_BATCH_JOBS, MAX_NESTING, new_job_id
from tests.e2eapp import make_app
from tests.workers import filesystem_config


@pytest.fixture()
def app(tmp_path: pathlib.Path) -> Iterator[Celery]:
    config = filesystem_config(tmp_path)
    config["celery"] = {"task_create_missing_queues": False}
    yield make_app(config)


def published(app: Celery) -> list[pathlib.Path]:
    folder = pathlib.Path(app.conf.broker_transport_options["data_folder_in"])
    return sorted(folder.glob("*.msg"))


def rejected(app: Celery, envelope: Any) -> list[tuple[str, str]]:
    before = published(app)
    with pytest.raises(InvalidJob) as raised:
        enqueue(envelope, app=app)
    assert published(app) == before
    return raised.value.violations


def nested(depth: int) -> list[Any]:
    top: list[Any] = []
    current = top
    for _ in range(depth - 1):
        inner: list[Any] = []
        current.append(inner)
        current = inner
    return top


def test_celery_kwargs_that_are_not_an_object_are_refused(app: Celery) -> None:
    job_id = new_job_id()
    found = rejected(app, {"id": job_id, "type": "e2e.add", "args": [1],
                           "x_celery_kwargs": [1]})
    assert [path for path, _ in found] == ["x_celery_kwargs"]
    assert get_job(job_id, app=app) is None


def test_a_queue_the_app_does_not_declare_is_refused(app: Celery) -> None:
    job_id = new_job_id()
    found = rejected(app, {"id": job_id, "type": "e2e.add", "args": [1, 2],
                           "queue": "nowhere"})
    assert [path for path, _ in found] == ["queue"]
    assert "task_create_missing_queues" in found[0][1]
    assert get_job(job_id, app=app) is None
    with pytest.raises(InvalidJob) as raised:  # Celery callers too
        app.tasks["e2e.add"].apply_async((1, 2), queue="nowhere")
    assert [path for path, _ in raised.value.violations] == ["queue"]
    assert published(app) == []
    enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)  # the default queue is declared
    assert len(published(app)) == 1


@pytest.mark.parametrize("as_text", [False, True])
def test_deep_nesting_is_refused_by_a_named_limit(app: Celery, as_text: bool) -> None:
    envelope: Any = {"type": "e2e.add", "args": nested(100_000)}
    if as_text:
        envelope = '{"type": "e2e.add", "args": ' + "[" * 100_000 + "]" * 100_000 + "}"
    found = rejected(app, envelope)
    assert len(found) == 1
    path, rule = found[0]
    assert path in ("args", "(envelope)")
    assert f"more than {MAX_NESTING} levels" in rule


def test_nesting_up_to_the_limit_is_accepted(app: Celery) -> None:
    job = enqueue({"type": "e2e.add", "args": [*nested(MAX_NESTING), 1]}, app=app)
    assert get_job(job.id, app=app) is not None
    found = rejected(app, {"type": "e2e.add", "args": nested(MAX_NESTING + 1),
                           "meta": {"a": nested(MAX_NESTING + 1)}})
    assert sorted(path for path, _ in found) == ["args", "meta"]


def test_every_problem_is_reported_at_once(app: Celery) -> None:
    found = rejected(app, {"type": "nope"})
    assert sorted(path for path, _ in found) == ["args", "type"]
    found = rejected(app, {"type": "nope", "args": "x", "queue": "nowhere", "priority": 1000,
                           "x_celery_link": {}})
    assert sorted(path for path, _ in found) == ["args", "priority", "queue", "type",
                                                  "x_celery_link"]


def test_an_id_spelled_with_json_escapes_is_a_chosen_id(app: Celery) -> None:
    job_id = new_job_id()
    text = '{"\\u0069d": "' + job_id + '", "type": "e2e.add", "args": [1, 2]}'
    first = enqueue(text, app=app)
    assert first.id == job_id
    other = text.replace("[1, 2]", "[2, 2]")
    with pytest.raises(DuplicateJob):
        enqueue(other, app=app)
    stored = get_job(job_id, app=app)
    assert stored is not None and stored.args == [1, 2]
    assert len(published(app)) == 1


def test_same_id_same_envelope_returns_the_existing_job(app: Celery) -> None:
    envelope = {"id": new_job_id(), "type": "e2e.add", "args": [1, 2], "x_trace": "t"}
    first = enqueue(envelope, app=app)
    again = enqueue(json.dumps({**envelope, "id": envelope["id"].upper()}), app=app)
    assert again.id == first.id and again.created_at == first.created_at
    assert len(published(app)) == 1  # published once


def test_same_id_different_envelope_is_a_duplicate(app: Celery) -> None:
    envelope = {"id": new_job_id(), "type": "e2e.add", "args": [1, 2]}
    enqueue(envelope, app=app)
    for change in ({"args": [1, 3]}, {"priority": 5}, {"x_trace": "t"}):
        with pytest.raises(DuplicateJob) as raised:
            enqueue({**envelope, **change}, app=app)
        assert isinstance(raised.value, InvalidJob)
        assert [path for path, _ in raised.value.violations] == ["id"]
        assert raised.value.job_id == envelope["id"]
    assert len(published(app)) == 1


def test_a_batch_with_an_unknown_type_names_the_field(app: Celery) -> None:
    with pytest.raises(InvalidJob) as raised:
        enqueue_batch([{"type": "e2e.add", "args": [1, 2]}, {"type": "e2e.missing", "args": []},
                       {"type": "e2e.plain", "args": [1]}], app=app)
    assert [path for path, _ in raised.value.violations] == ["[1].type", "[2].type"]
    assert published(app) == []


def test_non_utf8_bytes_are_refused(app: Celery) -> None:
    found = rejected(app, b'{"type": "e2e.add", "args": ["\xff\xfe"]}')
    assert [path for path, _ in found] == ["(envelope)"]
    assert "UTF-8" in found[0][1]


def test_a_batch_is_bounded_in_envelopes_and_in_bytes(app: Celery) -> None:
    """The OJS batch schema's limit (10,000 envelopes), and 32 MiB of text: a producer cannot
    make the process hold an unbounded batch. Nothing is stored or published."""
    envelope = {"type": "e2e.add", "args": [1, 2]}
    with pytest.raises(InvalidJob) as raised:
        enqueue_batch([envelope] * (MAX_BATCH_JOBS + 1), app=app)
    assert raised.value.violations == [
        ("(batch)", "must hold at most 10000 envelopes (the OJS batch schema's limit; send more "
                    "batches)")]
    text = json.dumps([{**envelope, "x_pad": "x" * 1_000_000}] * 34)  # 34 envelopes under 1 MiB
    assert len(text) > MAX_BATCH_BYTES
    with pytest.raises(InvalidJob) as raised:
        enqueue_batch(text, app=app)
    assert raised.value.violations == [("(batch)", "must not exceed 32 MiB")]
    assert published(app) == []


def test_a_batch_naming_a_taken_id_names_the_envelope(app: Celery) -> None:
    taken = enqueue({"type": "e2e.add", "args": [1, 2], "id": new_job_id()}, app=app)
    with pytest.raises(DuplicateJob) as raised:
        enqueue_batch([{"type": "e2e.add", "args": [3, 4]},
                       {"type": "e2e.add", "args": [5, 6], "id": taken.id}], app=app)
    assert raised.value.violations == [("[1].id", f"a different job with id {taken.id} exists "
                                                   "already")]
    assert len(published(app)) == 1  # the taken job's own


@pytest.mark.parametrize(
    "job_id", ["\udcff", "a b", "x" * 300, "01a1fc00-0000-7000-8000-0000000000e2\n"])
def test_text_that_cannot_be_a_job_id_names_no_job(app: Celery, job_id: str) -> None:
    assert get_job(job_id, app=app) is None
    with pytest.raises(JobNotFound):
        cancel(job_id, app=app)


def test_timeouts_shorter_than_two_worker_beats_are_refused(app: Celery) -> None:
    """The workers' beats (every heartbeat_interval, 5 s here) keep a running job alive: a
    heartbeat_timeout or visibility_timeout under two of them would end healthy jobs between
    two beats, every attempt."""
    found = rejected(app, {"type": "e2e.add", "args": [1, 2], "heartbeat_timeout": 2,
                           "visibility_timeout": 9})
    assert [path for path, _ in found] == ["heartbeat_timeout", "visibility_timeout"]
    assert all("at least 10s, twice the workers' heartbeat_interval (5s)" in rule
               for _, rule in found)
    assert '"x_heartbeat": "handler"' in found[0][1]
    # the handler's own heartbeats: its timeout is its own business (the extension, the task)
    handler = enqueue({"type": "e2e.add", "args": [1, 2], "heartbeat_timeout": 2,
                       "x_heartbeat": "handler"}, app=app)
    assert handler.heartbeat_timeout == 2
    assert enqueue({"type": "e2e.silent", "args": [1], "heartbeat_timeout": 1},
                   app=app).heartbeat_timeout == 1
    assert enqueue({"type": "e2e.add", "args": [1, 2], "heartbeat_timeout": 10,
                    "visibility_timeout": 10}, app=app).visibility_timeout == 10


@pytest.mark.parametrize("serializer", ["msgpack", "ojs-no-such-serializer"])
def test_a_task_serializer_this_process_cannot_encode_with_stores_nothing(
    app: Celery, serializer: str
) -> None:
    """``task_serializer = "msgpack"`` without the msgpack library (or a name kombu does not
    know): plain Celery's ``.delay()`` raises kombu's ``SerializerNotInstalled`` at every call;
    so does an OJS call, an ``enqueue`` and a batch, before anything is stored (the sweeper on
    this machine could not publish such a job either), and the CLI says it in one line."""
    if serializer == "msgpack":  # kombu registers msgpack as missing when it cannot import it
        try:
            import msgpack  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("msgpack is installed here")
    app.conf.task_serializer = serializer
    before = published(app)
    job_id, batch_id = new_job_id(), new_job_id()
    with pytest.raises(SerializerNotInstalled):
        app.tasks["e2e.add"].apply_async((1, 2), task_id="celery-call-1")
    with pytest.raises(SerializerNotInstalled, match="nothing was stored"):
        enqueue({"id": job_id, "type": "e2e.add", "args": [1, 2]}, app=app)
    with pytest.raises(SerializerNotInstalled):
        enqueue_batch([{"id": batch_id, "type": "e2e.add", "args": [1, 2]}], app=app)
    result = CliRunner().invoke(commands, ["enqueue", "-"], obj=app,
                                input=json.dumps({"type": "e2e.add", "args": [1, 2]}))
    assert result.exit_code == EXIT_INVALID, result.output
    assert result.stderr.startswith(f"error: task_serializer {serializer!r} cannot encode")
    assert "Traceback" not in result.output
    for stored in ("celery-call-1", job_id, batch_id):
        assert get_job(stored, app=app) is None
    assert published(app) == before


def test_a_plain_callback_with_text_utf8_cannot_encode_is_refused_at_the_call(
    app: Celery,
) -> None:
    """A plain task's signature in ``link`` is kept with the job (UTF-8 JSON): a lone
    surrogate in its arguments (``os.fsdecode`` of bytes that are not UTF-8) is refused at the
    call with ``InvalidJob`` naming the option, before anything is stored or published, not a
    bare ``UnicodeEncodeError`` from the store's write."""
    before = published(app)
    with pytest.raises(InvalidJob) as raised:
        app.tasks["e2e.add"].apply_async(
            (1, 2), task_id="celery-link-1", link=app.tasks["e2e.plain"].s(x="x\udcff"))
    assert [path for path, _ in raised.value.violations] == ["link"]
    assert "UTF-8" in raised.value.violations[0][1]
    assert get_job("celery-link-1", app=app) is None
    assert published(app) == before


def test_a_task_level_serializer_is_ignored_for_ojs_messages(app: Celery) -> None:
    """README: a task's own ``serializer`` is ignored, the message uses the app's
    ``task_serializer`` (the one checked at the call). Celery 5.7's ``send_task`` would take
    the task's: one this process cannot encode with left the job stored and never published."""
    task = app.tasks["e2e.add"]
    kept = task.serializer
    task.serializer, task._exec_options = "ojs-no-such-serializer", None
    try:
        before = published(app)
        job_id = task.apply_async((1, 2)).id
        sent = [path for path in published(app) if path not in before]
    finally:
        task.serializer, task._exec_options = kept, None
    assert len(sent) == 1, "the job's message was not published"
    assert json.loads(sent[0].read_text())["content-type"] == "application/json"
    assert get_job(job_id, app=app) is not None


def test_a_task_name_whose_ojs_type_differs_is_refused_naming_the_type(app: Celery) -> None:
    """``ojs_type`` overrides the type (README, public API): an envelope naming the task's
    Celery name instead is refused, and the rule says which type to use rather than to
    register a task that is registered already."""

    @app.task(name="proj.tasks.mail_out", base=OJSTask, ojs_type="mail.out", shared=False)
    def mail_out(x: int) -> int:
        return x

    [(path, rule)] = rejected(app, {"type": "proj.tasks.mail_out", "args": [1]})
    assert path == "type"
    assert "'mail.out'" in rule and "register it" not in rule
    assert enqueue({"type": "mail.out", "args": [1]}, app=app).type == "mail.out"


def test_a_type_map_entry_naming_a_plain_task_is_refused(tmp_path: pathlib.Path) -> None:
    """``type_map`` maps a type to an OJS task (README, settings). A plain task would run the
    message but never write the job's outcome: the job would stay ``available`` and the
    redispatch backstop would run the task again and again. So the envelope is refused, naming
    the entry, while an entry naming an OJS task is accepted."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {**config["ojs"],
                     "type_map": {"legacy.plain": "e2e.plain", "legacy.add": "e2e.add"}}
    app = make_app(config)
    [(path, rule)] = rejected(app, {"type": "legacy.plain", "args": [1]})
    assert path == "type"
    assert "'e2e.plain'" in rule and "type_map" in rule and "base=OJSTask" in rule
    assert enqueue({"type": "legacy.add", "args": [1, 2]}, app=app).type == "legacy.add"


def lazy_task_module(app: Celery, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                     module: str, task: str) -> None:
    """A module that defines the OJS task ``task``, listed in ``app``'s ``imports`` and not
    imported yet (as in a web process: Celery imports task modules in workers only)."""
    (tmp_path / f"{module}.py").write_text(
        "from celery import shared_task\n"
        "from ojs_celery import OJSTask\n"
        f"@shared_task(name={task!r}, base=OJSTask)\n"
        "def double(n):\n"
        "    return 2 * n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    app.conf.imports = [module]
    assert task not in app.tasks


def test_a_type_of_a_task_module_not_imported_yet_is_found(
    app: Celery, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery imports an app's task modules (``include``, ``imports``, ``autodiscover_tasks``)
    only in a worker, beat or a ``celery`` command: a web view calling ``enqueue`` imports none
    of them. Its envelopes were refused as "not an OJS task" (``ojs-celery enqueue``, which
    imports them, took the same envelope); the modules are now imported at the first miss."""
    lazy_task_module(app, tmp_path, monkeypatch, "ojs_lazy_tasks_mod", "lazy.double")
    job = enqueue({"type": "lazy.double", "args": [2]}, app=app)
    assert get_job(job.id, app=app) is not None
    assert rejected(app, {"type": "lazy.none", "args": []})[0][0] == "type"


def test_send_task_of_a_task_module_not_imported_yet_is_an_ojs_job(
    app: Celery, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a producer's ``send_task`` by name: it sent a plain Celery message for an
    OJS task whose module the producer had not imported (no job stored, no OJS guarantees)."""
    lazy_task_module(app, tmp_path, monkeypatch, "ojs_lazy_send_mod", "lazy.triple")
    result = app.send_task("lazy.triple", args=[2])
    job = get_job(result.id, app=app)
    assert job is not None and job.type == "lazy.triple" and job.args == [2]
    assert len(published(app)) == 1
