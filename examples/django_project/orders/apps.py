from typing import Any

from django.apps import AppConfig
from django.db.backends.signals import connection_created


class OrdersConfig(AppConfig):
    name = "orders"

    def ready(self) -> None:
        connection_created.connect(_sqlite_wal, dispatch_uid="orders-sqlite-wal")


def _sqlite_wal(sender: Any, connection: Any, **_: Any) -> None:
    """Web process, workers and beat share one SQLite file: with WAL, readers never block the
    writer (Django >= 5.1 could say it in OPTIONS["init_command"])."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
