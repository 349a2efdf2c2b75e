"""AdamW and learning-rate schedules shared by SFT and RL (thin over torch / transformers)."""

from __future__ import annotations

from typing import Callable

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
    on the tiny presets, docs/results/performance/speed-paths.md) where torch has it for these parameters."""
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


class MinibatchSteps:
    """One optimizer step per minibatch, alike for every algorithm (the RL step, PPO's critic,
    SFT, DPO): gradients in, the norm clipped, a step unless the loss or the norm is non-finite
    (then the gradient is dropped and the skip counted: ``skipped``), the scheduler advanced
    either way (a skipped update does not shift the schedule); and the minibatches' detached
    metrics averaged with one host sync (``means``)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, max_norm: float, *,
                 clip: Callable = torch.nn.utils.clip_grad_norm_):
        self.optimizer, self.scheduler, self.max_norm, self.clip = optimizer, scheduler, max_norm, clip
        self.skipped = 0
        self.collected: dict[str, list[torch.Tensor]] = {}

    def step(self, loss: torch.Tensor, params) -> torch.Tensor:
        """backward of ``loss`` from zeroed gradients, then ``apply``; returns the norm."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return self.apply(loss, params)

    def apply(self, loss: torch.Tensor, params) -> torch.Tensor:
        """The gradients are in (``loss``: what they are of): clip, step unless non-finite."""
        norm = self.clip(params, self.max_norm)
        if bool(torch.isfinite(loss.detach()) & torch.isfinite(norm)):   # one host sync
            self.optimizer.step()
        else:  # a NaN/Inf loss or gradient is never applied: skip this update, counted
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
        self.scheduler.step()
        return norm

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        """One minibatch's detached metrics (tensors)."""
        for key, value in stats.items():
            self.collected.setdefault(key, []).append(value.float())

    def means(self) -> dict[str, float]:
        """Each metric's mean over the minibatches, moved to Python floats together."""
        keys = list(self.collected)
        values = torch.stack([torch.stack(self.collected[k]).mean() for k in keys]).tolist()
        return dict(zip(keys, values))
