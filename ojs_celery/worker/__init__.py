"""The OJS worker protocol on Celery workers (bootsteps added by ``install``)."""
