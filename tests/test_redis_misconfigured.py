"""A Redis ``store_url`` the server refuses at the first session for a reason only a change of
configuration mends (a wrong password or user, no password where one is asked for, a database
number the server does not have, an ACL user without permission for the store's commands or
keys) is ``StoreMisconfigured``, as a PostgreSQL one is (``test_sql_misconfigured``): not an
outage retried for ever, nor ``StoreUncertain``. The message names the user or the database
and what to do, and never the password. A Redis that is down stays an outage, and a refusal
after the server has answered the store once stays an ordinary ``StoreError``."""

from __future__ import annotations

import pathlib
import socket
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from ojs_celery import StoreUncertain
from ojs_celery.lifecycle import Policy
from ojs_celery.store import StoreError, StoreMisconfigured, WorkerInfo, open_store
from ojs_celery.store.base import JobStore
from ojs_celery.store.redis import RedisStore
from tests.misconfigured import cli_refused, enqueue_refused, store_config, worker_refused
from tests.test_store_faults import PrivateRedis, new_job

PASSWORD = f"pw-{uuid.uuid4().hex}"


@pytest.fixture
def locked(tmp_path: pathlib.Path) -> Iterator[PrivateRedis]:
    """A ``redis-server`` of this test's own that asks for :data:`PASSWORD`."""
    server = PrivateRedis(tmp_path, password=PASSWORD)
    try:
        yield server
    finally:
        server.stop()


def _nothing_stored(server: PrivateRedis) -> None:
    assert server.admin.dbsize() == 0


def test_a_wrong_password_is_a_configuration_error(
    locked: PrivateRedis, tmp_path: pathlib.Path,
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    config = store_config(tmp_path, f"redis://:{wrong}@{locked.address}/0")
    said = str(enqueue_refused(config))
    assert f'the Redis server at {locked.address} does not accept user "default"' in said
    assert "give the right user and password" in said and wrong not in said
    _nothing_stored(locked)
    cli_refused(config, 'does not accept user "default"', secret=wrong)
    _nothing_stored(locked)


def test_no_password_where_the_server_asks_for_one(
    locked: PrivateRedis, tmp_path: pathlib.Path,
) -> None:
    config = store_config(tmp_path, f"redis://{locked.address}/0")
    said = str(enqueue_refused(config))
    assert "asks for a password and the URL gives none" in said
    cli_refused(config, "asks for a password", secret=PASSWORD)
    _nothing_stored(locked)


def test_a_user_the_server_does_not_know(locked: PrivateRedis, tmp_path: pathlib.Path) -> None:
    user = f"ojs-nosuch-{uuid.uuid4().hex[:8]}"
    said = str(enqueue_refused(store_config(
        tmp_path, f"redis://{user}:{PASSWORD}@{locked.address}/0")))
    assert f'does not accept user "{user}"' in said and PASSWORD not in said
    _nothing_stored(locked)


def test_a_database_the_server_does_not_have(
    locked: PrivateRedis, tmp_path: pathlib.Path,
) -> None:
    config = store_config(tmp_path, f"redis://:{PASSWORD}@{locked.address}/99")
    said = str(enqueue_refused(config))
    assert f"the Redis server at {locked.address} has no database 99" in said
    assert "name one it has" in said and PASSWORD not in said
    cli_refused(config, "has no database 99", secret=PASSWORD)
    _nothing_stored(locked)


def _acl_user(server: PrivateRedis, keys: str, *commands: str) -> str:
    """An ACL user with its own password, allowed ``keys`` and ``commands``: its URL."""
    user, password = f"ojs-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    server.admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=[keys],
                             commands=list(commands))
    return f"redis://{user}:{password}@{server.address}/0"


def test_an_acl_user_without_permission_for_the_store(
    locked: PrivateRedis, tmp_path: pathlib.Path,
) -> None:
    """NOPERM at the first session: the keys (another prefix's) or the commands (no scripts)
    the store needs are not the user's. The ACL the message suggests is enough."""
    config = store_config(tmp_path, _acl_user(locked, "~other:*", "+@all"))
    prefix = config["ojs"]["store_prefix"]
    said = str(enqueue_refused(config))
    assert "has no permission on the Redis server" in said and f'"{prefix}:*"' in said
    cli_refused(config, "has no permission", secret=PASSWORD)
    scriptless = _acl_user(locked, "~*", "+@all", "-@scripting")
    said = str(enqueue_refused(store_config(tmp_path, scriptless)))
    assert "has no permission" in said and "'evalsha'" in said
    _nothing_stored(locked)
    granted = _acl_user(locked, f"~{prefix}:*", "+@read", "+@write", "+@scripting",
                        "+@transaction", "+@connection")
    store = open_store(granted, policy=Policy(), prefix=prefix)
    try:
        store.create(new_job())
        store.workers.save(WorkerInfo(worker_id="w1", hostname="h", pid=1,
                                      last_beat=time.time()))
        assert len(store.workers.all()) == 1
    finally:
        store.clear()
        store.close()


def test_a_worker_exits_at_start_naming_the_user(
    locked: PrivateRedis, tmp_path: pathlib.Path,
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    log = worker_refused(store_config(tmp_path, f"redis://:{wrong}@{locked.address}/0"),
                         tmp_path / "worker.log", 'does not accept user "default"',
                         secret=wrong)
    assert PASSWORD not in log
    _nothing_stored(locked)


#: Each first call of a store: every part of it (jobs, worker registry, meta area) classifies.
FIRST_CALLS: dict[str, Callable[[JobStore], object]] = {
    "create": lambda s: s.create(new_job()),
    "create_many": lambda s: s.create_many([new_job(), new_job()]),
    "get": lambda s: s.get("01890a5d-ac96-774b-bcce-b302099a8057"),
    "ping": lambda s: s.ping(),
    "workers.save": lambda s: s.workers.save(
        WorkerInfo(worker_id="w1", hostname="h", pid=1, last_beat=time.time())),
    "workers.all": lambda s: s.workers.all(),
    "meta.send_directive": lambda s: s.meta.send_directive("w1", "quiet"),
    "insert_pushing (joint)": lambda s: _insert_pushing(s),
}


def _insert_pushing(store: JobStore) -> bool:
    assert isinstance(store, RedisStore)
    record = store.new_record(new_job()).record
    assert record is not None
    deadlines = store._deadlines(record)
    return store.insert_pushing(record, deadlines, store.insert_args(record, deadlines),
                                "queue", "message")


@pytest.mark.parametrize("call", sorted(FIRST_CALLS))
def test_every_first_call_classifies(locked: PrivateRedis, call: str) -> None:
    store = open_store(f"redis://:wrong@{locked.address}/0", policy=Policy(), prefix="t")
    try:
        with pytest.raises(StoreMisconfigured) as refused:
            FIRST_CALLS[call](store)
    finally:
        store.close()
    assert "wrong" not in str(refused.value).replace("a wrong password", "")
    _nothing_stored(locked)


def test_a_refusal_after_the_first_answer_is_an_ordinary_store_error(
    locked: PrivateRedis,
) -> None:
    """The server answered once: a password changed on it later is not the URL's mistake to
    end a worker or a sweep loop for (as the PostgreSQL store's later sessions)."""
    store = open_store(locked.url, policy=Policy(), prefix="t")
    try:
        store.ping()
        locked.admin.config_set("requirepass", "changed")
        locked.admin.client_kill_filter(skipme=True, _type="normal")
        with pytest.raises(StoreError) as failed:
            store.get("01890a5d-ac96-774b-bcce-b302099a8057")
        assert not isinstance(failed.value, StoreMisconfigured)
        assert "AuthenticationError" in str(failed.value)
    finally:
        store.close()


def test_a_redis_that_is_down_stays_an_outage(locked: PrivateRedis) -> None:
    """Connection refused at the first session, even with a password that would be wrong:
    not a configuration error (an outage; enqueue cannot tell whether an earlier try was
    done), and the first session stays open (the server has not answered)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = open_store(f"redis://:wrong@127.0.0.1:{port}/0", policy=Policy(), prefix="t")
    try:
        with pytest.raises(StoreUncertain) as unsure:
            store.create(new_job())
        assert "refused" in str(unsure.value)
        with pytest.raises(StoreError) as down:
            store.workers.save(WorkerInfo(worker_id="w1", hostname="h", pid=1,
                                          last_beat=time.time()))
        assert not isinstance(down.value, StoreMisconfigured)
    finally:
        store.close()
    assert isinstance(store, RedisStore) and not store._session.answered
