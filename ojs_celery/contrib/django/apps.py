"""The Django ``AppConfig`` that wires ``ojs_celery`` into a project's Celery app."""

from __future__ import annotations

from typing import Any

from celery import Celery, current_app
from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured
from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ...install import install
from ...runtime import get_runtime

#: The Django setting naming the Celery app (``"proj.celery:app"`` or ``"proj.celery.app"``);
#: without it, the current Celery app (the one ``proj/__init__.py`` imports) is used.
APP_SETTING = "OJS_CELERY_APP"
#: The name of the app Celery makes when none was created (``current_app`` then).
DEFAULT_APP_NAME = "default"


class OJSConfig(AppConfig):  # type: ignore[misc]
    """``ready()`` runs once Django's settings are final (a test settings module's overrides
    included), which is when ``config_from_object("django.conf:settings", namespace="CELERY")``
    may read them: ``CELERY_OJS`` is read and validated here, not when the settings module or
    the Celery app module is imported."""

    name = "ojs_celery.contrib.django"
    label = "ojs_celery"
    verbose_name = "Open Job Spec for Celery"

    def ready(self) -> None:
        app = celery_app()
        try:
            install(app)  # on an app configured already, this validates CELERY_OJS
            get_runtime(app).settings  # noqa: B018 - reads and validates CELERY_OJS
        except CeleryImproperlyConfigured as exc:
            lines = "\n".join(f"CELERY_OJS: {line.strip()}" for line in str(exc).splitlines()
                              if line.strip())
            raise ImproperlyConfigured(lines) from None


def celery_app() -> Celery:
    """The project's Celery app: the ``OJS_CELERY_APP`` setting, or Celery's current app."""
    path: Any = getattr(settings, APP_SETTING, None)
    if path is None:
        app = current_app._get_current_object()
    else:
        try:
            app = import_string(str(path).replace(":", "."))
        except ImportError as exc:
            raise ImproperlyConfigured(f"{APP_SETTING}: cannot import {path!r}: {exc}") from None
    if not isinstance(app, Celery):
        raise ImproperlyConfigured(f"{APP_SETTING}: {path!r} is not a Celery app")
    if path is None and app.main in (None, DEFAULT_APP_NAME) and not app.conf.broker_url:
        raise ImproperlyConfigured(
            "ojs_celery found no Celery app: import it in your project package "
            f"(`from .celery import app as celery_app`) or set {APP_SETTING} = 'proj.celery:app'")
    return app
