"""The start gate (``ojs_celery.worker.gate``): which job reaching a pool process during the
shutdown drain still starts, seen from the pool processes the worker forks."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

from ojs_celery.worker.gate import StartGate, cancel_point
from ojs_celery.worker.shutdown import Drain


def test_a_job_starts_unless_the_drain_would_cancel_it_at_once() -> None:
    gate = StartGate()
    assert not gate.too_late((30, 20), 5.0)  # never prepared (a producer): always open
    gate.prepare()
    assert not gate.too_late((30, 20), 5.0) and not gate.draining()  # no drain yet
    gate.drain_until(time.monotonic() + 3.0)
    assert gate.draining()
    assert gate.too_late((30, 20), 5.0)  # its point (5 s before the end) has passed
    assert not gate.too_late((11, 10), 5.0)  # a 1 s grace: cancelled only in the last second
    assert not gate.too_late(None, 5.0)  # no time limits: no grace, never cancelled early
    gate.prepare()  # a second worker in the same process starts with the gate open
    assert not gate.too_late((30, 20), 5.0)


def test_cancel_point_is_the_grace_period_at_most_the_window() -> None:
    assert cancel_point((30, 20), 5.0) == 5.0
    assert cancel_point((11, 10), 5.0) == 1.0
    assert cancel_point((10, None), 5.0) == 0.0
    assert cancel_point(None, 5.0) == 0.0


def test_a_forked_pool_process_sees_the_drain_begin() -> None:
    """The page is made before the fork and written after it, by the worker's main process."""
    gate = StartGate()
    gate.prepare()
    pid = os.fork()
    if pid == 0:  # the pool process: waits until the drain makes a start too late
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if gate.too_late((30, 20), 5.0):
                os._exit(0)
            time.sleep(0.01)
        os._exit(1)
    gate.drain_until(time.monotonic() + 1.0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_signal_handlers_are_left_alone_outside_the_main_thread() -> None:
    """Python itself tells the main thread (``signal.signal`` refuses the others), not
    ``threading.main_thread()``, which eventlet's monkey patching makes disagree in the main
    thread: there the worker's handlers must be installed, elsewhere (a worker embedded in a
    thread) none of them, and none half."""
    node = SimpleNamespace(runtime=None, settings=SimpleNamespace(shutdown_grace_period=1.0),
                           worker_id="w-thread")
    before = {signum: signal.getsignal(signum)
              for signum in (signal.SIGTSTP, signal.SIGCONT, signal.SIGTERM, signal.SIGINT,
                             signal.SIGQUIT)}
    thread = threading.Thread(target=Drain(node).install)  # type: ignore[arg-type]
    thread.start()
    thread.join()
    assert {signum: signal.getsignal(signum) for signum in before} == before
