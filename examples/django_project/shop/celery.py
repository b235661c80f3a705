"""The shop's Celery app, configured from Django's settings (``CELERY_*``).

``SHOP_OJS=1`` switches ``ojs_celery`` on: the settings add ``ojs_celery.contrib.django`` to
``INSTALLED_APPS`` (which calls ``install(app)`` when Django is ready) and the tasks use
``OJSTask`` as their base. Everything else is the project as it was on plain Celery.
"""

import os

from celery import Celery, Task

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

OJS_ENABLED = os.environ.get("SHOP_OJS") == "1"

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def task_base() -> type[Task]:
    """The base class of the shop's tasks: ``OJSTask`` once the switch is made."""
    if OJS_ENABLED:
        from ojs_celery import OJSTask

        return OJSTask
    return Task
