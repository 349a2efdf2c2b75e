"""Where the RL loop gets the batch of each step: in the loop (synchronous) or ahead of it.

``rollout.async: false`` (``SyncSource``): the batch of step k is ``collector.collect(k)``, as it
always was. ``rollout.async: true`` (``AsyncSource``): a worker thread with its own copy of the
policy generates, scores and (when the batch is stale) takes the old log-probs of batches k+1..
while the trainer trains on batch k.

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
worker waits for that version, never takes a fresher one. So a run does not depend on thread
timing (same seed, same run, as the synchronous loop), a resume can regenerate the batches in
flight exactly, and no batch is ever more than s steps old: ``async/dropped_batches`` counts
batches discarded for staleness and is 0 by construction. With s = 0 the worker samples batch k
after step k-1, in lockstep: the synchronous run, op for op.

**π_old is the behaviour policy.** When k - v > 0 the worker computes log π_v of the rows that
can carry a gradient (``behaviour_rows``) under the weights it sampled with and hands them in
``batch.extras["behaviour_logp"]``; the trainer takes them as π_old (and does not reuse its first
minibatch's forward as π_old, which only holds on-policy). With ``train.old_logprobs: rollout``
the generator's own log-probs are already π_v's. When k = v the trainer recomputes π_old itself,
exactly as in the synchronous loop (docs/math.md, "Asynchronous rollouts"). With
``rollout.async_ratio: decoupled`` the worker takes none: the trainer recomputes π_old under its
own weights (the proximal policy) and ``train.rollout_correction`` weighs it against the sampler's
log-probs, which are π_v's.

**torch's global RNG is the worker's.** transformers ``generate`` samples from torch's global CPU
generator (seeded per batch), which all threads share. So while the worker samples, the trainer
must neither draw from it nor set it: the RL update draws nothing (no dropout: a policy with
dropout is refused; activation checkpointing does not save and restore the RNG state,
gspo.core.logprobs and gspo.models.presets), and anything else that does (evaluation) holds
``rng_lock``. A checkpoint recompute that restored the RNG state mid-step rewound the worker's
stream: the same seed then sampled other tokens, one run in a few (issue 18's resume race).

Threads: ``torch.set_num_threads`` sets the calling thread's OpenMP pool size, so the worker sets
its own (``run.threads``) when it starts; with 1 each side runs its ops on its own core. Neither
side polls: the trainer blocks on a queue, the worker on a condition variable.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import re
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gspo.core import objectives
from gspo.errors import UserError
from gspo.models.presets import dropout_rates
from gspo.rollout.collect import Collector
from gspo.training.passes import LogprobPasses

BEHAVIOUR_FILE = "behaviour-{version}.safetensors"
"""Checkpoint file of the weights of ``version`` that a batch still in flight was sampled by."""


def build_source(cfg, collector: Collector, passes: LogprobPasses, *, skip_rows: bool,
                 log=print):
    """The loop's batch source: ``AsyncSource`` under rollout.async, else ``SyncSource``.
    ``skip_rows``: the update leaves rows without signal out (their π_old is never read)."""
    if cfg.rollout.async_:
        return AsyncSource(cfg, collector, passes, skip_rows=skip_rows, log=log)
    return SyncSource(collector)


def behaviour_version(step: int, max_staleness: int) -> int:
    """The weights version that samples the batch of ``step``: ``max(0, step - s)``."""
    return max(0, step - max_staleness)


def behaviour_rows(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """CPU indices of the rows of every group whose rewards are not all equal (NaN counts as
    unequal): a superset of the rows a group-relative advantage can make non-zero. rewards [N]."""
    std = rewards.detach().cpu().view(-1, group_size).std(-1)                # [P]
    return (~(std == 0)).repeat_interleave(group_size).nonzero().squeeze(-1)  # [n]


def staleness_hint(cfg) -> str | None:
    """One line for a run whose sequence-level ratio is clipped against a stale behaviour policy
    (measured to cost held-out accuracy, docs/performance.md); None when it does not apply."""
    name = cfg.objective.name
    if (not cfg.rollout.async_ or cfg.rollout.max_staleness == 0
            or cfg.rollout.async_ratio != "behaviour" or name not in objectives.available()
            or not objectives.spec(name).sequence_level):
        return None
    return (f"rollout.async: {name} clips its sequence ratio against the policy that sampled the "
            f"batch, up to {cfg.rollout.max_staleness} step(s) old; for gspo on the default job at s=1 "
            "that clipped 0.42 of the tokens instead of 0.33 and lost 0.08 held-out accuracy, and "
            "rollout.async_ratio=decoupled train.rollout_correction.mode=seq_tis did not "
            "(docs/performance.md)")


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights (one tensor per name, no shared storage: safetensors can write it)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class SyncSource:
    """The batch of step k is made in the loop, by ``collector.collect(k)``."""

    def __init__(self, collector: Collector):
        self.collector = collector
        self.rng_lock = contextlib.nullcontext()

    def collect(self, step: int):
        return self.collector.collect(step)

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
    """Batches made ahead by a worker thread with its own copy of the policy (module docstring)."""

    def __init__(self, cfg, collector: Collector, passes: LogprobPasses, *, skip_rows: bool,
                 log=print):
        rates = dropout_rates(collector.model)
        if rates:
            name, p = next(iter(rates.items()))
            raise UserError(f"rollout.async=true cannot train a policy with dropout ({name}={p}): "
                            "its masks would be drawn from the torch RNG the rollout worker samples "
                            "from; set it to 0 or rollout.async=false")
        self.cfg, self.collector, self.passes = cfg, collector, passes
        self.skip_rows, self.log = skip_rows, log
        if (hint := staleness_hint(cfg)) is not None:
            log(hint)
        self.s = cfg.rollout.max_staleness
        self.rng_lock = threading.Lock()       # torch's global RNG: the worker's sampling vs eval
        self._cond = threading.Condition()     # guards _weights, _stopping, _awaiting, _done
        self._weights: dict[int, dict[str, torch.Tensor]] = {}   # version -> weights
        self._stopping = False
        self._awaiting: int | None = None      # the version the worker is blocked on
        self._done = False                     # the worker has returned
        self._ready: queue.Queue = queue.Queue()   # (step, version, collected, seconds) | exception
        self._thread: threading.Thread | None = None
        self.dropped = 0

    # ------------------------------------------------------------------ the trainer's side
    def seed(self, step: int, rnd: int = 0) -> int:
        return self.collector.seed(step, rnd)

    def collect(self, step: int):
        """The batch of ``step`` (blocks until the worker has it); the trainer's data cursor is
        moved past it, so a checkpoint after this step resumes at the next batch."""
        if self._thread is None:
            self._start(step)
        t0 = time.perf_counter()
        item = self._ready.get()
        waited = time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        made_for, version, (batch, rewards, metrics), cursor, worker = item
        assert made_for == step, f"async rollouts: batch of step {made_for} offered at step {step}"
        self.collector.cursor.load(cursor)
        metrics = {**metrics,
                   "async/worker_generate_s": metrics.pop("time/generate_s", 0.0),
                   "async/worker_reward_s": metrics.pop("time/reward_s", 0.0),
                   **worker,
                   "async/staleness": float(step - version), "async/wait_s/trainer": waited,
                   "async/dropped_batches": float(self.dropped),
                   # the step's own breakdown: generation is what the trainer waited for
                   "time/generate_s": waited, "time/reward_s": 0.0}
        return batch, rewards, metrics

    def publish(self, version: int) -> None:
        """The trainer's weights are now those of ``version``: copy them for the worker. Versions
        older than ``version - s`` are dropped (no batch in flight can need them)."""
        weights = snapshot(self.collector.model)
        with self._cond:
            self._weights[version] = weights
            for old in [v for v in self._weights if v < version - self.s]:
                del self._weights[old]
            self._cond.notify_all()

    def save(self, folder: Path, done: int) -> None:
        """Write the weights that sample the batches in flight after ``done`` steps (versions
        done-s .. done-1; the checkpoint's own weights are version ``done``)."""
        with self._cond:
            held = dict(self._weights)
        for v in range(behaviour_version(done, self.s), done):
            if v in held:
                save_file(held[v], str(Path(folder) / BEHAVIOUR_FILE.format(version=v)))

    def load(self, folder: Path) -> None:
        """Read the behaviour weights a checkpoint holds (a resume regenerates its batches)."""
        pattern = re.compile(re.escape(BEHAVIOUR_FILE).replace(r"\{version\}", r"(\d+)") + "$")
        device = str(next(self.collector.model.parameters()).device)
        with self._cond:
            self._weights = {}
            for path in Path(folder).iterdir():
                match = pattern.match(path.name)
                if match:
                    self._weights[int(match.group(1))] = load_file(str(path), device=device)

    def settle(self) -> None:
        """Block until the worker has made every batch it can with the weights published so far
        (it waits for weights not yet published, or is done): a benchmark that times a stretch of
        steps then leaves nothing running after it (the time is the stretch's, counted there)."""
        with self._cond:
            while self._thread is not None and not self._done and (
                    self._awaiting is None or self._awaiting in self._weights):
                self._cond.wait()

    def close(self) -> None:
        """Stop the worker (after the batch it is making, if any) and join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ the worker
    def _start(self, step: int) -> None:
        """The worker begins at ``step``, with the trainer's current weights as that version;
        versions before it that the checkpoint did not hold fall back to them (logged)."""
        with self._cond:
            self._weights[step] = snapshot(self.collector.model)
            missing = [v for v in range(behaviour_version(step, self.s), step)
                       if v not in self._weights]
            for v in missing:
                self._weights[v] = self._weights[step]
        if missing:
            self.log(f"rollout.async: no weights of versions {missing} in the checkpoint; the "
                     f"batches in flight are sampled by the weights of step {step}")
        model = copy.deepcopy(self.collector.model).requires_grad_(False)
        # the worker shares config, task and rewards; owns its policy, data cursor, sampling engine
        worker = copy.copy(self.collector)
        worker.model, worker.cursor, worker.engine = model, copy.deepcopy(self.collector.cursor), None
        passes = copy.copy(self.passes)          # its log-prob passes run on its own policy
        passes.model = model
        self._thread = threading.Thread(target=self._serve, args=(worker, passes, step), daemon=True,
                                        name="gspo-rollout")
        self._thread.start()

    def _serve(self, worker: Collector, passes: LogprobPasses, step: int) -> None:
        if self.cfg.run.threads:
            torch.set_num_threads(self.cfg.run.threads)     # this thread's pool (module docstring)
        try:
            version = None
            for k in range(step, self.cfg.train.steps):
                t0 = time.perf_counter()
                weights, v = self._await(behaviour_version(k, self.s))
                waited = time.perf_counter() - t0
                if weights is None:                       # stopping
                    return
                if v != version:
                    worker.model.load_state_dict(weights)
                    version = v
                with self.rng_lock:
                    collected = worker.collect(k)
                t0 = time.perf_counter()
                if k > v:
                    self.behaviour_logp(passes, *collected[:2])
                seconds = {"async/worker_old_logprobs_s": time.perf_counter() - t0,
                           "async/wait_s/worker": waited}
                self._ready.put((k, v, collected, worker.cursor.state(), seconds))
        except BaseException as err:  # noqa: BLE001  the trainer raises it at its next batch
            self._ready.put(err)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _await(self, version: int):
        """(weights of ``version``, version) once published; (None, version) when stopping."""
        with self._cond:
            self._awaiting = version
            self._cond.notify_all()                       # (settle)
            while version not in self._weights and not self._stopping:
                self._cond.wait()
            self._awaiting = None
            return (None, version) if self._stopping else (self._weights[version], version)

    def behaviour_logp(self, passes: LogprobPasses, batch, rewards) -> None:
        """π_old of a stale batch under the weights that sampled it (the worker's ``passes``), for
        the rows that may carry a gradient (all rows when the trainer would forward every row, or
        when the generator's log-probs are kept: the mismatch metrics and correction read them all)."""
        if batch is None or self.cfg.train.old_logprobs == "rollout":  # rollout: π_v's already
            return
        if self.cfg.rollout.async_ratio == "decoupled":  # the sampler's log-probs (the correction
            return       # asks for them) are π_v's; the trainer recomputes π_old = π_prox itself
        every_row = not self.skip_rows or batch.rollout_logp is not None  # mismatch reads them all
        rows = None if every_row else behaviour_rows(rewards, self.cfg.rollout.group_size)
        batch.extras["behaviour_logp"] = passes.old_logprobs(batch, rows)            # [N, T]
