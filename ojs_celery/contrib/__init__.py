"""Integrations with frameworks (``ojs_celery.contrib.django``)."""
