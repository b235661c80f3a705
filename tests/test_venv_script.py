"""``scripts/venv.sh``, which the README's two commands source first: two first runs at once
(two demos started together from a new clone) install once, and both go on."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from tests.workers import ROOT

#: Stands in for the virtualenv's python: an "install" takes a second and fails when another
#: runs at the same moment, as two pip installs into one environment do.
FAKE_PYTHON = """#!/bin/sh
mkdir installing 2>/dev/null || { echo "another install is running" >&2; exit 1; }
sleep 1
rmdir installing
echo "$*" >> installs.log
"""


def test_two_first_runs_at_once_install_once_and_both_succeed(tmp_path: pathlib.Path) -> None:
    if shutil.which("flock") is None:
        pytest.skip("no flock(1) here: concurrent first runs are not serialised")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "venv.sh", tmp_path / "scripts" / "venv.sh")
    (tmp_path / "pyproject.toml").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    runs = [subprocess.Popen(["bash", "-c", 'source scripts/venv.sh ""; echo went on'],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=30)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert all("went on" in output for output in outputs), outputs
    assert len((tmp_path / "installs.log").read_text().splitlines()) == 1
