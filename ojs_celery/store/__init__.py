"""Job stores: SQL (SQLite, PostgreSQL) and Redis, behind one protocol.

A store has three parts on one backend: the jobs (:class:`JobStore`), the worker registry
(``store.workers``, :class:`WorkerRegistry`) and the meta area (``store.meta``,
:class:`MetaArea`).
"""

from __future__ import annotations

from ..lifecycle import Policy
from .base import (
    DEFAULT_TIMEOUT,
    DuplicateJob,
    JobStore,
    StoreError,
    StoreTimeout,
    StoreUncertain,
)
from .meta import MetaArea
from .workers import WorkerInfo, WorkerRegistry

__all__ = [
    "DuplicateJob",
    "JobStore",
    "MetaArea",
    "StoreError",
    "StoreTimeout",
    "StoreUncertain",
    "WorkerInfo",
    "WorkerRegistry",
    "open_store",
]


def open_store(
    url: str, policy: Policy | None = None, prefix: str = "ojs",
    synchronous_commit: str | None = None, timeout: float = DEFAULT_TIMEOUT,
) -> JobStore:
    """A store for ``url``: ``sqlite:///path``, ``postgresql://...`` or ``redis://...``.

    ``prefix`` namespaces the tables (SQL) or keys (Redis), so several apps or test runs can
    share one server. ``synchronous_commit``: PostgreSQL's, for every session of the store.
    ``timeout``: the seconds a call waits for the server before it fails (the ``store_timeout``
    setting); the URL's own socket or connection timeouts, when it names them, win.
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisStore

        return RedisStore(url, policy=policy, prefix=prefix, timeout=timeout)
    if scheme.startswith(("sqlite", "postgresql", "postgres")):
        from .sql import SQLStore

        return SQLStore(url, policy=policy, prefix=prefix,
                        synchronous_commit=synchronous_commit, timeout=timeout)
    raise ValueError(
        f"store_url: unsupported scheme {scheme!r} (use sqlite:///path, postgresql://... "
        "or redis://...)"
    )
