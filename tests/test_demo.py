"""The README's first command runs ``examples/demo.py``: it must keep showing what it promises."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from tests.workers import ROOT


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
    found = re.search(r"SQLite store in (\S+)\)", out)
    assert found is not None and not pathlib.Path(found.group(1)).exists()  # nothing left
