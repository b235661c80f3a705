"""A SQLite job store whose file cannot be opened at all (its folder missing, a file where its
folder should be, no permission): nothing was written, so an enqueue fails saying the store is
unavailable and naming the file, not a ``StoreUncertain`` saying that the job may be stored."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from ojs_celery import StoreError, StoreUncertain, enqueue, enqueue_batch, get_job
from ojs_celery.embedded import sqlite_url
from tests.e2eapp import make_app
from tests.workers import ROOT, filesystem_config

OPEN_AS_NOBODY = textwrap.dedent("""
    import sys
    from ojs_celery.store import StoreRefused
    from ojs_celery.store.sql import SQLStore
    try:
        SQLStore("sqlite:///" + sys.argv[1]).get("some-id")
    except StoreRefused as exc:
        print(exc)
""")


def as_another_user(tmp_path: pathlib.Path) -> None:
    """Root opens any file: the no-permission case runs in a process of user ``nobody``, in a
    folder of its own outside pytest's (which only root may enter)."""
    if shutil.which("setpriv") is None:
        pytest.skip("root opens any file, and setpriv is not there to be another user")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ojs-nobody-"))
    try:
        folder.chmod(0o755)
        (folder / "locked").mkdir(mode=0o555)  # root's: nobody may not create in it
        store_file = folder / "locked" / "store.sqlite3"
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-c", OPEN_AS_NOBODY, str(store_file)],
            cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=60)
        if "ModuleNotFoundError" in done.stderr or "Permission denied" in done.stderr:
            pytest.skip(f"user nobody cannot run this checkout: {done.stderr[-300:]}")
        assert done.returncode == 0, done.stderr
        said = done.stdout
        assert "unavailable" in said and f"cannot open its SQLite file {store_file}" in said
        assert "no permission" in said
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("case", ["missing-folder", "under-a-file", "no-permission"])
def test_a_store_file_that_cannot_be_opened_is_unavailable_not_uncertain(
        tmp_path: pathlib.Path, case: str) -> None:
    if case == "missing-folder":
        store_file = tmp_path / "gone" / "store.sqlite3"
        why = f"its folder {store_file.parent} does not exist"
    elif case == "under-a-file":
        (tmp_path / "plain").write_text("a file, not a folder")
        store_file = tmp_path / "plain" / "store.sqlite3"
        why = f"{store_file.parent} is not a folder"
    else:
        if os.geteuid() == 0:
            as_another_user(tmp_path)
            return
        (tmp_path / "locked").mkdir(mode=0o500)
        store_file = tmp_path / "locked" / "store.sqlite3"
        why = "no permission"
    config = filesystem_config(tmp_path / "ojs")
    config["ojs"]["store_url"] = sqlite_url(store_file)
    app = make_app(config)
    calls = [lambda: enqueue({"type": "e2e.add", "args": [1, 2]}, app=app),
             lambda: enqueue_batch([{"type": "e2e.add", "args": [n, 2]} for n in range(2)],
                                   app=app),
             lambda: get_job("01a21fe3-37f6-7e30-9cdb-c60c22ffc816", app=app)]
    for call in calls:
        with pytest.raises(StoreError) as raised:
            call()
        assert not isinstance(raised.value, StoreUncertain), str(raised.value)
        said = str(raised.value)
        assert "unavailable" in said and f"cannot open its SQLite file {store_file}" in said
        assert why in said
