"""Per-step time breakdown (``time/*`` metrics) without a host-device sync per section.

``StepTimer.section(name)`` adds the wall time of a block to ``name``. On CPU it reads
``time.perf_counter``; on CUDA it records a pair of CUDA events around the block (no
synchronisation) and ``seconds()`` waits for the last event once, at the end of the step, where
the trainer synchronises anyway to log its metrics. Sections may repeat (summed) but not nest.

What it is not: a profiler. For where the time goes inside a section use ``py-spy`` or
``torch.profiler`` (docs/results/performance/speed-paths.md, "Profiles").
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

PARTS = ("generate", "reward", "old_logprobs", "forward_backward", "optimizer", "logging", "other")
"""The parts of an RL step reported as ``time/<part>_s``; ``other`` is the step minus the rest."""


class StepTimer:
    """Seconds per named section of one step, CUDA-event based on a GPU."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = torch.device(device or "cpu").type == "cuda" and torch.cuda.is_available()
        self._host: dict[str, float] = defaultdict(float)
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    @contextmanager
    def section(self, name: str, host: bool = False) -> Iterator[None]:
        """Time the block; ``host=True``: host work only (rewards, logging), always perf_counter."""
        if self.cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host[name] += time.perf_counter() - t0

    def seconds(self) -> dict[str, float]:
        """Total seconds per section (one synchronisation on CUDA, here)."""
        out = dict(self._host)
        if self._events:
            last = [pair[1] for pairs in self._events.values() for pair in pairs]
            last[-1].synchronize()
            for name, pairs in self._events.items():
                out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs) / 1000
        return out


def breakdown(parts: dict[str, float], step_s: float) -> dict[str, float]:
    """``time/<part>_s`` for every part of PARTS, ``other`` being what the named parts leave of the step."""
    named = {p: parts.get(p, 0.0) for p in PARTS if p != "other"}
    return {**{f"time/{p}_s": v for p, v in named.items()},
            "time/other_s": max(step_s - sum(named.values()), 0.0), "time/step_s": step_s}


def iteration_times(row: dict, elapsed_s: float, logging_s: float) -> None:
    """Make a step's time/step_s the whole loop iteration (``elapsed_s``: guard hooks, the step,
    and writing the previous row, ``logging_s``), the parts' shares beside it; a row without an
    update is left alone. Evaluation and checkpoints (periodic) are left out."""
    if "time/step_s" not in row:                   # no update this step
        return
    parts = {p: row.get(f"time/{p}_s", 0.0) for p in PARTS if p != "other"}
    parts["logging"] = logging_s
    row.update(breakdown(parts, elapsed_s + logging_s))
