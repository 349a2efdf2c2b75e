"""Routing Replay on tiny-moe: routing change after one update, and what replay costs per step.

Measures, on one real rollout batch of the main job's task (configs/moe.yaml):
  * the routing change rate (share of (response token, layer) whose top-k set differs from
    pi_old's) after one optimizer step at the configured learning rate, per layer;
  * wall time of a training minibatch pass (forward + backward) with and without replay,
    interleaved, median over repeats;
  * the memory replay holds: the stored expert ids, N * L * layers * k bytes (uint8).

Usage: python benchmarks/moe_replay.py [--config configs/moe.yaml] [--repeats 7] [key=value ...]
Uses the cached cold start when present (run `gspo sft configs/moe.yaml` first to cache it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gspo.models import moe
from gspo.core.advantages import group_advantages
from gspo.config import load_config
from gspo.training.trainer import Trainer
from gspo.training.old_policy import OldLogprobs


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/moe.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, ["run.dir=/tmp/gspo-moe-bench", "run.overwrite=true",
                                    "run.tensorboard=false", *args.overrides])
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.setup()
    step, passes = trainer.step, trainer.step.passes
    batch, rewards, _ = trainer.collector.collect(0)
    old_logp = step.old_logprobs(batch)                        # captures pi_old's experts
    routing = batch.routing                          # [N, L, layers, k] uint8
    T = batch.response_mask.shape[1]

    # 1. one RL update (all minibatches), then the change of the top-k sets on the same batch
    adv = group_advantages(rewards, cfg.rollout.group_size)
    step.update(batch, OldLogprobs(old_logp, adv), step.plan(batch, adv, 0, speed_paths=False))
    with torch.no_grad(), moe.capture_routing(trainer.model) as cap:
        passes.logprobs(trainer.model, batch)
    overall, per_layer = moe.routing_change_rate(moe.response_routing(routing, T),
                                                 moe.response_routing(cap.routing, T),
                                                 batch.response_mask)
    # 2. cost of a training pass with and without replay, interleaved
    model = trainer.model

    def train_pass(replay: bool):
        ctx = moe.replay_routing(model, routing) if replay else moe.capture_routing(model)
        with ctx:
            out = passes.logprobs(model, batch, with_entropy=True)
        (out.logp.sum()).backward()
        model.zero_grad(set_to_none=True)

    for replay in (False, True):
        train_pass(replay)                                            # warm-up
    plain, replayed = [], []
    for _ in range(args.repeats):
        plain.append(timed(lambda: train_pass(False), 1))
        replayed.append(timed(lambda: train_pass(True), 1))
    t_plain, t_replay = statistics.median(plain), statistics.median(replayed)
    n, L = batch.input_ids.shape
    print(f"tiny-moe, N={n} sequences x L={L} positions, {routing.shape[2]} MoE layers, top-{routing.shape[3]}")
    print(f"routing change rate after one update at lr={cfg.train.lr}: {overall.item():.4f} "
          f"(per layer: {', '.join(f'{v:.4f}' for v in per_layer.tolist())})")
    print(f"forward+backward on the batch: {t_plain * 1e3:.1f} ms without replay, "
          f"{t_replay * 1e3:.1f} ms with replay (x{t_replay / t_plain:.2f})")
    print(f"replay storage: {routing.numel() * routing.element_size() / 1024:.1f} KiB "
          f"({routing.dtype}, N*L*layers*k)")


if __name__ == "__main__":
    main()
