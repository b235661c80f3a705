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
    StoreErrorReply,
    StoreMisconfigured,
    StoreRefused,
    StoreTimeout,
    StoreUncertain,
)
from .meta import BrokerMark, MetaArea
from .workers import WorkerInfo, WorkerRegistry

__all__ = [
    "BrokerMark",
    "DuplicateJob",
    "JobStore",
    "MetaArea",
    "StoreError",
    "StoreErrorReply",
    "StoreMisconfigured",
    "StoreRefused",
    "StoreTimeout",
    "StoreUncertain",
    "WorkerInfo",
    "WorkerRegistry",
    "open_store",
    "preload_store",
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
    if _backend(url) == "redis":
        from .redis import RedisStore

        return RedisStore(url, policy=policy, prefix=prefix, timeout=timeout)
    from .sql import SQLStore

    return SQLStore(url, policy=policy, prefix=prefix, synchronous_commit=synchronous_commit,
                    timeout=timeout)


def preload_store(url: str) -> None:
    """Import what a store for ``url`` needs (its backend, SQLAlchemy's dialect and the
    driver), without connecting. A worker does it before its pool forks: each pool process
    then inherits the modules instead of importing them on its first job's time (about a
    quarter of a second on PostgreSQL, which the job's time limit paid)."""
    if _backend(url) == "redis":
        from . import redis  # noqa: F401
    else:
        from .sql import preload

        preload(url)


def _backend(url: str) -> str:
    """``"redis"`` or ``"sql"``: the backend for ``url``'s scheme."""
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        return "redis"
    if scheme.startswith(("sqlite", "postgresql", "postgres")):
        return "sql"
    raise ValueError(
        f"store_url: unsupported scheme {scheme!r} (use sqlite:///path, postgresql://... "
        "or redis://...)"
    )
