"""Hand-run benchmark: enqueue and worker rates with 10k, 100k and 1M jobs already stored.

    .venv/bin/python bench/scale.py                        # 10k, 100k, 1M (about 15 min)
    .venv/bin/python bench/scale.py --sizes 10000,100000 -n 1000
    .venv/bin/python bench/scale.py --store postgres -n 1000   # the job store on PostgreSQL
    .venv/bin/python bench/scale.py --producer-only -n 4000    # the producer alone

Not part of the test suite. The broker is a PRIVATE ``redis-server`` (no persistence) on a free
port that the script starts and stops, and so is the OJS job store by default: a million jobs
take about 2 GB, kept out of the shared Redis, and nothing is left behind. With ``--store
postgres`` the job store is the PostgreSQL database at ``--postgres``, in tables of a unique
prefix that the script drops at the end (a million jobs take about 0.9 GB there); after each
fill the table is ``VACUUM ANALYZE``d, as autovacuum would after a bulk load, and checkpointed.

What is measured
----------------
The store grows in place (10k, then +90k, then +900k stored jobs) and is filled directly, not
through ``enqueue``: ``bench/sweep.py``'s row generator and loaders (raw-protocol Redis,
``COPY``) write records in the store's own layout, 90 % ``completed`` in the last 3 days (within
the 7-day retention, so indexed on the retention clock), 5 % ``available`` created in the last
10 minutes (with the TTL, total and redispatch deadlines of ``bench/sweep.py``'s jobs, all
ahead) and 5 % ``scheduled`` 2 to 24 h ahead, held in the store (promote clock). An ``ojs-celery
sweep --loop`` subprocess (every 2 s) runs for the whole run. At each size, after one round of
``enqueue()`` calls that is not measured (see :func:`settle`), one after the other:

* enqueue: ``ojs_celery.enqueue()`` and the OJS task's ``.apply_async()``, ``-n`` calls each,
  from this process into a queue nobody consumes (``throughput.enqueue_trial``; purged after);
* worker: one prefork worker, concurrency 2, draining ``-n`` OJS jobs from a filled queue
  (``throughput.worker_trial``: first ``task_prerun`` to last ``task_postrun``, and the worker's
  CPU per task, which is steadier than rates on a shared machine);
* 2 x 2: two producer processes publishing ``-n`` ``.apply_async()`` calls each while two
  workers (prefork, concurrency 2) run them: the producers' summed rate, and the end-to-end rate
  (jobs over first publish to last completion).

Targets: every rate drops by at most 10 % from the smallest to the largest size.

Rates on a shared 2-core machine move by more than that between runs, so each size also reports
the store server's CPU per job over its trials (the private ``redis-server``, or every process of
the local PostgreSQL server, exited backends included; the sweeper's passes count too): what the
store pays for a job as it grows, which the machine's load does not move. On Redis it also
reports the server's own time per job in commands and per call of the costliest ones
(``INFO commandstats``): whether a larger store runs more commands per job, or the same ones
more slowly.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import redis

BENCH_DIR = pathlib.Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(ROOT))

from benchapp import make_app  # noqa: E402
from chaos import RedisServer  # noqa: E402
from sweep import PostgresLoader, RedisLoader, Rows  # noqa: E402
from throughput import (  # noqa: E402
    HERTZ,
    Keys,
    count_ends,
    enqueue_trial,
    make_config,
    proc_cpu,
    proc_stat,
    unique,
    worker_process,
    worker_trial,
)

from ojs_celery.runtime import get_runtime  # noqa: E402
from ojs_celery.store.sql import SQLStore  # noqa: E402

#: What the store holds besides the benchmark's own jobs.
MIX = {"completed": 0.90, "available": 0.05, "scheduled": 0.05}
DROP_TARGET = 0.10
TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_cpu(store: str, redis_pid: int) -> float:
    """CPU seconds used so far by the job store's server: the private ``redis-server``, or
    every process of the local PostgreSQL server plus the backends that have exited (which
    the postmaster reaped: its children's time)."""
    if store == "redis":
        return proc_cpu(redis_pid)
    ticks = 0
    for pid in os.listdir("/proc"):
        stat = proc_stat(pid) if pid.isdigit() else None
        if stat is None or stat[0] != "postgres":
            continue
        fields = stat[1]
        ticks += int(fields[11]) + int(fields[12])
        parent = proc_stat(fields[1])
        if parent is None or parent[0] != "postgres":  # the postmaster
            ticks += int(fields[13]) + int(fields[14])
    return ticks / HERTZ


def command_times(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Redis's own count and time (µs) so far per command (``INFO commandstats``)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in stats.items()}


def command_note(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                 jobs: int) -> str:
    """The server's time per job in commands, and the time per call of the costliest ones:
    at a larger size the same commands (as many per job) take longer, or they do not."""
    spent = {name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
             for name, (calls, usec) in after.items()}
    top = sorted(spent.items(), key=lambda item: -item[1][1])[:4]
    total = sum(usec for _, usec in spent.values())
    return (f"redis {total / jobs:.0f} µs/job in commands ("
            + ", ".join(f"{name} {calls / jobs:.1f}/job x {usec / max(calls, 1):.1f} µs"
                        for name, (calls, usec) in top) + ")")


@dataclass
class Figures:
    size: int
    rates: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- producer


def produce(config: dict[str, Any], n: int) -> None:
    """A producer process: ``n`` ``.apply_async()`` calls; prints its loop's start and end."""
    app = make_app(config)
    task = app.tasks["bench.ojs"]
    for _ in range(20):  # warm-up: connections, scripts (run by the workers too)
        task.apply_async()
    began, cpu = time.time(), time.process_time()
    for _ in range(n):
        task.apply_async()
    ended, cpu = time.time(), time.process_time() - cpu
    get_runtime(app).bus.flush()
    print(json.dumps({"began": began, "ended": ended, "n": n, "cpu": cpu}), flush=True)


# ---------------------------------------------------------------------------------- trials


def apply_async_trial(app: Any, n: int, keys: Keys, queue: str) -> float:
    task = app.tasks["bench.ojs"]
    for _ in range(20):
        task.apply_async()
    began = time.perf_counter()
    for _ in range(n):
        task.apply_async()
    elapsed = time.perf_counter() - began
    get_runtime(app).bus.flush()
    keys.purge_queue(queue)
    return n / elapsed


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def many_trial(url: str, keys: Keys, tmp: pathlib.Path, prefix: str, exchange: str, n: int,
               producers: int, workers: int, store_url: str) -> tuple[float, float, float]:
    """``producers`` processes publishing while ``workers`` workers run the jobs; returns the
    producers' summed rate, the end-to-end rate and the producers' CPU ms per call."""
    queue = unique("scale_many_")
    keys.queues.append(queue)
    config = make_config(url, queue, exchange, prefix, store_url=store_url)
    stamps = tmp / queue
    stamps.mkdir()
    app = make_app(config)
    store = get_runtime(app).store
    before = {w.worker_id for w in store.workers.all()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(ROOT)])}
    total = (20 + n) * producers
    try:
        with ExitStack() as stack:
            for index in range(workers):
                hostname = unique(f"scalew{index}") + "@bench"
                keys.hostnames.append(hostname)
                stack.enter_context(worker_process(config, hostname, tmp / f"{queue}.{index}.log",
                                                   {"OJS_BENCH_STAMPS": str(stamps)}))
            wait_for(lambda: len({w.worker_id for w in store.workers.all()} - before) >= workers,
                     60, "the workers to register")
            command = [sys.executable, str(pathlib.Path(__file__)), "--produce", str(n),
                       "--config", json.dumps(config)]
            runs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE)
                    for _ in range(producers)]
            reports = []
            for run in runs:
                out, _ = run.communicate(timeout=TIMEOUT)
                if run.returncode:
                    raise RuntimeError(f"a producer failed ({run.returncode})")
                reports.append(json.loads(out.decode().strip().splitlines()[-1]))
            wait_for(lambda: count_ends(stamps) >= total, TIMEOUT, f"{total} jobs to run")
        ends = [float(line.split()[2]) for path in stamps.glob("stamps-*.txt")
                for line in path.read_text().splitlines() if line.startswith("E ")]
        began = min(r["began"] for r in reports)
        produced = sum(r["n"] / (r["ended"] - r["began"]) for r in reports)
        cpu_ms = sum(r["cpu"] for r in reports) / (producers * n) * 1000
        return produced, producers * n / (max(ends) - began), cpu_ms
    finally:
        keys.purge_queue(queue)
        get_runtime(app).close()
        app.close()


def measure(size: int, url: str, keys: Keys, tmp: pathlib.Path, prefix: str, exchange: str,
            args: argparse.Namespace, store_url: str) -> Figures:
    figures = Figures(size)
    queue = unique("scale_enq_")
    keys.queues.append(queue)
    app = make_app(make_config(url, queue, exchange, prefix, store_url=store_url))
    try:
        cpu = time.process_time()
        figures.rates["enqueue()"] = enqueue_trial(app, "ojs", args.n, keys, queue)
        cpu, spent = time.process_time(), time.process_time() - cpu
        figures.rates[".apply_async()"] = apply_async_trial(app, args.n, keys, queue)
        applied = time.process_time() - cpu
        # CPU of this process per call (the 20 warm-up calls and the purge included).
        figures.notes["producer"] = (f"producer {spent / args.n * 1000:.2f} ms CPU/enqueue(), "
                                     f"{applied / args.n * 1000:.2f} ms CPU/.apply_async()")
    finally:
        get_runtime(app).close()
        app.close()
    if args.producer_only:
        return figures
    trial = worker_trial("ojs", args.n, url, keys, tmp, prefix, exchange, store_url=store_url)
    figures.rates["worker"] = trial.rate
    figures.notes["worker"] = (f"worker {trial.cpu_ms:.2f} ms CPU/task, {trial.store_ok} of "
                               f"{trial.n} completed in the store")
    produced, end_to_end, cpu_ms = many_trial(url, keys, tmp, prefix, exchange, args.n,
                                              args.producers, args.workers, store_url)
    figures.notes["many"] = f"{args.producers}x{args.workers}: {cpu_ms:.2f} ms producer CPU/call"
    label = f"{args.producers}x{args.workers}"
    figures.rates[f"{label} producers"] = produced
    figures.rates[f"{label} end-to-end"] = end_to_end
    return figures


# ---------------------------------------------------------------------------------- driver


def settle(url: str, keys: Keys, prefix: str, exchange: str, store_url: str, n: int) -> None:
    """One round of ``enqueue()`` calls, not measured. Right after a fill of a million jobs
    the machine is still absorbing it: the first round ran at about half the rate, with the
    store server's time per command doubled for commands that do not depend on its size
    (``LPUSH``), and the next round as at 10k."""
    queue = unique("scale_settle_")
    keys.queues.append(queue)
    app = make_app(make_config(url, queue, exchange, prefix, store_url=store_url))
    try:
        enqueue_trial(app, "ojs", n, keys, queue)
    finally:
        get_runtime(app).close()
        app.close()


def fill(loader: RedisLoader | PostgresLoader, count: int, policy: Any) -> float:
    """``count`` more stored jobs of ``MIX``, relative to now (fresh ids each call)."""
    rows = Rows(time.time(), policy, seed=count)
    began = time.perf_counter()
    for chunk in rows.chunks("mix", count, MIX):
        loader.load(chunk)
    loader.after_load()
    return time.perf_counter() - began


def report(results: list[Figures], args: argparse.Namespace, took: float) -> None:
    names = list(results[0].rates)
    store = "Redis job store" if args.store == "redis" else "PostgreSQL job store"
    print(f"\nrates with N jobs stored (Redis broker, private server + {store}; "
          f"-n {args.n}; {os.cpu_count()} CPUs; {took:.0f} s in all):")
    print(f"{'N stored':>10}  " + "  ".join(f"{name:>20}" for name in names))
    for figures in results:
        print(f"{figures.size:>10,}  "
              + "  ".join(f"{figures.rates[name]:>20.0f}" for name in names))
    if len(results) > 1:
        low, high = results[0], results[-1]
        cells = []
        for name in names:
            drop = 1 - high.rates[name] / low.rates[name]
            verdict = "ok" if drop <= DROP_TARGET else "MISSED"
            cells.append(f"{drop:>+16.0%} {verdict:>3}")
        print(f"{'drop':>10}  " + "  ".join(f"{cell:>20}" for cell in cells)
              + f"   (target <= {DROP_TARGET:.0%})")
    for figures in results:
        print(f"  N={figures.size:,}: " + "; ".join(figures.notes.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("-n", type=int, default=2000, help="jobs per trial")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--store", choices=("redis", "postgres"), default="redis",
                        help="the job store: the private Redis, or PostgreSQL at --postgres")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--producer-only", action="store_true",
                        help="only the enqueue() and .apply_async() loops, no worker running")
    parser.add_argument("--redis-config", action="append", default=[], metavar="NAME=VALUE",
                        help="a CONFIG SET on the private Redis before the fill (an operator's "
                        "setting to measure, e.g. hash-max-listpack-value=1024)")
    parser.add_argument("--produce", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce is not None:
        produce(json.loads(args.config), args.produce)
        return 0
    sizes = sorted(int(s) for s in args.sizes.split(","))
    redis_config = [setting.split("=", 1) for setting in args.redis_config]
    if any(len(pair) != 2 or not all(pair) for pair in redis_config):
        parser.error("--redis-config: give NAME=VALUE, e.g. hash-max-listpack-value=1024")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ojs-bench-scale-"))
    server = RedisServer(tmp, free_port(), durable=False)
    began = time.monotonic()
    results: list[Figures] = []
    sweeper: subprocess.Popen[bytes] | None = None
    loader: RedisLoader | PostgresLoader | None = None
    try:
        server.start()
        assert server.process is not None
        redis_pid = server.process.pid
        url = server.url
        with redis.Redis.from_url(url) as admin:
            for name, value in redis_config:
                admin.config_set(name, value)
                print(f"private Redis: {name} {value}", flush=True)
        store_url = url if args.store == "redis" else args.postgres
        run = unique("")
        prefix, exchange = f"scale_{run}", f"scaleev_{run}"
        keys = Keys(redis.Redis.from_url(url))
        app = make_app(make_config(url, unique("scale_sweep_"), exchange, prefix,
                                   store_url=store_url))
        store = get_runtime(app).store
        if isinstance(store, SQLStore):
            store.engine  # noqa: B018 - creates the tables (and indexes) the store uses
            loader = PostgresLoader(store)
        else:
            loader = RedisLoader(url, prefix)
        policy = store.policy
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(ROOT)]),
               "OJS_BENCH_CONFIG": json.dumps(make_config(url, unique("scale_sweep_"), exchange,
                                                          prefix, store_url=store_url))}
        ojs_celery_cli = pathlib.Path(sys.executable).with_name("ojs-celery")
        with open(tmp / "sweeper.log", "ab") as log:
            sweeper = subprocess.Popen(
                [str(ojs_celery_cli), "-A", "benchapp:app", "sweep", "--loop", "--interval", "2"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stored = 0
        for size in sizes:
            seconds = fill(loader, size - stored, policy)
            stored = size
            print(f"N={size:,}: filled to {size:,} stored jobs in {seconds:.0f} s "
                  f"({loader.describe()})", flush=True)
            if sweeper.poll() is not None:
                raise RuntimeError("the sweeper exited:\n"
                                   + (tmp / "sweeper.log").read_text()[-3000:])
            settle(url, keys, prefix, exchange, store_url, args.n)
            spent, commands = server_cpu(args.store, redis_pid), command_times(keys.client)
            figures = measure(size, url, keys, tmp, prefix, exchange, args, store_url)
            spent = server_cpu(args.store, redis_pid) - spent
            # enqueue(), .apply_async(), then the worker and the 2x2 trial
            jobs = (2 if args.producer_only else 3 + args.producers) * args.n
            figures.notes["store"] = f"store server {spent / jobs * 1000:.2f} ms CPU/job"
            if args.store == "redis":
                figures.notes["commands"] = command_note(commands, command_times(keys.client),
                                                         jobs)
            memory = keys.client.info("memory")["used_memory"]  # the trials' jobs included
            figures.notes["memory"] = f"private Redis {memory / 2**20:.0f} MiB"
            print(f"N={size:,}: " + ", ".join(f"{k} {v:.0f}/s" for k, v in figures.rates.items())
                  + "; " + "; ".join(figures.notes.values()), flush=True)
            results.append(figures)
        get_runtime(app).close()
        app.close()
    finally:
        if sweeper is not None and sweeper.poll() is None:
            sweeper.terminate()
            sweeper.wait(30)
        if isinstance(loader, PostgresLoader):
            loader.cleanup()  # drops the store's tables
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, args, time.monotonic() - began)
    return 0


if __name__ == "__main__":
    sys.exit(main())
