"""rollout.engine=vllm under torchrun: an engine per rank, each sampling its share of the prompts
(skipped where vLLM is not installed; `make test-vllm` runs this file in a pytest process of its
own).

Why 2 ranks can repeat 1 process: vLLM seeds prompt p of a call with seed + p (a generator per
request), and each rank's seed is the step's offset by the index of its first prompt, so the
ranks' shares are sampled exactly as the one-process call samples them (the per-rank engine is
built from the architecture alone and gets its weights by the in-place sync, bit-equal to the
checkpoint the one-process engine loads). The update then differs from one process only by the
order in which gradients are summed over ranks.

* 2 ranks (ddp) vs 1 process, 3 steps: every reward, response and evaluation metric equal
  (the same tokens were sampled); losses and ratios equal to 1e-5 relative, clip fractions to a
  few tokens (sums over rows that the ranks add in another order; conftest.update_metric_close),
  mismatch/* (the engine's gaps to the trainer, ~1e-7 each) within the engine's tolerance. The
  weights are not compared: gradients summed in another order differ by rounding, and AdamW's
  division by sqrt(v) + 1e-8 turns that into a CPU-dependent difference in near-zero entries
  (docs/reliability.md); the metrics of steps 2-3, sampled from those weights, are the comparison.
* fsdp, resumed from the ddp run's step-1 checkpoint: the engines are synced from weights
  gathered one tensor at a time, and on every step their log-probs equal the trainer's to TOL
  (a wrong or missed sync is off by > 1e-3, test_vllm_train.py).
* rollout.engine_tp=2 (one engine over both ranks): its log-probs the trainer's on every step.
* stopped after step 1 and resumed under torchrun (ddp): the run repeats the uninterrupted one
  exactly on this machine (metrics but time/*, final weights).
* rollout.async (s = 1, a thread worker per rank through its engine): 2 ranks sample as the
  1-process asynchronous run.
"""

import json
import os
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("vllm")

from gspo.models.presets import load_model  # noqa: E402
from gspo.observe.metrics import read_metrics  # noqa: E402
from conftest import LAYOUT_METRICS, gspo_command, update_metric_close  # noqa: E402

STEPS = 3
TOL = 5e-5
"""vLLM's float32 log-probs against the trainer's (as test_vllm_train.py)."""
RUN = ["configs/default.yaml", "rollout.engine=vllm", "sft.steps=150", f"train.steps={STEPS}",
       "train.lr=1e-3", "rollout.prompts_per_step=8", "rollout.group_size=4", "task.n_test=8",
       "run.eval_every=0", "run.trackers=[]", "run.progress=false", "run.save_every=1",
       "run.keep_checkpoints=4"]
SAMPLED = ("reward/", "response/", "eval/")
"""What the samples alone decide: equal (reward/std aside, pooled from the ranks' stds); the
rest (losses, ratios, mismatch/*) are sums over rows that the ranks add in another order."""


def gspo(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run([*gspo_command(ranks), *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


RANKS_ONLY = "perf/rank_tokens_"
"""Metrics of torchrun alone (train.balance_ranks: how the minibatches' tokens lie on the ranks)."""


def timeless(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def weights(run, step=STEPS):
    return load_model(run / "checkpoints" / f"step_{step:06d}")[0].state_dict()


def stopped_after_step_1(run, into):
    """A copy of ``run`` as if it had been stopped right after step 1's checkpoint."""
    shutil.copytree(run, into)
    for later in range(2, STEPS + 1):
        shutil.rmtree(into / "checkpoints" / f"step_{later:06d}")
    (into / "summary.json").unlink()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and 2 ranks (ddp), the same job, the cold start shared."""
    root = tmp_path_factory.mktemp("vllm-torchrun")
    cache = f"sft.cache_dir={root / 'sft'}"
    gspo("train", *RUN, f"run.dir={root / 'one'}", cache)
    gspo("train", *RUN, f"run.dir={root / 'two'}", cache, ranks=2)
    return root


def test_two_ranks_sample_and_train_as_one_process(runs):
    one, two = timeless(read_metrics(runs / "one")), timeless(read_metrics(runs / "two"))
    assert [r["step"] for r in two] == list(range(STEPS + 1))
    assert all("mismatch/kl" in r for r in two[1:])           # every step sampled through vLLM
    assert any(r["reward/std"] > 0 for r in two[1:])          # and trained on some signal
    assert all(RANKS_ONLY + "max_over_mean" in r for r in two[1:])   # the loads of the ranks
    for a, b in zip(one, two):
        b = {k: v for k, v in b.items() if not k.startswith(RANKS_ONLY)}
        assert a.keys() == b.keys(), a["step"]
        for key in a:
            if key.startswith(SAMPLED) and key != "reward/std":
                assert b[key] == a[key], (a["step"], key, a[key], b[key])
            elif key.startswith("mismatch/"):     # engine vs trainer gaps, each within TOL
                assert b[key] == pytest.approx(a[key], abs=TOL), (a["step"], key)
            else:                         # sums in another order; token shares to a few tokens
                assert update_metric_close(key, b[key], a[key]), (a["step"], key, a[key], b[key])


def test_fsdp_engines_are_synced_from_gathered_shards(runs, tmp_path):
    run = tmp_path / "fsdp"
    stopped_after_step_1(runs / "two", run)
    gspo("train", "--resume", str(run), "dist.strategy=fsdp", ranks=2)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for r in rows[2:]:            # engines built fresh, synced from the sharded weights each step
        assert r["mismatch/token_abs_max"] < TOL, r
    ddp = read_metrics(runs / "two")
    assert [r["reward/mean"] for r in rows[2:]] == pytest.approx([r["reward/mean"] for r in ddp[2:]])


def test_lora_adapters_reach_every_ranks_engine_after_each_step(runs, tmp_path):
    """LoRA under torchrun (ddp): each rank's vLLM engine samples the merged weights of the
    adapters as the last update left them, so its log-probs are the trainer's at every step."""
    run = tmp_path / "lora"
    gspo("train", *RUN, f"run.dir={run}", f"sft.cache_dir={runs / 'sft'}", "model.lora={r: 4, alpha: 8}",
         "train.lr=1e-2", ranks=2)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert any(r["optim/grad_norm"] > 0 for r in rows[1:-1])   # the adapters moved before a sampling
    for r in rows[1:]:
        assert r["mismatch/token_abs_max"] < TOL, r


def test_a_torchrun_vllm_run_resumes_exactly(runs, tmp_path):
    run = tmp_path / "resumed"
    stopped_after_step_1(runs / "two", run)
    out = gspo("train", "--resume", str(run), ranks=2)
    assert "(step 1)" in out.stderr
    assert timeless(read_metrics(run)) == timeless(read_metrics(runs / "two"))
    assert json.loads((run / "summary.json").read_text())["eval_after"] == \
        json.loads((runs / "two" / "summary.json").read_text())["eval_after"]
    a, b = weights(runs / "two"), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_tensor_parallel_engine_over_both_ranks_samples_their_shares_together(runs, tmp_path):
    """rollout.engine_tp=2: one engine split over the 2 ranks, which sample the step's 8 prompts
    together and each keep their own 4 (and evaluate together). On every step the engine's
    log-probs equal the trainer's to TOL, which rows kept with the wrong prompt would break (their
    tokens were sampled after another prompt); the seeds are an engine per rank's, so the samples
    are the same up to a draw the split's summation order tips (observed: rewards equal; asserted
    to within 2 of the 32 rows)."""
    run = tmp_path / "tp"
    gspo("train", *RUN, f"run.dir={run}", f"sft.cache_dir={runs / 'sft'}", "rollout.engine_tp=2",
         "run.save_every=0", ranks=2)
    rows, per_rank = read_metrics(run), read_metrics(runs / "two")
    assert all(r["mismatch/token_abs_max"] < TOL for r in rows[1:])
    two_rows = {"reward/mean": 2 / 32, "reward/accuracy": 2 / 32,
                "response/length_mean": 2 * 16 / 32}          # 2 of 32 rows, 16 tokens at most
    for key, tol in two_rows.items():
        assert [r[key] for r in rows[1:]] == pytest.approx([r[key] for r in per_rank[1:]],
                                                           abs=tol), key


def test_asynchronous_rollouts_on_two_ranks_sample_as_one_process(runs, tmp_path):
    """rollout.async (s = 1) under torchrun with vllm: each rank's worker (a thread, derived)
    samples its share through the rank's engine, ahead of its trainer; the 2-rank run samples
    what the 1-process asynchronous run samples (rewards, responses, evaluations equal; the
    staleness 0, 1, 1 of one process) and the rest agrees to 1e-4 (sums in another order)."""
    s1 = ("rollout.async=true", "rollout.max_staleness=1", "run.save_every=0",
          f"sft.cache_dir={runs / 'sft'}")
    gspo("train", *RUN, f"run.dir={tmp_path / 'one'}", *s1, "rollout.async_worker=thread")
    gspo("train", *RUN, f"run.dir={tmp_path / 'two'}", *s1, ranks=2)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r.get("async/staleness") for r in two[1:]] == [0.0, 1.0, 1.0]
    for a, b in zip(one, two):
        for key in (k for k in a if not k.startswith(("time/", "async/"))
                    and k not in LAYOUT_METRICS):
            if key.startswith(SAMPLED) and key != "reward/std":
                assert b[key] == a[key], (a["step"], key, a[key], b[key])
            elif key.startswith("mismatch/"):
                assert b[key] == pytest.approx(a[key], abs=TOL), (a["step"], key)
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
