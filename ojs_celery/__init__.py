"""ojs_celery: Open Job Spec semantics for Celery.

``install(app)`` wires everything; tasks opt in with ``base=OJSTask``; producers hand over OJS
envelopes with ``enqueue``. See the README for the settings and the guarantees.
"""

from __future__ import annotations

from .api import JobNotFound, cancel, enqueue, enqueue_batch, get_job, purge
from .context import JobContext, NoCurrentJob, current_job
from .envelope import DuplicateJob, InvalidJob, Job, RetryPolicy, parse_envelope
from .install import install
from .producer import BrokerUnavailable
from .runtime import NotInstalled
from .store import StoreError, StoreUncertain
from .task import JobError, OJSTask

__version__ = "0.1.0"

__all__ = [
    "BrokerUnavailable",
    "DuplicateJob",
    "InvalidJob",
    "Job",
    "JobContext",
    "JobError",
    "JobNotFound",
    "NoCurrentJob",
    "NotInstalled",
    "OJSTask",
    "RetryPolicy",
    "StoreError",
    "StoreUncertain",
    "cancel",
    "current_job",
    "enqueue",
    "enqueue_batch",
    "get_job",
    "install",
    "parse_envelope",
    "purge",
]
