"""``ojs_celery.testing``: a pytest plugin for testing an app's OJS tasks against a real worker.

Enable it explicitly (``pytest -p ojs_celery.testing`` or ``pytest_plugins =
["ojs_celery.testing"]``) and name the app (``--ojs-app=proj.celery:app``, the ``ojs_app`` ini
option, or override the :func:`ojs_app_path` fixture). The fixtures run the app on the embedded
default (filesystem broker, SQLite store and results in a temporary folder: no server):

- ``ojs_app``: the app, configured so in the test process;
- ``ojs_worker``: a real prefork ``celery worker`` subprocess for it, and a sweeper (a thread
  running :func:`ojs_celery.sweeper.run_loop`);
- ``ojs_enqueue(envelope)`` and ``ojs_wait(job_id, timeout=...)``: enqueue a job and wait for its
  terminal state.

Every name starts with ``ojs_``, so the plugin coexists with pytest-celery.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from . import compat
from .api import enqueue, get_job
from .conf import raw_settings
from .embedded import embedded_settings
from .envelope import Job
from .install import install
from .runtime import get_runtime
from .sweeper import run_loop

#: The worker subprocess reads the app's path and its settings from these variables.
APP_VARIABLE = "OJS_TESTING_APP"
CONF_VARIABLE = "OJS_TESTING_CONF"
#: Seconds between sweeps in tests (deadlines are enforced within this much).
SWEEP_INTERVAL = 0.5
#: The test worker's ``shutdown_grace_period`` unless the app sets its own: a session's
#: teardown stops it, and a job still running then need not hold the session for 25 s.
SHUTDOWN_GRACE = 2.0
TERMINAL_STATES = ("completed", "cancelled", "discarded")
#: Environment variables Celery reads before any setting (``celery.app.utils.Settings``), each
#: with the setting whose embedded value the fixtures give it where it is set: the app would
#: otherwise keep the broker and result backend they name. Replaced, not dropped: a project's
#: settings may require them (``os.environ["CELERY_BROKER_URL"]``, django-environ's
#: ``env("CELERY_BROKER_URL")``), and the worker's subprocess imports those settings anew.
CELERY_URL_VARIABLES = {"CELERY_BROKER_URL": "broker_url", "CELERY_BROKER_READ_URL": "broker_url",
                        "CELERY_BROKER_WRITE_URL": "broker_url",
                        "CELERY_RESULT_BACKEND": "result_backend"}
#: Environment variables the ``celery`` command reads as its ``--broker`` and
#: ``--result-backend`` (``BROKER_URL`` or ``CELERY_BROKER``, ``RESULT_BACKEND``), and copies to
#: ``CELERY_BROKER_URL``/``CELERY_RESULT_BACKEND``; Celery 5.4 to 5.6 do so after they loaded
#: (so configured) the app: the worker's subprocess gets the embedded default's URLs in them.
CELERY_COMMAND_VARIABLES = {"BROKER_URL": "broker_url", "CELERY_BROKER": "broker_url",
                            "RESULT_BACKEND": "result_backend"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ojs_celery")
    group.addoption("--ojs-app", default=None,
                    help="The Celery app the ojs_* fixtures run, as module:attribute.")
    parser.addini("ojs_app", "The Celery app the ojs_* fixtures run, as module:attribute.")


def load_app(path: str) -> Celery:
    """``module:attribute`` (or ``module.attribute``) to the app it names."""
    module_name, _, attribute = path.partition(":")
    if not attribute:
        module_name, _, attribute = path.rpartition(".")
    app = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(app, Celery):
        raise TypeError(f"{path} is not a Celery app")
    return app


def configure(app: Celery, settings: dict[str, Any]) -> Celery:
    """Point ``app`` at the embedded default in ``settings`` (its own ``ojs`` settings kept,
    the store replaced). It installs OJS on the app (idempotent): a Django project may leave
    that to its Django app, whose ``ready()`` comes too late for the fixtures' worker.

    Each setting is set under the spelling Celery reads first (a Django project's
    ``CELERY_BROKER_URL`` would otherwise win on Celery 5.4 to 5.6), and the environment
    variables Celery prefers to any setting (:data:`CELERY_URL_VARIABLES`) are given the
    embedded default's URLs in this process's environment (so in the worker's): a project that
    keeps its broker's URL there would have taken the fixtures to its real broker, result
    backend and store."""
    for variable, key in CELERY_URL_VARIABLES.items():
        if variable in os.environ:
            if settings.get(key):
                os.environ[variable] = str(settings[key])
            else:
                del os.environ[variable]
    ojs = {"shutdown_grace_period": SHUTDOWN_GRACE, **(raw_settings(app.conf) or {}),
           **settings["ojs"], "sweep_interval": SWEEP_INTERVAL}
    for key, value in {"broker_read_url": None, "broker_write_url": None, **settings,
                       "ojs": ojs}.items():
        compat.set_celery_setting(app.conf, key, value)
    _forget_connections(app)
    install(app)
    get_runtime(app).configure(app.conf)  # settings read before this update are replaced
    return app


def _forget_connections(app: Celery) -> None:
    """Drop what Celery made from the app's settings before they were replaced: its result
    backend (kept per app, or per thread) and its broker connection pool, which an earlier
    test may have made for the production servers."""
    if getattr(app, "_backend_cache", None) is not None:
        app._backend_cache = None
    local = getattr(app, "_local", None)
    if local is not None and hasattr(local, "backend"):
        del local.backend
    # forgotten, not closed: kombu shares a connection pool among the apps of one URL
    if getattr(app, "_pool", None) is not None:
        app._pool = None
    amqp = app.__dict__.get("amqp")  # a cached_property: made only if used
    if amqp is not None and getattr(amqp, "_producer_pool", None) is not None:
        amqp._producer_pool = None


def __getattr__(name: str) -> Any:
    """``celery -A ojs_celery.testing:worker_app``: the user's app, configured from the
    environment the :func:`ojs_worker` fixture gives its subprocess."""
    if name != "worker_app":
        raise AttributeError(name)
    return configure(load_app(os.environ[APP_VARIABLE]), json.loads(os.environ[CONF_VARIABLE]))


@pytest.fixture(scope="session")
def ojs_app_path(pytestconfig: pytest.Config) -> str:
    """The app to test, as ``module:attribute``; override this fixture to choose it in code."""
    path = pytestconfig.getoption("--ojs-app") or pytestconfig.getini("ojs_app")
    if not path:
        raise pytest.UsageError("ojs_celery.testing: name the app with --ojs-app=module:app "
                                "or the ojs_app ini option")
    return str(path)


@pytest.fixture(scope="session")
def ojs_settings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The embedded default's settings, in a temporary folder of the session."""
    return embedded_settings(tmp_path_factory.mktemp("ojs"))


@pytest.fixture(scope="session")
def ojs_app(ojs_app_path: str, ojs_settings: dict[str, Any]) -> Celery:
    """The app under test, configured in this process as the worker is."""
    return configure(load_app(ojs_app_path), ojs_settings)


class CeleryProcess:
    """A ``celery`` subprocess in its own session (so that it and its pool children can be
    killed as a group), its output in a log file. :class:`WorkerProcess` and the project's own
    end-to-end helpers build on it."""

    def __init__(self, arguments: list[str], log: pathlib.Path, env: dict[str, str],
                 cwd: str | os.PathLike[str] | None = None,
                 program: list[str] | None = None) -> None:
        """``program``: what runs ``celery`` (default ``python -m celery``; Celery's SIGHUP
        restart re-runs its ``argv[0]``, which works with the ``celery`` script only)."""
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        command = program or [sys.executable, "-m", "celery"]
        self.process = subprocess.Popen([*command, *arguments], cwd=cwd, env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once the worker logged `` ready.``; raise if it exited or took too long."""
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            if self.process.poll() is not None:
                raise RuntimeError(f"the worker exited at start:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start in {timeout}s:\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a warm shutdown), then SIGKILL to the whole group after ``timeout``; the
        exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self._log.close()
        return self.process.returncode


class WorkerProcess(CeleryProcess):
    """A ``celery worker`` subprocess (prefork) of the app under test."""

    def __init__(self, app_path: str, settings: dict[str, Any], log: pathlib.Path,
                 concurrency: int = 2, arguments: list[str] | None = None) -> None:
        given = {variable: str(settings[key]) for variable, key in CELERY_COMMAND_VARIABLES.items()
                 if variable in os.environ and settings.get(key)}
        env = {**os.environ, **given, APP_VARIABLE: app_path, CONF_VARIABLE: json.dumps(settings),
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        super().__init__(
            ["-A", f"{__name__}:worker_app", "worker", "--pool", "prefork", "--concurrency",
             str(concurrency), "--loglevel", "INFO", "--without-gossip", "--without-mingle",
             "--hostname", f"ojs-test-{os.getpid()}@%h", *(arguments or [])], log, env)


@pytest.fixture(scope="session")
def ojs_worker_arguments() -> list[str]:
    """More ``celery worker`` arguments for :func:`ojs_worker`; override this fixture to give
    them, e.g. ``["-Q", "celery,emails"]`` for a queue that ``task_routes`` names but
    ``task_queues`` does not declare (a worker consumes only declared queues without ``-Q``),
    or ``["--concurrency", "4"]``."""
    return []


@pytest.fixture(scope="session")
def ojs_worker(ojs_app: Celery, ojs_app_path: str, ojs_settings: dict[str, Any],
               ojs_worker_arguments: list[str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A real prefork worker for the app and a sweeper, for the whole session."""
    worker = WorkerProcess(ojs_app_path, ojs_settings,
                           tmp_path_factory.mktemp("ojs-worker") / "worker.log",
                           arguments=ojs_worker_arguments)
    stop = threading.Event()
    sweeper = threading.Thread(target=run_loop, args=(get_runtime(ojs_app), SWEEP_INTERVAL),
                               kwargs={"stop": stop.is_set, "pause": stop.wait},
                               name="ojs-sweeper", daemon=True)
    try:
        worker.wait_ready()
        sweeper.start()
        yield worker
    finally:
        stop.set()
        worker.stop()
        if sweeper.is_alive():
            sweeper.join(10)


@pytest.fixture
def ojs_enqueue(ojs_app: Celery) -> Callable[..., Job]:
    """``ojs_enqueue({"type": ..., "args": [...]})``: store and publish an OJS job."""

    def enqueue_one(envelope: dict[str, Any] | str | bytes | Job) -> Job:
        return enqueue(envelope, app=ojs_app)

    return enqueue_one


@pytest.fixture
def ojs_wait(ojs_app: Celery) -> Callable[..., Job]:
    """``ojs_wait(job_id, timeout=30, states=...)``: the job once it reaches one of ``states``
    (by default a terminal state); fails the test after ``timeout`` seconds."""

    def wait(job_id: str, timeout: float = 30.0,
             states: tuple[str, ...] = TERMINAL_STATES) -> Job:
        deadline = time.monotonic() + timeout
        while True:
            job = get_job(job_id, app=ojs_app)
            if job is not None and job.state in states:
                return job
            if job is None and compat.celery_setting(ojs_app, "task_always_eager"):
                pytest.fail(f"job {job_id} is unknown: the app has task_always_eager on, so "
                            "a .delay() ran in this process and nothing reached the worker; "
                            "give the ojs_* fixtures settings without it")
            if time.monotonic() > deadline:
                hint = (f" (nothing took it from its queue {job.queue!r}: a queue the app "
                        "routes to but does not declare in task_queues is consumed only if "
                        "the ojs_worker_arguments fixture gives it with -Q)"
                        if job is not None and job.state == "available" else "")
                pytest.fail(f"job {job_id} is {job.state if job else 'unknown'} after "
                            f"{timeout}s, wanted {states}{hint}")
            time.sleep(0.1)

    return wait
