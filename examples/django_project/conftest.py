"""Test setup of the example shop: run it as its own project (``run_tests.sh``), once on plain
Celery and once with ``SHOP_OJS=1``. Needs Redis (``SHOP_REDIS_URL``) for broker and results;
every key lives under a unique ``global_keyprefix``, removed at the end."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings_test")
os.environ.setdefault("SHOP_RUN_DIR", tempfile.mkdtemp(prefix="shop-"))
os.environ.setdefault("SHOP_KEY_PREFIX", f"shop-{uuid.uuid4().hex[:10]}:")

import django  # noqa: E402
import pytest  # noqa: E402

django.setup()

OJS_ENABLED = os.environ.get("SHOP_OJS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if OJS_ENABLED:
        return
    skip = pytest.mark.skip(reason="OJS only: ojs_celery is not installed in this run")
    for item in items:
        if "ojs_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def database() -> None:
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this run's keys (and only them) from Redis."""
    from django.conf import settings

    try:
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL)
        keys = list(client.scan_iter(match=f"{settings.KEY_PREFIX}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    except Exception:
        pass


@pytest.fixture(scope="session")
def worker() -> Iterator[subprocess.Popen[bytes]]:
    """A real prefork ``celery -A shop worker`` on every queue of the shop (and the sweep queue
    with ojs_celery on), with the same settings and database as the tests."""
    queues = ["default", "emails_high", "reports_slow"] + (["ojs.sweep"] if OJS_ENABLED else [])
    yield from _celery("worker", "--pool", "prefork", "--concurrency", "2", "--queues",
                       ",".join(queues), "--hostname", f"shop-{uuid.uuid4().hex[:6]}@%h",
                       "--without-gossip", "--without-mingle", ready=" ready.")


@pytest.fixture
def beat(worker: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``celery beat`` with django-celery-beat's DatabaseScheduler (CELERY_BEAT_SCHEDULER)."""
    yield from start_beat()


def start_beat() -> Iterator[subprocess.Popen[bytes]]:
    """Start ``celery beat`` (a generator: use it with ``contextlib.contextmanager``)."""
    yield from _celery("beat", "--pidfile", "", ready="beat: Starting")


def _celery(*args: str, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    log = pathlib.Path(os.environ["SHOP_RUN_DIR"]) / f"{args[0]}-{uuid.uuid4().hex[:6]}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "shop", *args, "--loglevel", "INFO"],
            cwd=HERE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while ready not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start:\n"
                                   f"{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)
        process.log = log  # type: ignore[attr-defined]
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
