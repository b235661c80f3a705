"""Hand-run benchmark of what users run: ``.apply_async()`` with a worker running, per pairing.

    .venv/bin/python bench/caller.py --quick                 # smoke run: 200 jobs, 1 round
    .venv/bin/python bench/caller.py                         # every pairing, 2,000 jobs, 4 rounds
    .venv/bin/python bench/caller.py --pairs redis-pg --profile   # plus cProfile of the producer
    .venv/bin/python bench/caller.py --batch                 # plus enqueue_batch vs send_task

Not part of the test suite. Needs the services of the test suite (``--redis``, ``--postgres``,
``--amqp``); everything it creates (queues, exchanges, keys, store tables, files) is removed.

What is measured, and why
-------------------------
``bench/throughput.py`` drains a pre-filled queue; users who migrate call ``.apply_async()``
while their workers run (issue 12). Here, per trial: ONE ``celery worker`` subprocess (prefork,
concurrency 2, ``--without-gossip --without-mingle --without-heartbeat``, loglevel WARNING) is
started on a fresh queue, waited for (``worker_ready``) and warmed with 20 jobs, so that boot,
connections and table creation are outside the clock. Then this process publishes N (2,000)
``.apply_async()`` calls of one task that does one Redis ``INCR`` (``bench/callerapp.py``).
End-to-end rate = N / (first publish to the last ``task_postrun`` in the pool children, which
fires after OJS's complete); ``.apply_async()`` rate = N / the publish loop alone. The task is
plain Celery (an app without ``install``) or the same task with ``base=OJSTask`` (app with
``install``); neither has a result backend. The kinds alternate (plain/OJS, then OJS/plain)
``--rounds`` times (4) and the median of the per-round ratios OJS / plain is reported.

Pairings (``--pairs``): Redis broker + Redis store, Redis + PostgreSQL, RabbitMQ + Redis,
RabbitMQ + PostgreSQL, and the embedded default (``embedded_settings``: ``ojsfs://`` broker and
SQLite store, results off); the plain task always runs on the same broker.

Rates on a shared 2-core machine move with everyone else's load, so the CPU per job is printed
beside them, per process, from /proc over the measured window: this process (the producer:
publish loop plus the flush of OJS's background outbox acknowledgements and events), the
worker's main process, its pool children (sum) and the store server where it is local: the
whole ``redis-server`` (also the broker's and other users' work when the broker is the same
Redis), or the PostgreSQL backends serving this bench's connections (found in
``pg_stat_activity`` by a per-run ``application_name``).

``--batch``: ``ojs_celery.enqueue_batch`` of 1,000 jobs (one call) vs 1,000 ``app.send_task``
calls on the plain app, per pairing, same broker and queue, nobody consuming (the queue is
purged after each trial), alternated ``--rounds`` times, median ratio (issue 12: at least 1).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import redis

BENCH_DIR = pathlib.Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from callerapp import TASK_NAME, make_app  # noqa: E402
from throughput import (  # noqa: E402
    Keys,
    count_ends,
    proc_cpu,
    read_stamps,
    tree_cpu,
    worker_process,
)

import ojs_celery  # noqa: E402
from ojs_celery.embedded import embedded_settings  # noqa: E402
from ojs_celery.runtime import get_runtime  # noqa: E402

PAIRS = ("redis-redis", "redis-pg", "amqp-redis", "amqp-pg", "embedded")
WARMUP = 20
TIMEOUT = 180.0


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------------------------- pairings


@dataclass
class Pairing:
    """One broker + store pairing and everything this run creates for it."""

    name: str
    options: argparse.Namespace
    tmp: pathlib.Path
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    queues: list[str] = field(default_factory=list)
    counters: list[str] = field(default_factory=list)
    keys: Keys | None = None
    janitor: Any = None  # an OJS app on this pairing's store, for checks and cleanup

    def __post_init__(self) -> None:
        self.counter_client = redis.Redis.from_url(self.options.redis)
        broker, _, store = self.name.partition("-")
        self.broker = broker
        self.store_kind = {"redis": "redis", "pg": "postgresql", "": "sqlite"}[store]
        self.app_name = f"ojsbench_{self.run}"
        self.event_exchange = f"cbev{self.run}"
        self.sweep_queue = f"cbsweep{self.run}"
        self.transport_options: dict[str, Any] = {}
        if broker == "embedded":
            settings = embedded_settings(self.tmp / f"embedded-{self.run}")
            self.broker_url = settings["broker_url"]
            self.transport_options = settings["broker_transport_options"]
            store_url = settings["ojs"]["store_url"]
        else:
            self.broker_url = {"redis": self.options.redis, "amqp": self.options.amqp}[broker]
            store_url = (self.options.redis if store == "redis"
                         else f"{self.options.postgres}?application_name={self.app_name}")
        self.ojs = {"store_url": store_url, "store_prefix": f"cb{self.run}",
                    "sweep_queue": self.sweep_queue}
        self.ojs.update(getattr(self.options, "settings", None) or {})
        sync = getattr(self.options, "synchronous_commit", None)
        if self.store_kind == "postgresql" and sync:
            self.ojs["store_synchronous_commit"] = sync
        if broker == "redis" or self.store_kind == "redis":
            self.keys = Keys(self.counter_client)
            self.keys.exchanges.append(self.event_exchange)
            self.keys.queues.append(self.sweep_queue)
        self.janitor = make_app(self.config("ojs", f"cbjan{self.run}"))
        self.store_pid = self._redis_pid() if self.store_kind == "redis" else None

    def config(self, kind: str, queue: str) -> dict[str, Any]:
        return {"kind": kind, "broker_url": self.broker_url,
                "broker_transport_options": self.transport_options, "queue": queue,
                "event_exchange": self.event_exchange, "counter_url": self.options.redis,
                "counter_key": f"cbcount:{self.run}:{queue}", "ojs": self.ojs}

    def new_queue(self) -> str:
        queue = unique("cbq")
        self.queues.append(queue)
        self.counters.append(f"cbcount:{self.run}:{queue}")
        if self.broker == "redis" and self.keys is not None:
            self.keys.queues.append(queue)
        return queue

    def _redis_pid(self) -> int | None:
        """redis-server's pid if it runs on this machine (its /proc entry is readable)."""
        pid = int(self.counter_client.info("server")["process_id"])
        return pid if os.path.exists(f"/proc/{pid}/stat") else None

    def store_cpu(self) -> dict[int, float] | None:
        """CPU seconds so far of the local store server's processes, by pid (None: not local)."""
        if self.store_kind == "redis":
            return None if self.store_pid is None else {self.store_pid: proc_cpu(self.store_pid)}
        if self.store_kind == "postgresql":
            import psycopg

            with psycopg.connect(self.options.postgres, autocommit=True) as conn:
                rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                    (self.app_name,)).fetchall()
            return {int(pid): proc_cpu(int(pid)) for (pid,) in rows}
        return None

    def purge(self, app: Any, queue: str) -> None:
        if self.broker == "redis" and self.keys is not None:
            self.keys.purge_queue(queue)
            return
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)

    def cleanup(self) -> None:
        try:
            store = get_runtime(self.janitor).store
            store.clear()
            drop = getattr(store, "drop_tables", None)
            if drop is not None:
                drop()
            if self.broker == "amqp":
                with self.janitor.connection_for_write() as conn:
                    channel = conn.default_channel
                    for name in [*self.queues, self.sweep_queue]:
                        channel.queue_delete(name)
                        channel.exchange_delete(name)
                    channel.exchange_delete(self.event_exchange)
        finally:
            get_runtime(self.janitor).close()
            self.janitor.close()
            if self.keys is not None:
                self.keys.cleanup()
            if self.counters:
                self.counter_client.unlink(*self.counters)
            self.counter_client.close()


# ---------------------------------------------------------------------------------- trials


@dataclass
class Trial:
    kind: str
    n: int
    e2e: float  # jobs/s, first publish to last task_postrun
    apply: float  # .apply_async() calls/s, the publish loop alone
    cpu: dict[str, float]  # ms per job: producer, main, children, store (NaN: not local)


def worker(config: dict[str, Any], stamps: pathlib.Path, hostname: str,
           log: pathlib.Path) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """The bench's worker (see :func:`throughput.worker_process`) for ``callerapp``."""
    return worker_process(config, hostname, log, {"CALLER_BENCH_STAMPS": str(stamps)},
                          app="callerapp:app", config_var="CALLER_BENCH_CONFIG")


def wait_until(done: Callable[[], bool], process: subprocess.Popen[bytes], log: pathlib.Path,
               what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not done():
        if process.poll() is not None:
            raise RuntimeError(f"worker exited ({what}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}:\n{log.read_text()[-3000:]}")
        time.sleep(interval)


def flush(app: Any, kind: str) -> None:
    """Wait for OJS's background work of this process (outbox acknowledgements, events)."""
    if kind == "ojs":
        get_runtime(app).flush()


def run_trial(pairing: Pairing, kind: str, n: int) -> Trial:
    queue = pairing.new_queue()
    config = pairing.config(kind, queue)
    hostname = unique("cbw") + "@bench"
    if pairing.keys is not None:
        pairing.keys.hostnames.append(hostname)
    stamps = pairing.tmp / queue
    stamps.mkdir()
    log = pairing.tmp / f"{queue}.log"
    app = make_app(config)
    task = app.tasks[TASK_NAME]
    try:
        with worker(config, stamps, hostname, log) as process:
            wait_until(lambda: (stamps / "ready").exists(), process, log, "worker ready")
            for _ in range(WARMUP):
                task.apply_async()
            flush(app, kind)
            wait_until(lambda: count_ends(stamps) >= WARMUP, process, log, "warm-up")

            store_before = pairing.store_cpu()
            worker_before = tree_cpu(process.pid)
            producer_before = time.process_time()
            ids: list[str] = []
            started = time.time()
            loop_start = time.perf_counter()
            for _ in range(n):
                ids.append(task.apply_async().id)
            loop = time.perf_counter() - loop_start
            flush(app, kind)
            producer_ms = (time.process_time() - producer_before) / n * 1000
            wait_until(lambda: count_ends(stamps) >= WARMUP + n, process, log,
                       f"{n} jobs done", interval=0.05)
            worker_after = tree_cpu(process.pid)
            store_after = pairing.store_cpu()
        _, ends = read_stamps(stamps)
        last = max(t for t, _ in ends.values())
        failed = {state for _, state in ends.values()} - {"SUCCESS"}
        counted = int(pairing.counter_client.get(config["counter_key"]) or 0)
        if failed or counted != WARMUP + n:
            raise RuntimeError(f"{kind}: states {failed}, counter {counted} != {WARMUP + n}")
        if kind == "ojs":
            records = get_runtime(app).store.get_records(ids)
            done = sum(1 for r in records if r is not None and r.job.state == "completed")
            if done != n:
                raise RuntimeError(f"ojs: {done} of {n} jobs completed in the store")
        store_ms = float("nan")
        if store_before is not None and store_after is not None:
            store_ms = sum(cpu - store_before.get(pid, 0.0)
                           for pid, cpu in store_after.items()) / n * 1000
        cpu = {"producer": producer_ms,
               "main": (worker_after[0] - worker_before[0]) / n * 1000,
               "children": (worker_after[1] - worker_before[1]) / n * 1000,
               "store": store_ms}
        return Trial(kind, n, n / (last - started), n / loop, cpu)
    finally:
        pairing.purge(app, queue)
        if kind == "ojs":
            get_runtime(app).close()
        app.close()


def batch_trial(pairing: Pairing, apps: dict[str, Any], kind: str, n: int, queue: str) -> float:
    """Jobs per second: one ``enqueue_batch`` of ``n`` or ``n`` ``send_task`` calls."""
    app = apps[kind]
    if kind == "ojs":
        envelopes: list[object] = [{"type": TASK_NAME, "args": []} for _ in range(n)]
        start = time.perf_counter()
        ojs_celery.enqueue_batch(envelopes, app=app)
        elapsed = time.perf_counter() - start
    else:
        start = time.perf_counter()
        for _ in range(n):
            app.send_task(TASK_NAME, args=[])
        elapsed = time.perf_counter() - start
    flush(app, kind)
    pairing.purge(app, queue)
    return n / elapsed


def run_batches(pairing: Pairing, n: int, rounds: int) -> tuple[float, float, float]:
    """Median send_task rate, median enqueue_batch rate, median per-round ratio."""
    queue = pairing.new_queue()
    apps = {kind: make_app(pairing.config(kind, queue)) for kind in ("plain", "ojs")}
    rates: dict[str, list[float]] = {"plain": [], "ojs": []}
    ratios: list[float] = []
    try:
        batch_trial(pairing, apps, "ojs", WARMUP, queue)  # connections, scripts, tables
        batch_trial(pairing, apps, "plain", WARMUP, queue)
        for round_ in range(rounds):
            for kind in ("plain", "ojs") if round_ % 2 == 0 else ("ojs", "plain"):
                rates[kind].append(batch_trial(pairing, apps, kind, n, queue))
                print(f"  batch {pairing.name:12} {kind:5} round {round_ + 1}: "
                      f"{rates[kind][-1]:6.0f} jobs/s", flush=True)
            ratios.append(rates["ojs"][-1] / rates["plain"][-1])
    finally:
        get_runtime(apps["ojs"]).close()
        for app in apps.values():
            app.close()
    return (statistics.median(rates["plain"]), statistics.median(rates["ojs"]),
            statistics.median(ratios))


def profile_producer(pairing: Pairing, n: int) -> None:
    """cProfile of this process's OJS ``.apply_async()`` loop (no worker: queue purged), timed
    by the main thread's CPU clock: on a loaded machine wall time is mostly waiting for a turn
    on a core, which says nothing about what the code costs."""
    queue = pairing.new_queue()
    app = make_app(pairing.config("ojs", queue))
    task = app.tasks[TASK_NAME]
    try:
        for _ in range(WARMUP):
            task.apply_async()
        flush(app, "ojs")
        profile = cProfile.Profile(time.thread_time)
        profile.enable()
        for _ in range(n):
            task.apply_async()
        profile.disable()
        flush(app, "ojs")
    finally:
        pairing.purge(app, queue)
        get_runtime(app).close()
        app.close()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(15)
    text = out.getvalue()
    start = text.find("   ncalls")
    print(f"\n--- cProfile, {pairing.name}: {n} x OJS .apply_async() in the producer, "
          f"top 15 by cumulative main-thread CPU ---")
    print(text[start:] if start >= 0 else text)


# ---------------------------------------------------------------------------------- main


@dataclass
class Result:
    name: str
    trials: dict[str, list[Trial]] = field(default_factory=lambda: {"plain": [], "ojs": []})
    batch: tuple[float, float, float] | None = None

    def median(self, kind: str, attr: str) -> float:
        return float(statistics.median(getattr(t, attr) for t in self.trials[kind]))

    def ratio(self, attr: str) -> float:
        pairs = zip(self.trials["plain"], self.trials["ojs"], strict=True)
        return float(statistics.median(getattr(o, attr) / getattr(p, attr) for p, o in pairs))

    def cpu(self, kind: str) -> str:
        parts = []
        for part in ("producer", "main", "children", "store"):
            value = statistics.median(t.cpu[part] for t in self.trials[kind])
            parts.append("–" if value != value else f"{value:.2f}")
        return " / ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--pairs", default=",".join(PAIRS),
                        help=f"comma-separated, from {', '.join(PAIRS)} (default: all)")
    parser.add_argument("-n", type=int, default=2000, help="jobs per trial")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of plain and OJS")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 jobs, 1 round")
    parser.add_argument("--batch", action="store_true",
                        help="also enqueue_batch vs send_task (1,000 jobs; 200 with --quick)")
    parser.add_argument("--no-callers", action="store_true",
                        help="skip the .apply_async() trials (with --batch or --profile)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the producer's OJS .apply_async() loop (Redis broker)")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=JSON",
                        help="an extra ojs setting for the OJS side, e.g. events=false "
                             "(repeatable)")
    parser.add_argument("--synchronous-commit", choices=("on", "off"),
                        help="the PostgreSQL store's store_synchronous_commit (default: the "
                             "server's, on)")
    options = parser.parse_args()
    try:
        options.settings = {name: json.loads(value) for name, _, value in
                            (item.partition("=") for item in options.setting)}
    except ValueError as exc:
        parser.error(f"--setting: the value must be JSON ({exc})")
    n, rounds, batch_n = options.n, options.rounds, 1000
    if options.quick:
        n, rounds, batch_n = 200, 1, 200
    names = [name.strip() for name in options.pairs.split(",") if name.strip()]
    unknown = set(names) - set(PAIRS)
    if unknown:
        parser.error(f"unknown pairing(s): {', '.join(sorted(unknown))}")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ojs-caller-"))
    results: list[Result] = []
    began = time.monotonic()
    try:
        for name in names:
            pairing = Pairing(name, options, tmp)
            result = Result(name)
            results.append(result)
            try:
                for round_ in range(0 if options.no_callers else rounds):
                    for kind in ("plain", "ojs") if round_ % 2 == 0 else ("ojs", "plain"):
                        trial = run_trial(pairing, kind, n)
                        result.trials[kind].append(trial)
                        cpu = " / ".join(f"{v:.2f}" for v in trial.cpu.values())
                        print(f"{name:12} {kind:5} round {round_ + 1}: e2e {trial.e2e:6.0f} "
                              f"jobs/s, apply_async {trial.apply:6.0f}/s, CPU ms/job "
                              f"(producer / main / children / store) {cpu}", flush=True)
                if options.batch:
                    result.batch = run_batches(pairing, batch_n, rounds)
                if options.profile and pairing.broker == "redis":
                    profile_producer(pairing, n)
            finally:
                pairing.cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, n, rounds, batch_n, time.monotonic() - began)
    return 0


def report(results: list[Result], n: int, rounds: int, batch_n: int, took: float) -> None:
    print(f"\n{n} jobs per trial, median of {rounds} alternations, {os.cpu_count()} CPUs "
          f"({took:.0f}s in all). CPU ms/job: producer / worker main / pool children / "
          "store server (– not local)\n")
    rows = [r for r in results if r.trials["plain"]]
    if rows:
        print("| pairing | plain e2e jobs/s | OJS e2e jobs/s | ratio e2e | plain apply_async/s "
              "| OJS apply_async/s | ratio apply_async | CPU ms/job plain | CPU ms/job OJS |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r.name} | {r.median('plain', 'e2e'):.0f} | {r.median('ojs', 'e2e'):.0f} "
                  f"| {r.ratio('e2e'):.2f} | {r.median('plain', 'apply'):.0f} "
                  f"| {r.median('ojs', 'apply'):.0f} | {r.ratio('apply'):.2f} "
                  f"| {r.cpu('plain')} | {r.cpu('ojs')} |")
    batches = [r for r in results if r.batch is not None]
    if batches:
        print(f"\n| pairing | {batch_n} x send_task jobs/s | enqueue_batch of {batch_n} jobs/s "
              "| ratio (target ≥ 1) |")
        print("|---|---|---|---|")
        for r in batches:
            assert r.batch is not None
            plain, ojs, ratio = r.batch
            print(f"| {r.name} | {plain:.0f} | {ojs:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
