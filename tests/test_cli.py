"""The ``ojs-celery`` command line, run as a user would, against a real worker."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from ojs_celery.store import WorkerInfo, open_store
from tests.conftest import Env, start_env
from tests.e2eapp import make_app
from tests.test_store_faults import PrivateRedis
from tests.workers import ROOT, redis_config, unique, wait_for

CLI = str(pathlib.Path(sys.executable).parent / "ojs-celery")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with start_env("filesystem", tmp_path_factory.mktemp("cli"), concurrency=2) as started:
        yield started


def run(env: Env, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, "-A", "tests.e2eapp:app", *args], input=stdin, capture_output=True, text=True,
        cwd=ROOT, env=cli_env(env), timeout=60,
    )


def cli_env(env: Env) -> dict[str, str]:
    return {**os.environ, "OJS_E2E_CONFIG": json.dumps(env.config), "PYTHONPATH": str(ROOT)}


def test_enqueue_from_stdin_then_get(env: Env) -> None:
    out = run(env, "enqueue", "-", stdin='{"type": "e2e.add", "args": [20, 22]}')
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    job: dict[str, Any] = json.loads(lines[0])
    assert job["state"] == "available" and job["type"] == "e2e.add"
    env.wait_state(job["id"], "completed")
    got = run(env, "get", job["id"])
    assert got.returncode == 0
    assert len(got.stdout.splitlines()) == 1
    assert json.loads(got.stdout)["result"] == 42


def test_an_envelope_under_1_mib_as_sent_is_enqueued_and_runs(env: Env) -> None:
    """The 1 MiB limit is on the envelope as sent: 200,000 numbers written ``1e5`` are about
    800 kB here, and 1.8 MB in the job's own JSON (``100000.0``)."""
    text = '{"type":"e2e.tsum","args":[[' + ",".join(["1e5"] * 200_000) + "]]}"
    assert len(text) < 1024 * 1024
    out = run(env, "enqueue", "-", stdin=text)
    assert out.returncode == 0, out.stderr
    job = env.wait_state(json.loads(out.stdout)["id"], "completed")
    assert job.result == 2e10


def test_a_batch_under_1_mib_an_envelope_as_sent_is_enqueued_and_runs(
    env: Env, tmp_path: pathlib.Path
) -> None:
    """``--batch``: each envelope is measured as it is written in the file."""
    envelope = '{"type":"e2e.tsum","args":[[' + ",".join(["1e5"] * 200_000) + "]]}"
    batch = tmp_path / "grows.json"
    batch.write_text(f"[{envelope},{envelope}]")
    out = run(env, "enqueue", "--batch", str(batch))
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        assert env.wait_state(json.loads(line)["id"], "completed").result == 2e10


def test_invalid_envelope_exits_2_with_every_violation_and_stores_nothing(env: Env) -> None:
    job_id = "01a1fc00-0000-7000-8000-0000000000aa"
    bad = json.dumps({"id": job_id, "type": "Bad-Type", "args": {"not": "a list"},
                      "priority": 1000, "timeout": 0})
    out = run(env, "enqueue", "-", stdin=bad)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    for field in ("type:", "args:", "priority:", "timeout:"):
        assert field in out.stderr
    missing = run(env, "get", job_id)
    assert missing.returncode == 1 and "no job" in missing.stderr


def test_batch_is_all_or_nothing(env: Env, tmp_path: pathlib.Path) -> None:
    ids = ["01a1fc00-0000-7000-8000-0000000000b1", "01a1fc00-0000-7000-8000-0000000000b2"]
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps([{"id": ids[0], "type": "e2e.add", "args": [1, 2]},
                                 {"id": ids[1], "type": "e2e.add"}]))
    out = run(env, "enqueue", "--batch", str(batch))
    assert out.returncode == 2 and "[1].args: is required" in out.stderr
    assert run(env, "get", ids[0]).returncode == 1

    batch.write_text(json.dumps([{"id": i, "type": "e2e.add", "args": [1, 2]} for i in ids]))
    out = run(env, "enqueue", "--batch", str(batch))
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["id"] for line in out.stdout.splitlines()] == ids


def test_cancel(env: Env) -> None:
    scheduled = json.dumps({"type": "e2e.add", "args": [1, 1],
                            "scheduled_at": "2099-01-01T00:00:00Z"})
    job = json.loads(run(env, "enqueue", "-", stdin=scheduled).stdout)
    assert job["state"] == "scheduled"
    out = run(env, "cancel", job["id"])
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "cancelled"
    unknown = run(env, "cancel", "01a1fc00-0000-7000-8000-0000000000cc")
    assert unknown.returncode == 1 and "no job" in unknown.stderr


def test_cancel_of_a_cancelled_job_prints_it_with_status_0_as_help_says(env: Env) -> None:
    scheduled = json.dumps({"type": "e2e.add", "args": [1, 1],
                            "scheduled_at": "2099-01-01T00:00:00Z"})
    job = json.loads(run(env, "enqueue", "-", stdin=scheduled).stdout)
    assert run(env, "cancel", job["id"]).returncode == 0
    again = run(env, "cancel", job["id"])
    assert again.returncode == 0 and json.loads(again.stdout)["state"] == "cancelled"
    help_text = " ".join(run(env, "cancel", "--help").stdout.split())
    assert "a job cancelled before is printed as it is (exit status 0)" in help_text


def test_every_problem_is_one_line_on_stderr(env: Env) -> None:
    out = run(env, "enqueue", "-", stdin='{"type": "nope"}')
    assert out.returncode == 2 and out.stdout == ""
    assert sorted(line.split(":")[0] for line in out.stderr.splitlines()) == ["args", "type"]


def test_a_batch_with_an_unknown_type_exits_2_naming_the_field(
    env: Env, tmp_path: pathlib.Path
) -> None:
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps([{"type": "e2e.add", "args": [1, 2]},
                                 {"type": "e2e.missing", "args": []}]))
    out = run(env, "enqueue", "--batch", str(batch))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert [line.split(":")[0] for line in out.stderr.splitlines()] == ["[1].type"]


def test_a_duplicate_id_has_its_own_exit_status(env: Env) -> None:
    envelope = {"id": "01a1fc00-0000-7000-8000-0000000000d1", "type": "e2e.add", "args": [1, 2]}
    first = run(env, "enqueue", "-", stdin=json.dumps(envelope))
    assert first.returncode == 0, first.stderr
    same = run(env, "enqueue", "-", stdin=json.dumps(envelope))
    assert same.returncode == 0 and json.loads(same.stdout)["id"] == envelope["id"]
    other = run(env, "enqueue", "-", stdin=json.dumps({**envelope, "args": [5, 5]}))
    assert other.returncode == 3 and other.stdout == ""
    assert [line.split(":")[0] for line in other.stderr.splitlines()] == ["id"]


def run_with(env: Env, changes: dict[str, Any], *args: str,
             stdin: str = "") -> subprocess.CompletedProcess[str]:
    config = {**env.config, **changes}
    return subprocess.run(
        [CLI, "-A", "tests.e2eapp:app", *args], input=stdin, capture_output=True, text=True,
        cwd=ROOT, env={**cli_env(env), "OJS_E2E_CONFIG": json.dumps(config)}, timeout=60,
    )


def test_a_store_that_is_down_is_one_line_and_status_4(env: Env) -> None:
    down = {"ojs": {**env.config["ojs"], "store_url": "redis://127.0.0.1:1/0"}}
    for args in (("enqueue", "-"), ("get", "01a1fc00-0000-7000-8000-0000000000d2")):
        out = run_with(env, down, *args, stdin='{"type": "e2e.add", "args": [1, 2]}')
        assert out.returncode == 4, out.stderr
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
        if args[0] == "enqueue":  # the driver may have sent the insert before it failed
            assert re.search(r"job [0-9a-f-]{36}: the job store refused the connection .*if it "
                             r"was down all along the job is not stored", out.stderr)


def test_a_store_that_never_answers_gives_up_after_store_timeout(
    env: Env, silent_port: int
) -> None:
    """``ojs.store_timeout`` bounds the wait for a store that accepts connections and never
    answers (a hung server): status 4 and one line, well within the run's 60 s."""
    hung = {"ojs": {**env.config["ojs"], "store_url": f"redis://127.0.0.1:{silent_port}/0",
                    "store_timeout": 1}}
    out = run_with(env, hung, "enqueue", "-", stdin='{"type": "e2e.add", "args": [1, 2]}')
    assert out.returncode == 4, out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    assert "Timeout" in out.stderr and "may or may not be stored" in out.stderr


def test_a_broker_that_is_down_stores_the_job_for_the_sweeper(
    env: Env, tmp_path: pathlib.Path
) -> None:
    """The enqueue contract: once stored, the job will run (the sweeper publishes it), so the
    command succeeds with the job and a one-line warning rather than inviting a retry."""
    store_url = f"sqlite:///{tmp_path / 's.sqlite3'}"
    down = {"broker_url": "redis://127.0.0.1:1/0", "broker_transport_options": {},
            "ojs": {**env.config["ojs"], "store_url": store_url}}
    out = run_with(env, down, "enqueue", "-", stdin='{"type": "e2e.add", "args": [1, 2]}')
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    job_id = json.loads(out.stdout.splitlines()[-1])["id"]
    stored = open_store(store_url).get_record(job_id)
    assert stored is not None and stored.job.state == "available"
    assert stored.dispatch_due is not None  # owed: the sweeper publishes it


def test_invalid_settings_are_one_line_per_problem_and_status_2(env: Env) -> None:
    bad = {"ojs": {**env.config["ojs"], "sweep_intervall": 1, "heartbeat_interval": -1}}
    out = run_with(env, bad, "get", "01a1fc00-0000-7000-8000-0000000000d3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "ojs.sweep_intervall: unknown setting" in out.stderr


def test_help_lists_the_exit_statuses(env: Env) -> None:
    from ojs_celery.cli import EXIT_STATUSES

    out = run(env, "--help")
    for code in EXIT_STATUSES:
        assert f"  {code}  " in out.stdout
    # -A's help said module:attr only, and not that CELERY_APP is read when it is left out
    said = " ".join(out.stdout.split())
    assert "(module or module:attribute). [env var: CELERY_APP]" in said, out.stdout
    enqueue_help = " ".join(run(env, "enqueue", "--help").stdout.split())
    assert "4 if the store cannot be reached or refuses the write" in enqueue_help
    assert "5 if" not in enqueue_help  # a broker that is down exits 0 (the sweeper publishes)
    assert "(a file, or - for stdin, the default)" in enqueue_help  # SOURCE may be left out


def test_an_argument_that_is_not_utf8_names_no_job(env: Env) -> None:
    """A job id argument in another encoding (Python reads it with lone surrogates) is no job:
    one line, no traceback."""
    for command in ("get", "cancel"):
        out = subprocess.run([CLI, "-A", "tests.e2eapp:app", command, b"\xff\xfe"],
                             capture_output=True, cwd=ROOT, env=cli_env(env), timeout=60)
        assert out.returncode == 1, out.stderr
        assert out.stderr.decode() == "error: no job with id \\udcff\\udcfe\n"


def test_unknown_app_is_a_usage_error(env: Env, tmp_path: pathlib.Path) -> None:
    """Status 2 with the reason: no such module; a module without that attribute (Celery's
    own words named a module 'tests.e2eapp:nothere'); a module that calls ``sys.exit(3)``
    while imported (it ended the command silently with status 3, a duplicate job's)."""
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    for name, reason in [("no_such_module", "No module named 'no_such_module'"),
                         ("tests.e2eapp:nothere",
                          "module 'tests.e2eapp' has no attribute 'nothere'"),
                         ("exits_on_import", "importing it called sys.exit(3)")]:
        out = subprocess.run([CLI, "-A", name, "get", "x"], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             timeout=60)
        assert out.returncode == 2 and f"cannot load app {name!r}: {reason}" in out.stderr


def test_an_id_with_control_characters_or_of_any_length_is_one_short_line(env: Env) -> None:
    """What an argument quotes is escaped (a terminal would obey an escape sequence) and cut
    (a 100,000-character id was echoed whole)."""
    out = run(env, "get", "a\x07b\x1b[31mc" + "x" * 100_000)
    assert out.returncode == 1
    [line] = out.stderr.splitlines()
    assert line.startswith("error: no job with id a\\x07b\\x1b[31mcxxx")
    assert re.search(r"x\.\.\. \(99\d{3} more characters\)$", line) and len(line) < 1100


def test_an_envelope_file_with_a_byte_order_mark_is_read(env: Env, tmp_path: pathlib.Path) -> None:
    """A UTF-8 byte order mark (some Windows editors write one) was "not valid JSON"."""
    source = tmp_path / "bom.json"
    source.write_bytes(b"\xef\xbb\xbf" + b'{"type": "e2e.add", "args": [1, 2]}')
    out = run(env, "enqueue", str(source))
    assert out.returncode == 0, out.stderr
    assert env.wait_state(json.loads(out.stdout)["id"], "completed").result == 3


def events_listener(env: Env, *options: str) -> subprocess.Popen[str]:
    """``ojs-celery events`` in the background, returned once it listens."""
    listener = subprocess.Popen(
        [CLI, "-A", "tests.e2eapp:app", "events", *options], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=cli_env(env),
    )
    assert listener.stderr is not None
    assert "listening" in listener.stderr.readline()
    return listener


def test_events_streams_one_json_line_per_event(env: Env) -> None:
    """Events from every process (the CLI's enqueue, the worker's pool child), live, one compact
    JSON object per line. The worker's own events (heartbeats) may come in between."""
    listener = events_listener(env, "--timeout", "30")
    try:
        job = json.loads(run(env, "enqueue", "-", stdin='{"type":"e2e.add","args":[1,2]}').stdout)
        assert listener.stdout is not None
        types: list[str] = []
        for line in listener.stdout:  # ends at --timeout if the events never come
            event = json.loads(line)
            assert line == json.dumps(event, separators=(",", ":")) + "\n"
            if event.get("subject") == job["id"]:
                types.append(event["type"])
            if types[-1:] == ["job.completed"]:
                break
    finally:
        listener.kill()
        listener.communicate()
    assert types == ["job.enqueued", "job.started", "job.completed"]
    wait_for(lambda: env.job(job["id"]).state == "completed", 10, "completion")


def test_events_limit_counts_events(env: Env) -> None:
    """``--limit N`` prints N events and exits, although the bus carries them in batches; it
    does not give up while the bus is quiet (the enqueue below takes a process start)."""
    listener = events_listener(env, "--limit", "2", "--timeout", "30")
    try:
        enqueued = run(env, "enqueue", "-", stdin='{"type":"e2e.add","args":[2,3]}')
        assert enqueued.returncode == 0, enqueued.stderr
        out, _ = listener.communicate(timeout=30)
    finally:
        listener.kill()
    assert listener.returncode == 0
    assert len(out.splitlines()) == 2


def test_sweep_once_and_loop(env: Env) -> None:
    once = run(env, "sweep", "--once")
    assert once.returncode == 0, once.stderr
    report = json.loads(once.stdout)
    assert report["error"] is None and "published" in report

    lonely = json.dumps({"type": "e2e.add", "args": [1, 1], "queue": "nobody-here",
                         "enqueue_ttl": 1})
    job = json.loads(run(env, "enqueue", "-", stdin=lonely).stdout)
    loop = subprocess.Popen([CLI, "-A", "tests.e2eapp:app", "sweep", "--loop", "--interval",
                             "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=cli_env(env))
    try:
        done = wait_for(lambda: (j := env.job(job["id"])).state == "discarded" and j, 1 + 0.2 + 5,
                        "the loop to expire the job")
        assert done.error is not None and done.error["type"] == "enqueue_ttl_expired"
    finally:
        loop.terminate()
        loop.wait(10)


def test_sigterm_ends_sweep_loop_and_events_with_status_0(env: Env) -> None:
    """A service manager stops ``sweep --loop`` and ``events`` with SIGTERM (systemd,
    Kubernetes, supervisord): they ended by the signal's default action, status 143 with no word
    said. They now end as on Ctrl-C, with status 0 (``sweep --loop`` once the pass under way is
    done, as ``celery beat`` ends on SIGTERM)."""
    loop = subprocess.Popen([CLI, "-A", "tests.e2eapp:app", "sweep", "--loop", "--interval",
                             "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=cli_env(env))
    listener = events_listener(env)
    try:
        assert loop.stderr is not None and "sweeping every" in loop.stderr.readline()
        loop.send_signal(signal.SIGTERM)
        listener.send_signal(signal.SIGTERM)
        assert loop.wait(15) == 0  # the wait for the next pass (60 s) ends at once
        assert listener.wait(15) == 0
        said = loop.communicate()[1] + listener.communicate()[1]
    finally:
        loop.kill()
        listener.kill()
    assert "stopped (SIGTERM)" in said and "Traceback" not in said, said


def test_sweep_flags_that_contradict_are_a_usage_error(env: Env) -> None:
    """``sweep --once --loop`` ran the loop and ``--loop --once`` one pass (the last flag won),
    and ``sweep --interval 5`` one pass, its interval ignored: each is now click's usage error,
    naming the flags, before the app is loaded."""
    for args, said in ((("--once", "--loop"), "--once and --loop exclude each other"),
                       (("--loop", "--once"), "--once and --loop exclude each other"),
                       (("--interval", "5"), "--interval applies to --loop only"),
                       (("--once", "--interval", "5"), "--interval applies to --loop only"),
                       (("--loop", "--interval", "inf"),
                        "Invalid value for '--interval': must be a finite number of seconds, "
                        "not inf: nothing waits for ever"),
                       (("--loop", "--interval", "1e300"),
                        "Invalid value for '--interval': must be at most 3153600000 seconds (a "
                        "hundred years), not 1e+300: nothing waits for ever")):
        out = run(env, "sweep", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert f"Error: {said}" in out.stderr and out.stdout == "", (args, out.stderr)
    assert "Seconds between --loop's passes" in " ".join(run(env, "sweep", "--help").stdout.split())


def test_sweep_with_a_bad_setting_is_a_usage_error(env: Env) -> None:
    """``sweep --once`` read its settings inside the pass, which logs and survives anything:
    a bad setting came out as a failed pass with a traceback and exit status 1."""
    bad = {"ojs": {**env.config["ojs"], "worker_heartbeat_timeout": 172800}}
    for mode in ("--once", "--loop"):
        out = run_with(env, bad, "sweep", mode)
        assert out.returncode == 2, out.stderr
        assert "ojs.worker_heartbeat_timeout: at most a day" in out.stderr
        assert "Traceback" not in out.stderr


def test_events_goes_on_after_the_broker_restarts(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """The broker (a private Redis) is killed, stays down while the listener tries again, and
    is started again on its port: the listener says so in one line per try, connects again and
    prints the events published after it is back; no traceback, and it keeps running (the
    events published while it was away are lost: the bus is best-effort)."""
    config = redis_config(tmp_path, redis_server.url)
    config["ojs"]["events"] = True
    listener = subprocess.Popen(
        [CLI, "-A", "tests.e2eapp:app", "events"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "OJS_E2E_CONFIG": json.dumps(config), "PYTHONPATH": str(ROOT)})
    printed: queue.SimpleQueue[str] = queue.SimpleQueue()
    said: list[str] = []
    assert listener.stdout is not None and listener.stderr is not None
    assert "listening" in listener.stderr.readline()
    threading.Thread(target=lambda: [printed.put(line) for line in listener.stdout],
                     daemon=True).start()
    threading.Thread(target=lambda: [said.append(line) for line in listener.stderr],
                     daemon=True).start()
    app = make_app(config)

    def enqueued_event_comes(within: float) -> bool:
        """Enqueue jobs until one's job.enqueued event is printed (events published before
        the listener is bound again are lost)."""
        ids: set[str] = set()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            ids.add(enqueue({"type": "e2e.add", "args": [1, 1]}, app=app).id)
            get_runtime(app).flush()
            try:
                while True:
                    event = json.loads(printed.get(timeout=0.5))
                    if event.get("subject") in ids and event["type"] == "job.enqueued":
                        return True
            except queue.Empty:
                continue
        return False

    try:
        assert enqueued_event_comes(within=20)
        port = redis_server.port
        redis_server.process.kill()
        redis_server.process.wait(10)
        # down long enough that connecting again fails too (kombu's error, not the driver's)
        wait_for(lambda: sum("lost the broker" in line for line in said) >= 2, 20,
                 "a second try while the broker is down")
        redis_server.process = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                return bool(redis_server.admin.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 10, "the broker back")
        assert enqueued_event_comes(within=40)
        assert listener.poll() is None
    finally:
        listener.kill()
        listener.communicate()
        get_runtime(app).close()
    assert not any("Traceback" in line for line in said), "".join(said)
    assert sum("lost the broker" in line for line in said) >= 2


def test_ctrl_c_ends_events_while_its_broker_is_frozen(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """Ctrl-C while the broker (a private Redis) is frozen (``kill -STOP``): the listener went
    on waiting for it, in kombu's orderly close, which deletes the receiver's queue there. It
    now ends within a few seconds, status 0, with no traceback (the queue expires on the
    broker)."""
    config = redis_config(tmp_path, redis_server.url)
    listener = subprocess.Popen(
        [CLI, "-A", "tests.e2eapp:app", "events"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "OJS_E2E_CONFIG": json.dumps(config), "PYTHONPATH": str(ROOT)})
    assert listener.stderr is not None
    try:
        assert "listening" in listener.stderr.readline()
        redis_server.process.send_signal(signal.SIGSTOP)
        listener.send_signal(signal.SIGINT)
        assert listener.wait(15) == 0
        said = listener.stderr.read()
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
        listener.kill()
        listener.communicate()
    assert "Traceback" not in said, said


def test_listen_ends_when_asked_while_listening_and_while_its_broker_is_down(
    redis_server: PrivateRedis, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``listen(..., stop=...)`` (what a thread reading the bus is ended with) returns soon
    after ``stop`` is set: while it waits for events, and while it waits to connect again to a
    broker that went away (it would otherwise try for ever)."""
    from ojs_celery.events import listen

    config = redis_config(tmp_path, redis_server.url)
    app = make_app(config)
    for broker_down in (False, True):
        ready, stop = threading.Event(), threading.Event()
        thread = threading.Thread(target=listen, args=(app, lambda _event: None),
                                  kwargs={"ready": ready, "stop": stop}, daemon=True)
        thread.start()
        assert ready.wait(15), "the listener did not start"
        if broker_down:
            redis_server.stop()
            wait_for(lambda: "lost the broker" in caplog.text, 15, "the listener to lose it")
        stop.set()
        thread.join(5)
        assert not thread.is_alive(), f"listen went on after stop (broker down: {broker_down})"
    get_runtime(app).close()


def test_events_into_a_reader_that_goes_away_ends_at_once(env: Env) -> None:
    """``events | head -1``: the closed pipe was taken for a lost broker (both are OSError),
    and the listener printed "lost the broker" every second for ever instead of ending."""
    listener = events_listener(env, "--timeout", "30")
    assert listener.stdout is not None and listener.stderr is not None
    listener.stdout.close()  # the reader is gone, as `head -1` after its line
    try:
        run(env, "enqueue", "-", stdin='{"type":"e2e.add","args":[1,1]}')
        assert listener.wait(20) == 0
        said = listener.stderr.read()
    finally:
        listener.kill()
    assert "lost the broker" not in said and "Traceback" not in said, said


def test_a_directive_without_workers_is_a_usage_error_whatever_the_store(env: Env) -> None:
    """The usage was checked after the store was read: with the store down, a directive
    with no WORKER_ID and no --all exited 4 (store) instead of 2 (usage)."""
    down = {"ojs": {**env.config["ojs"], "store_url": "redis://127.0.0.1:1/0"}}
    out = run_with(env, down, "workers", "quiet")
    assert out.returncode == 2, out.stderr
    assert "give WORKER(s) (ids or node names) or --all" in out.stderr


def test_a_directive_takes_a_node_name_and_sends_it_to_its_live_workers(env: Env) -> None:
    """``workers quiet celery@host``: Celery users name workers by node name. A node name
    whose worker was restarted has a stale record beside the live one until the sweeper
    removes it: the directive goes to the live worker only. An id still names its worker, and
    an unknown name is one line and status 1, with nothing sent."""
    store = get_runtime(env.app).store
    node, other = f"{unique('node')}@host", f"{unique('node')}@host"
    now = time.time()
    stale = WorkerInfo(f"worker_{unique('stale')}", "host", 1, node, last_beat=now - 3600)
    live = WorkerInfo(f"worker_{unique('live')}", "host", 2, node, last_beat=now)
    elsewhere = WorkerInfo(f"worker_{unique('other')}", "host", 3, other, last_beat=now)
    infos = (stale, live, elsewhere)
    for info in infos:
        store.workers.save(info)
    try:
        def pending() -> list[str | None]:
            return [store.meta.pending_directive(info.worker_id) for info in infos]

        unknown = run(env, "workers", "quiet", node, "celery@nosuchnode")
        assert unknown.returncode == 1, unknown.stderr
        assert unknown.stderr.splitlines() == [
            "error: no registered worker with the id or node name celery@nosuchnode "
            "(see `ojs-celery workers`)"]
        assert pending() == [None, None, None]  # nothing sent

        out = run(env, "workers", "quiet", node)
        assert out.returncode == 0, out.stderr
        assert [json.loads(line) for line in out.stdout.splitlines()] == [
            {"worker_id": live.worker_id, "nodename": node, "directive": "quiet"}]
        assert stale.worker_id in out.stderr  # it says which record it left out
        assert pending() == [None, "quiet", None]

        by_id = run(env, "workers", "resume", stale.worker_id, other, live.worker_id)
        assert by_id.returncode == 0, by_id.stderr
        assert [json.loads(line)["worker_id"] for line in by_id.stdout.splitlines()] == [
            stale.worker_id, elsewhere.worker_id, live.worker_id]
        assert pending() == ["resume", "resume", "resume"]

        store.workers.remove(live.worker_id)  # only the stale record is left: it is named
        left = run(env, "workers", "terminate", node)
        assert left.returncode == 0, left.stderr
        assert [json.loads(line)["worker_id"] for line in left.stdout.splitlines()] == [
            stale.worker_id]
    finally:
        for info in infos:
            store.remove_worker(info.worker_id)


def test_a_directive_is_not_sent_to_a_worker_declared_dead(env: Env) -> None:
    """A dead worker's tombstone (its burial under way) is listed by ``workers`` as ``dead``
    but beats no more: ``--all`` leaves it out, and naming it is an error that says so, with
    nothing sent."""
    store = get_runtime(env.app).store
    now = time.time()
    dead = WorkerInfo(f"worker_{unique('dead')}", "host", 1, f"{unique('node')}@host",
                      last_beat=now - 3600)
    live = WorkerInfo(f"worker_{unique('live')}", "host", 2, f"{unique('node')}@host",
                      last_beat=now)
    store.workers.save(dead)
    store.workers.save(live)
    try:
        assert store.bury_worker(dead, now) is not None
        named = run(env, "workers", "quiet", dead.worker_id)
        assert named.returncode == 1, named.stderr
        assert named.stderr.splitlines() == [
            f"error: no registered worker with the id or node name {dead.worker_id} (see "
            f"`ojs-celery workers`); declared dead: {dead.worker_id}"]
        everyone = run(env, "workers", "resume", "--all")  # harmless to a running worker
        assert everyone.returncode == 0, everyone.stderr
        sent = [json.loads(line)["worker_id"] for line in everyone.stdout.splitlines()]
        assert live.worker_id in sent and dead.worker_id not in sent
        assert store.meta.pending_directive(dead.worker_id) is None
    finally:
        for info in (dead, live):
            store.remove_worker(info.worker_id)
            store.remove_worker(info.worker_id, buried=True)


def test_a_directive_to_the_node_name_of_a_worker_declared_dead_says_so(env: Env) -> None:
    """A node name whose only record is a tombstone (``workers`` lists it as ``dead`` under
    that name): an error that says it was declared dead, as naming its id does, nothing sent."""
    store = get_runtime(env.app).store
    now = time.time()
    node = f"{unique('node')}@host"
    dead = WorkerInfo(f"worker_{unique('dead')}", "host", 1, node, last_beat=now - 3600)
    store.workers.save(dead)
    try:
        assert store.bury_worker(dead, now) is not None
        named = run(env, "workers", "terminate", node)
        assert named.returncode == 1, named.stderr
        assert named.stderr.splitlines() == [
            f"error: no registered worker with the id or node name {node} (see "
            f"`ojs-celery workers`); declared dead: {node}"]
        assert store.meta.pending_directive(dead.worker_id) is None
    finally:
        store.remove_worker(dead.worker_id, buried=True)


def test_output_that_cannot_be_written_is_one_line_and_status_1(env: Env) -> None:
    """stdout on a full device (``> /dev/full``): ``get`` and ``sweep`` ended with a traceback,
    and ``enqueue`` too, although its job was stored (the line now names it)."""
    with open("/dev/full", "w") as full:
        enqueued = subprocess.run(
            [CLI, "-A", "tests.e2eapp:app", "enqueue", "-"], input='{"type":"e2e.add",'
            '"args":[4,4]}', stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=cli_env(env), timeout=60)
        swept = subprocess.run([CLI, "-A", "tests.e2eapp:app", "sweep", "--once"], stdout=full,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT, env=cli_env(env),
                               timeout=60)
    for out in (enqueued, swept):
        assert out.returncode == 1, out.stderr
        [line] = out.stderr.splitlines()
        assert line.startswith("error: cannot write the output: ") and "No space left" in line
    match = re.search(r"the job ([0-9a-f-]{36}) is stored", enqueued.stderr)
    assert match, enqueued.stderr
    assert env.wait_state(match.group(1), "completed").result == 8


def test_events_into_a_full_device_ends_with_one_line(env: Env) -> None:
    """``events > /dev/full``: the failed write (an OSError) was taken for a lost broker, and
    the listener said "lost the broker" and tried again for ever."""
    with open("/dev/full", "w") as full:
        listener = subprocess.Popen(
            [CLI, "-A", "tests.e2eapp:app", "events", "--timeout", "60"], stdout=full,
            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=cli_env(env))
    assert listener.stderr is not None
    try:
        assert "listening" in listener.stderr.readline()
        run(env, "enqueue", "-", stdin='{"type":"e2e.add","args":[1,1]}')
        assert listener.wait(30) == 1
        said = listener.stderr.read()
    finally:
        listener.kill()
        listener.communicate()
    assert "lost the broker" not in said and "Traceback" not in said, said
    [line] = said.splitlines()
    assert line.startswith("error: cannot write the output: ") and "No space left" in line


def test_listen_raises_what_its_handler_raises(env: Env) -> None:
    """An OSError from the handler (a file it writes to is full) is not a lost broker: it
    ends ``listen`` (it was logged as "lost the broker" and retried for ever)."""
    from ojs_celery.events import listen

    app = make_app(env.config)
    raised: list[BaseException] = []
    ready = threading.Event()

    def handler(_event: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    def target() -> None:
        try:
            listen(app, handler, ready=ready, timeout=60)
        except BaseException as exc:  # what the test looks at
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        assert ready.wait(15), "the listener did not start"
        run(env, "enqueue", "-", stdin='{"type":"e2e.add","args":[1,1]}')
        thread.join(30)
        assert not thread.is_alive(), "listen went on after its handler failed"
        assert len(raised) == 1 and isinstance(raised[0], OSError), raised
        assert raised[0].errno == 28
    finally:
        get_runtime(app).close()
