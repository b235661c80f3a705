"""One fork hook for the objects that hold a connection, a thread or a lock a forked child must
not share with its parent (Celery's prefork pool forks after the app is used).

Each such object registers itself once; the hook holds it weakly, so a process that makes many
stores or batchers neither keeps them alive nor piles up hooks that are never removed. An object
whose thread may be inside a client library can also hold a fork back until that thread is out
of it (:func:`hold_forks`): a lock the library held at the fork stays held for ever in the
child, where the library's own fork hooks take it (redis-py 8 resets a pool under its lock;
kombu disconnects its Redis channels' pools in every child).
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


class HoldsForks(Protocol):
    def before_fork(self) -> None:
        """Runs in the forking thread just before the fork (it may wait, briefly)."""

    def after_fork_in_parent(self) -> None:
        """Runs in the parent just after the fork."""


_holders: weakref.WeakSet[HoldsForks] = weakref.WeakSet()


def hold_forks(holder: HoldsForks) -> None:
    """Call ``holder.before_fork()`` before every fork from now on and
    ``holder.after_fork_in_parent()`` after it, while ``holder`` lives."""
    _holders.add(holder)


def _before_fork() -> None:
    for holder in list(_holders):
        holder.before_fork()


def _after_fork_in_parent() -> None:
    for holder in list(_holders):
        holder.after_fork_in_parent()


def _after_fork_in_child() -> None:
    for owner in list(_owners):
        owner.forget_parent()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
