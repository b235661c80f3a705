"""Hand-run measure of what a job's writes cost PostgreSQL, and what the deadline indexes add.

    .venv/bin/python bench/pg_row.py                 # the local PostgreSQL
    .venv/bin/python bench/pg_row.py -n 4000 --rounds 3

Not part of the test suite. Each job goes through the store the way a worker takes it: the
insert, the start and the outcome (``create``, ``start`` with the record as its hint, and
``complete``), one compare-and-set each, on the store's own tables and fast lane. The job is the
one a Celery caller's ``.apply_async()`` of a task without arguments stores (about 600 bytes of
JSON). It runs twice per round: on the store's schema, whose jobs table has one partial index
per clock (nine), and on the same table with those indexes dropped; each at
``synchronous_commit`` on and off.

Reported per job: the CPU of every PostgreSQL process of this machine (the backends, the WAL
writer, the checkpointer...: ``/proc/<pid>/task/*/schedstat``, nanoseconds), of this client,
and the wall time. Other clients of the same server count too: run it while the server is
otherwise idle. The table is written by this run only (a ``pgrow<random>`` prefix) and
dropped at the end. The sweeper's ``due`` needs the indexes: without them it scans the table,
which is why the store keeps them; this measures only what they cost the writes.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
import uuid

import sqlalchemy as sa

from ojs_celery.envelope import Job, parse_envelope
from ojs_celery.lifecycle import CLOCKS
from ojs_celery.store.sql import SQLStore

WORKER = "worker_pgrow"


def postgres_cpu() -> float:
    """CPU seconds so far of every process of this machine named ``postgres``."""
    total = 0
    for comm in pathlib.Path("/proc").glob("[0-9]*/comm"):
        try:
            if not comm.read_text().startswith("postgres"):
                continue
            for stat in comm.parent.glob("task/*/schedstat"):
                total += int(stat.read_text().split()[0])
        except OSError:  # the process ended meanwhile
            continue
    return total / 1e9


def one_run(url: str, n: int, indexed: bool, sync: str) -> tuple[float, float, float]:
    """Server CPU, client CPU and wall time per job, in µs, over ``n`` jobs."""
    store = SQLStore(url, prefix=f"pgrow{uuid.uuid4().hex[:8]}", synchronous_commit=sync)
    try:
        if not indexed:
            with store.engine.begin() as connection:
                for clock in CLOCKS:
                    connection.execute(sa.text(f"DROP INDEX ix_{store.prefix}_jobs_due_{clock}"))
        jobs = [parse_envelope({"type": "caller.task", "args": []}) for _ in range(n + 50)]
        for job in jobs[:50]:  # warm-up: the lane's connection and its prepared statements
            lifecycle(store, job)
        server, client, wall = postgres_cpu(), time.process_time(), time.perf_counter()
        for job in jobs[50:]:
            lifecycle(store, job)
        server = postgres_cpu() - server
        client, wall = time.process_time() - client, time.perf_counter() - wall
        return server / n * 1e6, client / n * 1e6, wall / n * 1e6
    finally:
        store.metadata.drop_all(store.engine)
        store.close()


def lifecycle(store: SQLStore, job: Job) -> None:
    """The insert, the start and the outcome of one job; raises if one is not applied."""
    created = store.create(job)
    record = created.record
    assert created.applied and record is not None
    started = store.start(record.job.id, record.token, WORKER, hint=record)
    assert started.applied and started.record is not None
    done = store.complete(record.job.id, started.record.job.attempt, WORKER, None,
                          hint=started.record)
    assert done.applied, done.reason


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("-n", type=int, default=2000, help="jobs per figure")
    parser.add_argument("--rounds", type=int, default=2, help="runs per figure (median)")
    options = parser.parse_args()
    if options.n < 1 or options.rounds < 1:
        parser.error("-n and --rounds: at least 1")
    figures: dict[tuple[bool, str], list[tuple[float, float, float]]] = {}
    for _ in range(options.rounds):
        for sync in ("on", "off"):
            for indexed in (True, False):
                figures.setdefault((indexed, sync), []).append(
                    one_run(options.postgres, options.n, indexed, sync))
    print(f"µs per job (insert + start + outcome), median of {options.rounds} run(s) of "
          f"{options.n} jobs\n\n| deadline indexes | synchronous_commit | PostgreSQL CPU | "
          "client CPU | wall |\n|---|---|---|---|---|")
    for (indexed, sync), runs in figures.items():
        server, client, wall = (statistics.median(run[i] for run in runs) for i in range(3))
        print(f"| {'nine' if indexed else 'none'} | {sync} | {server:.0f} | {client:.0f} | "
              f"{wall:.0f} |")


if __name__ == "__main__":
    main()
