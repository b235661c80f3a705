"""A PostgreSQL ``store_url`` naming a database that does not exist, or a user the server does
not let in, is a configuration error (``StoreMisconfigured``, Celery's ``ImproperlyConfigured``
too) raised at the first session, before anything is written: not ``StoreUncertain`` ("the job
may or may not be stored, retry"), which no retry mends. The CLI says so in one line with the
settings' exit status (2), and so does the sweep loop, which no later pass would mend; a worker
exits at start naming it, instead of running jobs it can never record."""

from __future__ import annotations

import pathlib
import uuid
from urllib.parse import urlsplit, urlunsplit

from tests import services
from tests.misconfigured import cli_refused, enqueue_refused, store_config, worker_refused


def _url(database: str | None = None, user: str | None = None) -> str:
    """The test server's URL with another database or user."""
    parts = urlsplit(services.postgres_url())
    if database is not None:
        parts = parts._replace(path=f"/{database}")
    if user is not None:
        parts = parts._replace(netloc=f"{user}@{parts.netloc.rsplit('@', 1)[-1]}")
    return urlunsplit(parts)


def test_a_database_that_does_not_exist_is_a_configuration_error(tmp_path: pathlib.Path) -> None:
    database = f"ojs_nosuch_{uuid.uuid4().hex[:10]}"
    config = store_config(tmp_path, _url(database=database))
    said = str(enqueue_refused(config))
    assert f'the database "{database}" does not exist' in said and "create it" in said
    cli_refused(config, f'"{database}" does not exist')  # the loop too: it says it starts


def test_a_user_the_server_does_not_know_is_a_configuration_error(
    tmp_path: pathlib.Path,
) -> None:
    user = f"ojs_nosuch_{uuid.uuid4().hex[:10]}"
    said = str(enqueue_refused(store_config(tmp_path, _url(user=user))))
    assert f'user "{user}"' in said


def test_a_worker_exits_at_start_naming_the_database(tmp_path: pathlib.Path) -> None:
    database = f"ojs_nosuch_{uuid.uuid4().hex[:10]}"
    worker_refused(store_config(tmp_path, _url(database=database)), tmp_path / "worker.log",
                   f'the database "{database}" does not exist')
