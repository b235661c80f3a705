"""The one fork hook: registered objects forget their parent's resources in a forked child, and
the hook neither keeps them alive nor grows with every store a process makes."""

from __future__ import annotations

import gc
import os
import weakref

from ojs_celery import forking


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
