"""One fork hook for the objects that hold a connection, a thread or a lock a forked child must
not share with its parent (Celery's prefork pool forks after the app is used).

Each such object registers itself once; the hook holds it weakly, so a process that makes many
stores or batchers neither keeps them alive nor piles up hooks that are never removed.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForgetsParent(Protocol):
    def forget_parent(self) -> None:
        """Drop what the parent holds, without using or closing it (runs in the new child)."""


_owners: weakref.WeakSet[ForgetsParent] = weakref.WeakSet()


def forget_in_children(owner: ForgetsParent) -> None:
    """Call ``owner.forget_parent()`` in every child forked from now on, while ``owner`` lives."""
    _owners.add(owner)


def _after_fork_in_child() -> None:
    for owner in list(_owners):
        owner.forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)
