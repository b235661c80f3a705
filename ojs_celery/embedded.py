"""The zero-setup default: a filesystem broker and SQLite files in one folder, no server.

kombu's filesystem transport writes a message file in place, and a consumer that lists the
folder in between may read it half-written: the message is then lost (it shows as a JSON error).
:class:`Transport` writes to a temporary name and renames, which is atomic, so consumers only
ever see whole messages. :func:`register_transport` makes it kombu's ``ojsfs://`` transport; it
runs in ``install(app)`` and :func:`embedded_settings`, not at import (kombu keeps its aliases
in a module-level dict: there is no per-app registry).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any
from urllib.parse import quote

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

from . import compat

SCHEME = "ojsfs"


class Channel(filesystem.Channel):
    """Filesystem channel whose writes are atomic (temp file + rename)."""

    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name, temporary_name = compat.filesystem_message_names(queue)
        final = os.path.join(self.data_folder_out, name)
        temporary = os.path.join(self.data_folder_out, temporary_name)
        try:
            with open(temporary, "wb") as handle:
                handle.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(temporary, final)
        except OSError as exc:
            # a write that failed midway (the disk full) leaves no part of a file behind: kept,
            # each failed publish would hold its part of the space that ran out, for good
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise ChannelError(f"Cannot add file {final!r} to directory: "
                               f"{exc.strerror or exc}") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register_transport() -> None:
    """Make ``ojsfs://`` URLs use :class:`Transport` in this process (idempotent)."""
    TRANSPORT_ALIASES[SCHEME] = f"{__name__}:Transport"


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
