"""Importing the package registers nothing; ``install`` registers the remote-control command."""

from __future__ import annotations

import subprocess
import sys

from tests.workers import ROOT

PROBE = """
import ojs_celery, ojs_celery.control, ojs_celery.install, ojs_celery.worker.steps
from celery import Celery
from celery.worker.control import Panel
print("ojs_terminate" in Panel.data)
ojs_celery.install(Celery("probe", set_as_current=False))
print("ojs_terminate" in Panel.data)
"""


def test_import_registers_no_control_command_and_install_does() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
