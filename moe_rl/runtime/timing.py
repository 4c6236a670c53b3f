"""Wall-clock time per phase of a training step.

    timer = StepTimer()
    with timer.phase("sample"):
        ...
    timer.seconds  # {"sample": 0.31, ...}; a phase entered twice is summed

On CUDA a phase ends with `torch.cuda.synchronize()`: kernels are asynchronous, so without
it a phase would be charged for the previous phase's queued work.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class StepTimer:
    """Seconds spent in each named phase of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
