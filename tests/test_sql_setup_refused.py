"""A PostgreSQL user that may not create the job store's tables (a least-privilege role on a
fresh database, a read-only session): the first enqueue fails with a plain ``StoreError``
naming the refusal, nothing stored, not a ``StoreUncertain`` that says the job may be stored:
nothing was sent but the table's creation."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from ojs_celery import StoreError, StoreUncertain, enqueue
from ojs_celery.store import open_store
from tests import services
from tests.e2eapp import make_app
from tests.workers import ROOT, _env, filesystem_config, unique


@pytest.fixture
def limited_url() -> Iterator[str]:
    """A login role that may connect and use a schema of its own (its whole ``search_path``)
    but create nothing in it, on any PostgreSQL version (before 15 every role may create in
    ``public``)."""
    import psycopg

    admin_url = services.postgres_url()
    name, password = f"ojs_limited_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{name}" LOGIN PASSWORD \'{password}\'')
        admin.execute(f'CREATE SCHEMA "{name}"')
        admin.execute(f'GRANT USAGE ON SCHEMA "{name}" TO "{name}"')
        admin.execute(f'ALTER ROLE "{name}" SET search_path = "{name}"')
    parts = urlsplit(admin_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    try:
        yield urlunsplit(parts._replace(netloc=f"{name}:{password}@{host}"))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA "{name}" CASCADE')
            admin.execute(f'DROP OWNED BY "{name}"')
            admin.execute(f'DROP ROLE "{name}"')


def test_an_enqueue_without_create_permission_is_refused_not_uncertain(
    limited_url: str, tmp_path: pathlib.Path
) -> None:
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": limited_url, "store_prefix": unique("t")}
    app = make_app(config)
    try:
        with pytest.raises(StoreError) as refused:
            enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
        assert not isinstance(refused.value, StoreUncertain), str(refused.value)
        assert "permission denied" in str(refused.value)
        assert "may" not in str(refused.value)
    finally:
        app.close()
    # the same through the CLI: exit status 4, one line, no "may be stored"
    done = subprocess.run(
        [str(pathlib.Path(sys.executable).with_name("ojs-celery")), "-A", "tests.e2eapp:app",
         "enqueue", "-"],
        input='{"type": "e2e.add", "args": [1, 2]}', capture_output=True, text=True,
        cwd=ROOT, env=_env(config), timeout=60)
    assert done.returncode == 4, done.stderr
    assert "permission denied" in done.stderr and "may" not in done.stderr, done.stderr


def test_a_batch_without_create_permission_is_refused_not_uncertain(limited_url: str) -> None:
    store = open_store(limited_url, prefix=unique("t"))
    from ojs_celery.envelope import Job

    try:
        with pytest.raises(StoreError) as refused:
            store.create_many([Job(type="e2e.add", args=[1, 2], queue="default")])
        assert not isinstance(refused.value, StoreUncertain), str(refused.value)
    finally:
        store.close()
