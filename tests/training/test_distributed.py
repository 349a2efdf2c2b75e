"""Two ranks against one process (gspo.training.distributed): the same loss, gradient and update.

The batch is split unevenly (P = 5 prompts on 2 ranks: 3 + 2 prompts, 9 + 6 responses of random
lengths, some empty), so the ranks hold different numbers of sequences and response tokens, and
some minibatches hold no row of a rank (its masked-out placeholder row must change nothing).

* ``test_two_ranks_equal_one_process_every_objective_and_aggregation``: a plain float64 parameter
  -> log-probs; every registered objective under every aggregation mode, M = 3 and M = 8
  minibatches: the summed loss and the summed gradient equal the single process's to 1e-6 (they
  agree to ~1e-15: the global normalisers make each rank's loss its exact part of the whole);
  advantage.scale=batch advantages equal the single process's.
* ``test_trainer_update_two_ranks_equals_one_process``: ``Trainer.update`` on tiny-dense, ddp (with
  the speed plan: skipped rows, first-minibatch π_old) and fsdp (FSDP2), two updates each, with an
  optimizer whose update is linear in the gradient (SGD with momentum, ``conftest.linear_optimizer``:
  after AdamW, weights are only equal to a CPU-dependent tolerance); the weights rank 0
  checkpoints, the optimizer state and the logged metrics equal the single process's; the 2-rank
  checkpoint resumes in one process.
Processes: torch.multiprocessing spawn, gloo on 127.0.0.1 with a free port.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from conftest import UPDATE_REL, free_port, gspo_command, linear_optimizer, update_mismatch

from gspo.training import distributed
from gspo.core import objectives
from gspo.core.advantages import group_advantages
from gspo.observe import reductions
from gspo.training.distributed import Dist
from gspo.core.plan import split_minibatches
from gspo.training.old_policy import OldLogprobs

P, G, T, V, H = 5, 3, 6, 11, 4   # prompts, group size, response columns, vocabulary, features
WORLD = 2


# ----------------------------------------------------------------------------- helpers

def _spawn(fn, *args) -> None:
    torch.multiprocessing.spawn(fn, args=(WORLD, free_port(), *args), nprocs=WORLD, join=True)


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                  world_size=world)


def _rows(rank: int, world: int) -> torch.Tensor:
    """The rows of rank's share of the P prompts (G rows each)."""
    prompts = range(P)[Dist(rank=rank, world=world).share(P)]
    return torch.arange(prompts.start * G, prompts.stop * G)


# ----------------------------------------------------------------------------- pure pieces

def test_shares_tile_the_prompts_and_differ_by_at_most_one():
    for n, k in [(5, 2), (7, 3), (4, 4), (16, 3)]:
        shares = [range(n)[Dist(rank=r, world=k).share(n)] for r in range(k)]
        assert [i for s in shares for i in s] == list(range(n))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert len(shares[0]) >= len(shares[-1])          # the first n mod K ranks take one more


def test_a_group_share_is_its_ranks_shares_together():
    """rollout.engine_tp: the ranks of one engine sample their shares as one contiguous block."""
    for n, k, size in [(8, 2, 2), (7, 4, 2), (9, 6, 3), (5, 2, 1)]:
        for r in range(k):
            first = r - r % size
            members = [range(n)[Dist(rank=m, world=k).share(n)] for m in range(first, first + size)]
            group = range(n)[Dist(rank=r, world=k).group_share(n, size)]
            assert list(group) == [i for s in members for i in s]
        assert Dist(rank=1, world=k).group_share(n, 1) == Dist(rank=1, world=k).share(n)


def test_an_engine_seeding_each_prompt_is_seeded_at_the_first_prompt_of_the_share():
    """vllm seeds prompt p of a call with seed + p: rank r's seed is the step's plus the index of
    its first prompt (its tensor-parallel group's with engine_tp), so K ranks sample the one-call
    batch; hf draws one generator per call: each rank its own seed (rank 0's the one-process one)."""
    from gspo.config import TrainConfig
    from gspo.rollout.shares import RankShares, rollout_seed
    from gspo.training.collectives import RANK_SEED_STRIDE

    def seed(engine, rank, world, tp=1):
        cfg = TrainConfig.model_validate({"rollout": {"engine": engine, "prompts_per_step": 10,
                                                      "engine_tp": tp}})
        return RankShares(cfg.rollout, cfg.seed, Dist(rank=rank, world=world)).seed(3, 1)

    base = rollout_seed(0, 3, 1)
    assert [seed("vllm", r, 3) for r in range(3)] == [base, base + 4, base + 7]
    assert [seed("vllm", r, 4, tp=2) for r in range(4)] == [base, base, base + 6, base + 6]
    assert seed("hf", 0, 2) == base and seed("hf", 1, 2) == base + RANK_SEED_STRIDE


def test_one_process_minibatches_are_the_trainers():
    a = Dist().minibatch_rows(10, 4, torch.Generator().manual_seed(3))
    b = split_minibatches(10, 4, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_rank_minibatches_are_the_single_process_minibatches(monkeypatch):
    """Minibatch m of one process = the union over ranks of their rows of minibatch m."""
    sizes = [9, 6, 4]
    single = split_minibatches(sum(sizes), 4, torch.Generator().manual_seed(7))
    monkeypatch.setattr(Dist, "sizes", lambda self, n: sizes)
    per_rank = [Dist(rank=r, world=3).minibatch_rows(sizes[r], 4, torch.Generator().manual_seed(7))
                for r in range(3)]
    offsets = [0, 9, 15]
    for m, part in enumerate(single):
        union = torch.cat([rows[m] + off for rows, off in zip(per_rank, offsets)])
        assert sorted(union.tolist()) == sorted(part.tolist())


def test_rank_minibatches_of_groups_are_the_single_process_minibatches(monkeypatch):
    """train.minibatch_by=groups under ranks: each rank holds whole groups of G; the union over
    ranks of minibatch m is the single process's minibatch m, and no group is split."""
    G, sizes = 4, [12, 8, 8]
    single = split_minibatches(sum(sizes), 3, torch.Generator().manual_seed(5), G)
    monkeypatch.setattr(Dist, "sizes", lambda self, n: sizes)
    per_rank = [Dist(rank=r, world=3).minibatch_rows(sizes[r], 3, torch.Generator().manual_seed(5), G)
                for r in range(3)]
    offsets = [0, 12, 20]
    for m, part in enumerate(single):
        union = torch.cat([rows[m] + off for rows, off in zip(per_rank, offsets)])
        assert sorted(union.tolist()) == sorted(part.tolist())
        for rows in per_rank:
            assert len(rows[m]) % G == 0 and bool((rows[m].view(-1, G)[:, 0] % G == 0).all())


def test_metric_reduction_rules():
    c = reductions.combine
    assert c("policy/loss", [(1.0, 5), (2.0, 0)]) == 3.0                  # parts of a global loss
    assert c("policy/clip_frac_tokens", [(0.5, 3), (0.0, 1)]) == 0.375     # weighted mean
    assert c("policy/ratio_max", [(1.2, 3), (1.0, 0)]) == 1.2              # placeholder left out
    assert c("policy/ratio_min", [(0.9, 3), (1.0, 0)]) == 0.9
    assert c("time/generate_s", [(1.0, 3), (2.0, 1)]) == 2.0
    assert c("optim/grad_norm", [(0.7, 3), (0.7, 1)]) == 0.7               # the same everywhere
    # pooled std: the Bessel std of the union of both ranks' samples
    a, b = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([3.0, 5.0])
    parts = [(x.std().item(), x.mean().item(), len(x)) for x in (a, b)]
    assert reductions.pooled_std(parts) == pytest.approx(torch.cat([a, b]).std().item())


def test_each_metric_reduces_as_declared():
    """Keys look up their declaration exactly, then by template; a length bucket's stats are
    weighted by the bucket's rows, its frac by the rank's rows; an undeclared key is a mean."""
    assert [reductions.reduction(k) for k in ("time/old_logprobs_s", "length/1-2/frac",
                                              "length/1-2/reward", "reward/std", "moe/aux_loss")] \
        == [reductions.MAX, reductions.MEAN, reductions.BUCKET_MEAN, reductions.POOLED_STD,
            reductions.MEAN]
    assert reductions.per_seq("policy/ratio_mean", True) and not reductions.per_seq(
        "policy/ratio_mean", False) and reductions.per_seq("policy/clip_frac_seqs", False)
    # rank 0: rewards [1, 1, 0], 2 of its 3 rows in bucket 1-2 (their reward 0.5 on average);
    # rank 1: reward [1], its 1 row in bucket 1-2. Together: 3 of 4 rows in the bucket, whose
    # reward is (2 * 0.5 + 1 * 1) / 3 = 2/3; the rewards [1, 1, 0, 1] have mean 0.75.
    r0 = torch.tensor([1.0, 1.0, 0.0])
    everyone = [({"length/1-2/frac": 2 / 3, "length/1-2/reward": 0.5, "reward/mean": 2 / 3,
                  "reward/std": r0.std().item()}, 3.0),
                ({"length/1-2/frac": 1.0, "length/1-2/reward": 1.0, "reward/mean": 1.0,
                  "reward/std": 0.0}, 1.0)]
    out = reductions.reduce_metrics(everyone, everyone[0][0])
    assert out["length/1-2/frac"] == pytest.approx(0.75)
    assert out["length/1-2/reward"] == pytest.approx(2 / 3)
    assert out["reward/mean"] == pytest.approx(0.75)
    assert out["reward/std"] == pytest.approx(torch.tensor([1.0, 1, 0, 1]).std().item())


# ----------------------------------------------------------------------------- objectives

def _problem():
    """A fixed batch: features -> log-probs through one shared weight W [V, H] (float64)."""
    g = torch.Generator().manual_seed(0)
    N = P * G
    feats = torch.randn(N, T, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(V, (N, T), generator=g)
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    lengths[[2, 11]] = 0                                                  # empty responses
    mask = (torch.arange(T) < lengths[:, None]).double()                  # [N, T]
    w0 = 0.5 * torch.randn(V, H, generator=g, dtype=torch.float64)
    scale = torch.logspace(-4, -0.5, N, dtype=torch.float64)[torch.randperm(N, generator=g)]
    noise = scale[:, None] * torch.randn(N, T, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 3, (N,), generator=g).double()
    return feats, tokens, mask, w0, noise, rewards


def _logp(w: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(feats @ w.T, -1).gather(-1, tokens[..., None]).squeeze(-1)  # [n, T]


def _objective_runs(dist: Dist, rows: torch.Tensor) -> tuple[dict, int]:
    """{(objective, aggregation, M): [(loss, grad) per minibatch]} on ``rows`` of the batch;
    the loss and gradient summed over ranks. Also the number of placeholder minibatches."""
    feats, tokens, mask, w0, noise, rewards = _problem()
    adv = group_advantages(rewards, G)[rows]                              # groups stay whole
    feats, tokens, mask, noise = feats[rows], tokens[rows], mask[rows], noise[rows]
    holder = nn.Module()
    holder.w = nn.Parameter(w0.clone())
    old = _logp(w0, feats, tokens).detach() + noise                       # [n, T]
    out, placeholders = {}, 0
    for name in objectives.available():
        for agg in objectives.AGGREGATIONS:
            for m in (3, 8):
                results = []
                for idx in dist.minibatch_rows(len(rows), m, torch.Generator().manual_seed(m)):
                    mb_mask = mask[idx]
                    if len(idx) == 0:                     # as the trainer: one masked-out row
                        placeholders += 1
                        idx = torch.zeros(1, dtype=torch.long)
                        mb_mask = torch.zeros_like(mask[idx])
                    holder.w.grad = None
                    logp = _logp(holder.w, feats[idx], tokens[idx])
                    loss, _ = objectives.get(name)(logp, old[idx], adv[idx], mb_mask, aggregation=agg,
                                                   token_sum_norm=float(T),
                                                   **dist.global_counts(mb_mask))
                    loss.backward()
                    total = dist.sync_grads(holder, loss.detach())
                    results.append((total.item(), holder.w.grad.clone()))
                out[(name, agg, m)] = results
    return out, placeholders


def _objective_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    import warnings
    warnings.simplefilter("ignore")                       # token-mean with a sequence ratio
    dist, rows = distributed.current(), _rows(rank, world)
    rewards = _problem()[-1][rows]
    rewards[1] = float("nan")                              # a dropped sample (rewards.on_error=drop)
    everyone, own = dist.all_rewards(rewards)               # what GroupRelative does for scale=batch
    batch_adv = group_advantages(everyone, G, scale="batch", eps=1e-6)[own]
    torch.save((_objective_runs(dist, rows), batch_adv), Path(out_dir) / f"objectives_{rank}.pt")
    distributed.shutdown()


@pytest.mark.filterwarnings("ignore:aggregation 'token-mean'")
def test_two_ranks_equal_one_process_every_objective_and_aggregation(tmp_path):
    _spawn(_objective_worker, str(tmp_path))
    single, _ = _objective_runs(Dist(), torch.arange(P * G))
    saved = [torch.load(tmp_path / f"objectives_{r}.pt") for r in range(WORLD)]
    ranks = [runs for runs, _ in saved]
    # advantage.scale=batch: the std of every rank's rewards, as one process computes it
    rewards = _problem()[-1]
    rewards[torch.tensor([1, int(_rows(1, WORLD)[1])])] = float("nan")
    expected = group_advantages(rewards, G, scale="batch", eps=1e-6)
    assert torch.allclose(torch.cat([adv for _, adv in saved]).float(), expected.float(), atol=1e-6)
    assert sum(placeholders for _, placeholders in ranks) > 0   # the empty-share path ran
    assert {"gspo", "gspo_token", "grpo"} <= {name for name, _, _ in single}
    for key, expected in single.items():
        for got, _ in ranks:
            assert len(got[key]) == len(expected), key
            for (loss, grad), (loss1, grad1) in zip(got[key], expected):
                assert loss == pytest.approx(loss1, abs=1e-6, rel=0), key
                assert torch.allclose(grad, grad1, rtol=0, atol=1e-6), key
                assert (grad - grad1).abs().max() < 1e-12, key  # in fact equal to rounding


# ----------------------------------------------------------------------------- the trainer

TRAIN = [
    "task.n_train=40", "task.n_test=4", "sft.enabled=false",
    f"rollout.prompts_per_step={P}", f"rollout.group_size={G}", "rollout.max_new_tokens=6",
    "train.minibatches=5", "train.lr=0.1", "objective.name=grpo",   # SGD: moves weights ~1e-2
    "eval.n=2", "eval.k=1", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
    "model.overrides={num_hidden_layers: 2}",
]
TRAINER_METRICS = ["policy/loss", "optim/grad_norm", "policy/clip_frac_tokens", "policy/approx_kl",
                   "policy/ratio_mean", "policy/ratio_max", "policy/clip_frac_seqs"]


def _trainer_updates(run_dir: Path, strategy: str, optimized: bool, *extra: str) -> tuple:
    """Two ``RLStep.update`` calls (SGD) on a fixed global batch (this rank's share of it);
    ``extra``: more overrides."""
    from gspo.config import load_config
    from gspo.training.trainer import Trainer
    cfg = load_config(None, [*TRAIN, f"run.dir={run_dir}", f"dist.strategy={strategy}", *extra])
    trainer = Trainer(cfg)
    with mock.patch("gspo.training.trainer.build_optimizer", linear_optimizer):
        trainer.setup()
    trainer.start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    dist = trainer.dist
    examples = trainer.train_set[:P]
    history = []
    for step in range(2):
        batch = trainer.collector.generate(examples, seed=100 + step)      # the same on every rank
        rewards = torch.tensor([float(len(c) % 3) for c in batch.completions])
        advantages = group_advantages(rewards, G)
        rows = _rows(dist.rank, dist.world)
        batch, advantages = batch.select(rows), advantages[rows]
        plan = trainer.step.plan(batch, advantages, step, speed_paths=optimized)
        old = trainer.step.old_logprobs(batch, rows=plan.old_rows)
        metrics = trainer.step.update(batch, OldLogprobs(old, advantages), plan)[0]
        history.append({k: metrics[k] for k in TRAINER_METRICS})
    trainer.save(2, 0.0)
    return trainer, history


def _trainer_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    for strategy, optimized in (("ddp", True), ("fsdp", False)):
        trainer, history = _trainer_updates(Path(root) / f"two-{strategy}", strategy, optimized)
        if strategy == "ddp":    # the replicas stay equal bit for bit
            history.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        torch.save(history, Path(root) / f"history_{strategy}_{rank}.pt")
    distributed.shutdown()


@pytest.mark.slow
def test_trainer_update_two_ranks_equals_one_process(tmp_path, monkeypatch):
    from gspo.core import logprobs
    from gspo.training.checkpoint import load_latest
    from gspo.models.presets import load_model
    from gspo.training.trainer import Trainer
    _spawn(_trainer_worker, str(tmp_path))
    for strategy, optimized in (("ddp", True), ("fsdp", False)):
        if strategy == "fsdp":  # fsdp ranks run each prompt per row (no shared-prompt pass): so
            # does the reference, else float rounding, amplified by Adam, is all the test sees
            monkeypatch.setattr(logprobs, "_shared_prompt_hidden", lambda *args, **kwargs: None)
        one, history = _trainer_updates(tmp_path / f"one-{strategy}", strategy, optimized)
        assert all(row["optim/grad_norm"] > 0 for row in history)    # the updates move the weights
        if strategy == "ddp":
            replicas = [torch.load(tmp_path / f"history_ddp_{r}.pt")[-1] for r in range(WORLD)]
            assert all(torch.equal(replicas[0][n], replicas[1][n]) for n in replicas[0])
        for rank in range(WORLD):                       # every rank logs the same numbers
            got = torch.load(tmp_path / f"history_{strategy}_{rank}.pt")[:len(history)]
            for step, (row, row1) in enumerate(zip(got, history)):
                for key in TRAINER_METRICS:
                    assert row[key] == pytest.approx(row1[key], rel=1e-4, abs=1e-6), (strategy, step, key)
        two = load_latest(tmp_path / f"two-{strategy}")     # written by rank 0
        weights, _ = load_model(two.path)
        expected = {n: p.detach() for n, p in one.model.named_parameters()}
        got = {n: p.detach() for n, p in weights.named_parameters()}
        assert got.keys() == expected.keys()
        assert update_mismatch(one.start, expected, got) < UPDATE_REL, strategy
        state, state1 = two.optimizer["state"], one.optimizer.state_dict()["state"]
        assert state.keys() == state1.keys()
        zero = {i: torch.zeros_like(state1[i]["momentum_buffer"]) for i in state1}
        buffers = [{i: s[i]["momentum_buffer"] for i in s} for s in (state1, state)]
        assert update_mismatch(zero, *buffers) < UPDATE_REL, strategy
        # the 2-rank checkpoint resumes in one process (data cursor and steps are global)
        resumed = Trainer(one.cfg.model_copy(update={"run": one.cfg.run.model_copy(
            update={"dir": str(tmp_path / f"two-{strategy}")})}), resume=True)
        monkeypatch.setattr("gspo.training.trainer.build_optimizer", linear_optimizer)
        resumed.setup()
        assert resumed.start_step == 2
        for name, p in resumed.model.named_parameters():
            assert torch.equal(p.detach(), got[name]), (strategy, name)     # what rank 0 saved


# ----------------------------------------------------------------------------- balanced ranks

BALANCED = ["train.minibatches=3", "train.balance_ranks=tokens"]   # 5 groups: 2 + 2 + 1 per minibatch
BALANCED_STEPS = (2, 5)
"""Steps whose minibatch split (seed 0) holds, at step 2, rank 0's groups {0, 1} in one minibatch
and rank 1's {3, 4} in another, which dealing splits; at step 5 only mixed pairs."""


def _ragged(batch):
    """The batch with the responses of the last two prompts (rank 1's share) cut to one token:
    rank 0 holds most tokens, so dealing by tokens moves groups between the ranks."""
    T = batch.response_mask.shape[1]
    short = torch.arange(len(batch.truncated)) >= 3 * G
    batch.response_mask[short, 1:] = 0.0
    batch.attention_mask[short, -T + 1:] = 0
    return batch


def _row_facts(dealt) -> list[tuple]:
    """(attended ids, reward, advantage, completion, example) of each row dealt here."""
    b = dealt.batch
    return [(tuple(b.input_ids[i][b.attention_mask[i].bool()].tolist()), float(dealt.rewards[i]),
             round(float(dealt.advantages[i]), 6), b.completions[i], repr(b.examples[i]))
            for i in range(len(dealt.rewards))]


def _balanced_updates(run_dir: Path, strategy: str, optimized: bool) -> tuple:
    """Two dealt ``RLStep`` updates (SGD) on a fixed ragged global batch: this rank's share,
    dealt by tokens (one process: the batch as it is); (trainer, metrics, rows' facts)."""
    from gspo.config import load_config
    from gspo.training.trainer import Trainer
    cfg = load_config(None, [*TRAIN, f"run.dir={run_dir}", f"dist.strategy={strategy}", *BALANCED])
    trainer = Trainer(cfg)
    with mock.patch("gspo.training.trainer.build_optimizer", linear_optimizer):
        trainer.setup()
    trainer.start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    dist, examples = trainer.dist, trainer.train_set[:P]
    history, facts = [], []
    for step in BALANCED_STEPS:
        batch = _ragged(trainer.collector.generate(examples, seed=100 + step))  # alike on every rank
        rewards = torch.tensor([float(len(c) % 3) for c in batch.completions])
        advantages = group_advantages(rewards, G)
        rows = _rows(dist.rank, dist.world)
        dealt = trainer.step.deal(batch.select(rows), rewards[rows], advantages[rows], step)
        facts.append(_row_facts(dealt))
        plan = trainer.step.plan(dealt.batch, dealt.advantages, step, speed_paths=optimized,
                                 minibatches=dealt.minibatches)
        old = trainer.step.old_logprobs(dealt.batch, rows=plan.old_rows)
        metrics = trainer.step.update(dealt.batch, OldLogprobs(old, dealt.advantages), plan)[0]
        history.append({**{k: metrics[k] for k in TRAINER_METRICS}, **dealt.metrics})
    trainer.save(2, 0.0)
    return trainer, history, facts


def _balanced_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    for strategy, optimized in (("ddp", True), ("fsdp", False)):
        trainer, history, facts = _balanced_updates(Path(root) / f"two-{strategy}", strategy,
                                                    optimized)
        torch.save((history, facts), Path(root) / f"balanced_{strategy}_{rank}.pt")
    distributed.shutdown()


@pytest.mark.slow
def test_ranks_balanced_by_tokens_equal_one_process(tmp_path, monkeypatch):
    """train.balance_ranks=tokens on 2 ranks, a ragged batch (rank 1's responses one token long):
    groups move between the ranks, each with its reward, advantage, completion and example; the
    per-minibatch token loads are more even than the contiguous shares'; and two SGD updates (ddp
    with the speed plan, fsdp) equal the single process's: metrics, checkpointed weights."""
    from gspo.core import logprobs
    from gspo.models.presets import load_model
    from gspo.training.checkpoint import load_latest
    _spawn(_balanced_worker, str(tmp_path))
    for strategy, optimized in (("ddp", True), ("fsdp", False)):
        if strategy == "fsdp":   # as in test_trainer_update_two_ranks_equals_one_process
            monkeypatch.setattr(logprobs, "_shared_prompt_hidden", lambda *args, **kwargs: None)
        one, history, facts = _balanced_updates(tmp_path / f"one-{strategy}", strategy, optimized)
        assert all(row["optim/grad_norm"] > 0 for row in history)
        assert "perf/rank_tokens_max_over_mean" not in history[0]        # one process: no dealing
        ranks = [torch.load(tmp_path / f"balanced_{strategy}_{r}.pt") for r in range(WORLD)]
        for step in range(2):
            # every row once, on some rank, with its own reward, advantage, text and example
            got = sorted(row for _, rank_facts in ranks for row in rank_facts[step])
            assert got == sorted(facts[step]), (strategy, step)
            assert all(len(rank_facts[step]) % G == 0 for _, rank_facts in ranks)  # whole groups
        moved = [sorted(ranks[0][1][step]) != sorted(facts[step][:3 * G]) for step in range(2)]
        assert any(moved), strategy                  # rank 0 trains rows rank 1 generated
        for rank_history, _ in ranks:
            for step, (row, row1) in enumerate(zip(rank_history, history)):
                for key in TRAINER_METRICS:
                    assert row[key] == pytest.approx(row1[key], rel=1e-4, abs=1e-6), (strategy, step, key)
                dealt, shares = (row["perf/rank_tokens_max_over_mean"],
                                 row["perf/rank_tokens_max_over_mean_unbalanced"])
                assert 1.0 <= dealt <= shares <= WORLD, (strategy, step)
            assert any(row["perf/rank_tokens_max_over_mean"]
                       < row["perf/rank_tokens_max_over_mean_unbalanced"] - 0.1
                       for row in rank_history), strategy
        weights, _ = load_model(load_latest(tmp_path / f"two-{strategy}").path)
        expected = {n: p.detach() for n, p in one.model.named_parameters()}
        got = {n: p.detach() for n, p in weights.named_parameters()}
        assert update_mismatch(one.start, expected, got) < UPDATE_REL, strategy


LORA = "model.lora={r: 4, alpha: 8}"


def _lora_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    trainer, history = _trainer_updates(Path(root) / "two-lora", "ddp", True, LORA)
    history.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    torch.save(history, Path(root) / f"history_lora_{rank}.pt")
    distributed.shutdown()


@pytest.mark.slow
def test_lora_update_two_ranks_equals_one_process(tmp_path):
    """LoRA under ddp: the adapters' gradients are summed over ranks (the check fails without the
    sum), the frozen base stays put, and two SGD updates give the one process's adapters and
    metrics; the replicas stay equal bit for bit."""
    _spawn(_lora_worker, str(tmp_path))
    one, history = _trainer_updates(tmp_path / "one-lora", "ddp", True, LORA)
    assert all(row["optim/grad_norm"] > 0 for row in history)
    expected = {n: p.detach() for n, p in one.model.named_parameters()}
    trained = [n for n, p in one.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    replicas = [torch.load(tmp_path / f"history_lora_{r}.pt") for r in range(WORLD)]
    assert all(torch.equal(replicas[0][-1][n], replicas[1][-1][n]) for n in expected)  # bit for bit
    for rank in range(WORLD):
        for step, (row, row1) in enumerate(zip(replicas[rank][:-1], history)):
            for key in TRAINER_METRICS:
                assert row[key] == pytest.approx(row1[key], rel=1e-4, abs=1e-6), (step, key)
    got = replicas[0][-1]
    assert all(torch.equal(got[n], one.start[n]) for n in expected if n not in trained)  # frozen
    assert update_mismatch({n: one.start[n] for n in trained}, {n: expected[n] for n in trained},
                           {n: got[n] for n in trained}) < UPDATE_REL


def _on_main_worker(rank: int, world: int, port: int, root: str) -> None:
    """Rank 0 fails inside ``on_main`` three ways; every rank records what it raised."""
    import json
    from gspo.errors import UserError, WriteFailed
    _init(rank, world, port)
    faults = [UserError("run.dir r is in use by PID 7 on h (gspo train, since t): ..."),
              WriteFailed("the checkpoint of step 3", Path("r/c"), "No space left on device"),
              ValueError("a bug")]
    seen = []
    for fault in faults:
        def fail(fault=fault):
            raise fault
        try:
            Dist(rank=rank, world=world).on_main(fail)
        except Exception as err:  # noqa: BLE001  recorded for the test
            seen.append([type(err).__name__, str(err)])
    (Path(root) / f"seen_{rank}.json").write_text(json.dumps(seen))
    torch_dist.destroy_process_group()


def test_on_main_tells_every_rank_rank_0s_user_error_and_failed_write(tmp_path):
    """The lock refusal (a UserError) and a full disk (WriteFailed) in rank 0's part reach the
    other ranks as themselves (one line and exit 2 / 4 each); anything else as a RuntimeError."""
    import json
    _spawn(_on_main_worker, str(tmp_path))
    zero, one = (json.loads((tmp_path / f"seen_{r}.json").read_text()) for r in range(WORLD))
    locked = "run.dir r is in use by PID 7 on h (gspo train, since t): ..."
    full = "could not write the checkpoint of step 3 (r/c): No space left on device"
    assert zero == [["UserError", locked], ["WriteFailed", full], ["ValueError", "a bug"]]
    assert one == [["UserError", locked], ["WriteFailed", full],
                   ["RuntimeError", "rank 0 failed: ValueError: a bug"]]


# ----------------------------------------------------------------------------- torchrun

SMALL_RUN = [
    "task.n_train=50", "task.n_test=10", "sft.steps=5", "sft.batch_size=16",
    "rollout.prompts_per_step=5", "rollout.group_size=4", "rollout.max_new_tokens=4",
    "train.minibatches=4", "eval.n=8", "eval.k=2", "run.eval_every=0", "run.save_every=1",
    "run.progress=false", "run.tensorboard=false",
    "rewards.sources=[{type: function, fn: 'gspo_test_rewards:first_char_parity'}]",
]


def _gspo(env: dict, *args: str, ranks: int = 1):
    import subprocess
    return subprocess.run([*gspo_command(ranks), *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_torchrun_train_then_resume_under_other_ranks_and_strategy(tmp_path, reward_dir):
    """`torchrun -m gspo train` (ddp, 2 ranks) -> resume with fsdp on 2 ranks -> resume in one
    process: rank 0 alone logs, reports and checkpoints; the data cursor and steps carry over."""
    import json
    import os
    from gspo.observe.metrics import read_metrics
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(reward_dir), os.environ.get("PYTHONPATH", "")])}
    out = _gspo(env, "train", *SMALL_RUN, f"run.dir={run}", f"sft.cache_dir={tmp_path / 'sft'}",
                "train.steps=2", ranks=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(re.findall(r"held-out accuracy( fell)?: ", out.stdout)) == 1  # rank 0 reports alone
    out = _gspo(env, "train", "--resume", str(run), "train.steps=3", "dist.strategy=fsdp",
                ranks=2)
    assert out.returncode == 0, out.stderr[-3000:]
    out = _gspo(env, "train", "--resume", str(run), "train.steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]                 # one row per step
    assert all(_finite(r["policy/loss"]) for r in rows[1:])
    assert "eval/accuracy" in rows[-1] and "eval/accuracy" in rows[3]   # end of each session
    state = json.loads((run / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["cursor"]["index"] == 4 * 5                            # P prompts per step
    assert (run / "summary.json").is_file() and (run / "report.md").is_file()


def _finite(x) -> bool:
    return isinstance(x, float) and x == x and abs(x) < 1e6
