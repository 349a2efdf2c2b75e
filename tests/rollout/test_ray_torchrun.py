"""Generators on Ray for a torchrun trainer (rollout.placement=ray, 2 ranks, ddp): rank 0 alone
talks to the generators and hands each rank the samples of the whole batch
(gspo.rollout.ray_generators.RankZero); each rank keeps its own rows.

Why 2 ranks can repeat the colocated process: rank 0 samples every prompt with the one-process
seed (a single hf generator seeded as the colocated engine is, its weights bit-equal after each
sync: tests/rollout/test_ray_engine.py), so the batch is the one-process batch; the update differs from
one process only by the order in which gradients are summed over ranks.

* 2 ranks on Ray vs 1 colocated process, 3 steps: every reward, response and evaluation metric
  equal (the same tokens, sampled and evaluated with the weights after steps 1 and 2), the rest
  (sums over rows the ranks add in another order) to 1e-5 relative, shares of tokens past a
  threshold (clip fractions) to a few tokens (conftest.update_metric_close: a ratio at the clip
  boundary can round to the other side; seen once); one weight sync per step,
  the cluster gone after. The weights themselves are not compared: after AdamW a rounding-sized
  gradient difference can move a weight by up to 2 lr (conftest.linear_optimizer).
* fsdp with Ray under torchrun: refused, one line (a gather to rank 0 is not built).
"""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from gspo.config.resolve import Environment, resolve
from gspo.config import load_config
from gspo.observe.metrics import read_metrics
from conftest import gspo_command, update_metric_close

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'gspo[ray]')")
pytestmark = pytest.mark.usefixtures("ray_without_auth")

STEPS = 3
RUN = ["configs/default.yaml", "sft.steps=150", f"train.steps={STEPS}", "train.lr=1e-3",
       "rollout.prompts_per_step=8", "rollout.group_size=4", "task.n_test=8", "eval.k=1",
       "run.eval_every=2", "run.trackers=[]", "run.progress=false", "run.save_every=0"]
SAMPLED = ("reward/", "response/", "eval/")
"""What the samples alone decide: equal (reward/std aside, pooled from the ranks' stds)."""


def gspo(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*gspo_command(ranks), *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def clusters_left() -> set[str]:
    return {p.name for p in Path("/tmp").glob("gspo-ray-*")}


def plain(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "ray/"))} for r in rows]


@needs_ray
def test_two_ranks_on_ray_train_as_one_colocated_process(tmp_path):
    before = clusters_left()
    cache = f"sft.cache_dir={tmp_path / 'sft'}"
    gspo("train", *RUN, f"run.dir={tmp_path / 'one'}", cache)
    gspo("train", *RUN, f"run.dir={tmp_path / 'two'}", cache, "rollout.placement=ray", ranks=2)
    raw = read_metrics(tmp_path / "two")
    one, two = plain(read_metrics(tmp_path / "one")), plain(raw)
    assert [r["step"] for r in two] == list(range(STEPS + 1))
    assert all(r["ray/sync_mb"] > 0 for r in raw[2:])          # a sync before each later step
    assert any(r["reward/std"] > 0 for r in two[1:])           # trained on some signal
    assert "eval/accuracy" in two[2]
    for a, b in zip(one, two):                # torchrun's own: how the ranks' loads compare
        b = {k: v for k, v in b.items() if not k.startswith("perf/rank_tokens_")}
        assert a.keys() == b.keys(), a["step"]
        for key in a:
            if key.startswith(SAMPLED) and key != "reward/std":
                assert b[key] == a[key], (a["step"], key, a[key], b[key])
            else:                         # sums in another order; token shares to a few tokens
                assert update_metric_close(key, b[key], a[key]), (a["step"], key, a[key], b[key])
    assert clusters_left() <= before                           # the local cluster ended


def test_fsdp_on_ray_under_torchrun_is_refused(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "rollout.placement=ray",
                             "dist.strategy=fsdp"])
    with pytest.raises(ValueError, match="dist.strategy=fsdp") as err:
        resolve(cfg, Environment(world_size=2))
    assert "\n" not in str(err.value)
    resolve(cfg.model_copy(update={"dist": cfg.dist.model_copy(update={"strategy": "ddp"})}),
            Environment(world_size=2))                          # ddp: served
