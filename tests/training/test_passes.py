"""Packed rows in the trainer's log-prob passes (train.pack_rows): π_old, the update with
gradient and the audit's π_new run on the rows packed without padding (each group's prompt once
where prompts may be shared); the gradients handed to
the optimizer, the loss and stats equal the padded (trimmed, prompt-shared) update's within 1e-5
in float32, for a dense model, an MoE with π_old's experts replayed, and multi-turn rows whose
loss mask has holes; and perf/padding_frac counts the positions the forwards computed."""

import pytest
import torch

from conftest import parity_rewards
from gspo.core.advantages import group_advantages
from gspo.training.old_policy import OldLogprobs
from gspo.training.trainer import Trainer


def _trainer(make_cfg, reward_module, *overrides, run):
    t = Trainer(make_cfg("sft.enabled=false", parity_rewards(reward_module),
                         "rollout.prompts_per_step=4", "rollout.group_size=4",
                         "rollout.max_new_tokens=12", "rollout.temperature=1.5",
                         "task.name=multistep", *overrides, run=run), log=lambda m: None)
    t.setup()
    return t


def _update(t: Trainer, batch, adv) -> tuple[dict, list, torch.Tensor]:
    """The update's metrics, the gradients the optimizer was handed per minibatch (its step
    replaced by a copy of them: the weights stay put), and π_old of the plan's rows."""
    seen = []
    t.step.optimizer.step = lambda *a, **k: seen.append([p.grad.clone()
                                                         for p in t.model.parameters()])
    plan = t.step.plan(batch, adv, 0)
    old = t.step.old_logprobs(batch, rows=plan.old_rows)
    return t.step.update(batch, OldLogprobs(old, adv), plan)[0], seen, old


def _ragged(batch, holes: bool) -> None:
    """Responses of 1..T tokens; ``holes``: tokens 2..3 of every longer response are tool
    output (attended, out of the response mask), as a multi-turn row's observations."""
    T = batch.response_mask.shape[1]
    L = batch.attention_mask.shape[1]
    for i, n in enumerate((torch.arange(len(batch.response_mask)) * 5 % T + 1).tolist()):
        batch.response_mask[i, n:] = 0
        batch.attention_mask[i, L - T + n:] = 0
        batch.attention_mask[i, L - T:L - T + n] = 1
        if holes and n > 5:
            batch.response_mask[i, 2:4] = 0


@pytest.mark.filterwarnings("ignore::UserWarning")   # the scheduler, on the stand-in step
@pytest.mark.parametrize("model, holes", [
    (["model.preset=tiny-dense"], False),
    (["model.preset=tiny-moe", "moe.routing_replay=old"], False),
    (["model.preset=tiny-dense"], True)],
    ids=["dense", "moe-replay", "multiturn"])
def test_packed_update_gives_the_padded_gradient_and_loss(make_cfg, reward_module, model, holes):
    """M = 2, one group without signal (its rows skip the forward), packed rows of about 40
    tokens (several per forward, with padding tails): π_old, the gradients before each optimizer
    step, the loss, clip, ratio and entropy stats equal the padded update's; the packed update
    computes fewer positions and a smaller padding share."""
    padded = _trainer(make_cfg, reward_module, *model, "train.pack_rows=false", run="padded")
    packed = _trainer(make_cfg, reward_module, *model, "train.pack_rows=true",
                      "train.pack_length=40", run="packed")
    batch, rewards, _ = padded.collector.collect(0)
    _ragged(batch, holes)
    adv = group_advantages(rewards, 4)
    adv.view(-1, 4)[0] = 0.0
    row_d, grads_d, old_d = _update(padded, batch, adv)
    batch.routing, batch.loss_mask = None, None          # π_old's experts captured afresh
    row_p, grads_p, old_p = _update(packed, batch, adv)
    torch.testing.assert_close(old_p, old_d, atol=1e-5, rtol=1e-5)
    assert len(grads_d) == len(grads_p) == 2
    for gd, gp in zip(grads_d, grads_p):
        assert max(a.abs().max() for a in gd) > 0
        for a, b in zip(gp, gd):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for key in ("policy/loss", "policy/clip_frac_tokens", "policy/ratio_mean", "policy/entropy"):
        assert row_p[key] == pytest.approx(row_d[key], rel=1e-5, abs=1e-6), key
    # both run each group's prompt once (the padded update: all but its last column, which
    # predicts the first response token of every row), so the packed update computes fewer
    # positions; MoE replay: neither shares (replayed experts are per row), packed still fewer
    assert row_p["perf/tokens_computed"] < row_d["perf/tokens_computed"]
    assert row_p["perf/padding_frac"] < row_d["perf/padding_frac"]


def test_pack_rows_refused_with_the_router_loss(make_cfg):
    from gspo.config.resolve import resolve  # noqa: F401  (the config refuses it in one line)
    with pytest.raises(Exception, match="pack_rows does not work with moe.aux_loss_coef"):
        make_cfg("model.preset=tiny-moe", "moe.aux_loss_coef=0.01", "train.pack_rows=true")


def _fsdp_worker(rank: int, world: int, port: int, root: str) -> None:
    """Rank r: tiny-dense sharded by FSDP2, its own rows (different counts and lengths per rank)
    through ``LogprobPasses.logprobs`` packed, with gradient; saves log-probs and gradients."""
    import torch.distributed as torch_dist
    from pathlib import Path
    from torch.distributed.tensor import DTensor
    from gspo.models.presets import build_model
    from gspo.training.distributed import Dist
    from gspo.training.passes import LogprobPasses
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                  world_size=world)
    model, _ = build_model("tiny-dense", 0)
    dist = Dist(rank=rank, world=world)
    passes = LogprobPasses(model, dist, temperature=1.0, chunk_size=16, group_size=2,
                           entropy_grad=False, routing_replay="none", aux_loss=False, pack=True,
                           pack_length=16)
    dist.wrap(model, "fsdp")
    batch = _fixed_batch().select(torch.arange(4) if rank == 0 else torch.arange(4, 6))
    logp = passes.logprobs(model, batch).logp
    logp.sum().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.named_parameters()}
    torch.save((logp.detach(), grads), Path(root) / f"fsdp_{rank}.pt")
    torch_dist.destroy_process_group()


def _fixed_batch():
    """6 rows of ragged prompts (left-padded) and responses (right-padded), random tokens."""
    from gspo.rollout.generate import RolloutBatch
    g = torch.Generator().manual_seed(0)
    prompts, responses, P, T = [5, 3, 7, 2, 6, 4], [6, 2, 4, 1, 5, 3], 7, 6
    ids = torch.zeros(6, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - p:P + r] = torch.randint(4, 90, (p + r,), generator=g)
    attention = (ids != 0).long()
    return RolloutBatch(input_ids=ids, attention_mask=attention,
                        response_mask=attention[:, P:].float(), truncated=torch.zeros(6, dtype=torch.bool),
                        completions=[""] * 6, examples=[None] * 6)


@pytest.mark.slow
def test_packed_rows_under_fsdp_equal_one_process_padded(tmp_path):
    """FSDP2 on 2 ranks, each packing its own rows (4 and 2, of other lengths): each rank's one
    forward per pass keeps the ranks' collectives in step; the log-probs equal the one-process
    padded ones of those rows, and the gradient summed over ranks equals the one-process
    gradient of all rows, within 1e-5."""
    from conftest import free_port
    from gspo.core.logprobs import response_logprobs
    from gspo.models.presets import build_model
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2,
                                join=True)
    (logp0, grads0), (logp1, grads1) = (torch.load(tmp_path / f"fsdp_{r}.pt") for r in range(2))
    model, _ = build_model("tiny-dense", 0)
    batch = _fixed_batch()
    ref = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                            with_entropy=False).logp
    ref.sum().backward()
    torch.testing.assert_close(torch.cat([logp0, logp1]), ref.detach(), atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():   # fsdp's reduce-scatter summed the ranks' gradients
        torch.testing.assert_close(grads0[n], p.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grads1[n], p.grad, atol=1e-5, rtol=1e-4)
