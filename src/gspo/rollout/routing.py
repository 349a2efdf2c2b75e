"""Measuring a MoE sampler's routing during collection: when the experts are captured while
sampling (R3, or a sampler copy whose routers may disagree with the trainer's), and the share of
(token, layer) pairs whose experts differ between the copy and the trainer
(``moe/sampler_trainer_disagreement``, the R3 paper's "routers that differ"). It measures; it
never changes a batch."""

from __future__ import annotations

import torch

from gspo.models import moe
from gspo.rollout import engines
from gspo.rollout.generate import RolloutBatch


def captures_at_generation(cfg, model: torch.nn.Module) -> bool:
    """Experts captured while sampling: R3 (moe.routing_replay=rollout), or a MoE policy
    sampled by a copy (rollout.dtype, rollout.quantize: its disagreement measured)."""
    r = cfg.rollout
    copy = r.quantize is not None or r.dtype not in ("model", cfg.model.dtype)
    return cfg.moe.routing_replay == "rollout" or (copy and moe.supports_moe(model))


def measures_routing(engine: engines.Engine, model: torch.nn.Module) -> bool:
    """A MoE policy sampled by a copy of its own on hf (rollout.dtype, rollout.quantize): the
    copy's experts are captured and compared with the trainer's (``disagreement``)."""
    return (engine.module is not None and engine.module is not model
            and moe.supports_moe(model))


@torch.no_grad()
def disagreement(model: torch.nn.Module, batch: RolloutBatch, sampled: torch.Tensor) -> dict:
    """moe/sampler_trainer_disagreement: the share of (response token, layer) pairs whose top-k
    experts differ between the sampler copy (``sampled`` [N, L, layers, k]) and ``model``'s own
    router on the same tokens (one forward, no replay)."""
    with moe.capture_routing(model) as own:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    T = batch.response_mask.shape[1]
    rate, _ = moe.routing_change_rate(moe.response_routing(sampled, T),
                                      moe.response_routing(own.routing, T), batch.response_mask)
    return {"moe/sampler_trainer_disagreement": rate.item()}
