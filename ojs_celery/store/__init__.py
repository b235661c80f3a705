"""Job stores: SQL (SQLite, PostgreSQL) and Redis, behind one protocol."""

from __future__ import annotations

from ..lifecycle import Policy
from .base import DuplicateJob, JobStore, StoreError, WorkerInfo

__all__ = ["DuplicateJob", "JobStore", "StoreError", "WorkerInfo", "open_store"]


def open_store(url: str, policy: Policy | None = None, prefix: str = "ojs") -> JobStore:
    """A store for ``url``: ``sqlite:///path``, ``postgresql://...`` or ``redis://...``.

    ``prefix`` namespaces the tables (SQL) or keys (Redis), so several apps or test runs can
    share one server.
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisStore

        return RedisStore(url, policy=policy, prefix=prefix)
    if scheme.startswith(("sqlite", "postgresql", "postgres")):
        from .sql import SQLStore

        return SQLStore(url, policy=policy, prefix=prefix)
    raise ValueError(
        f"store_url: unsupported scheme {scheme!r} (use sqlite:///path, postgresql://... "
        "or redis://...)"
    )
