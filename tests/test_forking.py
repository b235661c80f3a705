"""The one fork hook: registered objects forget their parent's resources in a forked child, and
the hook neither keeps them alive nor grows with every store a process makes."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest

from ojs_celery import batching, forking
from ojs_celery.batching import Batcher, Handler


class Holder:
    def __init__(self) -> None:
        self.connection: object | None = object()
        forking.forget_in_children(self)

    def forget_parent(self) -> None:
        self.connection = None


holder: Holder | None = None


def forked_exit_code() -> int:
    """Fork; the child exits 0 if it finds the holder's connection forgotten, 1 otherwise."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if holder is not None and holder.connection is None else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_forgets_what_the_parent_holds() -> None:
    global holder
    holder = Holder()
    try:
        assert forked_exit_code() == 0
        assert holder.connection is not None  # the parent keeps its own
    finally:
        holder = None


def test_the_hook_holds_its_objects_weakly() -> None:
    made = [Holder() for _ in range(100)]
    refs = [weakref.ref(h) for h in made]
    del made
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert not [o for o in list(forking._owners) if isinstance(o, Holder)]


class SlowBatcher(Batcher[int]):
    """A batcher whose handler takes ``seconds`` (a client library's call in progress)."""

    thread_name = "test-slow-batcher"

    def __init__(self, seconds: float) -> None:
        super().__init__(linger=0.0, max_batch=10)
        self.seconds = seconds
        self.entered = threading.Event()
        self.finished = threading.Event()

    def _open(self) -> Handler[int]:
        def handle(_batch: list[int]) -> None:
            self.entered.set()
            time.sleep(self.seconds)
            self.finished.set()

        return handle


def fork_during_a_batch(batcher: SlowBatcher) -> bool:
    """Fork while ``batcher``'s thread handles a batch; was the batch done when fork returned?"""
    batcher.put(1)
    assert batcher.entered.wait(10)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    done_at_fork = batcher.finished.is_set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return done_at_fork


def test_a_fork_waits_for_the_batch_a_thread_is_handling() -> None:
    """A batcher's thread is inside its handler (where a client library may hold its
    connection pool's lock, which a child would find held for ever) when the process forks:
    the fork waits until the batch is handled, and the next batches are handled as before."""
    batcher = SlowBatcher(0.3)
    assert fork_during_a_batch(batcher)
    batcher.finished.clear()
    batcher.put(2)
    assert batcher.flush(10) and batcher.finished.is_set()


def test_a_fork_waits_for_a_batch_no_longer_than_fork_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler that hangs (a server that does not answer) holds a fork back for
    ``FORK_WAIT`` at most; then the fork goes on."""
    monkeypatch.setattr(batching, "FORK_WAIT", 0.1)
    batcher = SlowBatcher(3.0)
    started = time.monotonic()
    assert not fork_during_a_batch(batcher)
    assert time.monotonic() - started < 2.5
