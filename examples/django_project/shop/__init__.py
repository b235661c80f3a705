"""The example shop project: its Celery app is imported here, as Celery's Django guide does."""

from .celery import app as celery_app

__all__ = ["celery_app"]
