"""``python manage.py ojs ...``: the ``ojs-celery`` commands on the project's Celery app."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from ojs_celery.cli import commands
from ojs_celery.contrib.django.apps import celery_app
from ojs_celery.install import install


class Command(BaseCommand):  # type: ignore[misc]
    help = ("Enqueue and inspect Open Job Spec jobs (the ojs-celery commands; see "
            "`manage.py ojs --help`).")

    def run_from_argv(self, argv: list[str]) -> None:
        """Hand everything after ``manage.py ojs`` to the click commands unparsed (Django's
        argparse would reject their options); click exits with their statuses."""
        app = _loaded_app()
        commands.main(args=argv[2:], prog_name=f"{argv[0]} {argv[1]}", obj=app)

    def handle(self, *args: Any, **options: Any) -> None:  # call_command("ojs", ...)
        app = _loaded_app()
        commands.main(args=list(args), prog_name="ojs", obj=app, standalone_mode=False)


def _loaded_app() -> Any:
    """The project's Celery app with its tasks imported (``autodiscover_tasks`` imports them
    when the loader imports the default modules, as ``celery -A`` does)."""
    app = celery_app()
    app.loader.import_default_modules()
    install(app)
    return app
