"""Where the RL loop gets the batch of each step: in the loop (synchronous) or ahead of it.

``rollout.async: false`` (``SyncSource``): the batch of step k is ``collector.collect(k)``, as it
always was. ``rollout.async: true`` (``AsyncSource``): a worker (gspo.training.async_rollout)
with its own copy of the policy makes batches k+1.. while the trainer trains on batch k. A
source does the version arithmetic and nothing else: which weights sample which batch, which it
keeps for checkpoints, and the ``version`` it stamps on each batch (``Trajectories.version``),
from which the step picks π_old's strategy (gspo.training.old_policy); the ratio and the
correction are not its business.

It is handed the ``Collector`` (gspo.rollout.collect), the policy's ``LogprobPasses`` and whether
the update skips rows without signal, never the trainer. The hooks, all the loop knows of it::

    source = build_source(cfg, collector, passes, skip_rows=..., log=...)   # set-up
    source.load(folder)                      # restoring a checkpoint folder
    batch, rewards, metrics = source.collect(k)  # step k: what collector.collect(k) returns
    source.publish(k + 1)                    # after step k's update and the guard's verdict
    source.save(folder, done)                # inside a checkpoint of ``done`` steps
    with source.rng_lock: evaluate(...)      # anything else that draws from torch's global RNG
    source.settle()                          # block until the worker waits for new weights
    source.close()                           # at the end, however it ends: stop and join

**Staleness, fixed.** The batch of step k is always sampled by the weights of version
``max(0, k - s)`` (version j = the weights after j RL steps, s = ``rollout.max_staleness``): the
worker waits for that version, never takes a fresher one. So a run does not depend on timing
(same seed, same run, as the synchronous loop), a resume can regenerate the batches in flight
exactly, and no batch is ever more than s steps old: ``async/dropped_batches`` counts batches
discarded for staleness and is 0 by construction. With s = 0 the worker samples batch k after
step k-1, in lockstep: the synchronous run, op for op.

**Weight publication.** ``publish(version)`` hands a copy of the trainer's weights to the worker
through ``WeightPublisher.publish(weights, version)``: named tensors and a version, which a
thread (a dict), a process (a queue of safetensors bytes) or, beyond one machine, a process
group can carry alike.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors.torch import load_file, save_file

from gspo.errors import UserError
from gspo.models.presets import dropout_rates
from gspo.rollout.collect import Collector
from gspo.training.async_rollout import (DONE, WORKERS, Proximal, ProcessWorker, ThreadWorker,
                                         behaviour_version)
from gspo.training.passes import LogprobPasses


class WeightPublisher(Protocol):
    """Where published weights go (the worker: ``ThreadWorker`` | ``ProcessWorker``)."""

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The trainer's weights after ``version`` RL steps, by name."""


BEHAVIOUR_FILE = "behaviour-{version}.safetensors"
"""Checkpoint file of the weights of ``version`` that a batch still in flight was sampled by."""


def build_source(cfg, collector: Collector, passes: LogprobPasses, *, skip_rows: bool,
                 log=print):
    """The loop's batch source: ``AsyncSource`` under rollout.async, else ``SyncSource``.
    ``skip_rows``: the update leaves rows without signal out (their π_old is never read)."""
    if cfg.rollout.async_:
        return AsyncSource(cfg, collector, passes, skip_rows=skip_rows, log=log)
    return SyncSource(collector)


def staleness_hint(cfg) -> str | None:
    """One line for a run that clips against a stale behaviour policy (measured to train more
    slowly than the synchronous run, docs/results/performance/async.md); None when it does not apply."""
    if (not cfg.rollout.async_ or cfg.rollout.max_staleness == 0
            or cfg.rollout.async_ratio != "behaviour" or cfg.train.old_logprobs != "recompute"):
        return None
    return (f"rollout.async: {cfg.objective.name} clips its ratio against the policy that sampled "
            f"the batch, up to {cfg.rollout.max_staleness} step(s) old; on the default job at s=1 "
            "that trained gspo and grpo more slowly than the synchronous run and "
            "rollout.async_ratio=decoupled (the default, auto) did not (docs/results/performance/async.md)")


def snapshot(model: torch.nn.Module, device: str | None = None) -> dict[str, torch.Tensor]:
    """A copy of the weights (one tensor per name, no shared storage: safetensors can write it),
    on ``device`` (None: where they are)."""
    return {k: v.detach().to(device, copy=True) for k, v in model.state_dict().items()}


class SyncSource:
    """The batch of step k is made in the loop, by ``collector.collect(k)``."""

    def __init__(self, collector: Collector):
        self.collector = collector
        self.rng_lock = contextlib.nullcontext()

    def collect(self, step: int):
        """The batch of ``step``, sampled by the current weights (version ``step``)."""
        return self.collector.collect(step, version=step)

    def proximal(self, step: int):
        raise RuntimeError("a synchronous batch is never stale: π_old is the trainer's own")

    def seed(self, step: int, rnd: int = 0) -> int:
        return self.collector.seed(step, rnd)

    def publish(self, version: int) -> None:
        pass

    def save(self, folder: Path, done: int) -> None:
        pass

    def load(self, folder: Path) -> None:
        pass

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncSource:
    """Batches made ahead by a worker with its own copy of the policy (module docstring)."""

    def __init__(self, cfg, collector: Collector, passes: LogprobPasses, *, skip_rows: bool,
                 log=print):
        rates = dropout_rates(collector.model)
        if rates:
            name, p = next(iter(rates.items()))
            raise UserError(f"rollout.async=true cannot train a policy with dropout ({name}={p}): "
                            "its masks come from torch's global RNG, which no batch seeds under "
                            "rollout.async (and a thread worker samples from), so runs would not "
                            "repeat; set it to 0 or rollout.async=false")
        self.cfg, self.collector, self.passes = cfg, collector, passes
        self.skip_rows, self.log = skip_rows, log
        if (hint := staleness_hint(cfg)) is not None:
            log(hint)
        self.s = cfg.rollout.max_staleness
        self.worker: ThreadWorker | ProcessWorker = WORKERS[cfg.rollout.async_worker]()
        self.rng_lock = self.worker.rng_lock
        self._weights: dict[int, dict[str, torch.Tensor]] = {}   # version -> weights (checkpoints)
        self._received: list = []              # items the worker made that collect has not taken
        self._done = False                     # the worker has said DONE (or failed)
        self._started = False
        self.dropped = 0

    def seed(self, step: int, rnd: int = 0) -> int:
        return self.collector.seed(step, rnd)

    def collect(self, step: int):
        """The batch of ``step`` (blocks until the worker has it); the trainer's data cursor is
        moved past it, so a checkpoint after this step resumes at the next batch."""
        if not self._started:
            self._start(step)
        t0 = time.perf_counter()
        item = self._next(lambda x: not isinstance(x, Proximal), f"the batch of step {step}")
        waited = time.perf_counter() - t0
        made_for, version, (batch, rewards, metrics), cursor, worker = item
        assert made_for == step, f"async rollouts: batch of step {made_for} offered at step {step}"
        self.collector.cursor.load(cursor)
        metrics = {**metrics,
                   "async/worker_generate_s": metrics.pop("time/generate_s", 0.0),
                   "async/worker_reward_s": metrics.pop("time/reward_s", 0.0),
                   **({"async/worker_weight_sync_s": metrics.pop("time/weight_sync_s")}
                      if "time/weight_sync_s" in metrics else {}),
                   **worker,
                   "async/staleness": float(step - version), "async/wait_s/trainer": waited,
                   "async/dropped_batches": float(self.dropped),
                   # the step's own breakdown: generation is what the trainer waited for
                   "time/generate_s": waited, "time/reward_s": 0.0}
        return batch, rewards, metrics

    def proximal(self, step: int) -> Callable[[], Proximal]:
        """For the stale batch of ``step`` just collected, under the decoupled ratio: a call that
        returns the worker's ``Proximal`` of it (waiting if need be; its wait is in
        ``seconds``), made beside the update's first minibatch."""
        return lambda: self._take_proximal(step)

    def _take_proximal(self, step: int) -> Proximal:
        t0 = time.perf_counter()
        item = self._next(lambda x: isinstance(x, Proximal) and x.step == step,
                          f"the proximal log-probs of step {step}")
        item.seconds["async/wait_s/proximal"] = time.perf_counter() - t0
        return item

    def _next(self, wanted: Callable, what: str):
        """The first item the worker made that is ``wanted`` (those before it are kept, in order,
        for later calls); raises the worker's error, or a RuntimeError if it stopped first."""
        for i, item in enumerate(self._received):
            if isinstance(item, BaseException) or item == DONE or wanted(item):
                self._received.pop(i)
                break
        else:
            while True:
                item = self.worker.receive()
                if isinstance(item, BaseException) or item == DONE or wanted(item):
                    break
                self._received.append(item)
        if isinstance(item, BaseException):
            raise item
        if item == DONE:
            raise RuntimeError(f"async rollouts: the worker stopped before {what}")
        return item

    def publish(self, version: int) -> None:
        """The trainer's weights are now those of ``version``: a copy to the worker. Versions
        older than ``version - s`` are dropped (no batch in flight can need them)."""
        weights = snapshot(self.collector.model, self.worker.weights_device)
        self._weights[version] = weights
        for old in [v for v in self._weights if v < version - self.s]:
            del self._weights[old]
        if self._started:
            self.worker.publish(weights, version)

    def save(self, folder: Path, done: int) -> None:
        """Write the weights that sample the batches in flight after ``done`` steps (versions
        done-s .. done-1; the checkpoint's own weights are version ``done``)."""
        for v in range(behaviour_version(done, self.s), done):
            if v in self._weights:
                save_file(self._weights[v], str(Path(folder) / BEHAVIOUR_FILE.format(version=v)))

    def load(self, folder: Path) -> None:
        """Read the behaviour weights a checkpoint holds (a resume regenerates its batches)."""
        pattern = re.compile(re.escape(BEHAVIOUR_FILE).replace(r"\{version\}", r"(\d+)") + "$")
        device = self.worker.weights_device or str(next(self.collector.model.parameters()).device)
        self._weights = {}
        for path in Path(folder).iterdir():
            match = pattern.match(path.name)
            if match:
                self._weights[int(match.group(1))] = load_file(str(path), device=device)

    def settle(self) -> None:
        """Block until the worker has made every batch it can with the weights published so far
        (the next needs weights not yet published, or it is done): a benchmark that times a
        stretch of steps then leaves nothing running after it (the time is the stretch's)."""
        if not self._started or self._done:
            return
        last = min(self.cfg.train.steps - 1, max(self._weights) + self.s)  # v(last) published
        while not self._done and max(self.ready_steps, default=-1) < last:
            item = self.worker.receive()
            self._done = item == DONE or isinstance(item, BaseException)
            self._received.append(item)

    def close(self) -> None:
        """Stop the worker (after the batch it is making, if any) and wait for it to end."""
        if self._started:
            self.worker.stop()
            self._started = False

    @property
    def ready_steps(self) -> list[int]:
        """Steps whose batches the worker has handed over and ``collect`` has not taken yet."""
        return [self._made(item) for item in self._received if self._made(item) >= 0]

    @staticmethod
    def _made(item) -> int:
        return item[0] if isinstance(item, tuple) else -1

    def _start(self, step: int) -> None:
        """The worker begins at ``step``, with the trainer's current weights as that version;
        versions before it that the checkpoint did not hold fall back to them (logged)."""
        self._weights[step] = snapshot(self.collector.model, self.worker.weights_device)
        missing = [v for v in range(behaviour_version(step, self.s), step) if v not in self._weights]
        for v in missing:
            self._weights[v] = self._weights[step]
        if missing:
            self.log(f"rollout.async: no weights of versions {missing} in the checkpoint; the "
                     f"batches in flight are sampled by the weights of step {step}")
        held = {v: w for v, w in sorted(self._weights.items())
                if v >= behaviour_version(step, self.s)}
        self.worker.start(self.cfg, self.collector, self.passes, step, skip_rows=self.skip_rows,
                          weights=held)
        self._started, self._done, self._received = True, False, []


