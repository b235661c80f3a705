"""Hand-run measure of the least one more store request can cost: CPU per bare request.

    .venv/bin/python bench/floor.py                 # the local Redis and PostgreSQL
    .venv/bin/python bench/floor.py -n 40000 --no-postgres

Not part of the test suite. Every OJS job pays Celery's own work plus a few store requests that
must each be answered before the job goes on (the fencing: the start and the outcome, and the
insert where the store is not the broker's Redis). On a 2-core machine a run's rate follows
the CPU it spends per job, so the cheapest such request, in the client and in the server
together, is the floor under what the design can cost. This times requests that do as little as
a request can, on one connection, past every library layer: on Redis ``PING``, an ``EVALSHA`` of
``return 1`` and an ``HSET`` of twenty fields; on PostgreSQL a prepared ``SELECT 1`` and a
prepared one-row ``UPDATE`` in autocommit (of an unindexed column: PostgreSQL updates the row in
place, a HOT update), with ``synchronous_commit`` on and off. With ``on`` the backend waits for
the WAL's flush and pays its system time; with ``off`` the WAL writer process flushes later,
which is not counted here.

``--fenced`` (Redis) times the store's own fenced write as well, the one each start and outcome
pays: the compare-and-set script on a record like ``bench/caller.py``'s (its JSON, its nine
clocks' indexes), sent raw on one connection, and through the store (the rule, the deadlines,
the encoding and the store's request path in the client). Those are the design as built, where
the bare requests are the least any request can cost.

CPU is this process's (user + system) and the server's: the ``redis-server`` process (all its
threads), or the PostgreSQL backend serving the connection, read from ``/proc/<pid>/task/*/
schedstat`` (nanoseconds), so both must run on this machine. Other clients of the same server
count too: run it while the servers are otherwise idle. Compare the figures with
``bench/caller.py``'s CPU per job taken in the same hour: the machine's state moves both. It
writes one key (``ojsfloor:hash``) and one table (``ojsfloor``) and removes them.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psycopg
import redis
from hiredis import pack_command as _pack_command
from psycopg import pq

from ojs_celery.compat import pool_connection

BENCH_DIR = pathlib.Path(__file__).resolve().parent
WARMUP = 500
KEY = "ojsfloor:hash"
TABLE = "ojsfloor"
#: hiredis's packer, as the store's Redis lane uses it (its stub types only one argument).
pack_command: Any = _pack_command


def server_process(pid: int, name: str) -> int:
    """``pid``, after checking that it is a process of this machine named ``name``."""
    comm = pathlib.Path(f"/proc/{pid}/comm")
    found = comm.read_text().strip() if comm.exists() else ""
    if not found.startswith(name):
        raise SystemExit(f"the server's process {pid} is not a local {name} (found "
                         f"{found or 'nothing'}): run this on the server's machine")
    return pid


def proc_cpu(pid: int) -> float:
    """CPU seconds so far of every thread of a process of this machine (ns resolution)."""
    tasks = pathlib.Path(f"/proc/{pid}/task").glob("*/schedstat")
    return sum(int(path.read_text().split()[0]) for path in tasks) / 1e9


def timed(request: Callable[[], Any], n: int, server_pid: int) -> tuple[float, float, float]:
    """Client CPU, server CPU and wall time per request, in µs, over ``n`` requests."""
    for _ in range(WARMUP):
        request()
    server, client, wall = proc_cpu(server_pid), time.process_time(), time.perf_counter()
    for _ in range(n):
        request()
    server = proc_cpu(server_pid) - server
    client, wall = time.process_time() - client, time.perf_counter() - wall
    return client / n * 1e6, server / n * 1e6, wall / n * 1e6


def report(store: str, what: str, figures: tuple[float, float, float]) -> None:
    client, server, wall = figures
    print(f"| {store} | {what} | {client:.1f} | {server:.1f} | {client + server:.1f} | "
          f"{wall:.1f} |", flush=True)


def redis_floor(url: str, n: int) -> None:
    client = redis.Redis.from_url(url)
    pid = server_process(int(client.info("server")["process_id"]), "redis-server")
    connection: Any = pool_connection(client.connection_pool)
    try:
        sha = client.script_load("return 1")
        fields = [part for i in range(20) for part in (f"f{i}", "v" * 20)]
        for what, command in (("PING", ("PING",)), ("EVALSHA of `return 1`", ("EVALSHA", sha, 0)),
                              ("HSET of 20 fields", ("HSET", KEY, *fields))):
            packed = [pack_command(command)]

            def request(packed: list[bytes] = packed) -> None:
                connection.send_packed_command(packed)
                connection.read_response()

            report("Redis", what, timed(request, n, pid))
    except BaseException:
        connection.disconnect()  # a reply may be left unread
        raise
    finally:
        client.connection_pool.release(connection)
        client.delete(KEY)
        client.close()


def fenced_floor(options: argparse.Namespace, n: int) -> None:
    """The store's compare-and-set of a job record, raw and through the store (``--fenced``).

    The record is a real job's: one ``.apply_async()`` of ``bench/caller.py``'s task on a Redis
    broker and store (nobody consumes it), started for a made-up worker. Each raw request is the
    script with that record's arguments, its version and nonces moved on so that every write
    wins; each write through the store is a heartbeat of the attempt (``JobStore.heartbeat``),
    a whole record written as a start or an outcome writes it."""
    sys.path.insert(0, str(BENCH_DIR))
    from caller import TASK_NAME, Pairing, flush, make_app

    from ojs_celery.runtime import get_runtime
    from ojs_celery.store.base import new_nonce

    services = argparse.Namespace(redis=options.redis, postgres=options.postgres,
                                  amqp=options.redis)
    with tempfile.TemporaryDirectory() as tmp:
        pairing = Pairing("redis-redis", services, pathlib.Path(tmp))
        try:
            app = make_app(pairing.config("ojs", pairing.new_queue()))
            job_id = app.tasks[TASK_NAME].apply_async().id
            flush(app, "ojs")
            store: Any = get_runtime(app).store
            pid = server_process(int(store.client.info("server")["process_id"]), "redis-server")
            published = store.get_record(job_id)
            record = store.start(job_id, published.token, "floor@bench", hint=published).record
            keys = store._job_keys(job_id)
            args = store._cas_args(record.copy(), record, store._deadlines(record))
            version, nonce = record.version, record.nonce
            nonce_at = 11  # the new record's nonce in the script's arguments (RedisStore._args)
            connection: Any = pool_connection(store.client.connection_pool)

            def raw() -> None:
                nonlocal version, nonce
                args[1], args[nonce_at], args[-1] = str(version), new_nonce(), nonce
                connection.send_packed_command(
                    [pack_command(("EVALSHA", store._cas_script.sha, len(keys), *keys, *args))])
                if connection.read_response() != 1:
                    raise SystemExit("the raw compare-and-set lost: the figures would be wrong")
                version, nonce = version + 1, args[nonce_at]

            try:
                report("Redis", "the compare-and-set script, raw", timed(raw, n, pid))
            finally:
                store.client.connection_pool.release(connection)
            current = store.get_record(job_id)

            def through_store() -> None:
                nonlocal current
                done = store.heartbeat(job_id, current.job.attempt, "floor@bench", hint=current)
                if done.record is None:
                    raise SystemExit(f"the heartbeat was refused ({done.reason})")
                current = done.record

            report("Redis", "the compare-and-set through the store", timed(through_store, n, pid))
            get_runtime(app).close()
            app.close()
        finally:
            pairing.cleanup()


def checked(result: Any) -> None:
    """Raise if a libpq call failed (libpq returns a failed result, it does not raise)."""
    if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
        raise SystemExit(bytes(result.error_message or b"").decode(errors="replace"))


def postgres_floor(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as connection:
        pid = server_process(connection.info.backend_pid, "postgres")
        connection.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id int PRIMARY KEY, v text)")
        try:
            connection.execute(f"INSERT INTO {TABLE} VALUES (1, '') ON CONFLICT DO NOTHING")
            pgconn = connection.pgconn
            statements: tuple[tuple[str, str, bytes, list[bytes]], ...] = (
                ("SELECT 1", "on", b"SELECT 1", []),
                ("one-row UPDATE, synchronous_commit on", "on",
                 f"UPDATE {TABLE} SET v = $1 WHERE id = 1".encode(), [b"v" * 200]),
                ("one-row UPDATE, synchronous_commit off", "off",
                 f"UPDATE {TABLE} SET v = $1 WHERE id = 1".encode(), [b"v" * 200]),
            )
            for index, (what, sync, sql, params) in enumerate(statements):
                connection.execute(f"SET synchronous_commit = {sync}")
                name = f"ojsfloor_{index}".encode()
                checked(pgconn.prepare(name, sql))

                def request(name: bytes = name, params: list[bytes] = params) -> None:
                    checked(pgconn.exec_prepared(name, params))

                report("PostgreSQL", what, timed(request, n // 4, pid))
        finally:
            connection.execute(f"DROP TABLE IF EXISTS {TABLE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("-n", type=int, default=20000,
                        help="requests per Redis figure (a quarter of it on PostgreSQL)")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--fenced", action="store_true",
                        help="also the store's own compare-and-set on Redis, raw and through it")
    options = parser.parse_args()
    if options.n < 4:
        parser.error("-n: at least 4")
    print("µs per request: CPU of this client, of the server, of both; wall time\n\n"
          "| store | request | client CPU | server CPU | both | wall |\n"
          "|---|---|---|---|---|---|")
    redis_floor(options.redis, options.n)
    if options.fenced:
        fenced_floor(options, options.n)
    if not options.no_postgres:
        postgres_floor(options.postgres, options.n)


if __name__ == "__main__":
    main()
