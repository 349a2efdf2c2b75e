"""The asynchronous rollout worker: batches k+1.. made ahead while the trainer trains on batch k.

Started by the batch source (gspo.training.batch_source.AsyncSource: the version arithmetic), a
worker with its own copy of the policy generates, scores and, for a stale batch, takes log-probs
of the batches to come. It is a child process (``rollout.async_worker: process``: ``ProcessWorker``)
or a thread (``thread``: ``ThreadWorker``); both run ``make_batches`` and take weights through
``publish(weights, version)``. It samples through its own engine, or a thread worker through the
trainer's when the engine is ``shared`` (vllm: one per process).

**π_old of a stale batch** (k - v > 0; docs/math.md, "Asynchronous rollouts"). When k = v the
trainer computes π_old itself, exactly as in the synchronous loop. Otherwise, by
``rollout.async_ratio`` (``auto``, the default, resolves to ``decoupled`` when a batch can be
stale and π_old is recomputed, gspo.config):

* ``behaviour``: π_old = π_v. The worker hands log π_v over in ``batch.behaviour_logp``:
  the sampler's own log-probs when the sampler is transformers on its float32 policy
  (``sampler_is_behaviour``), else a log-prob pass over the rows that can carry a gradient
  (``behaviour_rows``). The trainer does not reuse its first minibatch's forward as π_old (that
  only holds on-policy). With ``train.old_logprobs: rollout`` the generator's log-probs are π_v's.
* ``decoupled``: π_old = π_prox, the trainer's weights at the start of step k, and
  ``train.rollout_correction`` weighs it against the sampler's log-probs (π_v's). Minibatch 1's
  π_prox is its own forward; the later minibatches' rows (``proximal_rows``) the worker computes
  under version k as soon as it has it, which is when step k starts, and hands over as a
  ``Proximal`` (``make_batches`` keeps each stale batch until then, and runs s iterations past
  the last step for the last batches'). The trainer takes it before minibatch 2
  (``AsyncSource.proximal``; the ``proximal`` strategy of gspo.training.old_policy).

**The process worker** is started once, at the first batch, from a fork server that has already
imported this module (start-up in a fraction of a second after the first), and is handed a copy of
the collector's parts (its rewards are built again from the config: they may hold threads). Each
published version goes to it through a queue as safetensors bytes, each batch comes back through
another, pickled (its tensors as bytes). It has its own interpreter, so neither side waits for the
other's Python, and its own torch RNG, so nothing needs ``rng_lock``. It ignores SIGINT/SIGTERM
(the trainer saves and then stops it) and exits when the trainer's process is gone (a pipe only
the trainer writes to reaches its end: ``exit_with_trainer``).

**The thread worker shares torch's global RNG.** transformers ``generate`` samples from torch's
global CPU generator (seeded per batch), which all threads share. So while the worker samples, the
trainer must neither draw from it nor set it: the RL update draws nothing (no dropout: a policy
with dropout is refused; activation checkpointing does not save and restore the RNG state,
gspo.core.logprobs and gspo.models.presets), and anything else that does (evaluation) holds
``rng_lock``. A checkpoint recompute that restored the RNG state mid-step rewound the worker's
stream: the same seed then sampled other tokens, one run in a few (a resume race).

Threads: ``torch.set_num_threads`` sets the calling thread's OpenMP pool size (a process's, in
the child), so the worker sets its own (``run.threads``) when it starts; with 1 each side runs its
ops on its own core. Neither side polls: each blocks on a queue or a condition variable.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Callable

import torch
from safetensors.torch import load as safetensors_weights
from safetensors.torch import save as safetensors_bytes

from gspo.errors import UserError
from gspo.rewards.isolation import isolated_rewards
from gspo.rollout import engines
from gspo.core.plan import minibatch_seed, split_minibatches
from gspo.rollout.collect import Collector
from gspo.training.passes import LogprobPasses

DONE = "done"
"""What a worker puts on its queue last, however its loop ended."""


def behaviour_version(step: int, max_staleness: int) -> int:
    """The weights version that samples the batch of ``step``: ``max(0, step - s)``."""
    return max(0, step - max_staleness)


def behaviour_rows(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """CPU indices of the rows of every group whose rewards are not all equal (NaN counts as
    unequal): a superset of the rows a group-relative advantage can make non-zero. rewards [N]."""
    std = rewards.detach().cpu().view(-1, group_size).std(-1)                # [P]
    return (~(std == 0)).repeat_interleave(group_size).nonzero().squeeze(-1)  # [n]


# ---------------------------------------------------------------------------- the worker's loop
def make_batches(cfg, worker: Collector, passes: LogprobPasses, step: int, *, skip_rows: bool,
                 await_weights: Callable[[int], dict | None], put: Callable, rng_lock) -> None:
    """The worker's loop, either kind: for k = step.., wait for the weights of version
    max(0, k - s) (``await_weights``; None: stop), load them, collect batch k, take its behaviour
    log-probs when stale, and ``put`` (k, v, collected, the data cursor after it, seconds)."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)     # this thread's pool (module docstring)
    version = None
    worker.keep_logprobs = sampler_is_behaviour(cfg, worker, passes)
    decoupled = proximal_from_worker(cfg)
    due: dict[int, tuple] = {}     # step -> (batch, rewards): stale batches whose π_prox is owed
    s = cfg.rollout.max_staleness
    for k in range(step, cfg.train.steps + (s if decoupled else 0)):
        v = behaviour_version(k, s)
        t0 = time.perf_counter()
        weights = await_weights(v)
        waited = time.perf_counter() - t0
        if weights is None:                        # stopping
            return
        if v != version:
            worker.model.load_state_dict(weights)
            version = v
        if v in due:     # the weights of version v are π_prox of the batch of step v: the trainer
            put(proximal_logp(cfg, passes, v, *due.pop(v), skip_rows=skip_rows))  # starts it now
        if k >= cfg.train.steps:                   # (the last s steps' π_prox only)
            continue
        with rng_lock:
            collected = worker.collect(k, version=v)
        t0 = time.perf_counter()
        if k > v:
            behaviour_logp(cfg, skip_rows, passes, *collected[:2],
                           from_sampler=worker.keep_logprobs)
        elif worker.keep_logprobs and collected[0] is not None:
            collected[0].rollout_logp = None        # on-policy: the synchronous path, unchanged
        seconds = {"async/worker_old_logprobs_s": time.perf_counter() - t0,
                   "async/wait_s/worker": waited}
        if decoupled and k > v and collected[0] is not None:
            due[k] = collected[:2]
        put((k, v, collected, worker.cursor.state(), seconds))


@dataclasses.dataclass
class Proximal:
    """What the worker hands over for a stale batch under the decoupled ratio: log π_prox of
    ``rows`` under the weights of version ``step`` (the trainer's at the start of that step)."""
    step: int
    rows: torch.Tensor          # [n] CPU, rows of the rollout batch
    logp: torch.Tensor          # [n, T]
    seconds: dict               # async/worker_proximal_s (its pass), then async/wait_s/proximal


def proximal_from_worker(cfg) -> bool:
    """rollout.async_ratio=decoupled with a recomputed π_old: the worker computes π_prox of each
    stale batch's later minibatches while the trainer runs the first (docs/results/performance/async.md)."""
    return cfg.rollout.async_ratio == "decoupled" and cfg.train.old_logprobs == "recompute"


def proximal_rows(cfg, rewards: torch.Tensor, step: int, *, skip_rows: bool) -> torch.Tensor:
    """CPU rows whose π_prox the worker computes for the batch of ``step``: those that may carry
    a gradient (``behaviour_rows``; all when no row is skipped) outside the first minibatch of
    that step's split (whose π_prox is the trainer's own first forward, before any update)."""
    n = len(rewards)
    gen = torch.Generator().manual_seed(minibatch_seed(cfg.seed, step))
    first = split_minibatches(n, cfg.train.minibatches, gen, cfg.minibatch_unit)[0]
    rows = behaviour_rows(rewards, cfg.rollout.group_size) if skip_rows else torch.arange(n)
    return rows[~torch.isin(rows, first)]


def proximal_logp(cfg, passes: LogprobPasses, step: int, batch, rewards, *,
                  skip_rows: bool) -> Proximal:
    """``Proximal`` of the batch of ``step``, under the weights ``passes`` holds now."""
    t0 = time.perf_counter()
    rows = proximal_rows(cfg, rewards, step, skip_rows=skip_rows)
    logp = passes.old_logprobs(batch, rows)[rows.to(batch.input_ids.device)]        # [n, T]
    return Proximal(step, rows, logp, {"async/worker_proximal_s": time.perf_counter() - t0})


def behaviour_logp(cfg, skip_rows: bool, passes: LogprobPasses, batch, rewards, *,
                   from_sampler: bool = False) -> None:
    """π_old of a stale batch under the weights that sampled it (the worker's ``passes``), for
    the rows that may carry a gradient (all rows when the trainer would forward every row, or
    when the generator's log-probs are kept: the mismatch metrics and correction read them all).
    ``from_sampler``: the sampler's own log-probs are taken instead (``sampler_is_behaviour``),
    and the batch carries none (it is not a mismatched sampler's)."""
    if batch is None or cfg.train.old_logprobs == "rollout":   # rollout: π_v's already
        return
    if cfg.rollout.async_ratio == "decoupled":  # the sampler's log-probs (the correction asks
        return       # for them) are π_v's; the trainer recomputes π_old = π_prox itself
    if from_sampler:
        batch.behaviour_logp, batch.rollout_logp = batch.rollout_logp, None  # [N, T]
        return
    every_row = not skip_rows or batch.rollout_logp is not None   # mismatch reads them all
    rows = None if every_row else behaviour_rows(rewards, cfg.rollout.group_size)
    batch.behaviour_logp = passes.old_logprobs(batch, rows)                     # [N, T]


SAMPLER_LOGPROBS_BYTES = 256 * 2**20
"""Largest [N, T, V] float32 stack of a batch's logits the hf sampler may keep for its log-probs
(``sampler_is_behaviour``); past it the worker's chunked log-prob pass is used."""


def sampler_is_behaviour(cfg, worker: Collector, passes: LogprobPasses) -> bool:
    """Whether the worker takes π_v of a stale batch from the sampler's own log-probs, saving its
    log-prob pass: the sampler is transformers on the worker's policy itself (same weights, same
    float32 math up to rounding), with the behaviour ratio, a dense model (MoE: the pass also
    records π_old's experts), the config not asking for the sampler's log-probs otherwise (then
    they are a mismatched sampler's, kept as such), and the logits stack ``generate`` keeps for
    them within ``SAMPLER_LOGPROBS_BYTES``."""
    r, t = cfg.rollout, cfg.train
    if (not engines.capabilities(r.engine).trainer_logprobs or r.dtype != "model" or r.async_ratio != "behaviour" or passes.is_moe
            or t.old_logprobs != "recompute" or t.log_rollout_logprobs
            or t.rollout_correction.mode != "none"):
        return False
    vocab = worker.model.config.vocab_size
    return cfg.batch_size * r.max_new_tokens * vocab * 4 <= SAMPLER_LOGPROBS_BYTES


# ---------------------------------------------------------------------------- the thread worker
class ThreadWorker:
    """The worker as a thread of this process, sharing its memory, interpreter and RNG."""

    weights_device = None       # the snapshots stay where the policy is

    def __init__(self):
        self.rng_lock = threading.Lock()       # torch's global RNG: the worker's sampling vs eval
        self._cond = threading.Condition()     # guards _weights and _stopping
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._stopping = False
        self._ready: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, cfg, collector: Collector, passes: LogprobPasses, step: int, *,
              skip_rows: bool, weights: dict) -> None:
        self._weights, self._stopping, self.s = dict(weights), False, cfg.rollout.max_staleness
        self._ready = queue.Queue()
        model = copy.deepcopy(collector.model).requires_grad_(False)
        # the worker shares config, task and rewards, and a shared engine (vllm); owns its policy,
        # data cursor and any other engine (hf: built on its policy at its first batch)
        worker = collector.for_worker(model)
        passes = copy.copy(passes)               # its log-prob passes run on its own policy
        passes.model = model
        self._thread = threading.Thread(
            target=self._serve, args=(cfg, worker, passes, step, skip_rows), daemon=True,
            name="gspo-rollout")
        self._thread.start()

    def publish(self, weights: dict, version: int) -> None:
        """Hold ``weights`` as version ``version`` (older than version - s dropped)."""
        with self._cond:
            self._weights[version] = weights
            for old in [v for v in self._weights if v < version - self.s]:
                del self._weights[old]
            self._cond.notify_all()

    def receive(self):
        return self._ready.get()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    def _serve(self, cfg, worker, passes, step, skip_rows) -> None:
        try:
            make_batches(cfg, worker, passes, step, skip_rows=skip_rows,
                         await_weights=self._await, put=self._ready.put, rng_lock=self.rng_lock)
        except BaseException as err:  # noqa: BLE001  the trainer raises it at its next batch
            self._ready.put(err)
        finally:
            self._ready.put(DONE)

    def _await(self, version: int):
        """The weights of ``version`` once published; None when stopping."""
        with self._cond:
            while version not in self._weights and not self._stopping:
                self._cond.wait()
            return None if self._stopping else self._weights[version]


# ---------------------------------------------------------------------------- the process worker
@dataclasses.dataclass
class WorkerSpec:
    """What the child process builds its collector and log-prob passes from (pickled once)."""
    cfg: object
    parts: dict                 # the Collector's fields but its rewards (no engine, model on CPU)
    passes: LogprobPasses       # its model is set to the child's policy
    device: str
    step: int
    skip_rows: bool

    def build(self) -> tuple[Collector, LogprobPasses]:
        host = self.parts["host"]
        model = host.model.to(self.device).requires_grad_(False)
        rewards = isolated_rewards(self.cfg.rewards, self.parts["task"])   # (may hold threads)
        collector = Collector(**{**self.parts, "host": dataclasses.replace(host, model=model),
                                 "rewards": rewards})
        self.passes.model = model
        return collector, self.passes


def _context():
    """A fork server that has imported this module (torch, transformers, gspo) once: a worker
    starts in a fraction of a second. Spawn where there is no fork server (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class ProcessWorker:
    """The worker as a child process (module docstring)."""

    rng_lock = contextlib.nullcontext()      # the child samples from its own RNG
    weights_device = "cpu"                   # what crosses the process boundary

    def __init__(self):
        self._proc = None
        self._inbox = self._outbox = None
        self._device = "cpu"

    def start(self, cfg, collector: Collector, passes: LogprobPasses, step: int, *,
              skip_rows: bool, weights: dict) -> None:
        ctx = _context()
        self._device = str(collector.device)
        model = collector.model if self._device == "cpu" else copy.deepcopy(collector.model).cpu()
        sent = collector.for_process(model)
        parts = {f.name: getattr(sent, f.name) for f in dataclasses.fields(sent)
                 if f.name != "rewards"}
        passes = copy.copy(passes)
        passes.model = None
        spec = WorkerSpec(cfg, parts, passes, self._device, step, skip_rows)
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        alive, self._alive = ctx.Pipe(duplex=False)   # only this process holds the writing end
        # the spec as bytes: multiprocessing's own pickler would hand the child the policy's
        # parameters in shared memory, which the trainer then updates under it (and vice versa)
        self._proc = ctx.Process(target=_process_main, name="gspo-rollout", daemon=True,
                                 args=(_packed_spec(spec), self._inbox, self._outbox, alive))
        self._proc.start()
        alive.close()
        for version, w in weights.items():
            self.publish(w, version)

    def publish(self, weights: dict, version: int) -> None:
        """Send ``weights`` as version ``version`` (safetensors bytes: no pickle for weights)."""
        self._inbox.put((version, safetensors_bytes(weights)))

    def receive(self):
        """The worker's next item; a RuntimeError if the process ended without saying DONE."""
        while True:
            try:
                item = pickle.loads(self._outbox.get(timeout=1.0))
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    return RuntimeError(
                        f"async rollouts: the worker process ended (exit code {self._proc.exitcode})"
                        " without a batch or an error. It imports the main module of this program"
                        " as Python's multiprocessing does: a script that trains must start under"
                        " `if __name__ == \"__main__\":` (or set rollout.async_worker=thread)")
        return item if self._device == "cpu" else _from_host(item, self._device)

    def stop(self) -> None:
        """Ask the worker to stop, take what it still sends until DONE, and join it (killed if
        it has not ended 60 s after its last batch)."""
        self._inbox.put(None)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and self._proc.is_alive():
            try:
                if pickle.loads(self._outbox.get(timeout=1.0)) == DONE:
                    break
            except queue.Empty:
                pass
        self._proc.join(timeout=10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._inbox.cancel_join_thread()       # nothing left to deliver to a process that is gone
        self._alive.close()
        self._proc = None


def _packed_spec(spec: WorkerSpec) -> bytes:
    """``_packed(spec)``, or a UserError naming the part that does not pickle."""
    try:
        return _packed(spec)
    except Exception as err:  # noqa: BLE001  pickle raises TypeError, AttributeError, PicklingError...
        host = spec.parts["host"]             # the policy and the tokenizer, named as such
        parts = {**spec.parts, "model": host.model, "tokenizer": host.tokenizer,
                 "host": host, "passes": spec.passes}
        bad = [name for name, part in parts.items() if not _pickles(part)] or ["config"]
        raise UserError(f"rollout.async_worker=process: the worker's copy of the {bad[0]} cannot "
                        f"be pickled ({type(err).__name__}: {err}); set rollout.async_worker=thread"
                        ) from None


def _pickles(obj) -> bool:
    try:
        _packed(obj)
        return True
    except Exception:  # noqa: BLE001
        return False


def _process_main(packed_spec: bytes, inbox, outbox, alive) -> None:
    """The child: build the collector from the pickled ``WorkerSpec``, then ``make_batches``
    with weights from ``inbox`` and batches (or the error that ended it) to ``outbox``; DONE last.
    ``alive``: the reading end of a pipe only the trainer writes to (``exit_with_trainer``)."""
    for sig in (signal.SIGINT, signal.SIGTERM):   # the trainer saves, then stops the worker
        signal.signal(sig, signal.SIG_IGN)
    exit_with_trainer(alive)
    try:
        spec: WorkerSpec = pickle.loads(packed_spec)
        worker, passes = spec.build()
        on_cpu = spec.device == "cpu"
        put = lambda item: outbox.put(_packed(item if on_cpu else _to_host(item)))  # noqa: E731
        make_batches(spec.cfg, worker, passes, spec.step, skip_rows=spec.skip_rows,
                     await_weights=_inbox_reader(inbox), put=put,
                     rng_lock=contextlib.nullcontext())
    except BaseException as err:  # noqa: BLE001  the trainer raises it at its next batch
        outbox.put(_packed(_portable(err)))
    finally:
        outbox.put(_packed(DONE))


def exit_with_trainer(alive) -> None:
    """A daemon thread that ends this process once the trainer's end of ``alive`` is closed: the
    trainer stopped it, or died without stopping it (then nothing else would: the child of a fork
    server does not see its trainer, and a queue's buffered batch would block its exit)."""
    def watch():
        try:
            alive.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="gspo-rollout-watchdog").start()


def _inbox_reader(inbox) -> Callable[[int], dict | None]:
    """``await_weights`` of the child: reads published versions until ``version`` is there
    (older ones dropped); None on the stop message."""
    held: dict[int, dict] = {}

    def await_weights(version: int):
        while version not in held:
            message = inbox.get()             # (version, safetensors bytes) | None
            if message is None:
                return None
            held[message[0]] = safetensors_weights(message[1])
        for old in [v for v in held if v < version]:
            del held[old]
        return held[version]
    return await_weights


def _packed(item) -> bytes:
    """``item`` as bytes, its tensors' data inside. Plain pickle, not the queue's: torch's
    reductions for it pass tensors as shared memory, which would alias the two sides' weights and
    vanish when the child exits before the trainer reads its last batch."""
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def _portable(err: BaseException) -> BaseException:
    """``err`` as the trainer will raise it: with the child's traceback as a note, or, when it
    does not pickle, a RuntimeError that names it."""
    err.add_note("in the rollout worker process:\n" + "".join(traceback.format_exception(err)))
    try:
        pickle.loads(_packed(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"async rollouts: the worker process failed: "
                            f"{''.join(traceback.format_exception(err))}")


@dataclasses.dataclass
class _OnDevice:
    """A tensor that was on an accelerator in the child, crossing on the CPU."""
    tensor: torch.Tensor


def _to_host(item):
    """``item`` with every tensor inside it (tuples, lists, dicts, dataclasses) that is not on
    the CPU wrapped as ``_OnDevice`` of a CPU copy (CPU tensors, e.g. ``batch.correct``, stay)."""
    return _map_leaves(item, lambda t: t if t.device.type == "cpu" else _OnDevice(t.cpu()))


def _from_host(item, device: str):
    """``item`` with every ``_OnDevice`` moved back to ``device``."""
    return _map_leaves(item, lambda x: x.tensor.to(device) if isinstance(x, _OnDevice) else x)


def _map_leaves(item, fn):
    """``fn`` applied to each tensor or ``_OnDevice`` inside ``item`` (tuples, lists, dicts,
    dataclasses); everything else as it is."""
    if isinstance(item, (torch.Tensor, _OnDevice)):
        return fn(item)
    if isinstance(item, (list, tuple)):
        return type(item)(_map_leaves(x, fn) for x in item)
    if isinstance(item, dict):
        return {k: _map_leaves(v, fn) for k, v in item.items()}
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.replace(item, **{f.name: _map_leaves(getattr(item, f.name), fn)
                                            for f in dataclasses.fields(item) if f.init})
    return item


WORKERS = {"process": ProcessWorker, "thread": ThreadWorker}
"""rollout.async_worker -> the worker class."""
