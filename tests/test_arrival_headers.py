"""Message arrival: a malformed ``ojs`` header, or a store that fails while a start is being
decided, never acks a message whose job then waits for ever and never stops the worker.

Messages are published by hand (``send_task`` with the header a test wants) to real prefork
workers; the job's record is the authority: a message that can start its job starts it, one
whose token is unusable is dropped and the sweeper's redispatch backstop publishes the job
again; an exception while deciding sends the message back to the broker.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ojs_celery import enqueue, parse_envelope
from ojs_celery.envelope import Job
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import sweep
from tests.conftest import Env, start_env
from tests.test_store_faults import PrivateRedis, free_port
from tests.workers import wait_for


def stored_job(env: Env, args: list[Any]) -> Job:
    """A job stored as ``enqueue`` stores it, its message counted as published (so that only
    the message the test sends by hand is out there)."""
    store = get_runtime(env.app).store
    created = store.create(parse_envelope({"type": "e2e.add", "args": args}))
    assert created.record is not None
    store.ack_dispatch(created.record.job.id, created.record.token)
    return created.record.job


def send(env: Env, job: Job, header: Any) -> None:
    env.app.send_task("e2e.add", args=job.args, task_id=job.id, queue=env.config["queue"],
                      headers={"ojs": header})


def postrun_states(env: Env, job_id: str) -> list[str]:
    return [line.split()[1] for line in env.lines("postrun") if line.startswith(job_id)]


def runs(env: Env, job_id: str) -> int:
    return env.lines("runs").count(f"add {job_id}")


@pytest.fixture
def env(tmp_path: pathlib.Path) -> Iterator[Env]:
    with start_env("filesystem", tmp_path, concurrency=1,
                   config={"ojs": {"redispatch_after": 1.0}}) as started:
        yield started


def test_malformed_headers_are_decided_by_the_record(env: Env) -> None:
    now = time.time()
    unusable = {
        "token not an int": {"token": "one", "created_at": now},
        "header not an object": "garbage",
        "header a list": [1],
        "token missing": {"created_at": now},
    }
    startable = {
        "snapshot does not decode": {"token": 1, "created_at": now,
                                     "snapshot": "[1, 1]\n{not json"},
        "nested snapshot does not decode": {"token": 1, "created_at": now,
                                            "record": {"job": "{not json", "version": "x"}},
        "created_at missing": {"token": 1},
    }
    jobs = {name: stored_job(env, [index, 1]) for index, name in
            enumerate([*unusable, *startable])}
    for name, header in {**unusable, **startable}.items():
        send(env, jobs[name], header)

    for name in startable:  # the record says it may start: it starts
        assert env.wait_state(jobs[name].id, "completed").attempt == 1
    for name in unusable:  # dropped, not failed; the job still waits
        wait_for(lambda job_id=jobs[name].id: postrun_states(env, job_id), 20,
                 f"the message of {name} to be dropped")
        assert postrun_states(env, jobs[name].id) == ["IGNORED"], name
        assert env.job(jobs[name].id).state == "available", name
        assert runs(env, jobs[name].id) == 0, name

    # The redispatch backstop publishes each dropped job once more: each then runs once.
    runtime = get_runtime(env.app)
    time.sleep(1.0)  # redispatch_after, so that the backstop is due
    sweep(runtime)
    for name in unusable:
        done = env.wait_state(jobs[name].id, "completed")
        assert done.attempt == 1 and done.errors == [], name
    for job in jobs.values():
        assert runs(env, job.id) == 1, job.id


def _received(env: Env, job_id: str) -> int:
    return sum(1 for line in env.lines("received") if line.startswith(job_id))


def test_a_start_that_raises_sends_the_message_back(tmp_path: pathlib.Path) -> None:
    """A store answering READONLY (a Redis replica after a failover), then a record that does
    not decode (an error that is no StoreError): each message bounces, and runs once healed.
    (The jobs' 8 s timeout keeps the READONLY start's wait for the store to 2 s a try.)"""
    server = PrivateRedis(tmp_path)
    try:
        with start_env("filesystem", tmp_path, concurrency=1,
                       config={"ojs": {"store_url": server.url}}) as env:
            soon = time.time() + 3
            readonly = enqueue({"type": "e2e.add", "args": [1, 2], "timeout": 8,
                                "scheduled_at": _iso(soon)}, app=env.app)
            corrupt = enqueue({"type": "e2e.add", "args": [3, 4], "timeout": 8,
                               "scheduled_at": _iso(soon)}, app=env.app)
            [key] = [k for k in server.admin.scan_iter(match=f"*{corrupt.id}")
                     if server.admin.type(k) == "hash"]
            data = server.admin.hget(key, "data")
            server.admin.hset(key, "data", "{not json")
            server.admin.hincrby(key, "version", 1)  # the message's snapshot is stale
            server.admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))

            wait_for(lambda: _received(env, readonly.id) >= 3 and _received(env, corrupt.id) >= 3,
                     40, "both messages to come back from the broker")
            server.admin.execute_command("REPLICAOF", "NO", "ONE")
            assert env.wait_state(readonly.id, "completed").result == 3
            wait_for(lambda: _received(env, corrupt.id) >= 5, 20, "the corrupt one to bounce")
            assert env.job(readonly.id).attempt == 1
            server.admin.hset(key, "data", data)  # healed
            done = env.wait_state(corrupt.id, "completed")
            assert done.result == 7 and done.attempt == 1
            assert runs(env, readonly.id) == 1 and runs(env, corrupt.id) == 1
            assert "FAILURE" not in postrun_states(env, corrupt.id)
    finally:
        server.admin.execute_command("REPLICAOF", "NO", "ONE")  # the fixture's clear() writes
        server.stop()


def _iso(epoch: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(epoch, timezone.utc).isoformat()
