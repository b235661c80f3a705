"""Hand-run soak: a prefork worker over thousands of jobs and many child recycles, resources
counted from outside (an operator's trial for leaks and unbounded growth).

    .venv/bin/python bench/soak.py --store redis --kind ojs --jobs 3000
    .venv/bin/python bench/soak.py --store postgres --kind plain --mode autoscale
    .venv/bin/python bench/soak.py --broker amqp --store redis --jobs 2000

Not part of the test suite. Redis (broker, results and the Redis store) is a private
``redis-server`` on a free port, so that its ``CLIENT LIST`` counts this run only; PostgreSQL
and RabbitMQ are the shared test servers (unique table prefix and queue names, removed at the
end). The worker is ``tests.e2eapp`` with ``--max-tasks-per-child`` (and
``--max-memory-per-child``) or ``--autoscale``; jobs are ``e2e.noop`` (``--kind ojs``) or the
plain Celery task ``e2e.plain`` (``--kind plain``): the difference is what OJS adds.

Every ``--every`` jobs it prints, for the worker's main process and its pool children: open
fds, threads, RSS, and TCP connections to each server (read from ``/proc``), plus the
server's own count (``CLIENT LIST`` of the private Redis; ``pg_stat_activity`` rows whose
client port is one of the worker's), and at the end the store's keys or rows per kind.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import redis  # noqa: E402
from chaos import RedisServer, free_port  # noqa: E402

from tests.e2eapp import make_app  # noqa: E402
from tests.workers import Beat, Worker, forget_made, redis_config, unique  # noqa: E402

POSTGRES = os.environ.get("OJS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
AMQP = os.environ.get("OJS_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _status(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _tcp_by_inode() -> dict[str, int]:
    """Socket inode -> remote port, for every established TCP connection of the machine."""
    found: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "01":  # ESTABLISHED
                found[cols[9]] = int(cols[2].rsplit(":", 1)[1], 16)
    return found


def _local_ports(pid: int, server_port: int) -> list[int]:
    inodes = _socket_inodes(pid)
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if (cols[3] == "01" and cols[9] in inodes
                    and int(cols[2].rsplit(":", 1)[1], 16) == server_port):
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def process_line(pid: int, ports: dict[str, int]) -> str:
    try:
        tcp = _tcp_by_inode()
        inodes = _socket_inodes(pid)
        conns = {name: sum(1 for i in inodes if tcp.get(i) == port)
                 for name, port in ports.items()}
        fds = len(list(pathlib.Path(f"/proc/{pid}/fd").iterdir()))
        return (f"fds={fds:3d} thr={_status(pid, 'Threads'):2d} "
                f"rss={_status(pid, 'VmRSS') // 1024:4d}MB "
                + " ".join(f"{k}={v}" for k, v in conns.items()))
    except (FileNotFoundError, ProcessLookupError):
        return "(gone)"


def store_counts(config: dict[str, Any], store_url: str) -> dict[str, int]:
    prefix = config["ojs"]["store_prefix"]
    if store_url.startswith("redis"):
        client = redis.Redis.from_url(store_url)
        counts: dict[str, int] = {}
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            parts = key.decode().split(":")
            kind = parts[1] if len(parts) > 1 else "?"
            ktype = client.type(key).decode()
            size = {"zset": client.zcard, "hash": client.hlen, "set": client.scard,
                    "list": client.llen}.get(ktype)
            counts[f"{kind}({ktype})"] = counts.get(f"{kind}({ktype})", 0) + (
                size(key) if size and kind != "job" else 1)
        client.close()
        return counts
    import sqlalchemy

    engine = sqlalchemy.create_engine(store_url)
    counts = {}
    with engine.connect() as conn:
        tables = conn.execute(sqlalchemy.text(
            "select tablename from pg_tables where tablename like :p"),
            {"p": f"{prefix}%"}).scalars().all()
        for table in tables:
            query = sqlalchemy.text(f'select count(*) from "{table}"')
            counts[table] = int(conn.execute(query).scalar() or 0)
    engine.dispose()
    return counts


def drop_pg(prefix: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(POSTGRES)
    with engine.begin() as conn:
        tables = conn.execute(sqlalchemy.text(
            "select tablename from pg_tables where tablename like :p"),
            {"p": f"{prefix}%"}).scalars().all()
        for table in tables:
            conn.execute(sqlalchemy.text(f'drop table if exists "{table}" cascade'))
    engine.dispose()


def pg_backends(ports: list[int]) -> int:
    import sqlalchemy

    if not ports:
        return 0
    engine = sqlalchemy.create_engine(POSTGRES)
    with engine.connect() as conn:
        n = conn.execute(sqlalchemy.text(
            "select count(*) from pg_stat_activity where client_port = any(:p)"),
            {"p": ports}).scalar()
    engine.dispose()
    return int(n or 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["redis", "postgres"], default="redis")
    parser.add_argument("--broker", choices=["redis", "amqp"], default="redis")
    parser.add_argument("--kind", choices=["ojs", "plain"], default="ojs")
    parser.add_argument("--mode", choices=["maxtasks", "autoscale"], default="maxtasks")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--max-tasks", type=int, default=5)
    parser.add_argument("--beat", action="store_true",
                        help="celery beat schedules the sweep (on a queue of its own the worker "
                        "also consumes); completed jobs are kept 5 s, and the store is counted "
                        "again once they are due")
    args = parser.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ojs-soak-"))
    server = RedisServer(tmp, free_port(), durable=False)
    server.start()
    config = redis_config(tmp, server.url)
    store_url = server.url if args.store == "redis" else POSTGRES
    config["ojs"]["store_url"] = store_url
    config["ojs"]["events"] = True
    if args.broker == "amqp":
        config["broker_url"] = AMQP
    if args.beat:
        config["ojs"]["sweep_queue"] = unique("sweep")
        config["ojs"]["retention"] = {"completed": 5}
        config["worker_queues"] = [config["queue"], config["ojs"]["sweep_queue"]]
    ports = {"redis": server.port, "pg": 5432, "amqp": 5672}
    extra = (["--max-tasks-per-child", str(args.max_tasks), "--max-memory-per-child", "400000"]
             if args.mode == "maxtasks" else ["--autoscale", "2,1"])
    app = make_app(config)
    task = app.tasks["e2e.noop" if args.kind == "ojs" else "e2e.plain"]
    worker = Worker(config, tmp / "worker.log", concurrency=2, extra=extra)
    admin = redis.Redis.from_url(server.url)
    beat = Beat(config, tmp) if args.beat else None
    try:
        worker.wait_ready(60)
        main_pid = worker.process.pid
        print(f"soak: store={args.store} broker={args.broker} kind={args.kind} "
              f"mode={args.mode} worker={main_pid} log={tmp / 'worker.log'}", flush=True)
        print(f"store before: {store_counts(config, store_url)}", flush=True)
        done = 0
        start = time.monotonic()
        while done < args.jobs:
            results = [task.delay() if args.kind == "ojs" else task.delay(1)
                       for _ in range(args.batch)]
            for result in results:
                result.get(timeout=120)
                result.forget()
            done += args.batch
            if done % args.every == 0 or done >= args.jobs:
                kids = children(main_pid)
                pg_ports = [p for pid in [main_pid, *kids] for p in _local_ports(pid, 5432)]
                print(f"[{done:6d} {time.monotonic() - start:5.0f}s] redis clients="
                      f"{len(admin.client_list())} pg backends={pg_backends(pg_ports)}",
                      flush=True)
                print(f"   main {main_pid}: {process_line(main_pid, ports)}", flush=True)
                for kid in kids:
                    print(f"   child {kid}: {process_line(kid, ports)}", flush=True)
        print(f"store after jobs: {store_counts(config, store_url)}", flush=True)
        if beat is not None:
            time.sleep(15)
            print(f"store 15 s later: {store_counts(config, store_url)}", flush=True)
        worker.stop(60)
        print(f"store after stop: {store_counts(config, store_url)}", flush=True)
        print(f"redis clients after stop={len(admin.client_list())}", flush=True)
    finally:
        if beat is not None:
            beat.stop()
        worker.stop(30)
        admin.close()
        server.stop()
        if args.store == "postgres":
            drop_pg(config["ojs"]["store_prefix"])
        forget_made(None, AMQP if args.broker == "amqp" else None)
        _ = unique


if __name__ == "__main__":
    main()
