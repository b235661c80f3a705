"""A PostgreSQL ``store_url`` naming a database that does not exist, or a user the server does
not let in, is a configuration error (``StoreMisconfigured``, Celery's ``ImproperlyConfigured``
too) raised at the first session, before anything is written: not ``StoreUncertain`` ("the job
may or may not be stored, retry"), which no retry mends. The CLI says so in one line with the
settings' exit status (2), and so does the sweep loop, which no later pass would mend; a worker
exits at start naming it, instead of running jobs it can never record."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery.exceptions import ImproperlyConfigured

from ojs_celery import StoreUncertain, enqueue
from ojs_celery.store import StoreMisconfigured
from tests import services
from tests.e2eapp import make_app
from tests.workers import ROOT, Worker, _env, filesystem_config, unique

CLI = str(pathlib.Path(sys.executable).with_name("ojs-celery"))


def _url(database: str | None = None, user: str | None = None) -> str:
    """The test server's URL with another database or user."""
    parts = urlsplit(services.postgres_url())
    if database is not None:
        parts = parts._replace(path=f"/{database}")
    if user is not None:
        parts = parts._replace(netloc=f"{user}@{parts.netloc.rsplit('@', 1)[-1]}")
    return urlunsplit(parts)


def _config(tmp_path: pathlib.Path, store_url: str) -> dict[str, Any]:
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": store_url, "store_prefix": unique("t")}
    return config


def _enqueue_refused(config: dict[str, Any]) -> StoreMisconfigured:
    app = make_app(config)
    try:
        with pytest.raises(StoreMisconfigured) as refused:
            enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    finally:
        app.close()
    assert isinstance(refused.value, ImproperlyConfigured)
    assert not isinstance(refused.value, StoreUncertain)
    assert "may" not in str(refused.value)
    return refused.value


def test_a_database_that_does_not_exist_is_a_configuration_error(tmp_path: pathlib.Path) -> None:
    database = f"ojs_nosuch_{uuid.uuid4().hex[:10]}"
    config = _config(tmp_path, _url(database=database))
    said = str(_enqueue_refused(config))
    assert f'the database "{database}" does not exist' in said and "create it" in said
    for args in (("enqueue", "-"), ("workers",), ("sweep", "--loop"), ("sweep", "--once")):
        done = subprocess.run([CLI, "-A", "tests.e2eapp:app", *args],
                              input='{"type": "e2e.add", "args": [1, 2]}', capture_output=True,
                              text=True, cwd=ROOT, env=_env(config), timeout=60)
        assert done.returncode == 2, done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in done.stderr  # the loop says it starts
        assert f'"{database}" does not exist' in errors[0] and done.stdout == ""


def test_a_user_the_server_does_not_know_is_a_configuration_error(
    tmp_path: pathlib.Path,
) -> None:
    user = f"ojs_nosuch_{uuid.uuid4().hex[:10]}"
    said = str(_enqueue_refused(_config(tmp_path, _url(user=user))))
    assert f'user "{user}"' in said


def test_a_worker_exits_at_start_naming_the_database(tmp_path: pathlib.Path) -> None:
    database = f"ojs_nosuch_{uuid.uuid4().hex[:10]}"
    worker = Worker(_config(tmp_path, _url(database=database)), tmp_path / "worker.log")
    try:
        status = worker.process.wait(60)
    finally:
        worker.stop()
    assert status != 0
    assert f'the database "{database}" does not exist' in worker.log()
    assert " ready." not in worker.log()
