"""Packed rows against padded rows in the trainer's log-prob passes, on a job's rollout batches.

For a job's config, after its cold start (cached in ``sft.cache_dir``): ``--batches`` rollout
batches sampled by the cold-start policy, then ``--rounds`` rounds over the layouts, alternated
(the order reversed every other round), on the same batches and the same weights (the
optimizer's step replaced by a no-op): π_old's pass (no gradient) and the update (every
minibatch's forward/backward, ``RLStep.update``), as a training step runs them. Per layout: the
positions the update's forwards computed, their padding share (``perf/padding_frac``), and the
medians over rounds of the seconds of π_old's pass and of the update's forward/backward.

Layouts: ``padded`` (``train.pack_rows=false``: padding columns trimmed, each group's prompt run
once), ``packed/N`` for each ``--pack-length N`` (``train.pack_rows=true``,
``train.pack_length=N``; 0: one packed row per forward; each group's prompt packed once), and
``rows/N`` for the first N: packed without sharing prompts (every row its own prompt, as under
flash-attention or fsdp).

    OMP_NUM_THREADS=1 python benchmarks/packed_rows.py configs/default.yaml [key=value ...] \\
        --batches 3 --rounds 5 --pack-length 256 0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gspo.config import load_config
from gspo.core.logprobs import packing_honoured
from gspo.observe.timing import StepTimer
from gspo.training.old_policy import OldLogprobs
from gspo.training.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pack-length", type=int, nargs="+", default=[256, 0])
    parser.add_argument("--cache", default="/tmp/gspo-pack/sft-cache")
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    cfg = load_config(a.config, ["run.dir=/tmp/gspo-pack/run", "run.overwrite=true",
                                 "run.tensorboard=false", "run.progress=false", "run.eval_every=0",
                                 f"sft.cache_dir={a.cache}", *a.overrides])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.setup()
    step, passes = trainer.step, trainer.step.passes
    assert packing_honoured(trainer.model) and packing_honoured(trainer.model, shared=True)
    step.optimizer.step = lambda *args, **kwargs: None         # the weights stay put
    batches = [trainer.collector.collect(k)[:2] for k in range(a.batches)]
    print(f"{a.config} {' '.join(a.overrides)}: set-up and {a.batches} batches in "
          f"{time.perf_counter() - t0:.0f} s; rows per batch {len(batches[0][1])}, "
          f"response columns {[b.response_mask.shape[1] for b, _ in batches]}")
    n0 = a.pack_length[0]
    layouts = ([("padded", False, None, True)]
               + [(f"packed/{n}", True, n or None, True) for n in a.pack_length]
               + [(f"rows/{n0}", True, n0 or None, False)])
    seen = {name: {"old": [], "fb": [], "computed": [], "real": []} for name, *_ in layouts}
    for r in range(a.rounds):
        for name, pack, length, shared in (layouts if r % 2 == 0 else layouts[::-1]):
            passes.pack, passes.pack_length, passes.pack_shared = pack, length, shared
            t_old = t_fb = 0.0
            for k, (batch, rewards) in enumerate(batches):
                batch.loss_mask, batch.dropped = None, None
                adv = trainer.algorithm.advantages(batch, rewards)
                plan = step.plan(batch, adv, k)
                t1 = time.perf_counter()
                old = step.old_logprobs(batch, rows=plan.old_rows)
                t_old += time.perf_counter() - t1
                timer = StepTimer(trainer.device)
                metrics, _ = step.update(batch, OldLogprobs(old, adv), plan, timer)
                t_fb += timer.seconds()["forward_backward"]
                if r == 0:
                    seen[name]["computed"].append(metrics["perf/tokens_computed"])
                    seen[name]["real"].append(metrics["perf/tokens_real"])
            seen[name]["old"].append(t_old)
            seen[name]["fb"].append(t_fb)
    base = seen["padded"]
    print("| layout | positions computed (update, per batch) | needed | padding share | "
          "π_old pass s | forward/backward s | time ratio to padded (fwd/bwd) | "
          "positions ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, *_ in layouts:
        s = seen[name]
        comp, real = sum(s["computed"]), sum(s["real"])
        old, fb = statistics.median(s["old"]), statistics.median(s["fb"])
        print(f"| {name} | {comp / a.batches:.0f} | {real / a.batches:.0f} | {1 - real / comp:.3f} | "
              f"{old:.3f} | {fb:.3f} | {fb / statistics.median(base['fb']):.2f} | "
              f"{comp / sum(base['computed']):.2f} |")
    print("per-round forward/backward s:", {n: [round(x, 3) for x in s["fb"]] for n, s in seen.items()})


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
