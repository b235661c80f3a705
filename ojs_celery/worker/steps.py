"""The OJS worker bootsteps, in the order they start (``install`` adds them to the consumer).

Registration → directives → beat → pool children → signals and drain; each step declares what it
requires, and they share one :class:`~.node.WorkerNode` (``consumer.ojs``). Two steps stand
apart: the broker folder's (``ojsfs://`` only) ends the worker whose broker folder is removed,
and the reconnect step hands back what a failed broker connection left in kombu's record.
"""

from __future__ import annotations

from .beat import BeatStep
from .broker_folder import BrokerFolderStep
from .children import PoolChildrenStep
from .directives import DirectivesStep
from .reconnect import ReconnectStep
from .registration import RegistrationStep
from .shutdown import DrainStep

STEPS = (RegistrationStep, DirectivesStep, BeatStep, PoolChildrenStep, DrainStep,
         BrokerFolderStep, ReconnectStep)
