"""Dynamic loss scaling for float16 parameters (``model.dtype: float16``).

float16 has 10 significand bits (bfloat16 has 7) but only 5 exponent bits: values below 2^-24
flush to zero, above 65504 overflow. Gradients of a policy loss are mostly tiny, so a float16
backward loses them to underflow. The remedy (Micikevicius et al. 2018, "Mixed precision
training"; torch.amp.GradScaler's defaults): backpropagate the loss times a scale S, a power of
two, then divide the gradients by S before clipping and the optimizer step. Multiplying by a power
of two is exact in binary floating point, so without overflow or underflow the unscaled
gradients equal the unscaled backward's bit for bit. S is dynamic: an update whose loss or
gradient norm is not finite is skipped (never applied, counted by ``MinibatchSteps.skipped``) and
halves S; ``growth_interval`` finite updates in a row double it.

The gradients are unscaled where they have the range to hold it: into the float32 masters when
the optimizer keeps them (``MasterWeightsAdamW.take_grads``), in place otherwise. The scaler's
state is part of the optimizer's ``state_dict()``, so checkpoints, exact resume and the stability
guard's roll-backs keep it.

What it is not: autocast (the forward runs in the parameters' dtype) or a per-parameter scale.
"""

from __future__ import annotations

import torch


class LossScaler:
    """S, and the rule that moves it (torch.amp.GradScaler's constants)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        """Finite updates since S last changed."""

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """S · loss, to backpropagate."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params) -> None:
        """Divide the gradients of ``params`` by S in place (exact for a power-of-two S, barring
        underflow)."""
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """After an update: a non-finite one backs S off (not below 1, as Megatron-LM's
        min_loss_scale), ``growth_interval`` finite ones in a row grow it."""
        if not finite:
            self.scale, self.good_steps = max(self.scale * self.backoff_factor, 1.0), 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale, self.good_steps = self.scale * self.growth_factor, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
