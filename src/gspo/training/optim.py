"""AdamW and learning-rate schedules shared by SFT and RL (thin over torch / transformers)."""

from __future__ import annotations

from typing import Callable

import torch
from transformers import get_scheduler

from gspo.training.loss_scale import LossScaler
from gspo.training.master_weights import MasterWeightsAdamW

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


# train.master_weights -> the AdamW class: "model" steps the parameters in their own dtype,
# "float32" float32 masters of them (gspo.training.master_weights)
ADAMW = {"model": torch.optim.AdamW, "float32": MasterWeightsAdamW}


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), master_weights: str = "model"
                    ) -> torch.optim.Optimizer:
    """AdamW; the fused kernel (one call for all parameters, ~4x faster than the per-tensor loop
    on the tiny presets, docs/results/performance/speed-paths.md) where torch has it for these
    parameters. float16 parameters need ``master_weights="float32"`` (float16 moments underflow:
    AdamW's ε = 1e-8 is 0 in float16) and get a dynamic loss scale (gspo.training.loss_scale)."""
    params = [p for p in model.parameters() if p.requires_grad]
    half = any(p.dtype == torch.float16 for p in params)
    if half and master_weights != "float32":
        raise ValueError("float16 parameters train with float32 master weights "
                         "(train.master_weights=float32)")
    adamw = ADAMW[master_weights]
    extra = {"loss_scaler": LossScaler()} if half else {}
    try:
        return adamw(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=True, **extra)
    except (RuntimeError, ValueError):  # a device / dtype without the fused kernel
        return adamw(params, lr=lr, weight_decay=weight_decay, betas=betas, **extra)


def loss_scaler(optimizer: torch.optim.Optimizer) -> LossScaler | None:
    """The optimizer's dynamic loss scale (float16 parameters), else None."""
    return getattr(optimizer, "loss_scaler", None)


def scaled(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """What to backpropagate: ``loss`` times the optimizer's loss scale, if it has one."""
    scaler = loss_scaler(optimizer)
    return loss if scaler is None else scaler.scaled(loss)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up then ``schedule`` (constant | cosine | linear) over ``total_steps``."""
    return get_scheduler(SCHEDULES[schedule], optimizer, num_warmup_steps=warmup_steps,
                         num_training_steps=max(total_steps, 1))


GRAD_NORM = "optim/grad_norm"


class MinibatchSteps:
    """One optimizer step per minibatch, alike for every algorithm (the RL step, PPO's critic,
    SFT, DPO): gradients in (unscaled first under a loss scale, ``scaled``), the norm clipped, a
    step unless the loss or the norm is non-finite (then the gradient is dropped and the skip
    counted: ``skipped``; a loss scale backs off), the scheduler advanced either way (a skipped
    update does not shift the schedule); and the minibatches' detached metrics averaged with one
    host sync (``means``; ``optim/loss_scale`` among them under a loss scale).

    Under a loss scale, an update whose loss is finite but whose gradient is not overflowed at S:
    the scale's own business (dropped, counted, S backed off), expected now and then in float16.
    Its gradient norm (inf) is left out of ``optim/grad_norm``'s mean, so the step's metrics stay
    finite and the stability guard's ``nan`` rule does not discard the step's other updates (and,
    restoring the optimizer, the scale's back-off with them). Without a loss scale a non-finite
    norm is reported as it is."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, max_norm: float, *,
                 clip: Callable = torch.nn.utils.clip_grad_norm_):
        self.optimizer, self.scheduler, self.max_norm, self.clip = optimizer, scheduler, max_norm, clip
        self.skipped = 0
        self.overflowed = False
        """The last update overflowed under a loss scale: its norm is not reported (``add``)."""
        self.collected: dict[str, list[torch.Tensor]] = {}

    def step(self, loss: torch.Tensor, params) -> torch.Tensor:
        """backward of ``loss`` from zeroed gradients, then ``apply``; returns the norm."""
        self.optimizer.zero_grad(set_to_none=True)
        scaled(loss, self.optimizer).backward()
        return self.apply(loss, params)

    def apply(self, loss: torch.Tensor, params) -> torch.Tensor:
        """The gradients are in (``loss``: what they are of, unscaled): clip, step unless non-finite."""
        scaler = loss_scaler(self.optimizer)
        if scaler is not None:   # into the float32 masters, divided by S (those then clipped)
            self.add({"optim/loss_scale": torch.tensor(scaler.scale)})
            params = self.optimizer.take_grads(scaler.scale)
        norm = self.clip(params, self.max_norm)
        finite_loss, finite_norm = torch.isfinite(loss.detach()), torch.isfinite(norm)
        finite = bool(finite_loss & finite_norm)                              # one host sync
        self.overflowed = scaler is not None and not finite and bool(finite_loss)
        if finite:
            self.optimizer.step()
        else:  # a NaN/Inf loss or gradient is never applied: skip this update, counted
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
        if scaler is not None:
            scaler.update(finite)
        self.scheduler.step()
        return norm

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        """One minibatch's detached metrics (tensors); after an overflow under a loss scale,
        without its gradient norm."""
        if self.overflowed:
            stats, self.overflowed = {k: v for k, v in stats.items() if k != GRAD_NORM}, False
        for key, value in stats.items():
            self.collected.setdefault(key, []).append(value.float())

    def means(self) -> dict[str, float]:
        """Each metric's mean over the minibatches, moved to Python floats together."""
        keys = list(self.collected)
        values = torch.stack([torch.stack(self.collected[k]).mean() for k in keys]).tolist()
        return dict(zip(keys, values))
