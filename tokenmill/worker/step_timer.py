"""Where a step's time goes, measured on the code path the step really takes.

`phase(StepPhase.X)` labels a part of a step for torch.profiler
("tokenmill::x") and adds its wall time to `seconds[X]`. Timed here rather
than read from the profiler, because under the profiler the model takes its
per-op path, not the one a timed run takes. On CUDA the host does not wait for
the GPU until the sampled tokens come back, so the GPU's time shows up in
SAMPLE.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch.autograd import _profiler_enabled
from torch.profiler import record_function


class StepPhase(enum.StrEnum):
    """The parts of one engine step, in order. A StrEnum, so reports and JSON keep
    the plain names ("schedule", ...)."""

    SCHEDULE = "schedule"
    PREPARE_INPUTS = "prepare_inputs"
    FORWARD = "forward"
    HEAD = "head"
    SAMPLE = "sample"
    UPDATE = "update"
    DETOKENIZE = "detokenize"


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[StepPhase, float] = {}

    @contextmanager
    def phase(self, phase: StepPhase, label: bool = True) -> Iterator[None]:
        """`label=False` where the code inside labels itself (the model's head).
        Labelled only while a profiler runs: a record_function costs ~10 us
        even with none (six a step; docs/perf-notes.md)."""
        start = time.perf_counter()
        try:
            if label and _profiler_enabled():
                with record_function("tokenmill::" + phase.value):
                    yield
            else:
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def take(self) -> dict[StepPhase, float]:
        """The seconds so far, and start again from zero."""
        seconds, self.seconds = self.seconds, {}
        return seconds
