"""The training run: build the pieces, then RL steps with evaluation, checkpoints and the guard.

``Trainer(cfg).run()`` prepares the task and rewards (before any model: user errors first),
builds the initial policy (cold start, gspo.training.cold_start), wires the step's collaborators
(``setup``) and loops: the stability guard's pre-step hook, one ``RLStep`` (gspo.training.step,
where the algorithm reads top to bottom), the guard's verdict (skip, roll back, pause), periodic
held-out evaluation, metrics, checkpoints, and a graceful stop on SIGINT / SIGTERM. Resuming
restores weights, optimizer, data position and history from the last good checkpoint.

It holds no math and no per-minibatch logic.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gspo.config import TrainConfig, dump_yaml
from gspo.errors import Interrupted
from gspo.models.presets import DTYPES, load_model, resolve_device
from gspo.observe.metrics import MetricsWriter, NullWriter, report_progress
from gspo.observe.records import Recorder
from gspo.observe.samples import SampleWriter
from gspo.observe.timing import iteration_times
from gspo.rewards.isolation import isolated_rewards
from gspo.rollout import episodes
from gspo.rollout.collect import Collector, DataCursor
from gspo.rollout.data import build_task, eval_examples
from gspo.rollout.evaluation import EvalResult, evaluate
from gspo.rollout.turns import check_template
from gspo.training import algorithms, dist_checkpoint, distributed, lora, provenance
from gspo.storage import write_atomic, writing
from gspo.training.checkpoint import BEST, kept_best, load_latest, save_weights, selection_examples
from gspo.training.batch_source import build_source
from gspo.training.cold_start import initial_policy, prepare_policy
from gspo.training.optim import build_optimizer, build_scheduler
from gspo.training.passes import LogprobPasses
from gspo.training.rundir import RunLock, claim, run_summary
from gspo.training.stability import RunControl, StabilityGuard, StepGuard
from gspo.training.step import RLStep, skips_rows


class Trainer:
    """Runs ``cfg.train.steps`` RL steps and writes everything to ``cfg.run.dir``."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, log=None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.dist = distributed.current()         # rank and world under torchrun; else one process
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        if not self.dist.is_main:                 # rank 0 speaks for all
            self.log = lambda msg: None
        self.progress = cfg.run.progress and sys.stderr.isatty() and self.dist.is_main
        self.resume = resume
        self.stop = None                          # a gspo.training.signals.GracefulStop (the CLI's)
        self.run_lock: RunLock | None = None       # rank 0, from set-up to the end of run()
        self.algorithm = algorithms.get(cfg.objective.name)(cfg)  # group-relative | ppo | sft
        self.task = build_task(cfg)
        self.train_set, self.test_set = self.task.split("train"), eval_examples(self.task, cfg)
        self.val_set = [] if self.dist.enabled and cfg.dist.strategy == "fsdp" else \
            selection_examples(self.task, cfg)     # []: no best checkpoint (fsdp: not gathered)
        self.rewards = isolated_rewards(cfg.rewards, self.task)
        self.episode = episodes.build(cfg.rollout.episode, cfg, self.task)   # single turn, tool loop...

    # ----------------------------------------------------------------------------- set-up
    def setup(self) -> None:
        """The policy and everything that works on it; a resumed run's checkpoint restored."""
        cfg = self.cfg
        self.dist.on_main(self.claim_run_dir)     # rank 0 writes the run folder
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)  # process-wide, before SFT and RL
        self.logging_s = 0.0                        # writing the last metrics row (time/logging_s)
        with self.dist.main_first():                # rank 0 fills the SFT cache, the others read it
            self.model, self.tokenizer, self.init_info = initial_policy(cfg, self.task, self.log,
                                                                        self.progress, self.episode)
        multi_turn = getattr(self.episode, "multi_turn", False)   # absent: one turn (Episode)
        if multi_turn and getattr(self.tokenizer, "chat_template", None):
            check_template(self.tokenizer, self.tokenizer.eos_token_id,   # refused in one line
                           cfg.task.chat_template_kwargs)
        self.device = next(self.model.parameters()).device
        self.model = prepare_policy(self.model, self.tokenizer, cfg, self.run_dir,  # LoRA, act. ckpt
                                    self.dist.on_main, self.init_info)
        passes = LogprobPasses(self.model, self.dist, temperature=cfg.rollout.temperature,
                               chunk_size=cfg.train.logprob_chunk, group_size=cfg.rollout.group_size,
                               entropy_grad=cfg.train.entropy_coef > 0,
                               routing_replay=cfg.moe.routing_replay, aux_loss=cfg.moe.aux_loss_coef > 0,
                               pack=cfg.train.pack_rows, pack_length=cfg.train.pack_length)
        self.ref_model = lora.frozen_reference(self.model) if cfg.train.beta > 0 else None
        self.dist.wrap(self.model, cfg.dist.strategy)  # rank 0's weights everywhere; fsdp: sharded
        self.optimizer = build_optimizer(self.model, cfg.train.lr, cfg.train.weight_decay,
                                         master_weights=cfg.train.master_weights)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.schedule, cfg.train.warmup_steps,
                                         cfg.train.steps * cfg.train.minibatches)
        self.cursor = DataCursor(len(self.train_set), cfg.seed)
        self.start_step, self.history, self.wall_before = 0, {}, 0.0
        self.metrics = (MetricsWriter(self.run_dir, cfg.run.trackers, cfg.model_dump(mode="json"))
                        if self.dist.is_main else NullWriter())
        run = RunControl(save_now=lambda step: self.save(step, self.wall()), restore=self.restore,
                         on_main=self.dist.on_main, is_main=self.dist.is_main)
        self.guard: StepGuard = StabilityGuard(
            cfg=cfg.guard, faults=cfg.faults, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, run_dir=self.run_dir, metrics=self.metrics, run=run, log=self.log)
        self.algorithm.setup(algorithms.PolicyParts(     # ppo: the critic, from the policy
            model=self.model, tokenizer=self.tokenizer, optimizer=self.optimizer,
            scheduler=self.scheduler, device=self.device, train_set=self.train_set,
            ref_model=self.ref_model, passes=passes, ranks=self.dist))
        self.collector = Collector.create(
            cfg=cfg, model=self.model, tokenizer=self.tokenizer, task=self.task,
            train_set=self.train_set, cursor=self.cursor, rewards=self.rewards, shards=self.dist,
            device=self.device, episode=self.episode)
        recorder = Recorder.for_run(cfg, self.run_dir, self.model, self.tokenizer,
                                    self.collector.sampling)
        self.rollouts = build_source(cfg, self.collector, passes, log=self.log,  # now, or ahead
                                     skip_rows=skips_rows(cfg, self.algorithm.objective, self.ref_model))
        samples = SampleWriter(
            cfg.run.samples_every, cfg.run.samples_prompts, self.run_dir, self.tokenizer,
            cfg.rollout.group_size, recorder.objective, recorder.objective_kwargs,
            transcripts=multi_turn, log=self.metrics.log_samples,
        ) if self.dist.is_main else None                 # rank 0 writes (its share of the batch)
        self.step = RLStep(cfg=cfg, model=self.model, optimizer=self.optimizer,
                           scheduler=self.scheduler, source=self.rollouts, algorithm=self.algorithm,
                           passes=passes, ranks=self.dist, audit=recorder, task=self.task,
                           ref_model=self.ref_model, samples=samples,
                           pad_id=self.tokenizer.pad_token_id)
        if self.resume:
            self.restore_latest()

    def claim_run_dir(self) -> None:
        """Lock the folder (one writer at a time), then start it afresh (gspo.training.rundir)."""
        self.run_lock = claim(self.run_dir, resume=self.resume, overwrite=self.cfg.run.overwrite,
                              log=self.log, lock=self.run_lock)   # (set up twice: still ours)
        with writing("config.yaml", self.run_dir / "config.yaml"):
            dump_yaml(self.cfg, self.run_dir / "config.yaml")
        with writing(provenance.FILE, self.run_dir / provenance.FILE):   # what produces this run
            provenance.write(self.run_dir, provenance.collect(
                self.cfg, command="train", world_size=self.dist.world,
                device=str(resolve_device(self.cfg.model.device))), resume=self.resume)

    # ----------------------------------------------------------------------------- checkpoints
    def restore_latest(self) -> None:
        """--resume: the newest checkpoint that verifies (none: start from scratch)."""
        loaded = load_latest(self.run_dir, warn=self.log)
        if loaded is None:
            self.log(f"resume: no usable checkpoint in {self.run_dir}; starting from scratch")
            self.metrics.truncate_after(-1)  # rows of the killed attempt would be logged twice
            return
        self.restore(loaded)
        self.guard.load_state_dict(loaded.state.get("guard"))
        self.wall_before = loaded.state.get("wall_s", 0.0)
        self.metrics.truncate_after(self.start_step)
        self.log(f"resume: restored {loaded.path} (step {self.start_step})")

    def restore(self, loaded) -> None:
        """Weights, optimizer, scheduler, data position, step and history of a checkpoint."""
        if lora.is_lora(self.model):   # the checkpoint holds the adapter; the base is unchanged
            lora.load_adapter(self.model, loaded.path)
            weights = self.model.state_dict()
        else:
            weights = load_model(loaded.path, DTYPES[self.cfg.model.dtype])[0].state_dict()
        dist_checkpoint.load_state(self.dist, self.model, self.optimizer, weights, loaded.optimizer)
        self.scheduler.load_state_dict(loaded.scheduler)
        state = loaded.state
        self.cursor.load(state["cursor"])
        self.start_step = state["step"]
        self.history = state.get("history", {})
        if self.val_set:    # best/ may be newer than this checkpoint (a rollback, a killed run)
            self.history["best_validation"] = self.dist.on_main(lambda: kept_best(self.run_dir))
        self.algorithm.load(loaded.path, state.get("algorithm", {}))
        self.rollouts.load(loaded.path)             # async: the weights of the batches in flight

    def save(self, step: int, wall: float) -> Path:
        self.metrics.flush()                    # TensorBoard as far as the checkpoint
        state = {"cursor": self.cursor.state(), "history": self.history, "wall_s": wall,
                 "objective": self.cfg.objective.name, "init": self.init_info,
                 "guard": self.guard.state_dict(), "algorithm": self.algorithm.state_dict()}
        return dist_checkpoint.save_checkpoint(                                      # rank 0
            self.dist, self.run_dir, step, self.model, self.tokenizer, self.optimizer,
            self.scheduler, state, keep=self.cfg.run.keep_checkpoints,
            extra=lambda folder: (self.algorithm.save(folder),               # ppo: critic
                                  self.rollouts.save(folder, step)))

    # ----------------------------------------------------------------------------- the loop
    def evaluate(self, examples=None) -> EvalResult:
        """Held-out evaluation of ``examples`` (default: the test split; under torchrun: on rank 0,
        its result sent to every rank)."""
        e = self.cfg.eval
        examples = self.test_set if examples is None else examples
        with self.rollouts.rng_lock:                    # async: not while the worker samples
            host = self.collector.host
            engine = host.eval_engine()                 # vllm: the same engine; hf: the policy
            with host.gathered(engine):                 # (every rank: fsdp gathers, vllm syncs)
                return self.dist.on_main(lambda: evaluate(
                    self.model, self.tokenizer, self.task, examples,
                    max_new_tokens=self.cfg.rollout.max_new_tokens, k=e.k,
                    temperature=e.temperature, batch_size=e.batch_size, seed=self.cfg.seed,
                    engine=engine, episode=self.episode),
                    alongside=self.collector.shares.engine_group() if engine is host.engine
                    else 1)                           # (hf on the policy: rank 0 alone)

    def wall(self) -> float:
        """Seconds of training so far, over all resumed sessions."""
        return self.wall_before + time.time() - self.t_start

    def stop_if_requested(self, done: int) -> None:
        """Between steps: after SIGINT/SIGTERM (``self.stop``, a GracefulStop set by the CLI),
        save a checkpoint of the ``done`` steps, then raise Interrupted."""
        if self.stop is None or not self.dist.any(self.stop.signum is not None):  # ranks together
            return
        signum = self.stop.signum or signal.SIGTERM
        raise Interrupted(signum, done, self.save(done, self.wall()), self.run_dir)

    def run(self) -> dict:
        """Set up, train, save, evaluate; the run folder's lock is released however it ends."""
        try:
            return self.train()
        finally:
            if getattr(self, "rollouts", None) is not None:  # (set-up may have failed before it)
                self.rollouts.close()                        # async: the worker stopped and joined
            if getattr(self, "collector", None) is not None:
                self.collector.close()                       # vllm: its engine core released
            self.episode.close()                             # multiturn: the tools' sandboxes
            if self.run_lock is not None:   # another process may write this run now
                self.run_lock.release()

    def train(self) -> dict:
        self.setup()
        cfg = self.cfg
        self.t_start = time.time()
        if "eval_before" not in self.history:
            result = self.evaluate()
            self.history["eval_before"] = result.as_dict()
            self.metrics.write({"step": 0, **result.as_metrics(), **self.keep_if_best(0, result)})
            self.log(f"held-out before RL: accuracy {result.accuracy:.3f}  pass@1 {result.pass1:.3f}")
        bar = tqdm(desc=f"{cfg.objective.name}", initial=self.start_step, total=cfg.train.steps,
                   disable=not self.progress, dynamic_ncols=True)
        last_acc = self.history["eval_before"]["accuracy"]
        self.guard.on_start(self.start_step)
        step = self.start_step
        self.stop_if_requested(step)
        while step < cfg.train.steps:
            t_iter = time.perf_counter()
            self.guard.before_step(step)                # learning rate; snapshot for skip / pause
            row = self.step(step)
            back = self.guard.after_step(row)           # skip restores; pause raises GuardPause
            if back is not None:                        # rolled back to the checkpoint of step back
                step = bar.n = back
                continue
            self.rollouts.publish(row["step"])          # async: these weights to the worker
            iteration_times(row, time.perf_counter() - t_iter, self.logging_s)
            done = row["step"]
            if (cfg.run.eval_every and done % cfg.run.eval_every == 0) or done == cfg.train.steps:
                result = self.evaluate()
                row.update(result.as_metrics())
                row.update(self.keep_if_best(done, result))
                last_acc = result.accuracy
                self.history["eval_last"] = result.as_dict()
            self.log_row(row)
            report_progress(bar, row, last_acc, cfg.train.steps, None if self.progress else self.log)
            if cfg.run.save_every and done % cfg.run.save_every == 0 and done < cfg.train.steps:
                self.save(done, self.wall())
            self.stop_if_requested(done)
            step += 1
            bar.update(1)
        bar.close()
        wall = self.wall()
        final = self.save(cfg.train.steps, wall)
        self.metrics.close()
        return self.finish(final, wall)

    def keep_if_best(self, done: int, test: EvalResult) -> dict:
        """With a validation split: score it, and when its greedy accuracy beats the best so far
        (history["best_validation"]) write these weights to <run.dir>/best; the val/* metrics."""
        if not self.val_set:
            return {}
        val = self.evaluate(self.val_set)
        best = self.history.get("best_validation")
        if best is None or val.accuracy > best["accuracy"]:
            folder = self.run_dir / BEST
            best = {"step": done, "accuracy": val.accuracy, "n": val.n,
                    "test_accuracy": test.accuracy, "checkpoint": str(folder)}
            self.dist.on_main(lambda: save_weights(self.model, self.tokenizer, folder, best))
            self.history["best_validation"] = best
        return val.as_metrics("val/")

    def log_row(self, row: dict) -> None:
        """Write a metrics row (JSONL + TensorBoard), timed for the next row's time/logging_s."""
        t0 = time.perf_counter()
        self.metrics.write(row)
        self.logging_s = time.perf_counter() - t0

    def finish(self, final: Path, wall: float) -> dict:
        summary = run_summary(self.cfg, self.history, self.init_info, final, wall,
                              data=getattr(self.task, "data_report", None))
        if self.dist.is_main:
            with writing("summary.json", self.run_dir / "summary.json"):
                write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary
