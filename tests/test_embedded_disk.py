"""The embedded default (``ojsfs://`` broker, SQLite files) when its disk misbehaves: full,
or at a path that a URL would read otherwise. The full disk is a small tmpfs of the test's own;
where mounting is not permitted (not root, a container without the capability), those tests
skip."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import ChannelError, OperationalError

from ojs_celery.embedded import embedded_settings


@contextlib.contextmanager
def small_disk(path: pathlib.Path, size: str = "256k") -> Iterator[pathlib.Path]:
    """A tmpfs of ``size`` mounted on ``path`` for the block, unmounted after it."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: pathlib.Path) -> None:
    """Write to ``folder`` until its disk is full (a hidden file, which no queue reads)."""
    with contextlib.suppress(OSError), open(folder / ".filler", "wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 4096)


def test_a_publish_to_a_full_disk_names_the_cause_and_leaves_no_part_of_a_file(
        tmp_path: pathlib.Path) -> None:
    settings = embedded_settings(tmp_path / "ojs")
    broker = pathlib.Path(settings["broker_transport_options"]["data_folder_out"])
    with small_disk(broker):
        fill(broker)
        queue = Queue("disk", Exchange("disk"), "disk")
        with Connection(settings["broker_url"],
                        transport_options=settings["broker_transport_options"]) as connection:
            producer = Producer(connection.channel())
            queue(producer.channel).declare()
            full = "No space left on device"
            for _ in range(3):
                with pytest.raises((ChannelError, OperationalError), match=full):
                    producer.publish({"payload": "x" * 20000}, exchange=queue.exchange,
                                     routing_key="disk", retry=False)
        # each failed publish took no space: nothing but the filler is left in the folder
        assert sorted(p.name for p in broker.iterdir()) == [".filler"]


@pytest.mark.parametrize("name", ["with space ünï", "percent%41", "query?x=1", "hash#1"])
def test_the_sqlite_files_are_in_the_folder_whatever_its_name(
        tmp_path: pathlib.Path, name: str) -> None:
    """A folder's name is not a URL: its ``%``, ``?`` and ``#`` are characters of the path,
    and the job store and the results live in that folder, not at a file the URL names."""
    from sqlalchemy.engine import make_url

    from ojs_celery import enqueue, get_job
    from tests.e2eapp import make_app
    from tests.workers import filesystem_config

    base = tmp_path / name / "ojs"
    config = filesystem_config(base)
    settings = embedded_settings(base)
    assert make_url(settings["ojs"]["store_url"]).database == str(base / "store.sqlite3")
    assert make_url(settings["result_backend"][len("db+"):]).database == str(
        base / "results.sqlite3")
    app = make_app(config)
    job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    assert get_job(job.id, app=app) is not None
    app.backend.store_result(job.id, 3, "SUCCESS")
    assert {"store.sqlite3", "results.sqlite3"} <= {p.name for p in base.iterdir()}
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["ojs"]  # nothing beside it


def test_a_job_stored_after_the_sqlite_file_was_deleted_is_in_the_file_others_read(
        tmp_path: pathlib.Path) -> None:
    """SQLite goes on writing to a file deleted while it is open: a store that kept its
    connections would report jobs stored that no other process, and no later one, can read.
    A process whose file was deleted opens the path again (here the folder is still there,
    so a new file gets the tables); an enqueue either fails or stores where others read."""
    from ojs_celery import enqueue, enqueue_batch
    from ojs_celery.store import StoreError
    from ojs_celery.store.sql import SQLStore
    from tests.e2eapp import make_app
    from tests.workers import filesystem_config

    config = filesystem_config(tmp_path / "ojs")
    app = make_app(config)
    enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)  # the file is open in this process
    store_file = pathlib.Path(make_url_database(config["ojs"]["store_url"]))
    for leftover in store_file.parent.glob(store_file.name + "*"):
        leftover.unlink()  # the database, its WAL and shared-memory files: a clean-up
    stored = []
    for call in range(3):  # single inserts (the lane), then a batch (the engine)
        try:
            if call < 2:
                stored.append(enqueue({"type": "e2e.add", "args": [call, 1]}, app=app).id)
            else:
                stored += [job.id for job in enqueue_batch(
                    [{"type": "e2e.add", "args": [n, 2]} for n in range(3)], app=app)]
        except StoreError:
            pass
    assert stored, "no enqueue succeeded after the file was made again"
    reader = SQLStore(config["ojs"]["store_url"])  # another process's view of the path
    try:
        assert [job_id for job_id in stored if reader.get(job_id) is None] == []
    finally:
        reader.close()


def make_url_database(url: str) -> str:
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    assert database is not None
    return database
