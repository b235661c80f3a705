"""Fencing: a message or a write proves which record it belongs to (issue 9, item 2).

A job that tried to take an existing id was published (with a snapshot of the record it would
have written) before the store refused it. Its version number matches the victim's first
version; its nonce and origin do not, so its start can never touch the victim's record.
"""

from __future__ import annotations

import json
import pathlib
import time
import uuid
from collections.abc import Iterator

import pytest

from ojs_celery import enqueue, get_job
from ojs_celery.envelope import Job, new_job_id, parse_envelope
from ojs_celery.header import build as build_header
from ojs_celery.header import origin as header_origin
from ojs_celery.header import snapshot as record_from_header
from ojs_celery.lifecycle import Record
from ojs_celery.store import DuplicateJob, JobStore, open_store
from tests.conftest import start_env
from tests.services import postgres_url, redis_url
from tests.workers import lines

BACKENDS = ["sqlite", "postgres", "redis"]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[JobStore]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    else:
        url = postgres_url() if request.param == "postgres" else redis_url()
    made = open_store(url, prefix=f"f{uuid.uuid4().hex[:10]}")
    try:
        yield made
    finally:
        made.clear()
        drop = getattr(made, "drop_tables", None)
        if drop is not None:
            drop()
        made.close()


def stored(store: JobStore, job_id: str) -> Record:
    found = store.get_record(job_id)
    assert found is not None
    return found


def same_record(a: Record, b: Record) -> bool:
    return (a.version, a.nonce, a.origin, a.token, a.job.to_json()) == (
        b.version, b.nonce, b.origin, b.token, b.job.to_json()
    )


def intruder_header(store: JobStore, job_id: str) -> dict[str, object]:
    """What enqueue publishes for a job whose id turns out to be taken: a header built from
    the record it tried to insert (before the store's answer), then the refusal."""
    intruder = parse_envelope({"id": job_id, "type": "evil.job", "args": ["rm", "-rf"]})
    transition, confirm = store.begin_create(intruder)
    record = transition.record
    assert record is not None
    header = build_header(record.job, record.token, record)
    with pytest.raises(DuplicateJob):
        confirm()
    return header


def test_a_snapshot_of_a_refused_insert_cannot_start_the_victim(store: JobStore) -> None:
    victim = parse_envelope({"type": "good.job", "args": [1, 2]})
    store.create(victim)
    before = stored(store, victim.id)
    header = intruder_header(store, victim.id)
    hint = record_from_header(header, victim.id)
    assert hint is not None and hint.version == before.version  # the version alone matches

    started = store.start(victim.id, int(str(header["token"])), "w-intruder", hint=hint,
                          origin=header_origin(header))
    assert not started.applied and started.reason == "foreign"
    assert same_record(stored(store, victim.id), before)
    # The hint alone (a worker that does not pass the origin) proves nothing either.
    started = store.start(victim.id, 1, "w-intruder", hint=hint)
    assert not started.applied
    assert same_record(stored(store, victim.id), before)


def test_a_big_job_without_snapshot_is_fenced_by_its_origin(store: JobStore) -> None:
    victim = parse_envelope({"type": "good.job", "args": [1]})
    store.create(victim)
    before = stored(store, victim.id)
    header = intruder_header(store, victim.id)
    header.pop("record", None)  # as for a job too big for a snapshot
    started = store.start(victim.id, 1, "w-intruder", origin=header_origin(header))
    assert not started.applied and started.reason == "foreign"
    assert same_record(stored(store, victim.id), before)


def test_the_victims_own_message_still_starts_it(store: JobStore) -> None:
    transition, confirm = store.begin_create(parse_envelope({"type": "good.job", "args": []}))
    record = transition.record
    assert record is not None
    header = build_header(record.job, record.token, record)
    confirm()
    intruder_header(store, record.job.id)
    started = store.start(record.job.id, 1, "w1", hint=record_from_header(header, record.job.id),
                          origin=header_origin(header))
    assert started.applied and started.record is not None
    assert started.record.origin == record.origin


def test_every_write_has_a_fresh_nonce_and_keeps_the_origin(store: JobStore) -> None:
    job = parse_envelope({"type": "good.job", "args": []})
    store.create(job)
    first = stored(store, job.id)
    assert first.nonce and first.origin == first.nonce
    store.start(job.id, 1, "w1")
    second = stored(store, job.id)
    assert second.version == first.version + 1
    assert second.nonce != first.nonce and second.origin == first.origin


def test_a_stale_snapshot_with_the_current_version_is_refused(store: JobStore) -> None:
    """A compare-and-set from a record with the right version but another nonce writes
    nothing: the backends compare the nonce, not only the version."""
    job = parse_envelope({"type": "good.job", "args": []})
    store.create(job)
    current = stored(store, job.id)
    forged = Record(job=current.job.model_copy(), token=current.token, version=current.version,
                    nonce="0" * 16, origin=current.origin)
    new = forged.copy()
    new.nonce = "1" * 16
    assert not store._cas(new, forged, {})
    assert same_record(stored(store, job.id), current)


# --------------------------------------------------------------------------- end to end


def test_a_disguised_id_cannot_hijack_a_stored_job(tmp_path: pathlib.Path) -> None:
    """The attack of issue 9, item 2, through ``enqueue`` and a real worker: the intruder's
    message is dropped and the victim's job (type, args, state) stays as it was."""
    job_id = new_job_id()
    with start_env("redis", tmp_path, concurrency=1) as env:
        later = time.time() + 3600
        victim = enqueue({
            "id": job_id, "type": "e2e.add", "args": [1, 2],
            "scheduled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(later)),
        }, app=env.app)
        before = env.app._ojs_runtime.store.get_record(job_id)
        assert before is not None
        text = json.dumps({"ID": 0, "type": "e2e.add", "args": [40, 2]})
        text = text.replace('"ID": 0', f'"\\u0069d": "{job_id}"')
        with pytest.raises(Exception, match="exists already"):
            enqueue(text, app=env.app)
        # One worker process, one message at a time, in order: once a job enqueued after the
        # intruder has completed, the intruder's message has been handled.
        marker = enqueue({"type": "e2e.add", "args": [0, 0]}, app=env.app)
        env.wait_state(marker.id, "completed")
        after = env.app._ojs_runtime.store.get_record(job_id)
        assert after is not None and same_record(after, before)
        found = get_job(job_id, app=env.app)
        assert isinstance(found, Job) and found.args == victim.args == [1, 2]
        runs = lines(env.config["dir"], "runs")
        assert f"add {job_id}" not in runs


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_jobs_table_of_an_older_version_gets_the_fencing_columns(
    backend: str, tmp_path: pathlib.Path
) -> None:
    url = f"sqlite:///{tmp_path / 'old.sqlite3'}" if backend == "sqlite" else postgres_url()
    prefix = f"m{uuid.uuid4().hex[:10]}"
    old = open_store(url, prefix=prefix)
    old.ping()
    with old.engine.connect() as conn:  # type: ignore[attr-defined]
        for column in ("nonce", "origin"):
            conn.exec_driver_sql(f"ALTER TABLE {prefix}_jobs DROP COLUMN {column}")
    old.close()
    store = open_store(url, prefix=prefix)
    try:
        job = parse_envelope({"type": "good.job", "args": []})
        store.create(job)
        assert store.start(job.id, 1, "w1").applied
    finally:
        store.clear()
        store.drop_tables()  # type: ignore[attr-defined]
        store.close()
