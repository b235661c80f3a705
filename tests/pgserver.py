"""A PostgreSQL server of a test's own (its restarts, settings and faults are the test's; the
shared server is never touched): ``initdb`` into a temporary folder, a free port, trust
authentication. Skips the test when PostgreSQL's server programs are not installed (as
:class:`tests.test_store_faults.PrivateRedis` does for ``redis-server``)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import psycopg


def _program(name: str) -> str | None:
    """A PostgreSQL server program: on ``PATH``, else where Debian's packages keep it."""
    found = shutil.which(name)
    if found is not None:
        return found
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / name).is_file():
            return str(Path(folder) / name)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivatePostgres:
    """``initdb`` and ``pg_ctl`` in a temporary folder of its own (as the ``postgres`` user
    when run as root, which PostgreSQL refuses; pytest's own folders are root's alone);
    :meth:`stop` and :meth:`start` keep the data and the port; :meth:`destroy` stops it by
    force and removes the folder."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        initdb, pg_ctl = _program("initdb"), _program("pg_ctl")
        if initdb is None or pg_ctl is None:
            pytest.skip("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
        self.pg_ctl = pg_ctl
        self.user: str | None = None
        owner = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("run as root without a 'postgres' user to run PostgreSQL as")
            self.user = "postgres"
        directory = Path(tempfile.mkdtemp(prefix="ojs-pg-"))
        if owner is not None:
            os.chown(directory, owner.pw_uid, owner.pw_gid)
        self.directory = directory
        self.data = directory / "data"
        self.port = _free_port()
        self.settings = {"listen_addresses": "127.0.0.1", "fsync": "off", **(settings or {})}
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._run(initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()

    def _run(self, *command: str, check: bool = True) -> None:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        subprocess.run([*prefix, *command], check=check, capture_output=True, timeout=60)

    def start(self) -> None:
        options = " ".join([f"-p {self.port}", f"-k {self.directory}",
                            *(f"-c {name}={value}" for name, value in self.settings.items())])
        self._run(self.pg_ctl, "-D", str(self.data), "-o", options,
                  "-l", str(self.directory / "server.log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``: ``fast`` ends every session, ``immediate`` as a crash."""
        self._run(self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)


#: Settings of a server whose commits wait for a synchronous standby that never comes (a
#: session with ``synchronous_commit`` ``on`` waits until its wait is cancelled).
NO_STANDBY = {"synchronous_standby_names": "nosuch", "synchronous_commit": "local"}


def waiting_for_standby(admin: psycopg.Connection[object]) -> list[int]:
    """The server processes whose commit waits for the synchronous standby."""
    rows = admin.execute("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
    return [int(row[0]) for row in rows]  # type: ignore[call-overload]
