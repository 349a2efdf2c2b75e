"""AdamW and learning-rate schedules shared by SFT and RL (thin over torch / transformers)."""

from __future__ import annotations

import torch
from transformers import get_scheduler

from gspo.training.master_weights import MasterWeightsAdamW

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


# train.master_weights -> the AdamW class: "model" steps the parameters in their own dtype,
# "float32" float32 masters of them (gspo.training.master_weights)
ADAMW = {"model": torch.optim.AdamW, "float32": MasterWeightsAdamW}


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), master_weights: str = "model"
                    ) -> torch.optim.Optimizer:
    """AdamW; the fused kernel (one call for all parameters, ~4x faster than the per-tensor loop
    on the tiny presets, docs/performance.md) where torch has it for these parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = ADAMW[master_weights]
    try:
        return adamw(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=True)
    except (RuntimeError, ValueError):  # a device / dtype without the fused kernel
        return adamw(params, lr=lr, weight_decay=weight_decay, betas=betas)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up then ``schedule`` (constant | cosine | linear) over ``total_steps``."""
    return get_scheduler(SCHEDULES[schedule], optimizer, num_warmup_steps=warmup_steps,
                         num_training_steps=max(total_steps, 1))


def clipped_step(loss: torch.Tensor, params, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, max_norm: float) -> torch.Tensor:
    """backward, clip the gradient norm, step unless loss or norm is non-finite; returns the norm.

    The scheduler advances either way, so a skipped update does not shift the schedule.
    """
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if bool(torch.isfinite(loss.detach()) & torch.isfinite(norm)):
        optimizer.step()
    scheduler.step()
    return norm
