"""A password in ``store_url`` never shows: not in a store's ``repr``/``str``, not in the
errors it raises, not in what it logs. Celery masks broker URLs (``**``); the store does the
same for its own URL."""

from __future__ import annotations

import logging

import pytest

from ojs_celery.store import StoreError, open_store
from ojs_celery.store.base import mask_secrets, store_errors

SECRET = "s3cr3t-Pa55"

URLS = [
    f"redis://:{SECRET}@127.0.0.1:1/0",
    f"redis://ojs:{SECRET}@127.0.0.1:1/3",
    f"rediss://ojs:{SECRET}@127.0.0.1:1/0?ssl_cert_reqs=none",
    f"redis://127.0.0.1:1/0?password={SECRET}",
    f"unix://:{SECRET}@/nonexistent/redis.sock?db=2",
    f"postgresql://ojs:{SECRET}@127.0.0.1:1/ojs",
    f"postgresql://ojs@127.0.0.1:1/ojs?password={SECRET}&connect_timeout=2",
]


@pytest.mark.parametrize("url", URLS)
def test_repr_and_str_hide_the_password(url: str) -> None:
    store = open_store(url, prefix="secrets")
    try:
        for shown in (repr(store), str(store), f"{store}", f"{store!r}"):
            assert SECRET not in shown
            assert "**" in shown
        assert "127.0.0.1" in repr(store) or "redis.sock" in repr(store)  # still useful
    finally:
        store.close()


@pytest.mark.parametrize("url", URLS)
def test_errors_and_logs_hide_the_password(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store = open_store(url, prefix="secrets")
    try:
        for operation in (store.ping, lambda: store.get("x"), store.workers.all,
                          store.meta.last_sweep):
            with pytest.raises(StoreError) as info:
                operation()
            assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    finally:
        store.close()
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


def test_a_driver_message_that_quotes_the_url_is_masked() -> None:
    @store_errors(lambda exc: isinstance(exc, OSError))
    def connect() -> None:
        raise OSError(f"cannot connect to redis://ojs:{SECRET}@db.internal:6379/0 (refused)")

    with pytest.raises(StoreError) as info:
        connect()
    assert SECRET not in str(info.value)
    assert "redis://ojs:**@db.internal:6379/0" in str(info.value)


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (f"redis://:{SECRET}@h:6379/0", "redis://:**@h:6379/0"),
        (f"redis://u:p@{SECRET}@h/0", "redis://u:**@h/0"),  # an unescaped @ in the password
        (f"postgresql+psycopg://u:{SECRET}@h/db?sslmode=require",
         "postgresql+psycopg://u:**@h/db?sslmode=require"),
        (f"redis://h/0?db=1&password={SECRET}&x=1", "redis://h/0?db=1&password=**&x=1"),
        ("redis://user@h:6379/0", "redis://user@h:6379/0"),
        ("sqlite:////var/lib/ojs.sqlite3", "sqlite:////var/lib/ojs.sqlite3"),
    ],
)
def test_mask_secrets(text: str, masked: str) -> None:
    assert mask_secrets(text) == masked


def test_celery_report_masks_the_store_url() -> None:
    """``celery report`` prints the app's settings censored: ``ojs.store_url`` is masked as
    Celery masks its own passwords."""
    from celery import Celery

    from ojs_celery import install

    app = Celery("report_secrets", set_as_current=False)
    app.conf.ojs = {"store_url": f"redis://:{SECRET}@127.0.0.1:6379/0"}
    install(app)
    report = app.bugreport()
    assert SECRET not in report and "store_url" in report
