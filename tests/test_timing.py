"""Stage timers: host clock on a CPU, device events read once at the end on a GPU (no sync in the loop)."""

from __future__ import annotations

import time

import torch

from vlmspec.timing import StageClock


def test_laps_add_up_by_stage_on_the_host_clock():
    clock = StageClock(torch.device("cpu"))
    for _ in range(2):
        time.sleep(0.01)
        clock.lap("draft")
        clock.lap("verify")
    seconds = clock.read()
    assert seconds["draft"] >= 0.02 and 0 <= seconds["verify"] < seconds["draft"]
    assert seconds["prefill"] == 0  # a stage never lapped


class FakeEvent:
    """torch.cuda.Event's timing interface over the host clock, counting the syncs it is asked for."""

    syncs = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.syncs += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000  # milliseconds, as CUDA events give them


def test_on_a_gpu_laps_are_events_read_with_one_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = StageClock(torch.device("cuda"))
    for _ in range(3):
        time.sleep(0.01)
        clock.lap("draft")
        clock.lap("verify")
    assert FakeEvent.syncs == 0  # nothing waits for the device while decoding
    seconds = clock.read()
    assert FakeEvent.syncs == 1
    assert seconds["draft"] >= 0.03 and 0 <= seconds["verify"] < seconds["draft"]
