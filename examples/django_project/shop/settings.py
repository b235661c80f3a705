"""Settings of the example shop. Paths and servers come from the environment (see run_tests.sh)."""

import os
import pathlib

from kombu import Queue

BASE_DIR = pathlib.Path(__file__).resolve().parent.parent
RUN_DIR = pathlib.Path(os.environ.get("SHOP_RUN_DIR", BASE_DIR))
OJS_ENABLED = os.environ.get("SHOP_OJS") == "1"

SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "shop.urls"
MIDDLEWARE: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_celery_beat",
    "orders",
]
if OJS_ENABLED:
    INSTALLED_APPS.append("ojs_celery.contrib.django")

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(RUN_DIR / "shop.sqlite3"),
        "OPTIONS": {"timeout": 30},
        "TEST": {"NAME": str(RUN_DIR / "shop-test.sqlite3")},
    }
}

REDIS_URL = os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SHOP_KEY_PREFIX", "shop:")

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": KEY_PREFIX}
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": KEY_PREFIX}
CELERY_RESULT_EXPIRES = 600
CELERY_TASK_SERIALIZER = "json"
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_QUEUES = [Queue("default"), Queue("emails_high"), Queue("reports_slow")]
CELERY_TASK_CREATE_MISSING_QUEUES = False
CELERY_TASK_ROUTES = {
    "orders.tasks.send_receipt": {"queue": "emails_high"},
    "orders.tasks.build_*": {"queue": "reports_slow"},
}
CELERY_TASK_SOFT_TIME_LIMIT = 60
CELERY_TASK_TIME_LIMIT = 90
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_BEAT_SCHEDULE = {
    "nightly-sales-report": {"task": "orders.tasks.build_sales_report", "schedule": 3600.0},
}
CELERY_OJS = {
    "store_url": f"sqlite:///{RUN_DIR / 'ojs.sqlite3'}",
    "sweep_interval": 1,
}
