"""Django integration: ``INSTALLED_APPS += ["ojs_celery.contrib.django"]``.

The app's :class:`~ojs_celery.contrib.django.apps.OJSConfig` calls ``install()`` on the project's
Celery app when Django is ready, validates ``CELERY_OJS`` then, and adds ``manage.py ojs``.
"""
