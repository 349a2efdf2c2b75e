"""rollout.async under torchrun (dist.strategy=ddp, hf): a worker per rank, each sampling its
rank's share of the prompts ahead of the trainer with its own copy of the policy, through the
same batch source as in one process (the version arithmetic is per rank and the same on all).

* s = 0 on 2 ranks (the process worker) is the synchronous 2-rank run: every metric but time/*
  and async/* equal, final weights bit-equal (the same samples, the same update on each rank).
* s = 1 on 2 ranks: the thread and the process worker give the same run (metrics, weights),
  with the staleness 0, 1, 1 of one process.
* What a worker per rank cannot serve is refused in one line: fsdp, dynamic sampling, a vllm
  process worker, generators on Ray; with vllm the worker is derived a thread (its runs:
  tests/rollout/test_vllm_torchrun.py).
"""

import os
import subprocess

import pytest
import torch

from gspo.config import load_config
from gspo.config.resolve import Environment, resolve
from gspo.models.presets import load_model
from gspo.observe.metrics import read_metrics
from conftest import gspo_command

STEPS = 3
RUN = ["configs/default.yaml", "sft.steps=150", f"train.steps={STEPS}", "train.lr=1e-3",
       "rollout.prompts_per_step=8", "rollout.group_size=4", "task.n_test=8", "eval.k=1",
       "run.eval_every=2", "run.trackers=[]", "run.progress=false", "run.save_every=0"]


def two_ranks(*args: str) -> None:
    out = subprocess.run([*gspo_command(ranks=2), "train", *RUN, *args],
                         env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]


def plain(run):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/"))}
            for r in read_metrics(run)]


def assert_same_weights(a, b):
    wa, wb = (load_model(r / "checkpoints" / f"step_{STEPS:06d}")[0].state_dict() for r in (a, b))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"sft.cache_dir={tmp_path_factory.mktemp('sft')}"


def test_staleness_zero_on_two_ranks_is_the_synchronous_run(tmp_path, cache):
    """The synchronous run keeps each rank's own rows (train.balance_ranks=none), as rollout.async
    must: dealt rows would sum the same loss in another order."""
    two_ranks(f"run.dir={tmp_path / 'sync'}", cache, "train.balance_ranks=none")
    two_ranks(f"run.dir={tmp_path / 's0'}", cache, "rollout.async=true", "rollout.max_staleness=0",
              "rollout.async_worker=process")
    sync, s0 = plain(tmp_path / "sync"), plain(tmp_path / "s0")
    assert [r["step"] for r in s0] == list(range(STEPS + 1)) and "eval/accuracy" in s0[2]
    assert any(r["reward/std"] > 0 for r in s0[1:])
    assert s0 == sync
    assert_same_weights(tmp_path / "sync", tmp_path / "s0")


def test_staleness_one_on_two_ranks_thread_and_process_workers_agree(tmp_path, cache):
    s1 = ("rollout.async=true", "rollout.max_staleness=1")
    two_ranks(f"run.dir={tmp_path / 'thread'}", cache, *s1, "rollout.async_worker=thread")
    two_ranks(f"run.dir={tmp_path / 'process'}", cache, *s1, "rollout.async_worker=process")
    thread = read_metrics(tmp_path / "thread")
    assert [r.get("async/staleness") for r in thread[1:]] == [0.0, 1.0, 1.0]
    assert plain(tmp_path / "thread") == plain(tmp_path / "process")
    assert_same_weights(tmp_path / "thread", tmp_path / "process")


@pytest.mark.parametrize("override, message", [
    ("dist.strategy=fsdp", "dist.strategy=fsdp"),
    ("train.dynamic_sampling=true", "train.dynamic_sampling"),
    ("rollout.engine=vllm rollout.async_worker=process", "rollout.engine=vllm and rollout.async_worker=process"),
    ("rollout.placement=ray", "rollout.placement=ray"),
])
def test_what_a_worker_per_rank_cannot_serve_is_refused(tmp_path, override, message):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "rollout.async=true", *override.split()])
    with pytest.raises(ValueError, match=f"rollout.async=true cannot serve torchrun with {message}") as err:
        resolve(cfg, Environment(world_size=2))
    assert "\n" not in str(err.value)


def test_with_vllm_the_worker_is_a_thread_through_the_ranks_engine(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "rollout.async=true",
                             "rollout.engine=vllm"])
    out = resolve(cfg, Environment(world_size=2))
    assert out.config.rollout.async_worker == "thread"
    assert out.derived["rollout.async_worker"].startswith("thread (torchrun with rollout.engine=vllm")
