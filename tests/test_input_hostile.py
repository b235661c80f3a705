"""The hostile-input corpus (``hostile_envelopes.json``) through every ingress: ``enqueue()``,
``enqueue_batch()`` and the CLI. Every case is rejected with its fields named, and nothing is
stored or published. Runs on the embedded broker and store, without a worker."""

from __future__ import annotations

import json
import pathlib
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner

from ojs_celery import InvalidJob, enqueue, enqueue_batch
from ojs_celery.cli import EXIT_INVALID, commands
from tests.e2eapp import make_app
from tests.workers import filesystem_config

CASES: list[dict[str, Any]] = json.loads(
    (pathlib.Path(__file__).parent / "hostile_envelopes.json").read_text())["cases"]
SINGLE = [case for case in CASES if not case.get("batch_only")]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Celery]:
    config = filesystem_config(tmp_path_factory.mktemp("hostile"))
    config["celery"] = {"task_create_missing_queues": False}
    app = make_app(config)
    yield app
    assert published(app) == []
    assert stored_rows(app) == 0


@pytest.fixture(autouse=True)
def nothing_left(app: Celery) -> Iterator[None]:
    yield
    assert published(app) == []
    assert stored_rows(app) == 0


def published(app: Celery) -> list[pathlib.Path]:
    folder = pathlib.Path(app.conf.broker_transport_options["data_folder_in"])
    return sorted(folder.glob("*.msg"))


def stored_rows(app: Celery) -> int:
    """Rows in every job table of the SQLite store (0 before the store was first used)."""
    path = app.conf.ojs["store_url"].removeprefix("sqlite:///")
    if not pathlib.Path(path).exists():
        return 0
    with sqlite3.connect(path) as db:
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
                  if "job" in row[0] or "outbox" in row[0]]
        return sum(db.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables)


def single_input(case: dict[str, Any]) -> Any:
    if "envelope" in case:
        return case["envelope"]
    if "envelope_raw" in case:  # any JSON value, as JSON text
        return json.dumps(case["envelope_raw"])
    if "text" in case:
        return case["text"]
    if "text_repeat" in case:
        return "".join(piece * times for piece, times in case["text_repeat"])
    return bytes.fromhex(case["bytes_hex"])


def batch_input(case: dict[str, Any]) -> Any:
    if case.get("batch_only"):
        return case["batch"]
    if "envelope_raw" in case:
        return [case["envelope_raw"]]
    value = single_input(case)
    if isinstance(value, str):
        return "[" + value + "]"
    if isinstance(value, bytes):
        return b"[" + value + b"]"
    return [value]


def batch_expect(case: dict[str, Any]) -> list[list[str]]:
    if case.get("batch_only"):
        return list(case["expect"])
    if "batch_expect" in case:
        return list(case["batch_expect"])
    return [["[0]" if field == "(envelope)" else f"[0].{field}", rule]
            for field, rule in case["expect"]]


def as_cli_input(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


def check(violations: list[tuple[str, str]], expected: list[list[str]]) -> None:
    assert sorted(path for path, _ in violations) == sorted(field for field, _ in expected)
    for field, words in expected:
        assert any(path == field and words in rule for path, rule in violations), (field, words)


def name(case: dict[str, Any]) -> str:
    return str(case["name"])


@pytest.mark.parametrize("case", SINGLE, ids=name)
def test_enqueue_rejects(app: Celery, case: dict[str, Any]) -> None:
    with pytest.raises(InvalidJob) as raised:
        enqueue(single_input(case), app=app)
    check(raised.value.violations, case["expect"])


@pytest.mark.parametrize("case", CASES, ids=name)
def test_enqueue_batch_rejects(app: Celery, case: dict[str, Any]) -> None:
    with pytest.raises(InvalidJob) as raised:
        enqueue_batch(batch_input(case), app=app)
    check(raised.value.violations, batch_expect(case))


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_cli_rejects_every_case_with_one_line_per_problem(app: Celery, batch: bool) -> None:
    runner = CliRunner()
    for case in CASES if batch else SINGLE:
        if case.get("batch_only") and not batch:
            continue
        value = batch_input(case) if batch else single_input(case)
        args = ["enqueue", "--batch", "-"] if batch else ["enqueue", "-"]
        result = runner.invoke(commands, args, input=as_cli_input(value), obj=app)
        assert result.exit_code == EXIT_INVALID, (case["name"], result.output)
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        check([(line.split(": ", 1)[0], line.split(": ", 1)[-1]) for line in lines],
              batch_expect(case) if batch else case["expect"])
