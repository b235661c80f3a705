"""The embedded default's data folder removed, or its disk full, under running ``celery worker``
and ``celery beat`` processes: each failure is said in a line, without a traceback, and
nothing waits for ever."""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil

import pytest

from ojs_celery import enqueue
from tests.e2eapp import make_app
from tests.test_embedded_disk import fill, small_disk
from tests.workers import Beat, Worker, filesystem_config, lines, unique, wait_for


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "running-a-job"])
def test_a_worker_whose_data_folder_is_removed_stops_with_one_line(
        tmp_path: pathlib.Path, busy: bool) -> None:
    """The folder held every message and the job store: the worker says so in one ERROR
    line, drains as for SIGTERM (a running job within the grace period) and exits with status
    1, for its supervisor to start it again, which makes the folders anew. It exited with
    Celery's "Unrecoverable error" and a traceback, and a running job's outcome, which had no
    store to go to, held its warm shutdown for ever."""
    base = tmp_path / "ojs"
    config = filesystem_config(base)
    (tmp_path / "files").mkdir()
    config["dir"] = str(tmp_path / "files")  # outside the folder that goes
    config["ojs"]["shutdown_grace_period"] = 2
    worker = Worker(config, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        if busy:
            app = make_app(config)
            enqueue({"type": "e2e.sleep", "args": [60]}, app=app)
            wait_for(lambda: lines(config["dir"], "runs"), 30, "the job to start")
        shutil.rmtree(base)
        worker.process.wait(60)
    finally:
        code = worker.stop()
    log = worker.log()
    assert code == 1, log[-4000:]
    broker = re.escape(str(base / "broker"))
    said = [line for line in log.splitlines()
            if re.search(rf"ERROR.*broker folder {broker} is missing", line)]
    assert len(said) == 1, log[-4000:]
    assert "Traceback" not in log and "Unrecoverable error" not in log, log[-4000:]


@pytest.mark.parametrize(("fault", "beat_in"), [("missing", "beat"), ("full", "beat"),
                                                ("full", "worker -B")])
def test_celery_beat_says_a_failed_sweep_publish_in_one_line_per_tick(
        tmp_path: pathlib.Path, fault: str, beat_in: str) -> None:
    """Each tick whose sweep cannot be published (the broker folder removed, or its disk
    full) is one ERROR line naming the cause, and beat goes on, in ``celery beat`` and in
    ``celery worker -B``: it logged Celery's "Message Error" with the whole traceback and its
    stack at every tick."""
    base = tmp_path / "ojs"
    config = filesystem_config(base)
    config["ojs"]["sweep_interval"] = 0.5
    config["ojs"]["sweep_queue"] = unique("sweep")
    broker = base / "broker"
    cause = (f"broker folder {broker} is missing" if fault == "missing"
             else "No space left on device")
    with contextlib.ExitStack() as stack:
        if fault == "missing":
            shutil.rmtree(broker)
        else:
            stack.enter_context(small_disk(broker))
            fill(broker)
        beat: Beat | Worker = (
            Beat(config, tmp_path) if beat_in == "beat"
            else Worker(config, tmp_path / "worker.log",
                        extra=["-B", "--schedule", str(tmp_path / "schedule")]))
        try:
            said = wait_for(lambda: [line for line in beat.log().splitlines()
                                     if "ERROR" in line and cause in line][2:], 60,
                            "three ticks' lines")
            assert beat.process.poll() is None  # beat goes on
        finally:
            beat.stop()
    log = beat.log()
    assert "could not send the sweep" in said[0], log[-4000:]
    assert "Traceback" not in log and "Message Error" not in log, log[-4000:]
