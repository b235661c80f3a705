"""The zero-setup demo: a real ``celery worker`` runs three OJS JSON jobs; events print live.

    python examples/demo.py

One job completes, one times out (soft signal, checkpoint, hard stop, retry, discard), one fails
and retries with backoff until it succeeds. Everything lives in a temporary folder: filesystem
broker, SQLite job store, SQLite result backend.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEADLINE = 50.0

JOBS: list[dict[str, Any]] = [
    {"type": "demo.greet", "args": ["world"]},
    {
        "type": "demo.report",
        "args": [20],
        "timeout": 2,
        "grace_period": 1,
        "retry": {"max_attempts": 2, "initial_interval": "PT1S", "jitter": False},
    },
    {
        "type": "demo.flaky",
        "args": [3],
        "retry": {"max_attempts": 5, "initial_interval": "PT1S", "backoff_coefficient": 2.0},
    },
]


def describe(event: dict[str, Any], started: float) -> str:
    data = event["data"]
    extra = []
    for key in ("attempt", "timeout_kind", "limit_seconds", "elapsed_seconds", "delay_seconds",
                "worker_id", "duration_ms"):
        if key in data and data[key] is not None:
            value = data[key]
            if key == "worker_id":
                value = str(value)[:15] + "…"
            extra.append(f"{key}={value}")
    if "error" in data:
        extra.append(f"error={data['error'].get('type')}: {data['error'].get('message')}")
    if "last_error" in data:
        extra.append(f"last_error={data['last_error'].get('type')}")
    return (f"{time.monotonic() - started:6.2f}s  {event['type']:<18} "
            f"{data.get('job_type', ''):<12} {' '.join(extra)}")


#: Runs its arguments with Ctrl-C (SIGINT) ignored until the program sets a handler of its own
#: (Celery's worker does once it starts): a Ctrl-C while the worker imports Celery printed a
#: traceback; the demo, which gets it too, stops the worker meanwhile.
IGNORING_CTRL_C = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh"]


def start_worker(app: Any, base: pathlib.Path) -> subprocess.Popen[bytes]:
    """The demo's ``celery worker``, with the sweeper's beat inside it."""
    from ojs_celery.runtime import get_runtime

    return subprocess.Popen(
        [*IGNORING_CTRL_C, sys.executable, "-m", "celery", "--quiet", "-A", "examples.demo_app",
         "worker", "--pool", "prefork", "--concurrency", "3", "--without-gossip",
         "--loglevel", os.environ.get("OJS_DEMO_LOGLEVEL", "WARNING"),
         "--without-mingle", "--hostname", "demo@%h",
         # the sweeper too (beat inside the worker, fine for a demo): it enforces every
         # deadline again from the store, as a deployment's `celery beat` would
         "-B", "--schedule", str(base / "celerybeat-schedule"),
         "-Q", f"{app.conf.task_default_queue},{get_runtime(app).settings.sweep_queue}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def main() -> int:
    base: pathlib.Path | None = None
    worker: subprocess.Popen[bytes] | None = None
    # the listener ends before the broker's folder goes (else it says it lost the broker)
    stop_listening = threading.Event()
    listener: threading.Thread | None = None
    # Ctrl-C at any point, from the imports on: one line, the same clean-up, status 130
    try:
        base = pathlib.Path(tempfile.mkdtemp(prefix="ojs-demo-"))
        os.environ["OJS_DEMO_DIR"] = str(base)
        sys.path.insert(0, str(ROOT))
        from examples.demo_app import app
        from ojs_celery import enqueue, get_job
        from ojs_celery.events import listen

        started = time.monotonic()
        ready = threading.Event()

        def show(event: dict[str, Any]) -> None:
            print(describe(event, started), flush=True)

        listener = threading.Thread(target=listen, args=(app, show),
                                    kwargs={"ready": ready, "stop": stop_listening},
                                    daemon=True)
        listener.start()
        ready.wait(10)
        # the worker before the header: a Ctrl-C once the header shows finds it to stop (one
        # between the two left it running, its output holding the terminal's pipes open)
        worker = start_worker(app, base)
        print(f"ojs_celery demo (filesystem broker, SQLite store in {base})", flush=True)
        print("demo.report is stopped at its hard limit twice: Celery logs each stop as ERROR "
              "lines (such as 'Hard time limit' or 'Process ... exited with signal 9'), as "
              "intended\n", flush=True)
        ids = []
        for envelope in JOBS:
            job = enqueue(envelope, app=app)
            ids.append(job.id)
            print(f"enqueued {job.type:<12} id={job.id}", flush=True)
        print()
        while time.monotonic() - started < DEADLINE:
            jobs = [get_job(i, app=app) for i in ids]
            if all(j is not None and j.terminal for j in jobs):
                break
            time.sleep(0.2)
        time.sleep(0.5)  # let the last events arrive
        print("\nfinal states:")
        ok = True
        for job_id in ids:
            job = get_job(job_id, app=app)
            assert job is not None
            errors = ", ".join(f"#{e['attempt']} {e['type']}" for e in job.errors)
            print(f"  {job.type:<12} {job.state:<10} attempts={job.attempt} "
                  f"result={job.result!r} last_checkpoint={job.last_checkpoint!r} "
                  f"errors=[{errors}]")
            ok = ok and job.terminal
        return 0 if ok else 1
    except KeyboardInterrupt:
        stopping = "stopping the worker and " if worker is not None else ""
        print(f"\ninterrupted: {stopping}removing the demo's folder", flush=True)
        return 130
    finally:
        # a second Ctrl-C now would leave the worker and the folder behind, with a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(15)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        stop_listening.set()
        if listener is not None:
            listener.join(3)
        if base is not None and os.environ.get("OJS_DEMO_KEEP"):
            print(f"\nkept {base} (OJS_DEMO_KEEP is set)", flush=True)
        elif base is not None:  # the store, the broker's folders, the beat schedule: all go
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
