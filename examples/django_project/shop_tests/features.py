"""Which tests wait for ojs_celery features that are being built (issue 11): with ``SHOP_OJS=1``
they are expected to fail until then (``xfail``, not strict); the plain run must pass them."""

import os

import pytest

OJS_ENABLED = os.environ.get("SHOP_OJS") == "1"


def missing(feature: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(OJS_ENABLED, strict=False,
                             reason=f"ojs_celery does not yet support {feature} (issue 11)")


EAGER = missing("task_always_eager for OJS tasks (item 4)")
ROUTES = missing("task_routes for Celery callers (item 2)")
UNDERSCORE_QUEUES = missing("queue names with underscores (item 2)")
MAX_RETRIES = missing("max_retries bounding Celery callers' retries (item 1)")
TIME_LIMITS = missing("task time limits as timeout and grace period (item 1)")
EXPIRES = missing("expires as the job's expires_at (item 1)")
CANVAS = missing("chords of OJS tasks (item 3)")
RETRIES_COUNT = missing("self.request.retries counting a Celery caller's retries (item 1)")
