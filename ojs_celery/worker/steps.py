"""The OJS worker bootsteps, in the order they start (``install`` adds them to the consumer).

Registration → directives → beat → pool children → signals and drain; each step declares what it
requires, and they share one :class:`~.node.WorkerNode` (``consumer.ojs``).
"""

from __future__ import annotations

from .beat import BeatStep
from .children import PoolChildrenStep
from .directives import DirectivesStep
from .registration import RegistrationStep
from .shutdown import DrainStep

STEPS = (RegistrationStep, DirectivesStep, BeatStep, PoolChildrenStep, DrainStep)
