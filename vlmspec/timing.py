"""Seconds per stage of a generation (prefills, drafting, verification), with no host sync in the decoding loop.

On a CPU a stage's seconds are :func:`time.perf_counter` differences. On a GPU the host runs ahead of the device
(kernels are queued and return at once), so host timestamps would measure launches, not work, and a stage's wait
would land in whichever later stage first needs a result on the host. There each stage boundary records a CUDA
event in the stream instead, and the elapsed times between them are read once, when the generation ends (its
tokens are on the host by then anyway): the stages then split the device's timeline, idle gaps waiting for the
host included, as a profiler's would.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch


class StageClock:
    """Laps of a generation: :meth:`lap` closes the running stage under a name, :meth:`read` sums them by name.

    Args:
        device: where the models run; CUDA devices are timed with events, everything else with the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self._events = device.type == "cuda"
        self._laps: list[tuple[str, Any, Any]] = []
        self._last = self._mark()

    def _mark(self) -> Any:
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def lap(self, stage: str) -> None:
        """End the running stage, counting it as ``stage``, and start the next one."""
        now = self._mark()
        self._laps.append((stage, self._last, now))
        self._last = now

    def read(self) -> dict[str, float]:
        """Seconds per stage name (0 for a name never lapped); waits for the device's last lap on a GPU."""
        if self._events:
            self._last.synchronize()
        seconds: dict[str, float] = defaultdict(float)
        for stage, start, end in self._laps:
            seconds[stage] += start.elapsed_time(end) / 1000 if self._events else end - start
        return seconds
