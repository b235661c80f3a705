"""Hand-run measure of what a job's writes cost PostgreSQL, and what the deadline indexes add.

    .venv/bin/python bench/pg_row.py                 # the local PostgreSQL
    .venv/bin/python bench/pg_row.py -n 4000 --rounds 6

Not part of the test suite. Each job goes through the store the way a worker takes it: the
insert (``INSERT ... ON CONFLICT DO NOTHING``), the start with the record as its hint and the
outcome (each a compare-and-set ``UPDATE``), on the store's own tables and fast lane. The job is
like the one a Celery caller's ``.apply_async()`` of a task without arguments stores (500 – 600
bytes of JSON). Four runs make a round: the store's schema, whose jobs table has one partial
index per clock (nine), and a schema with those indexes dropped, each at ``synchronous_commit``
on and off; every run has a store of its own (``pgrow<random>`` tables, dropped at its end), and
each round takes the four in the reverse order of the round before, so that a machine drifting
during the run does not favour one.

Reported per job, as the median and the range over the rounds: the CPU of the local PostgreSQL
server (every ``postgres`` process, plus the postmaster's reaped children: a backend that exits
during a run is counted; read in clock ticks, so keep ``-n`` in the thousands), of this client,
and the wall time. Other clients of the same server count too: run it while the server is
otherwise idle. Only the writes are measured, on a small table whose indexes stay in memory: not
vacuuming, nor the bloat of updates that cannot be made in place, which the indexes also cost a
long-lived table. A run killed midway leaves its ``pgrow*`` tables behind (``DROP TABLE`` them
by hand).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import server_process
from scale import server_cpu

from ojs_celery.envelope import Job, parse_envelope
from ojs_celery.lifecycle import CLOCKS
from ojs_celery.store.sql import SQLStore

WORKER = "worker_pgrow"
WARMUP = 50
#: A round's runs: (deadline indexes kept, synchronous_commit).
RUNS = ((True, "on"), (False, "on"), (True, "off"), (False, "off"))


def one_run(url: str, n: int, indexed: bool, sync: str) -> tuple[float, float, float]:
    """Server CPU, client CPU and wall time per job, in µs, over ``n`` jobs."""
    store = SQLStore(url, prefix=f"pgrow{uuid.uuid4().hex[:8]}", synchronous_commit=sync)
    try:
        if not indexed:
            with store.engine.begin() as connection:
                for clock in CLOCKS:
                    connection.execute(sa.text(f"DROP INDEX ix_{store.prefix}_jobs_due_{clock}"))
        jobs = [parse_envelope({"type": "caller.task", "args": []}) for _ in range(n + WARMUP)]
        for job in jobs[:WARMUP]:  # the lane's connection and its prepared statements
            lifecycle(store, job)
        wall, client, server = time.perf_counter(), time.process_time(), server_cpu("postgres", 0)
        for job in jobs[WARMUP:]:
            lifecycle(store, job)
        wall, client = time.perf_counter() - wall, time.process_time() - client
        server = server_cpu("postgres", 0) - server
        return server / n * 1e6, client / n * 1e6, wall / n * 1e6
    finally:
        try:
            store.drop_tables()
        finally:
            store.close()


def lifecycle(store: SQLStore, job: Job) -> None:
    """The insert, the start and the outcome of one job; raises if one is not applied."""
    created = store.create(job)
    if not created.applied or created.record is None:
        raise RuntimeError(f"insert not applied: {created.reason}")
    record = created.record
    started = store.start(record.job.id, record.token, WORKER, hint=record)
    if not started.applied or started.record is None:
        raise RuntimeError(f"start not applied: {started.reason}")
    done = store.complete(record.job.id, started.record.job.attempt, WORKER, None,
                          hint=started.record)
    if not done.applied:
        raise RuntimeError(f"outcome not applied: {done.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("-n", type=int, default=2000, help="jobs per run")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the four runs")
    options = parser.parse_args()
    if options.n < 1 or options.rounds < 1:
        parser.error("-n and --rounds: at least 1")
    with psycopg.connect(options.postgres) as connection:  # the server must be this machine's
        server_process(connection.info.backend_pid, "postgres")
    figures: dict[tuple[bool, str], list[tuple[float, float, float]]] = {run: [] for run in RUNS}
    for round_ in range(options.rounds):
        for indexed, sync in RUNS if round_ % 2 == 0 else reversed(RUNS):
            figures[indexed, sync].append(one_run(options.postgres, options.n, indexed, sync))
    print(f"µs per job (insert + start + outcome): median (min – max) of {options.rounds} "
          f"run(s) of {options.n} jobs\n\n| deadline indexes | synchronous_commit | "
          "PostgreSQL CPU | client CPU | wall |\n|---|---|---|---|---|")
    for (indexed, sync), runs in figures.items():
        cells = []
        for i in range(3):
            values = [run[i] for run in runs]
            cells.append(f"{statistics.median(values):.0f} ({min(values):.0f} – "
                         f"{max(values):.0f})")
        print(f"| {'nine' if indexed else 'none'} | {sync} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
