"""The README's first command runs ``examples/demo.py``: it must keep showing what it promises."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests.workers import ROOT, wait_for


def test_demo_shows_completion_timeout_and_retries_then_ends() -> None:
    done = subprocess.run(
        [sys.executable, "examples/demo.py"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for event in ("job.enqueued", "job.started", "job.completed", "job.timeout", "job.retrying",
                  "job.discarded", "worker.started", "worker.stopped"):
        assert event in out, f"{event} missing from the demo's output:\n{out}"
    final = out[out.index("final states:"):]
    assert "demo.greet   completed" in final
    assert "demo.report  discarded  attempts=2" in final
    assert "demo.flaky   completed  attempts=3" in final
    # the second attempt resumed from the checkpoint the first saved when it was cancelled
    pages = [int(page) for page in re.findall(r"cancelled at page (\d+)", done.stderr)]
    assert len(pages) == 2 and 0 < pages[0] < pages[1], done.stderr
    assert f"last_checkpoint={{'page': {pages[1]}}}" in final
    assert "no OJS sweep has completed" not in done.stderr
    # its event listener ends before the broker's folder is removed, not alarmed by it
    assert "lost the broker" not in done.stdout + done.stderr
    found = re.search(r"SQLite store in (\S+)\)", out)
    assert found is not None and not pathlib.Path(found.group(1)).exists()  # nothing left


def test_the_demo_interrupted_with_ctrl_c_says_so_in_a_line_and_leaves_nothing() -> None:
    """Ctrl-C reaches the whole foreground group: the demo and its worker."""
    demo = subprocess.Popen([sys.executable, "examples/demo.py"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert demo.stdout is not None
    seen = []
    for line in demo.stdout:  # interrupted once its jobs are enqueued, while they run
        seen.append(line)
        if "job.started" in line:
            break
    os.killpg(demo.pid, signal.SIGINT)
    out, err = demo.communicate(timeout=60)
    out = "".join(seen) + out
    assert demo.returncode == 130, out + err
    assert "interrupted" in out and "KeyboardInterrupt" not in err, out + err
    found = re.search(r"SQLite store in (\S+)\)", out)
    assert found is not None and not pathlib.Path(found.group(1)).exists()

    def session_left() -> bool:  # a killed pool process may be a zombie for a moment
        return subprocess.run(["ps", "-o", "pid=", "-g", str(demo.pid)], capture_output=True,
                              text=True).stdout.split() == []

    wait_for(session_left, 15, "the demo's processes to end")


@pytest.mark.parametrize("moment", ["starting", "worker-starting"])
def test_the_demo_interrupted_before_its_jobs_run_ends_the_same_way(
        tmp_path: pathlib.Path, moment: str) -> None:
    """Ctrl-C while the demo starts (its imports, its event listener: its folder is there), or
    while its worker starts (its header is printed, the worker imports Celery): the same one
    line, status 130 and nothing left, not a traceback (the demo's, or its worker's)."""
    demo = subprocess.Popen([sys.executable, "examples/demo.py"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp_path)},
                            start_new_session=True)
    seen = []
    try:
        if moment == "starting":
            wait_for(lambda: list(tmp_path.glob("ojs-demo-*")), 30, "the demo's folder")
        else:
            assert demo.stdout is not None
            for line in demo.stdout:
                seen.append(line)
                if "ojs_celery demo (" in line:
                    break
        os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
    out = "".join(seen) + out
    assert demo.returncode == 130, out + err
    assert "interrupted" in out and "Traceback" not in err, out + err
    if moment == "starting":
        assert "enqueued" not in out, out  # interrupted before, as meant
    assert list(tmp_path.iterdir()) == []  # the demo's folder is gone
