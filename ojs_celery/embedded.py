"""The zero-setup default: a filesystem broker and SQLite files in one folder, no server.

:func:`embedded_settings` gives Celery's settings for it: the ``ojsfs://`` broker
(:mod:`ojs_celery.ojsfs`), SQLite results and an SQLite job store, all under one folder.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any
from urllib.parse import quote

from .ojsfs import SCHEME, register_transport

__all__ = ["SCHEME", "embedded_settings", "register_transport", "sqlite_url"]


def embedded_settings(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Celery settings for the embedded default, everything under ``directory``.

    Broker: atomic filesystem transport; results: SQLite; OJS job store: SQLite. Use
    ``app.conf.update(embedded_settings(path))``.
    """
    register_transport()
    base = pathlib.Path(directory).resolve()
    for folder in ("broker", "processed", "control"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    return {
        "broker_url": f"{SCHEME}://localhost/",
        "broker_transport_options": {
            "data_folder_in": str(base / "broker"),
            "data_folder_out": str(base / "broker"),
            "processed_folder": str(base / "processed"),
            "control_folder": str(base / "control"),
            "polling_interval": 0.1,
        },
        "result_backend": f"db+{sqlite_url(base / 'results.sqlite3')}",
        "broker_connection_retry_on_startup": True,
        "ojs": {"store_url": sqlite_url(base / "store.sqlite3")},
    }


def sqlite_url(path: pathlib.Path) -> str:
    """The SQLite URL of the file ``path``, percent-encoded: SQLAlchemy decodes a URL's path
    and ends it at a ``?`` or ``#``, so a folder named ``a%41`` or ``a?b`` written as it is
    would put the database at another file (``aA``, ``a``) or fail to open it."""
    return "sqlite:///" + quote(str(path), safe="/")
