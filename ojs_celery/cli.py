"""``ojs-celery``: enqueue, inspect and follow OJS jobs from the shell.

It feels like ``celery``: ``-A/--app`` (or ``CELERY_APP``) names the Celery app, and the same
commands are available as ``celery -A proj ojs ...``. Output is compact JSON, one line per item.
Errors are one line each on stderr, never a traceback, with an exit status per kind (see
:data:`EXIT_STATUSES`): invalid input prints one line per problem and exits with status 2, with
nothing stored.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, NoReturn

import click
from celery import Celery
from celery.app.utils import find_app
from celery.exceptions import ImproperlyConfigured
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.exceptions import SerializerNotInstalled

from .api import JobNotFound, cancel, enqueue, enqueue_batch, get_job, purge
from .conf import finite_seconds
from .envelope import (
    MAX_BATCH_BYTES,
    MAX_ENVELOPE_BYTES,
    DuplicateJob,
    InvalidJob,
    Job,
    format_epoch,
    utf8_safe,
)
from .events import listen
from .install import install
from .lifecycle import Policy, WorkerClock
from .migration import Report, build_report
from .runtime import get_runtime
from .store import StoreError, StoreMisconfigured, WorkerInfo
from .sweeper import run_loop, sweep
from .worker.registry import DIRECTIVES

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_DUPLICATE = 3
EXIT_STORE = 4
#: Every exit status of every command (also shown by ``--help``).
EXIT_STATUSES = {
    0: "done",
    EXIT_FAILED: "not done: no such job or worker, a job that already ended, a failed sweep; "
                 "or output that cannot be written",
    EXIT_INVALID: "invalid input, settings or usage (one line per problem; nothing stored)",
    EXIT_DUPLICATE: "a different job with this id exists (nothing stored)",
    EXIT_STORE: "the job store cannot be reached or refused the operation (nothing stored, "
                "unless the message says the job may be stored: then it names the job's id)",
}
_EPILOG = "\b\nExit status:\n" + "\n".join(
    f"  {code}  {text}" for code, text in EXIT_STATUSES.items())


def load_app(name: str | None) -> Celery:
    """Import the app like ``celery -A`` does, import its tasks and install OJS."""
    if not name:
        raise click.UsageError("no app given: pass -A/--app module[:attribute] or set CELERY_APP")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        app = find_app(name)
    except (Exception, SystemExit) as exc:  # a module may sys.exit() while it is imported
        raise click.BadParameter(f"cannot load app {name!r}: {_load_failure(name, exc)}",
                                 param_hint="-A/--app") from exc
    if not isinstance(app, Celery):
        raise click.BadParameter(f"{name!r} is not a Celery app", param_hint="-A/--app")
    _import_modules(app, name)
    install(app)
    return app


def _import_modules(app: Celery, name: str | None) -> None:
    """Import the app's task modules, as ``celery`` does before a command. Its configuration
    is read then (a Django project's settings module, named by ``DJANGO_SETTINGS_MODULE``):
    one that does not load is a usage error naming why, not a traceback; a bad setting keeps
    its own lines (:func:`_improperly_configured`)."""
    try:
        app.loader.import_default_modules()
    except (Exception, SystemExit) as exc:
        if isinstance(exc, Exception) and _improperly_configured(exc):
            raise
        raise click.BadParameter(f"cannot load app {name or app.main!r}: "
                                 f"{_load_failure(name or '', exc)}",
                                 param_hint="-A/--app") from exc


def _load_failure(name: str, exc: BaseException) -> str:
    """Why ``name`` did not load, in words: Celery's ``find_app`` says "No module named
    'proj:missing'" for a module that imports but lacks the attribute, and a module that
    calls ``sys.exit()`` while imported would end the command with its status, silently."""
    if isinstance(exc, SystemExit):
        return f"importing it called sys.exit({exc.code!r})"
    module, _, attribute = name.partition(":")
    if attribute and isinstance(exc, ImportError):
        try:
            imported = importlib.import_module(module)
        except (Exception, SystemExit):
            return str(exc)
        if not hasattr(imported, attribute.split(".")[0]):
            return f"module {module!r} has no attribute {attribute.split('.')[0]!r}"
    return str(exc)


def _app(ctx: click.Context) -> Celery:
    obj = ctx.find_root().obj
    if isinstance(obj, Celery):
        return obj
    celery_app = getattr(obj, "app", None)  # inside `celery -A proj ojs ...`
    if isinstance(celery_app, Celery):
        _import_modules(celery_app, None)
        install(celery_app)
        return celery_app
    raise click.UsageError("no app given: pass -A/--app")


def _line(data: Any, unprinted: Callable[[], str] | None = None) -> None:
    """Print one JSON line. A reader that went away (``events | head -1``) ends the command
    quietly with status 0; output that cannot be written (a full disk, ``> /dev/full``) ends
    it with one line and status 1, naming what ``unprinted`` says was done all the same (an
    enqueue's stored jobs). :func:`~ojs_celery.events.listen` raises its handler's errors, so
    neither is taken for a lost broker."""
    try:
        click.echo(json.dumps(data, separators=(",", ":"), ensure_ascii=False))
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's advice: point stdout at devnull, so the flush at exit raises nothing again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except OSError as exc:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        done = f" ({unprinted()})" if unprinted is not None else ""
        _fail([f"error: cannot write the output: {exc}{done}"], EXIT_FAILED)


#: The longest problem line printed (a job id argument of 100,000 characters is echoed
#: no further).
LINE_LIMIT = 1000


def _one_line(text: object) -> str:
    """``text`` on one line, printable whatever it quotes: a lone surrogate from an argument
    that was not UTF-8 is written as ``\\udcxx`` (not raised), a control character as
    ``\\xNN`` (a terminal would obey it), and a line past :data:`LINE_LIMIT` is cut."""
    line = " ".join(utf8_safe(str(text)).split())
    if not line.isprintable():
        line = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256
                       else f"\\u{ord(c):04x}" for c in line)
    if len(line) > LINE_LIMIT:
        line = f"{line[:LINE_LIMIT]}... ({len(line) - LINE_LIMIT} more characters)"
    return line


def _fail(lines: list[str], status: int) -> NoReturn:
    for line in lines:
        click.echo(_one_line(line), err=True)
    sys.exit(status)


class _Commands(click.Group):
    """A command group that turns the package's errors into one-line messages and their exit
    statuses (:data:`EXIT_STATUSES`) instead of tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InvalidJob as exc:  # DuplicateJob included
            status = EXIT_DUPLICATE if isinstance(exc, DuplicateJob) else EXIT_INVALID
            _fail([f"{path}: {rule}" for path, rule in exc.violations], status)
        except StoreMisconfigured as exc:  # store_url names what the server refuses: a setting
            _fail([f"error: {exc}"], EXIT_INVALID)
        except StoreError as exc:
            _fail([f"error: {exc}"], EXIT_STORE)  # it says what failed, whatever the backend
        except SerializerNotInstalled as exc:  # the app's task_serializer: a bad setting
            _fail([f"error: {exc}"], EXIT_INVALID)
        except Exception as exc:
            if _improperly_configured(exc):
                _fail([line for line in str(exc).splitlines() if line.strip()], EXIT_INVALID)
            raise


def _improperly_configured(exc: Exception) -> bool:
    """Is ``exc`` a bad setting: Celery's ImproperlyConfigured (the app's ojs settings, read by
    ``install()``) or Django's (the Django app's word for a bad ``CELERY_OJS``, raised when
    Django is ready; Django is looked at only if it was imported)?"""
    django_exceptions = sys.modules.get("django.core.exceptions")
    django_kind = getattr(django_exceptions, "ImproperlyConfigured", None)
    return isinstance(exc, ImproperlyConfigured) or (
        isinstance(django_kind, type) and isinstance(exc, django_kind))


@click.group(name="ojs", cls=_Commands, epilog=_EPILOG,
             help="Enqueue and inspect Open Job Spec jobs on a Celery app.")
def commands() -> None:
    """The subcommands shared by ``ojs-celery`` and ``celery ojs``."""


@commands.command(name="enqueue")
@click.argument("source", type=click.File("rb"), default="-")
@click.option("--batch", is_flag=True, help="SOURCE holds a JSON array of envelopes.")
@click.pass_context
def enqueue_command(ctx: click.Context, source: Any, batch: bool) -> None:
    """Enqueue the OJS envelope in SOURCE (a file, or - for stdin, the default); print the
    stored job.

    Exit status 2 for invalid input (one line per problem on stderr, nothing stored), 3 if a
    different job with the same id exists (the same envelope again prints the existing job),
    4 if the store cannot be reached or refuses the write. A broker that cannot be reached is
    no failure: the job is stored, printed, and published by the sweeper later (a warning says
    so), exit status 0.
    """
    app = _app(ctx)
    # One byte past the limit is enough to refuse it: a bigger input is never held whole.
    text = source.read((MAX_BATCH_BYTES if batch else MAX_ENVELOPE_BYTES) + 1)
    jobs = enqueue_batch(text, app=app) if batch else [enqueue(text, app=app)]
    for index, job in enumerate(jobs):
        _line(job.to_dict(), unprinted=partial(_stored, jobs, index))


def _stored(jobs: list[Job], start: int) -> str:
    """What an enqueue whose output could not be written from ``jobs[start]`` on did all the
    same."""
    ids = [job.id for job in jobs[start:]]
    return (f"the job {ids[0]} is stored" if len(ids) == 1
            else f"the jobs {', '.join(ids)} are stored")


@commands.command(name="get")
@click.argument("job_id")
@click.pass_context
def get_command(ctx: click.Context, job_id: str) -> None:
    """Print the job JOB_ID as JSON (exit status 1 if there is none)."""
    job = get_job(job_id, app=_app(ctx))
    if job is None:
        _fail([f"error: no job with id {job_id}"], EXIT_FAILED)
    _line(job.to_dict())


@commands.command(name="cancel")
@click.argument("job_id")
@click.pass_context
def cancel_command(ctx: click.Context, job_id: str) -> None:
    """Cancel JOB_ID and print it; a job cancelled before is printed as it is (exit status 0).

    Exit status 1 if there is no such job or it already ended otherwise (completed or
    discarded).
    """
    try:
        job = cancel(job_id, app=_app(ctx))
    except (JobNotFound, ValueError) as exc:
        _fail([f"error: {exc}"], EXIT_FAILED)
    _line(job.to_dict())


@commands.command(name="purge")
@click.option("-f", "--force", is_flag=True, help="Don't prompt for verification.")
@click.option("-Q", "--queues", default=None,
              help="Comma separated list of queue names to purge.")
@click.option("-X", "--exclude-queues", default=None,
              help="Comma separated list of queue names not to purge.")
@click.pass_context
def purge_command(ctx: click.Context, force: bool, queues: str | None,
                  exclude_queues: str | None) -> None:
    """Throw away every job waiting to run in the app's known task queues (or -Q): cancel them
    in the job store, then empty the queues as `celery purge` does. Print the counts.

    Use it instead of `celery purge`, which empties the queues but not the store: the
    sweeper would send a purged job's message again after `redispatch_after`. Running jobs
    are left to finish. Exit status 1 if the broker could not be reached to empty the queues
    (the jobs are cancelled all the same: their messages never run).
    """
    app = _app(ctx)
    names = sorted(set(_names(queues) or app.amqp.queues.keys()) - set(_names(exclude_queues)))
    if not names:
        _fail(["error: no queue to purge"], EXIT_INVALID)
    if not force:
        click.confirm(f"WARNING: this throws away every waiting job and message of "
                      f"{', '.join(names)}; there is no undo. Go on?", abort=True, err=True)
    cancelled = purge(names, app=app)
    try:
        messages = _empty_queues(app, names)
    except _BrokerDown as exc:
        _fail([f"error: the broker could not be reached to empty the queues: {exc} "
               f"({cancelled} waiting job(s) were cancelled: their messages will not run)"],
              EXIT_FAILED)
    _line({"queues": names, "cancelled": cancelled, "messages": messages})


def _names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


class _BrokerDown(Exception):
    """The broker could not be reached (its one-line reason)."""


def _empty_queues(app: Celery, names: list[str]) -> int:
    """Empty ``names`` on the broker as ``celery purge`` does (a queue the broker does not
    have counts 0); how many messages went. One try to connect, not Celery's retries."""
    with app.connection_for_write() as connection:
        lost = (KombuOperationalError, OSError, *connection.connection_errors)
        try:
            connection.ensure_connection(max_retries=1)
            channel = connection.channel()
            emptied = 0
            for queue in names:
                try:
                    emptied += channel.queue_purge(queue) or 0
                except connection.channel_errors:  # AMQP closes the channel: take a new one
                    channel = connection.channel()
            return emptied
        except lost as exc:
            raise _BrokerDown(_one_line(exc)) from exc


@commands.command(name="events")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Stop after N events.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds without an event.")
@click.pass_context
def events_command(ctx: click.Context, limit: int | None, timeout: float | None) -> None:
    """Print every OJS event from every process, one compact JSON line each, as they happen."""
    app = _app(ctx)
    if not get_runtime(app).settings.events:
        click.echo("warning: this app's ojs.events setting is false: its own processes emit no "
                   "events (other apps' on the same exchange still show)", err=True)
    ready = threading.Event()
    threading.Thread(target=_announce, args=(ready,), daemon=True).start()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_within_deadline)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a service manager's stop
        signal.signal(signal.SIGTERM, _interrupt_within_deadline)
    try:
        listen(app, _line, limit=limit, timeout=timeout, ready=ready)
    except KeyboardInterrupt:
        pass


#: Seconds the events command may spend ending after Ctrl-C.
INTERRUPT_DEADLINE = 3.0


def _interrupt_within_deadline(_signum: int, _frame: Any) -> None:
    """Ctrl-C (or SIGTERM) ends ``events`` as Python does (``KeyboardInterrupt``), within
    :data:`INTERRUPT_DEADLINE` all the same: kombu's orderly close of the listener's connection
    deletes its queue on the broker, which waits for ever on a frozen one (``kill -STOP``).
    Past the deadline the process exits with status 0, as Ctrl-C does, without that close (the
    queue expires on the broker by itself)."""
    deadline = threading.Timer(INTERRUPT_DEADLINE, os._exit, (0,))
    deadline.daemon = True
    deadline.start()
    raise KeyboardInterrupt


def _finite_option(value: float | None) -> float | None:
    """``--interval inf`` would be a loop that never sweeps again (or fails at its first
    wait) and prunes without end: the settings' rule, as a usage error."""
    try:
        return None if value is None else finite_seconds(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@commands.command(name="sweep")
@click.option("--once", is_flag=True, help="Run one pass and print what it did (the default).")
@click.option("--loop", is_flag=True, help="Run a pass every --interval seconds.")
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=None,
              callback=lambda ctx, param, value: _finite_option(value),
              help="Seconds between --loop's passes (default: the ojs.sweep_interval setting).")
@click.pass_context
def sweep_command(ctx: click.Context, once: bool, loop: bool, interval: float | None) -> None:
    """Enforce every deadline from the store (for deployments without celery beat)."""
    # --once --loop ran the loop (--loop --once one pass), and --interval without --loop one
    # pass: the flag given last or the one ignored decided, silently
    if once and loop:
        raise click.UsageError("--once and --loop exclude each other")
    if interval is not None and not loop:
        raise click.UsageError("--interval applies to --loop only")
    mode = "loop" if loop else "once"
    app = _app(ctx)
    runtime = get_runtime(app)
    settings = runtime.settings  # read here: a bad one is a usage error, not a failed pass
    if mode == "loop":
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s] %(message)s")
        stopping = _StopRequest()
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a service manager's stop
            signal.signal(signal.SIGTERM, stopping.request)
        click.echo(f"sweeping every {interval or settings.sweep_interval}s "
                   "(Ctrl-C to stop)", err=True)
        try:
            run_loop(runtime, interval, stop=stopping.is_set, pause=stopping.pause)
        except KeyboardInterrupt:
            pass
        if stopping.is_set():
            click.echo("stopped (SIGTERM): the pass under way was finished", err=True)
        return
    report = sweep(runtime)
    _line(report.as_dict())
    if report.error:
        sys.exit(1)


class _StopRequest:
    """SIGTERM to ``sweep --loop``: the pass under way is finished, then the loop ends (as
    ``celery beat`` ends on SIGTERM, with status 0). The handler only sets a flag, which
    :meth:`pause` checks every :data:`STOP_CHECK` seconds: setting a ``threading.Event`` from
    a signal handler can deadlock on the lock that the interrupted code holds."""

    def __init__(self) -> None:
        self.requested = False

    def request(self, _signum: int, _frame: Any) -> None:
        self.requested = True

    def is_set(self) -> bool:
        return self.requested

    def pause(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while not self.requested and (left := until - time.monotonic()) > 0:
            time.sleep(min(left, STOP_CHECK))


#: Seconds between ``sweep --loop``'s looks at a stop request while it waits for a pass.
STOP_CHECK = 0.2


@commands.command(name="inspect")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tasks, warnings).")
@click.option("--strict", is_flag=True,
              help="Exit status 1 if the app or an OJS task has a warning (for CI).")
@click.pass_context
def inspect_command(ctx: click.Context, as_json: bool, strict: bool) -> None:
    """Migration report: every registered task (OJS or not, its OJS type, the queue it routes
    to, the job fields a Celery call of it gets from its options) and what works against OJS
    in the app's settings. Reads the app only; connects to nothing."""
    report = build_report(_app(ctx))
    _print_report(report, as_json)
    if strict and (report.warnings or any(t.warnings for t in report.tasks if t.ojs)):
        sys.exit(EXIT_FAILED)


def _print_report(report: Report, as_json: bool) -> None:
    if as_json:
        _line(report.as_dict())
        return
    for task in report.tasks:
        kind = f"OJS type {task.ojs_type}" if task.ojs else "not an OJS task yet"
        click.echo(f"{task.name}  [{kind}]  queue {task.queue}"
                   + (f" (OJS queue {task.ojs_queue})" if task.ojs_queue else ""))
        fields = ", ".join(f"{key}={json.dumps(value, separators=(',', ':'))}"
                           for key, value in task.envelope.items())
        # a task not migrated keeps Celery's behaviour: its lines say what base=OJSTask brings
        once = "" if task.ojs else "once migrated, "
        click.echo(f"    {once}a Celery call's job: {fields}")
        if task.celery_retry is not None:
            retries = json.dumps(task.celery_retry, separators=(",", ":"))
            click.echo(f"    {once}its Celery retries (self.retry, autoretry_for): {retries}")
        for warning in task.warnings:
            click.echo(f"    warning: {once}{warning}")
    for warning in report.warnings:
        click.echo(f"warning: {warning}")


def _worker_rows(app: Celery) -> list[dict[str, Any]]:
    store = get_runtime(app).store
    now = time.time()
    rows = []
    for info in store.workers.all():
        rows.append({
            "worker_id": info.worker_id, "hostname": info.hostname, "pid": info.pid,
            # a tombstone: declared dead, its jobs' recovery under way (the sweeper removes it)
            "nodename": info.nodename, "state": "dead" if info.buried else info.state,
            "directive": store.meta.pending_directive(info.worker_id),
            "queues": info.queues, "concurrency": info.concurrency, "labels": info.labels,
            "started_at": format_epoch(info.started_at) if info.started_at
            else None,
            "heartbeat_timeout": info.heartbeat_timeout or None,
            "active_jobs": len(info.active_job_ids),
            "last_beat_age": round(now - info.last_beat, 3),
        })
    return rows


@commands.group(name="workers", cls=_Commands, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def workers_command(ctx: click.Context, as_json: bool) -> None:
    """List registered workers, or send one a directive (quiet, resume, terminate)."""
    if ctx.invoked_subcommand is not None:
        return
    rows = _worker_rows(_app(ctx))
    if as_json:
        _line(rows)
        return
    click.echo(f"{'WORKER':<44} {'NODE':<28} {'STATE':<9} {'DIRECTIVE':<9} {'ACTIVE':>6} "
               f"{'BEAT AGE':>8}")
    for row in rows:
        click.echo(f"{row['worker_id']:<44} {row['nodename']:<28} {row['state']:<9} "
                   f"{row['directive'] or '-':<9} {row['active_jobs']:>6} "
                   f"{row['last_beat_age']:>7.1f}s")


def _directive(name: str) -> click.Command:
    @click.command(name=name, help=f"Send the one-shot `{name}` directive to WORKER(s): each a "
                   "worker id, or a Celery node name (`celery@host`, as `celery inspect -d` "
                   "takes it; its live workers, see `ojs-celery workers`). It is delivered in "
                   "the reply to the worker's next beat. Exit status 1 if one of them names no "
                   "registered worker (then none is sent).")
    @click.argument("workers", nargs=-1, metavar="[WORKER]...")
    @click.option("--all", "everyone", is_flag=True, help="Every registered worker.")
    @click.pass_context
    def send(ctx: click.Context, workers: tuple[str, ...], everyone: bool) -> None:
        if everyone == bool(workers):  # a usage error needs no store (status 2, not 4)
            raise click.UsageError("give WORKER(s) (ids or node names) or --all (not both)")
        runtime = get_runtime(_app(ctx))
        store = runtime.store
        every = store.workers.all()
        known = [info for info in every if not info.buried]  # a tombstone beats no more
        targets = sorted(known, key=lambda w: w.worker_id) if everyone else _named_workers(
            known, workers, store.policy,
            buried={name for w in every if w.buried for name in (w.worker_id, w.nodename) if name})
        for info in targets:
            store.meta.send_directive(info.worker_id, name)
            _line({"worker_id": info.worker_id, "nodename": info.nodename, "directive": name})

    return send


def _named_workers(known: list[WorkerInfo], names: tuple[str, ...],
                   policy: Policy, buried: Collection[str] = ()) -> list[WorkerInfo]:
    """The registered workers ``names`` name, each a worker id or a Celery node name, in the
    order named (each once). A node name stands for its live workers, those the sweeper would
    not declare dead (a worker restarted under the same name leaves its old record behind until
    the sweeper removes it): the stale records it also names are left out, one line each on
    stderr; if none of them is live, all of them. A name that is neither (the id or node name
    of a worker declared dead among them, ``buried``: the error says so) ends the command with
    status 1 before anything is sent."""
    by_id = {info.worker_id: info for info in known}
    now = time.time()
    clock = WorkerClock()
    chosen: dict[str, WorkerInfo] = {}
    unknown: list[str] = []
    notes: list[str] = []
    for name in names:
        if name in by_id:
            chosen.setdefault(name, by_id[name])
            continue
        node = [info for info in known if info.nodename == name]
        if not node:
            unknown.append(name)
            continue
        live = [info for info in node if not clock.is_dead(
            info.last_beat, now, policy, own_timeout=info.heartbeat_timeout)]
        for info in node:
            if live and info not in live:
                notes.append(f"note: {name}: left out worker {info.worker_id}, a stale record "
                             f"(no beat for {now - info.last_beat:.1f}s); name its id to send "
                             "it all the same")
        for info in live or node:
            chosen.setdefault(info.worker_id, info)
    dead = [name for name in unknown if name in buried]
    if unknown:
        _fail([f"error: no registered worker with the id or node name {', '.join(unknown)} "
               "(see `ojs-celery workers`)" + (f"; declared dead: {', '.join(dead)}"
                                               if dead else "")], EXIT_FAILED)
    for note in notes:
        click.echo(_one_line(note), err=True)
    return list(chosen.values())


for _name in DIRECTIVES:
    workers_command.add_command(_directive(_name))


def _announce(ready: threading.Event) -> None:
    if ready.wait(30):
        click.echo("listening for OJS events (Ctrl-C to stop)", err=True)


@click.group(name="ojs-celery", cls=_Commands, epilog=_EPILOG, help=commands.help)
@click.option("-A", "--app", "app_name", envvar="CELERY_APP", show_envvar=True,
              help="The Celery app, as `celery -A` takes it (module or module:attribute).")
@click.pass_context
def cli(ctx: click.Context, app_name: str | None) -> None:
    if ctx.resilient_parsing:
        return
    if ctx.invoked_subcommand is not None and "--help" not in sys.argv[1:]:
        ctx.obj = load_app(app_name)


for _command in list(commands.commands.values()):
    cli.add_command(_command)

#: ``celery -A proj ojs ...`` (entry point ``celery.commands``).
celery_command = commands


def main() -> None:
    cli(prog_name="ojs-celery")
