"""Hand-run soak under chaos: jobs through real workers while processes and Redis fail.

    .venv/bin/python bench/chaos.py                          # 3000 jobs, 180 s of chaos
    .venv/bin/python bench/chaos.py --duration 60 --jobs 600
    .venv/bin/python bench/chaos.py --store postgres       # the job store in PostgreSQL
    .venv/bin/python bench/chaos.py --broker rabbitmq      # the broker a private RabbitMQ

Not part of the test suite. Needs ``redis-server`` on the PATH: the script starts a PRIVATE
one on a free port (AOF with ``appendfsync always`` in a temp dir, so a restart loses no
acknowledged write), used as broker, result backend and job store, and stops it at the end.
With ``--store postgres`` the job store is a PRIVATE PostgreSQL server instead (``initdb`` in
a temp dir, as ``tests/pgserver.py`` makes for the tests), so the path where the record and the
message are two writes (the outbox, orphan messages) is soaked too, and the chaos also restarts
PostgreSQL (a fast shutdown or a crash) and ends its client sessions. With ``--broker rabbitmq``
the broker is a PRIVATE RabbitMQ node (``tests/rabbitserver.py``'s, in a temp dir; Redis stays
the result backend and, without ``--store postgres``, the job store), so the record and the
message are two writes there too, and the chaos also restarts the node's broker
(``rabbitmqctl stop_app``/``start_app``, or a kill -9 of the node: durable queues and persistent
messages are kept, unacknowledged ones are redelivered) and closes its client connections.
Publisher confirms are on, as the README's Brokers section asks for RabbitMQ; ``--no-confirms``
turns them off (then a message in a socket the broker closes is lost, and its job waits for the
redispatch backstop).

What runs: ``--workers`` (3) ``celery worker`` subprocesses (``--pool``, prefork by default;
concurrency 2) of
``bench/chaosapp.py`` and two ``ojs-celery sweep --loop`` processes. A producer thread in this
process enqueues ``--jobs`` jobs over the first 70 % of the chaos period (a producer that gets
an exception retries as the ``enqueue`` contract says: with the job's id after
``StoreUncertain``, with a new call after anything else). Jobs sleep 10 to 100 ms (one in 40
for 1 to 3 s); one in 20 fails on its first attempt, one in 20 on every attempt (discarded after
its 6 attempts), one in 20 refuses for good at once.

The chaos, one action every 1 to 3 s for ``--duration`` seconds: kill -9 of a worker (its whole
process group, or only its main process so that orphaned pool children go on), SIGSTOP of a
worker for 1 to 12 s (longer than the worker heartbeat timeout of 6 s: it is declared dead while
it sleeps, and finds its late outcomes rejected), a SIGTERM deploy (the worker drains, a new one
starts when it has left), a Redis restart (SIGTERM, down 0 to 3 s, started again on the same
port and dir), and ``CLIENT KILL TYPE normal`` (every client connection cut); with
``--store postgres`` also a PostgreSQL restart (``pg_ctl stop -m fast`` or ``-m immediate``,
down 0 to 3 s) and ``pg_terminate_backend`` of every client session. A killed worker is
replaced at once. Then every worker is resumed and the system drains, with the sweepers
running, until every job has ended or none has ended for ``--drain`` (60) seconds; then every
process is killed and the checks run on what the store and the journals hold.

What is checked, from the store and from the per-process journals the handlers and the OJS
event signals write (see ``chaosapp.py``):

- lost: an accepted job (``enqueue`` returned) that is not terminal after the drain;
- double runs: a handler that ran twice for one (job, attempt);
- bad ends: a job that ended more than once (two terminal events), a completed job whose
  final attempt's handler never returned or whose result is wrong, a discarded job without
  an error;
- phantoms: a job the store holds or a handler ran that no ``enqueue`` returned (an enqueue
  that raised must have stored nothing).

It prints one summary line and exits 1 if any invariant failed (after printing each failing
job's history from the journals and the store). The temp dir (Redis AOF, logs, journals) is
kept when something failed or with ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis

BENCH_DIR = pathlib.Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from chaosapp import make_app  # noqa: E402

import ojs_celery  # noqa: E402
from ojs_celery.store import StoreUncertain  # noqa: E402

TERMINAL = ("completed", "discarded", "cancelled")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
HEARTBEAT_TIMEOUT = 6.0
MAX_DRAIN = 900.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def say(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- processes


class RedisServer:
    """A private ``redis-server`` with AOF (fsync always) in ``directory``; without
    persistence when not ``durable`` (``bench/scale.py``: a million jobs, never restarted)."""

    def __init__(self, directory: pathlib.Path, port: int, durable: bool = True) -> None:
        self.directory = directory
        self.port = port
        self.durable = durable
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = open(directory / "redis.log", "ab")  # noqa: SIM115 - closed in close()

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--appendonly", "yes" if self.durable else "no",
             "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--protected-mode", "no"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                client = redis.Redis(port=self.port, socket_timeout=1)
                client.ping()
                client.close()
                return
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                if self.process.poll() is not None:
                    raise RuntimeError("redis-server exited at start") from None
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server not ready after 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: Redis fsyncs its AOF and exits (never SHUTDOWN NOSAVE)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def close(self) -> None:
        self.stop()
        self.log.close()


class PostgresStore:
    """The job store's private PostgreSQL server (``--store postgres``), with the chaos it
    takes: restarts and ended sessions."""

    #: Its chaos actions' prefix (``pg-restart``, ``pg-cut``), and what a failed cut raises.
    prefix = "pg"
    cut_errors: tuple[type[Exception], ...] = (psycopg.Error,)

    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.pgserver import PrivatePostgres  # the tests' private server, reused

        self.server = PrivatePostgres({"max_connections": "300"})
        self.url = self.server.url

    def restart(self, rng: random.Random) -> str:
        mode = rng.choice(["fast", "immediate"])
        down = rng.uniform(0.0, 3.0)
        self.server.stop(mode)
        time.sleep(down)
        self.server.start()
        return f"postgres restart ({mode}, down {down:.1f}s)"

    def cut(self) -> str:
        with psycopg.connect(self.url, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchone()
        return f"pg_terminate_backend ({ended[0] if ended else 0} sessions)"

    def stored_ids(self, prefix: str) -> set[str]:
        with psycopg.connect(self.url) as client:
            rows = client.execute(f"SELECT id FROM {prefix}_jobs").fetchall()
        return {str(row[0]) for row in rows}

    def close(self) -> None:
        self.server.destroy()


class RabbitBroker:
    """The broker's private RabbitMQ node (``--broker rabbitmq``), with the chaos it takes:
    restarts of the broker inside the node, kills of the whole node, closed connections."""

    prefix = "rabbit"
    cut_errors: tuple[type[Exception], ...] = (subprocess.SubprocessError,)

    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.rabbitserver import PrivateRabbit  # the tests' private node, reused

        self.server = PrivateRabbit()
        self.url = self.server.url

    def restart(self, rng: random.Random) -> str:
        down = rng.uniform(0.0, 3.0)
        if rng.random() < 0.3:  # a crash: the node's Erlang VM killed, started again
            process = self.server.process
            assert process is not None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
            time.sleep(down)
            self.server.start()
            return f"rabbitmq node kill -9 (down {down:.1f}s + its start)"
        self.server.stop_app()
        time.sleep(down)
        self.server.start_app()
        return f"rabbitmq restart (down {down:.1f}s)"

    def cut(self) -> str:
        self.server.ctl("close_all_connections", "chaos")
        return "rabbitmq close_all_connections"

    def close(self) -> None:
        self.server.destroy()


@dataclass
class Proc:
    """A worker or sweeper subprocess in its own process group."""

    name: str
    process: subprocess.Popen[bytes]
    state: str = "running"  # running, stopped, draining
    resume_at: float = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass


@dataclass
class Tally:
    kills: int = 0
    stops: int = 0
    deploys: int = 0
    restarts: int = 0
    cuts: int = 0
    #: Restarts and cuts of the other servers (PostgreSQL, RabbitMQ), by action prefix.
    service_restarts: Counter[str] = field(default_factory=Counter)
    service_cuts: Counter[str] = field(default_factory=Counter)
    enqueue_errors: Counter[str] = field(default_factory=Counter)


class Cluster:
    """The workers and sweepers of one run, and every process group ever started."""

    def __init__(self, directory: pathlib.Path, config: dict[str, Any], workers: int,
                 pool: str = "prefork") -> None:
        self.directory = directory
        self.pool = pool
        self.config = config
        self.target = workers
        self.env = {**os.environ, "OJS_CHAOS_CONFIG": json.dumps(config),
                    "PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(ROOT)])}
        self.workers: list[Proc] = []
        self.sweepers: list[Proc] = []
        self.groups: list[int] = []
        self.count = 0

    def _spawn(self, name: str, command: list[str]) -> Proc:
        with open(self.directory / f"{name}.log", "ab") as out:
            process = subprocess.Popen(command, cwd=BENCH_DIR, env=self.env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.groups.append(process.pid)
        return Proc(name, process)

    def start_worker(self) -> Proc:
        self.count += 1
        name = f"worker{self.count}"
        proc = self._spawn(name, [
            sys.executable, "-m", "celery", "-A", "chaosapp:app", "worker", "--pool", self.pool,
            "--concurrency", "2", "--loglevel", "INFO", "--queues", self.config["queue"],
            "--hostname", f"{name}@chaos", "--without-gossip", "--without-mingle"])
        self.workers.append(proc)
        return proc

    def start_sweeper(self, n: int) -> None:
        self.sweepers.append(self._spawn(f"sweeper{n}", [
            sys.executable, "-c", "from ojs_celery.cli import main; main()",
            "-A", "chaosapp:app", "sweep", "--loop"]))

    def tend(self) -> None:
        """Resume stopped workers that are due, forget the dead, keep ``target`` serving."""
        now = time.monotonic()
        for proc in self.workers:
            if proc.state == "stopped" and now >= proc.resume_at:
                proc.signal_group(signal.SIGCONT)
                proc.state = "running"
        self.workers = [proc for proc in self.workers if proc.alive()]
        while len(self.workers) < self.target:
            self.start_worker()
        for n, proc in enumerate(self.sweepers):
            if not proc.alive():  # a sweep loop must survive everything: say so, restart it
                say(f"{proc.name} exited with {proc.process.returncode}; restarting it")
                self.sweepers[n] = self._spawn(f"{proc.name}b", proc.process.args)  # type: ignore[arg-type]

    def running(self) -> list[Proc]:
        return [proc for proc in self.workers if proc.state == "running" and proc.alive()]

    def resume_all(self) -> None:
        for proc in self.workers:
            if proc.state == "stopped":
                proc.signal_group(signal.SIGCONT)
                proc.state = "running"

    def kill_everything(self) -> None:
        for pgid in self.groups:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pgid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in [*self.workers, *self.sweepers]:
            try:
                proc.process.wait(10)
            except subprocess.TimeoutExpired:
                pass


# ---------------------------------------------------------------------------------- producer


def job_plan(index: int, rng: random.Random) -> dict[str, Any]:
    """The envelope of job ``index``: mostly short, some long, some failing."""
    kind = index % 40
    seconds = rng.uniform(0.01, 0.1)
    fail_before, fail = 0, "no"
    if kind in (0, 20):
        fail = "retry"  # every attempt fails: discarded after its retries
    elif kind in (1, 21):
        fail_before = 2  # the first attempt fails, the second completes
    elif kind in (2, 22):
        fail = "final"
    elif kind == 3:
        seconds = rng.uniform(1.0, 3.0)
    return {
        "type": "chaos.work",
        "args": [index, round(seconds, 3), fail_before, fail],
        "timeout": 20,
        "grace_period": 2,
        "retry": {"max_attempts": 6, "initial_interval": "PT1S", "backoff_coefficient": 2.0,
                  "max_interval": "PT4S"},
    }


class Producer(threading.Thread):
    """Enqueues ``n`` jobs spread over ``seconds``; retries a call that raised, as the
    ``enqueue`` contract tells a caller to: after ``StoreUncertain`` with the job id it names
    (the same envelope again is idempotent), after any other error with a new call."""

    def __init__(self, app: Any, n: int, seconds: float, tally: Tally, seed: int,
                 directory: pathlib.Path) -> None:
        super().__init__(daemon=True, name="producer")
        self.app = app
        self.n = n
        self.seconds = seconds
        self.tally = tally
        self.rng = random.Random(seed)
        self.accepted: dict[str, int] = {}  # job id -> index
        self.done = threading.Event()
        self.journal = directory / "log-accepted.txt"

    def run(self) -> None:
        began = time.monotonic()
        for index in range(self.n):
            pause = began + self.seconds * index / self.n - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            envelope = job_plan(index, self.rng)
            while True:
                try:
                    job = ojs_celery.enqueue(envelope, app=self.app)
                except StoreUncertain as exc:  # maybe stored: repeat the call with its id
                    self.tally.enqueue_errors[type(exc).__name__] += 1
                    envelope = {**envelope, "id": exc.job_id}
                    time.sleep(0.2)
                    continue
                except Exception as exc:  # nothing stored: a producer retries, with a new call
                    self.tally.enqueue_errors[type(exc).__name__] += 1
                    time.sleep(0.2)
                    continue
                self.accepted[job.id] = index
                with open(self.journal, "a") as out:
                    out.write(f"A {job.id} {index} {time.time():.3f}\n")
                break
        self.done.set()


# ---------------------------------------------------------------------------------- chaos


def chaos_step(cluster: Cluster, server: RedisServer, store: PostgresStore | None,
               broker: RabbitBroker | None, rng: random.Random, tally: Tally,
               actions: list[str]) -> None:
    choices = ["kill", "kill", "stop", "stop", "deploy", "restart", "cut", "cut"]
    services = {service.prefix: service for service in (store, broker) if service is not None}
    for prefix in services:
        choices += [f"{prefix}-restart", f"{prefix}-cut"]
    action = rng.choice(choices)
    running = cluster.running()
    if action in ("kill", "stop", "deploy") and not running:
        action = "cut"
    if action == "kill":
        proc = rng.choice(running)
        whole = rng.random() < 0.7
        if whole:
            proc.signal_group(signal.SIGKILL)
        else:  # the main process only: its pool children are orphaned mid-job
            os.kill(proc.pid, signal.SIGKILL)
        proc.process.wait(10)
        tally.kills += 1
        actions.append(f"kill -9 {proc.name} ({'group' if whole else 'main process'})")
    elif action == "stop":
        proc = rng.choice(running)
        pause = rng.uniform(1.0, 12.0)
        proc.signal_group(signal.SIGSTOP)
        proc.state, proc.resume_at = "stopped", time.monotonic() + pause
        tally.stops += 1
        actions.append(f"SIGSTOP {proc.name} for {pause:.1f}s")
    elif action == "deploy":
        proc = rng.choice(running)
        proc.process.send_signal(signal.SIGTERM)
        proc.state = "draining"
        tally.deploys += 1
        actions.append(f"SIGTERM deploy {proc.name}")
    elif action == "restart":
        down = rng.uniform(0.0, 3.0)
        server.stop()
        time.sleep(down)
        server.start()
        tally.restarts += 1
        actions.append(f"redis restart (down {down:.1f}s)")
    elif action.endswith("-restart"):
        service = services[action.removesuffix("-restart")]
        actions.append(service.restart(rng))
        tally.service_restarts[service.prefix] += 1
    elif action.endswith("-cut"):
        service = services[action.removesuffix("-cut")]
        try:
            actions.append(service.cut())
        except service.cut_errors as exc:
            actions.append(f"{action} failed: {exc}")
            return
        tally.service_cuts[service.prefix] += 1
    else:
        try:
            client = redis.Redis.from_url(server.url, socket_timeout=5)
            killed = client.client_kill_filter(_type="normal")
            client.close()
        except redis.RedisError as exc:
            actions.append(f"connection cut failed: {exc}")
            return
        tally.cuts += 1
        actions.append(f"CLIENT KILL TYPE normal ({killed} connections)")


def draining_count(cluster: Cluster) -> int:
    return sum(1 for proc in cluster.workers if proc.state == "draining" and proc.alive())


# ---------------------------------------------------------------------------------- checks


@dataclass
class Journals:
    runs: dict[tuple[str, int], list[str]] = field(default_factory=lambda: defaultdict(list))
    returned: set[tuple[str, int]] = field(default_factory=set)
    ends: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    lines: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def read_journals(directory: pathlib.Path) -> Journals:
    found = Journals()
    for path in sorted(directory.glob("log-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            if parts[0] == "R":
                found.runs[(parts[1], int(parts[2]))].append(line)
                found.lines[parts[1]].append(line)
            elif parts[0] == "D":
                found.returned.add((parts[1], int(parts[2])))
                found.lines[parts[1]].append(line)
            elif parts[0] == "A":
                found.lines[parts[1]].append(line)
            elif parts[0] == "E" and len(parts) >= 4:
                found.ends[parts[2]].append(parts[1])
                found.lines[parts[2]].append(line)
    for history in found.lines.values():
        history.sort(key=lambda line: float(line.split()[-1]))
    return found


def stored_ids(client: redis.Redis, prefix: str) -> set[str]:
    ids: set[str] = set()
    for key in client.scan_iter(match=f"{prefix}:job:*", count=1000):
        match = UUID.search(key.decode(errors="replace"))
        if match:
            ids.add(match.group(0))
    return ids


class Logs:
    """The workers' and sweepers' log lines, read once, for the history of a failing job."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.lines: list[str] | None = None

    def about(self, job_id: str, limit: int = 12) -> list[str]:
        if self.lines is None:
            self.lines = [f"{path.stem}: {line}" for path in sorted(self.directory.glob("*.log"))
                          for line in path.read_text(errors="replace").splitlines()]
        found = [line[:300] for line in self.lines if job_id in line]
        return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


def describe(job_id: str, record: Any, journals: Journals, logs: Logs) -> str:
    lines = [f"  job {job_id}"]
    if record is None:
        lines.append("    store: no record")
    else:
        lines.append(f"    store: state={record.state} attempt={record.attempt} "
                     f"result={json.dumps(record.result)}")
        for error in record.errors:
            lines.append(f"    error: {json.dumps(error)}")
    lines.extend(f"    {line}" for line in journals.lines.get(job_id, []))
    lines.extend(f"    {line}" for line in logs.about(job_id))
    return "\n".join(lines)


def check(app: Any, accepted: dict[str, int], directory: pathlib.Path,
          stored: set[str]) -> tuple[dict[str, int], list[str]]:
    journals = read_journals(directory)
    logs = Logs(directory)
    counts: Counter[str] = Counter()
    problems: list[str] = []
    records = {job_id: ojs_celery.get_job(job_id, app=app) for job_id in accepted}
    for job_id, index in accepted.items():
        record = records[job_id]
        state = record.state if record is not None else "missing"
        counts[state] += 1
        why = []
        if state not in TERMINAL:
            counts["lost"] += 1
            why.append(f"lost (state {state})")
        if len(journals.ends.get(job_id, [])) > 1:
            why.append(f"ended {len(journals.ends[job_id])} times: {journals.ends[job_id]}")
        if record is not None and state == "completed":
            if record.result != f"done {index}":
                why.append(f"completed with result {record.result!r}")
            if (job_id, record.attempt) not in journals.returned:
                why.append(f"completed, but attempt {record.attempt}'s handler never returned")
        if record is not None and state == "discarded" and not record.error:
            why.append("discarded without an error")
        if why:
            counts["bad"] += len(why) - (state not in TERMINAL)
            problems.append("; ".join(why) + "\n" + describe(job_id, record, journals, logs))
    for (job_id, attempt), runs in journals.runs.items():
        if len(runs) > 1:
            counts["double"] += 1
            problems.append(f"handler ran {len(runs)} times for attempt {attempt}\n"
                            + describe(job_id, records.get(job_id), journals, logs))
    ran = {job_id for job_id, _ in journals.runs}
    phantoms = (stored | ran) - set(accepted)
    for job_id in sorted(phantoms):
        counts["phantom"] += 1
        problems.append("a job no enqueue returned (stored or run)\n"
                        + describe(job_id, ojs_celery.get_job(job_id, app=app), journals, logs))
    return dict(counts), problems


def sweeps_applied(directory: pathlib.Path) -> Counter[str]:
    """What the sweep loops did, by clock (from their ``sweep {...}`` log lines)."""
    applied: Counter[str] = Counter()
    for path in directory.glob("sweeper*.log"):
        for match in re.finditer(r"'applied': \{([^}]*)\}", path.read_text(errors="replace")):
            for clock, n in re.findall(r"'(\w+)': (\d+)", match.group(1)):
                applied[clock] += int(n)
    return applied


def pending(app: Any, ids: list[str]) -> list[str]:
    left = []
    for job_id in ids:
        try:
            record = ojs_celery.get_job(job_id, app=app)
        except Exception:
            left.append(job_id)
            continue
        if record is None or record.state not in TERMINAL:
            left.append(job_id)
    return left


# ---------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of chaos")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=3, help="celery workers (at most 3)")
    parser.add_argument("--drain", type=float, default=60.0,
                        help="after the chaos, stop waiting for jobs to end once none has "
                             "ended for this many seconds")
    parser.add_argument("--redispatch-after", type=float, default=None,
                        help="ojs.redispatch_after (default: the library's, an hour)")
    parser.add_argument("--store", choices=("redis", "postgres"), default="redis",
                        help="the job store: the broker's Redis, or a private PostgreSQL")
    parser.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis",
                        help="the broker: the private Redis, or a private RabbitMQ node")
    parser.add_argument("--pool", choices=("prefork", "threads", "gevent", "solo"),
                        default="prefork", help="the workers' pool (concurrency 2)")
    parser.add_argument("--no-confirms", action="store_true",
                        help="with --broker rabbitmq: publisher confirms off (on by default)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    options = parser.parse_args()
    workers = max(1, min(options.workers, 3))
    seed = options.seed if options.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)

    directory = pathlib.Path(tempfile.mkdtemp(prefix="ojs-chaos-"))
    (directory / "redis").mkdir()
    server = RedisServer(directory / "redis", free_port())
    server.start()
    store: PostgresStore | None = None
    broker: RabbitBroker | None = None
    try:
        store = PostgresStore() if options.store == "postgres" else None
        broker = RabbitBroker() if options.broker == "rabbitmq" else None
    except BaseException:
        server.close()
        if store is not None:
            store.close()
        raise
    prefix = "chaos"
    ojs: dict[str, Any] = {
        "store_url": store.url if store is not None else server.url,
        "store_prefix": prefix, "heartbeat_interval": 1.0,
        "worker_heartbeat_timeout": HEARTBEAT_TIMEOUT, "sweep_interval": 1.0,
        "shutdown_grace_period": 8.0, "shutdown_cancel_window": 2.0}
    if options.redispatch_after is not None:
        ojs["redispatch_after"] = options.redispatch_after
    config = {"redis_url": server.url, "queue": "chaos", "dir": str(directory), "ojs": ojs,
              "broker_url": broker.url if broker is not None else server.url}
    if broker is not None and not options.no_confirms:
        config["broker_transport_options"] = {"confirm_publish": True}
    say(f"seed {seed}, redis on port {server.port}"
        + (f", postgres on port {store.server.port}" if store is not None else "")
        + (f", rabbitmq on port {broker.server.port}" if broker is not None else "")
        + f", files in {directory}")
    cluster = Cluster(directory, config, workers, options.pool)
    tally = Tally()
    actions: list[str] = []
    app = make_app(config)
    failed = True
    try:
        cluster.start_sweeper(1)
        cluster.start_sweeper(2)
        cluster.tend()
        began = time.monotonic()
        producer = Producer(app, options.jobs, options.duration * 0.7, tally, seed,
                            directory)
        producer.start()
        next_action = began + rng.uniform(3.0, 5.0)  # let the first workers boot
        while time.monotonic() - began < options.duration:
            cluster.tend()
            if time.monotonic() >= next_action:
                if draining_count(cluster) == 0 or rng.random() < 0.5:
                    chaos_step(cluster, server, store, broker, rng, tally, actions)
                    say(actions[-1])
                    actions[-1] = f"{time.strftime('%H:%M:%S')} {actions[-1]}"
                next_action = time.monotonic() + rng.uniform(1.0, 3.0)
            time.sleep(0.1)
        chaos_seconds = time.monotonic() - began
        say("chaos over: resuming every worker, draining")
        cluster.resume_all()
        producer.join(timeout=options.drain)
        left = list(producer.accepted)
        drain_began = progress_at = time.monotonic()
        while left and time.monotonic() - progress_at < options.drain \
                and time.monotonic() - drain_began < MAX_DRAIN:
            cluster.tend()
            before = len(left)
            left = pending(app, left)
            if len(left) < before:
                progress_at = time.monotonic()
            time.sleep(2.0)
        say(f"drained for {time.monotonic() - drain_began:.0f}s, {len(left)} not ended")
        cluster.kill_everything()  # nothing may change while the journals and store are read
        if store is not None:
            stored = store.stored_ids(prefix)
        else:
            client = redis.Redis.from_url(server.url)
            stored = stored_ids(client, prefix)
            client.close()
        counts, problems = check(app, producer.accepted, directory, stored)
        (directory / "problems.txt").write_text("\n".join(problems) + "\n")
        for problem in problems[:30]:
            print(problem, file=sys.stderr)
        if len(problems) > 30:
            print(f"... and {len(problems) - 30} more (all in problems.txt)", file=sys.stderr)
        if not producer.done.is_set():
            problems.append("the producer did not finish")
        errors = ", ".join(f"{n} {name}" for name, n in tally.enqueue_errors.items())
        applied = ", ".join(f"{clock} {n}" for clock, n in sweeps_applied(directory).most_common())
        print(f"chaos: {len(producer.accepted)} jobs, {counts.get('completed', 0)} completed, "
              f"{counts.get('discarded', 0)} discarded, {counts.get('lost', 0)} lost, "
              f"{counts.get('double', 0)} double runs, {counts.get('bad', 0)} bad ends, "
              f"{counts.get('phantom', 0)} phantoms, {tally.kills} kills, "
              f"{tally.stops} stops, {tally.deploys} deploys, {tally.restarts} redis restarts, "
              f"{tally.cuts} connection cuts"
              + (f", {tally.service_restarts['pg']} postgres restarts, "
                 f"{tally.service_cuts['pg']} session cuts"
                 if store is not None else "")
              + (f", {tally.service_restarts['rabbit']} rabbitmq restarts, "
                 f"{tally.service_cuts['rabbit']} rabbitmq cuts" if broker is not None else "")
              + f" in {chaos_seconds:.0f}s "
              f"(enqueue retries: {errors or 'none'}; sweeps applied: {applied or 'none'}; "
              f"seed {seed})", flush=True)
        (directory / "actions.txt").write_text("\n".join(actions) + "\n")
        failed = bool(problems)
        return 1 if failed else 0
    finally:
        cluster.kill_everything()
        server.close()
        if store is not None:
            store.close()
        if broker is not None:
            broker.close()
        if failed or options.keep:
            say(f"files kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
