"""Where a step's time goes, measured on the code path the step really takes.

`phase(name)` labels a part of a step for torch.profiler ("tokenmill::NAME")
and adds its wall time to `seconds[name]`. The profiler alone could not say
this: under it the model runs its per-op Python path (the C++ layer stack
stays off so attention and linear layers get rows of their own), which is not
the path a timed run takes. Two perf_counter calls a part, seven parts a step:
a few microseconds. On CUDA the host does not wait for the GPU until the
sampled tokens come back, so there the GPU's time shows up in "sample".
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch.profiler import record_function


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, label: bool = True) -> Iterator[None]:
        """`label=False` where the code inside labels itself (the model's head)."""
        start = time.perf_counter()
        try:
            if label:
                with record_function("tokenmill::" + name):
                    yield
            else:
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The seconds so far, and start again from zero."""
        seconds, self.seconds = self.seconds, {}
        return seconds
