"""What the tests of a misconfigured job store share (``test_sql_misconfigured``,
``test_redis_misconfigured``): a ``store_url`` the server refuses at the first session is
``StoreMisconfigured`` from ``enqueue()``, one line and exit status 2 from the CLI (``sweep
--loop`` included), and a worker that exits at start naming it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import pytest
from celery.exceptions import ImproperlyConfigured

from ojs_celery import StoreUncertain, enqueue
from ojs_celery.store import StoreMisconfigured
from tests.e2eapp import make_app
from tests.workers import ROOT, Worker, _env, filesystem_config, unique

CLI = str(pathlib.Path(sys.executable).with_name("ojs-celery"))

#: The CLI's commands that open the store: each must end with the one line and status 2.
COMMANDS = (("enqueue", "-"), ("workers",), ("sweep", "--loop"), ("sweep", "--once"))


def store_config(tmp_path: pathlib.Path, store_url: str) -> dict[str, Any]:
    """``tests.e2eapp``'s embedded configuration (a filesystem broker) with this store."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": store_url, "store_prefix": unique("t")}
    return config


def published(config: dict[str, Any]) -> list[pathlib.Path]:
    """The messages in the filesystem broker's folder."""
    folder = pathlib.Path(config["broker_transport_options"]["data_folder_out"])
    return [path for path in folder.iterdir() if path.is_file()]


def enqueue_refused(config: dict[str, Any]) -> StoreMisconfigured:
    """``enqueue()``'s StoreMisconfigured (Celery's ImproperlyConfigured, never "may be
    stored"), with nothing published."""
    app = make_app(config)
    try:
        with pytest.raises(StoreMisconfigured) as refused:
            enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    finally:
        app.close()
    assert isinstance(refused.value, ImproperlyConfigured)
    assert not isinstance(refused.value, StoreUncertain)
    assert "may" not in str(refused.value)
    assert published(config) == []
    return refused.value


def cli_refused(config: dict[str, Any], *said: str, secret: str | None = None,
                commands: tuple[tuple[str, ...], ...] = COMMANDS) -> None:
    """Each of ``commands`` ends with status 2 and one ``error:`` line saying each of ``said``,
    no traceback, nothing on stdout, and ``secret`` nowhere."""
    for args in commands:
        done = subprocess.run([CLI, "-A", "tests.e2eapp:app", *args],
                              input='{"type": "e2e.add", "args": [1, 2]}', capture_output=True,
                              text=True, cwd=ROOT, env=_env(config), timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert all(words in errors[0] for words in said), (args, errors[0])
        assert done.stdout == "", args
        assert secret is None or secret not in done.stderr, args
    assert published(config) == []


def worker_refused(config: dict[str, Any], log: pathlib.Path, *said: str,
                   secret: str | None = None) -> str:
    """A ``celery worker`` that exits at start, its log saying each of ``said`` (and never
    ``secret``) and never ready; its log."""
    worker = Worker(config, log)
    try:
        status = worker.process.wait(60)
    finally:
        worker.stop()
    text = worker.log()
    assert status != 0
    assert all(words in text for words in said), text
    assert " ready." not in text
    assert secret is None or secret not in text
    return text
