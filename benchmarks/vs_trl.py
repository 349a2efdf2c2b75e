"""Wall time per RL step: gspo vs TRL's GRPOTrainer (configured for GSPO) on the same work.

Same local tiny checkpoint (built with ``gspo.models.presets.build_model`` and saved to a temp dir), same
prompts in the same order (gspo's data cursor), same reward, and:

    P prompts per step x G responses      TRL: generation_batch_size = P*G, num_generations = G
    max new tokens                        TRL: max_completion_length
    temperature 1, top_p 1, top_k 0       TRL: temperature, top_p, top_k
    M minibatches = M optimizer steps     TRL: per_device_train_batch_size = P*G/M,
      per rollout batch                        steps_per_generation = M, gradient_accumulation 1
      (π_old recomputed: TRL does so too       (grad_accum % steps_per_generation != 0)
      when steps_per_generation > 1)
    GSPO: sequence-level ratio, seq-mean  TRL: importance_sampling_level="sequence", loss_type="grpo"
    ε_low 3e-4, ε_high 4e-4, no KL        TRL: epsilon, epsilon_high, beta=0
    AdamW, constant lr, clip 1.0          TRL: learning_rate, lr_scheduler_type="constant",
                                               max_grad_norm=1.0
    a log row per RL step                 gspo: metrics.jsonl + TensorBoard; TRL: logging_steps=M

Three workloads (``--init``, ``--reward``):

    --init random --reward verifier       untrained preset, arithmetic task, its exact-match check:
                                          0 everywhere, no group has a signal
    --init random --reward parity         untrained preset, arithmetic prompts, the first character's
                                          code point is odd: a signal in nearly every group
    --init coldstart                      the default job (configs/default.yaml): the preset after
                                          gspo's cold-start SFT (cached in --sft-cache), the
                                          multistep task and its verifier, P = 32, 8 new tokens:
                                          some groups with a signal, many without (real runs)

Both run in this one process with the same torch thread count, interleaved: TRL warm-up, gspo
warm-up, then ``--rounds`` rounds of ``--steps`` RL steps each (gspo, then TRL). One TRL RL step
is the wall time between the ends of its M-th optimizer steps (a Trainer callback runs gspo's
rounds in between, outside TRL's clock); one gspo step is the body of ``Trainer.run``'s loop
(guard, step, metrics write) without the periodic eval and checkpoint (TRL: none either).
Tokens per second count generated tokens up to and including EOS. Nothing is downloaded
(HF_HUB_OFFLINE=1, report_to="none", local paths). TRL is an optional extra: pip install -e .[bench]

    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --rounds 10 --steps 1     # tiny-dense, tiny-moe
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --reward parity --preset tiny-moe --json out.json
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --init coldstart --rounds 10 --steps 1

What a user gets (not equal work): gspo with asynchronous rollouts (``--gspo-async 1``: the next
batch is generated while this one trains, ``rollout.async=true rollout.max_staleness=1``) against
TRL's synchronous default, which recomputes activations in backward (``--trl-gradient-checkpointing``):

    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --reward parity --preset tiny-dense \
        --gspo-async 1 --trl-gradient-checkpointing --rounds 5 --steps 3

gspo's worker thread must not run on TRL's clock: at the end of each gspo round the benchmark
waits until the worker has made every batch it can (``settle``) and counts that wait in the
round's last step. So compare whole rounds (``TRL/gspo per round``: a gspo round's seconds
against those of the TRL steps right after it, robust to the load drifting between rounds) or
means, which include it, not medians; with ``--steps 1`` every step pays for a whole generation it
cannot overlap, so use several steps per round.

Figures and how to read them: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
TIME_PARTS = ("generate", "reward", "old_logprobs", "forward_backward", "optimizer", "logging", "other")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", nargs="+", default=["tiny-dense", "tiny-moe"])
    p.add_argument("--init", choices=["random", "coldstart"], default="random",
                   help="random: the untrained preset on the arithmetic task; coldstart: the default "
                        "job (configs/default.yaml) after its cold-start SFT, multistep task, its verifier")
    p.add_argument("--config", default=str(DEFAULT_JOB), help="the job of --init coldstart")
    p.add_argument("--sft-cache", default="runs/.sft-cache", help="cold-start cache (--init coldstart)")
    p.add_argument("--prompts", type=int, default=None,
                   help="P: prompts per RL step (default 16; coldstart: the job's)")
    p.add_argument("--group", type=int, default=8, help="G: responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 16; coldstart: the job's")
    p.add_argument("--minibatches", type=int, default=4, help="M: optimizer steps per rollout batch")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=1, help="RL steps of each before measuring")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="measured RL steps per round and library")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL's own default (recomputes activations in backward); off: same work as gspo")
    p.add_argument("--reward", choices=["verifier", "parity"], default="verifier",
                   help="verifier: the task's own check (arithmetic exact match: 0 everywhere for an "
                        "untrained model, no group has a signal); parity: the first character's "
                        "code point is odd (varies inside nearly every group)")
    p.add_argument("--gspo-async", type=int, default=None, metavar="S",
                   help="gspo with rollout.async=true, rollout.max_staleness=S (default: synchronous)")
    p.add_argument("--gspo-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra gspo config overrides, e.g. train.skip_zero_advantage=false")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    if a.init == "coldstart" and a.reward != "verifier":
        p.error("--init coldstart scores with the task's verifier (--reward verifier)")
    return a


def job_config(a: argparse.Namespace, preset: str):
    """The --init coldstart job (--config) on ``preset``, its cold start cached in --sft-cache."""
    from gspo.config import load_config
    return load_config(a.config, [f"seed={a.seed}", f"model.preset={preset}", "model.device=cpu",
                                  f"sft.cache_dir={a.sft_cache}", f"run.threads={a.threads}"])


def resolve_shapes(a: argparse.Namespace) -> None:
    """P and max new tokens: the job's under --init coldstart, else 16 and 16 (unless given)."""
    job = job_config(a, "tiny-dense").rollout if a.init == "coldstart" else None
    if a.prompts is None:
        a.prompts = job.prompts_per_step if job else 16
    if a.max_new_tokens is None:
        a.max_new_tokens = job.max_new_tokens if job else 16
    if job and a.group != job.group_size:
        print(f"note: G = {a.group}, the job's is {job.group_size}")


def first_char_parity(completion: str, **row) -> float:
    """A verifiable reward that varies inside a group even for an untrained model."""
    return float(ord(completion[0]) % 2) if completion else 0.0


# ----------------------------------------------------------------------------- gspo side

class GspoRunner:
    """A gspo Trainer set up on the checkpoint; ``run(n)`` times n iterations of the train loop."""

    def __init__(self, a: argparse.Namespace, checkpoint: Path, run_dir: Path):
        from gspo.config import load_config
        from gspo.training.trainer import Trainer
        overrides = {
            "seed": a.seed, "run.dir": str(run_dir), "run.overwrite": True, "run.progress": False,
            "run.threads": a.threads, "model.path": str(checkpoint), "model.device": "cpu",
            "sft.enabled": False,
            "rollout.prompts_per_step": a.prompts, "rollout.group_size": a.group,
            "rollout.max_new_tokens": a.max_new_tokens, "rollout.temperature": 1.0,
            "rollout.top_p": 1.0, "rollout.top_k": 0, "objective.name": "gspo",
            "objective.eps_low": 3e-4, "objective.eps_high": 4e-4,
            "train.minibatches": a.minibatches, "train.lr": a.lr, "train.schedule": "constant",
            "train.beta": 0.0, "train.grad_clip": 1.0, "train.warmup_steps": 0,
            "train.steps": a.warmup + a.rounds * a.steps,
        }
        if a.gspo_async is not None:
            overrides.update({"rollout.async": True, "rollout.max_staleness": a.gspo_async})
        from gspo.config import RunConfig
        if "threads" not in RunConfig.model_fields:  # an older gspo (before/after figures)
            overrides.pop("run.threads")
        if a.reward == "parity":
            overrides["rewards.sources"] = "[{type: function, fn: 'vs_trl:first_char_parity'}]"
        if a.init == "random":
            overrides["task.name"] = "arithmetic"
        base = a.config if a.init == "coldstart" else None   # the job's task and rewards
        self.cfg = load_config(base, [f"{k}={v}" for k, v in overrides.items()] + a.gspo_set)
        self.trainer = Trainer(self.cfg, log=lambda msg: None)
        self.trainer.setup()
        self.trainer.t_start = time.time()
        self.step, self.seconds, self.tokens, self.rows = 0, [], [], []

    def run(self, n: int, measure: bool = True) -> None:
        t = self.trainer
        for _ in range(n):
            t0 = time.perf_counter()
            if hasattr(t.guard, "run"):             # the body of Trainer.run's loop
                t.guard.before_step(self.step)
                row = t.step(self.step)
                t.guard.after_step(row)
                if hasattr(t, "rollouts"):
                    t.rollouts.publish(row["step"])   # async: these weights to the worker
            else:                                   # an older gspo: the guard took the trainer
                t.guard.before_step(t, self.step)
                row = t.step(self.step)
                t.guard.after_step(t, row)
            if hasattr(t, "log_row"):
                t.time_iteration(row, t0)
                t.log_row(row)
            else:                                   # an older gspo (before/after figures)
                t.metrics.write(row)
            seconds = time.perf_counter() - t0
            if measure:
                self.seconds.append(seconds)
                self.tokens.append(row["response/length_mean"] * self.cfg.batch_size)
                self.rows.append(row)
            self.step += 1
        if hasattr(t, "rollouts") and hasattr(t.rollouts, "settle"):
            t0 = time.perf_counter()
            t.rollouts.settle()        # async: the batches it makes ahead are made on gspo's clock
            if measure:
                self.seconds[-1] += time.perf_counter() - t0

    def close(self) -> None:
        if hasattr(self.trainer, "rollouts"):
            self.trainer.rollouts.close()

    def breakdown(self) -> dict[str, float]:
        """Mean share of time/step_s per part over the measured steps (time/* metrics)."""
        out = {}
        for part in TIME_PARTS:
            key = f"time/{part}_s"
            vals = [r[key] / r["time/step_s"] for r in self.rows if key in r]
            if vals:
                out[part] = statistics.mean(vals)
        return out


# ----------------------------------------------------------------------------- TRL side

def trl_trainer(a: argparse.Namespace, checkpoint: Path, out_dir: Path, prompts: list, task,
                callback):
    """TRL's GRPOTrainer on the same checkpoint and prompts; its reward calls ``task.reward``
    (the verifier gspo's default reward source calls; unguarded) or the parity reward."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokens = []
    verifier = getattr(task, "inner", task)   # the task's own check, without gspo's call guard

    def reward(completions, completion_ids, index, **_):
        tokens.append(sum(len(ids) for ids in completion_ids))
        if a.reward == "parity":
            return [first_char_parity(c) for c in completions]
        return [verifier.reward(c, prompts[i]) for c, i in zip(completions, index)]

    reward.__name__ = a.reward
    N = a.prompts * a.group
    config = GRPOConfig(
        output_dir=str(out_dir), report_to="none", save_strategy="no", eval_strategy="no",
        use_cpu=True, bf16=False, fp16=False, seed=a.seed, data_seed=a.seed,
        max_steps=a.minibatches * (a.warmup + a.rounds * a.steps),
        per_device_train_batch_size=N // a.minibatches, gradient_accumulation_steps=1,
        steps_per_generation=a.minibatches, num_iterations=1, num_generations=a.group,
        max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        beta=0.0, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, scale_rewards="group", shuffle_dataset=False,
        logging_steps=a.minibatches, disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False,
        gradient_checkpointing=a.trl_gradient_checkpointing,  # TRL's default is True; gspo: off
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    dataset = Dataset.from_list([{"prompt": ex.prompt, "index": i} for i, ex in enumerate(prompts)])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[callback])
    return trainer, tokens


def make_callback(a: argparse.Namespace, gspo: GspoRunner, results: dict):
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        """At each RL-step boundary, time TRL's step; at round boundaries, run a gspo round."""

        def __init__(self):
            self.mark, self.rl_step = None, 0

        def on_train_begin(self, args, state, control, **kw):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % a.minibatches:
                return
            seconds = time.perf_counter() - self.mark
            self.rl_step += 1
            if self.rl_step > a.warmup:
                results["trl_seconds"].append(seconds)
                results["trl_tokens"].append(results["trl_token_log"][-1])
            measured = self.rl_step - a.warmup
            if measured == 0:
                gspo.run(a.warmup, measure=False)
            if measured >= 0 and measured % a.steps == 0 and measured < a.rounds * a.steps:
                gspo.run(a.steps)                     # outside TRL's clock
            self.mark = time.perf_counter()

    return Interleave()


# ----------------------------------------------------------------------------- main

def bench_preset(a: argparse.Namespace, preset: str, tmp: Path) -> dict:
    from gspo import tasks
    from gspo.models.presets import build_model, save_model
    from gspo.rollout.collect import DataCursor

    if a.init == "coldstart":                       # gspo's cold start of the job, cached
        from gspo.rollout.data import build_task
        from gspo.training.cold_start import initial_policy
        cfg = job_config(a, preset)
        _, _, info = initial_policy(cfg, build_task(cfg), log=print, progress=False)
        checkpoint = Path(info["checkpoint"])
    else:
        checkpoint = tmp / preset
        model, tokenizer = build_model(preset, a.seed)
        save_model(model, tokenizer, checkpoint)
    gspo = GspoRunner(a, checkpoint, tmp / f"{preset}-gspo")
    task = gspo.trainer.task
    train = task.split("train")
    steps = a.warmup + a.rounds * a.steps
    order = DataCursor(len(train), a.seed).take(a.prompts * steps)   # gspo's prompts, in order
    results = {"trl_seconds": [], "trl_tokens": []}
    trainer, token_log = trl_trainer(a, checkpoint, tmp / f"{preset}-trl", [train[i] for i in order],
                                     task, make_callback(a, gspo, results))
    results["trl_token_log"] = token_log
    try:
        trainer.train()
    finally:
        gspo.close()
    g, t = statistics.median(gspo.seconds), statistics.median(results["trl_seconds"])
    gm, tm = statistics.mean(gspo.seconds), statistics.mean(results["trl_seconds"])
    n = a.steps     # gspo's round r runs just before TRL's steps r*n .. r*n+n-1: neighbours in time
    rounds = [sum(results["trl_seconds"][i:i + n]) / sum(gspo.seconds[i:i + n])
              for i in range(0, len(gspo.seconds), n)]
    return {
        "preset": preset, "gspo_s": gspo.seconds, "trl_s": results["trl_seconds"],
        "gspo_median_s": g, "trl_median_s": t, "speedup": t / g,
        "gspo_mean_s": gm, "trl_mean_s": tm, "speedup_mean": tm / gm,
        "speedup_rounds": rounds, "speedup_rounds_median": statistics.median(rounds),
        "gspo_tokens_per_s": statistics.median(gspo.tokens) / g,
        "trl_tokens_per_s": statistics.median(results["trl_tokens"]) / t,
        "gspo_tokens_per_step": statistics.median(gspo.tokens),
        "trl_tokens_per_step": statistics.median(results["trl_tokens"]),
        "gspo_breakdown": gspo.breakdown(),
        "frac_zero_std_groups": statistics.mean(r["reward/frac_zero_std_groups"] for r in gspo.rows),
        "rows_skipped": statistics.mean(r.get("train/rows_skipped", 0) for r in gspo.rows),
    }


def main() -> int:
    a = _args()
    resolve_shapes(a)
    torch.set_num_threads(a.threads)
    import transformers
    import trl
    transformers.utils.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"init={a.init} reward={a.reward} P={a.prompts} G={a.group} max_new_tokens={a.max_new_tokens} M={a.minibatches} "
          f"lr={a.lr}; warm-up {a.warmup}, {a.rounds} rounds x {a.steps} steps each, interleaved")
    print("gspo: " + ("synchronous" if a.gspo_async is None else
                      f"asynchronous rollouts, max_staleness {a.gspo_async}")
          + "; TRL: synchronous, gradient checkpointing " + ("on (its default)" if
                                                            a.trl_gradient_checkpointing else "off"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.preset:
            r = bench_preset(a, preset, Path(tmp))
            results.append(r)
            print(f"\n{preset}: seconds per RL step, gspo {' '.join(f'{s:.3f}' for s in r['gspo_s'])}")
            print(f"{preset}: seconds per RL step, TRL  {' '.join(f'{s:.3f}' for s in r['trl_s'])}")
    print(f"\n{'preset':<11} {'gspo s/step':>11} {'TRL s/step':>11} {'TRL/gspo':>9} "
          f"{'gspo tok/s':>10} {'TRL tok/s':>10} {'mean: gspo':>10} {'TRL':>6} {'TRL/gspo':>9}")
    for r in results:
        print(f"{r['preset']:<11} {r['gspo_median_s']:>11.3f} {r['trl_median_s']:>11.3f} "
              f"{r['speedup']:>8.2f}x {r['gspo_tokens_per_s']:>10.0f} {r['trl_tokens_per_s']:>10.0f} "
              f"{r['gspo_mean_s']:>10.3f} {r['trl_mean_s']:>6.3f} {r['speedup_mean']:>8.2f}x")
    for r in results:
        print(f"{r['preset']}: TRL/gspo per round (each round's seconds, gspo's round against the "
              f"TRL steps right after it) {' '.join(f'{x:.2f}' for x in r['speedup_rounds'])}, "
              f"median {r['speedup_rounds_median']:.2f}x")
    for r in results:
        shares = ", ".join(f"{k} {v:.1%}" for k, v in r["gspo_breakdown"].items())
        print(f"gspo time shares ({r['preset']}): {shares}")
        print(f"gspo ({r['preset']}): groups without signal {r['frac_zero_std_groups']:.1%}, "
              f"rows skipped {r['rows_skipped']:.1f} of {a.prompts * a.group}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
