"""Where the test servers are, and what to do when one is down.

Each ``*_url()`` returns the server's URL (from ``OJS_TEST_*_URL`` or the standard local
default) after a short connect check. An unreachable server skips the calling test with the
reason, except under ``OJS_TEST_REQUIRE_SERVICES=1`` (CI), where it fails it: there a missing
server is a broken machine, not a reason to pass.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlsplit, urlunsplit

import pytest

REQUIRE_ENV = "OJS_TEST_REQUIRE_SERVICES"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def services_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() == "1"


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@functools.cache
def unreachable(url: str, default_port: int, timeout: float = 1.0) -> str | None:
    """Why ``url``'s server cannot be reached (TCP or unix socket connect), or None if it can.

    Cached: a server that is down stays down for the run, and each check may take ``timeout``.
    """
    parts = urlsplit(url)
    try:
        if parts.scheme == "unix":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(parts.path)
        else:
            host = parts.hostname or "127.0.0.1"
            port = parts.port or default_port
            with socket.create_connection((host, port), timeout=timeout):
                pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def reachable_url(env: str, default: str, default_port: int) -> str | None:
    """The URL of a service if it can be reached, else None (never skips or fails)."""
    url = os.environ.get(env) or default
    return None if unreachable(url, default_port) is not None else url


def service_url(name: str, env: str, default: str, default_port: int) -> str:
    """The URL of service ``name`` if reachable; otherwise skip (or fail, when required)."""
    url = os.environ.get(env) or default
    problem = unreachable(url, default_port)
    if problem is not None:
        message = f"{name} is not reachable at {_redacted(url)} ({problem}); start it or set {env}"
        if services_required():
            pytest.fail(f"{message} [{REQUIRE_ENV}=1]", pytrace=False)
        pytest.skip(message)
    return url


def redis_url() -> str:
    return service_url("Redis", "OJS_TEST_REDIS_URL", DEFAULT_REDIS_URL, 6379)


def postgres_url() -> str:
    return service_url("PostgreSQL", "OJS_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL, 5432)


def amqp_url() -> str:
    return service_url("RabbitMQ", "OJS_TEST_AMQP_URL", DEFAULT_AMQP_URL, 5672)
