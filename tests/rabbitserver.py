"""A RabbitMQ node of a test's own (its alarms, restarts and settings are the test's; the shared
server is never touched): ``rabbitmq-server`` with its own node name, ports, data and logs in a
temporary folder, no plugins, and an Erlang cookie of its own (``HOME`` is that folder). Skips
the test when RabbitMQ's server is not installed. It starts in about 5 to 10 seconds, so tests
share one per module."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

#: Debian's package keeps the real scripts here; ``/usr/sbin``'s wrappers switch to the
#: ``rabbitmq`` user, whose cookie and folders are the shared server's.
_PACKAGE_BIN = Path("/usr/lib/rabbitmq/bin")


def _program(name: str) -> str | None:
    if (_PACKAGE_BIN / name).is_file():
        return str(_PACKAGE_BIN / name)
    return shutil.which(name)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRabbit:
    """A node on free ports; :meth:`ctl` runs ``rabbitmqctl`` against it; :meth:`stop_app` and
    :meth:`start_app` stop and start the broker inside the node (its clients' connections are
    closed; queues and durable messages are kept); :meth:`destroy` stops it and removes its
    folder. ``settings`` are ``rabbitmq.conf`` lines (``consumer_timeout``, ...); ``advanced``,
    the ``advanced.config`` term (settings ``rabbitmq.conf`` cannot set)."""

    def __init__(self, settings: dict[str, str] | None = None,
                 advanced: str | None = None) -> None:
        server, ctl = _program("rabbitmq-server"), _program("rabbitmqctl")
        if server is None or ctl is None:
            pytest.skip("RabbitMQ's server (rabbitmq-server, rabbitmqctl) is not installed")
        self.server, self.ctl_program = server, ctl
        self.directory = Path(tempfile.mkdtemp(prefix="ojs-rabbit-"))
        self.port = _free_port()
        self.node = f"ojstest{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        lines = {"listeners.tcp.1": f"127.0.0.1:{self.port}", "loopback_users": "none",
                 **(settings or {})}
        (self.directory / "rabbitmq.conf").write_text(
            "".join(f"{key} = {value}\n" for key, value in lines.items()))
        (self.directory / "enabled_plugins").write_text("[].\n")
        (self.directory / "advanced.config").write_text(advanced or "[].\n")
        self.env = {
            **os.environ,
            "HOME": str(self.directory),  # the node's and rabbitmqctl's Erlang cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(_free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.directory / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.directory / "pid"),
        }
        self.process: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:
            self.destroy()
            raise

    def start(self) -> None:
        with open(self.directory / "server.out", "ab") as out:
            self.process = subprocess.Popen([self.server], env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.await_broker()

    def await_broker(self, timeout: float = 60.0) -> None:
        """Wait for the node's AMQP listener to accept a connection."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited: see {self.directory}/server.out")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RabbitMQ node {self.node} did not start") from None
                time.sleep(0.2)

    def ctl(self, *args: str) -> str:
        done = subprocess.run([self.ctl_program, "-n", self.node, *args], env=self.env,
                              capture_output=True, text=True, timeout=60, check=True)
        return done.stdout

    def stop_app(self) -> None:
        self.ctl("stop_app")

    def start_app(self) -> None:
        self.ctl("start_app")
        self.await_broker()

    def destroy(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.ctl("stop")
            except (subprocess.SubprocessError, OSError):
                pass
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)
