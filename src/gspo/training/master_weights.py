"""Float32 master weights for a policy held in bfloat16 (``train.master_weights: float32``).

Pure bfloat16 training loses small updates: with an 8-bit significand a weight w moves only when
its update exceeds half a bfloat16 step, about |w|·2^-8, and AdamW's steps at a learning rate of
1e-4 are below that for most weights near 1 (the norm weights lose every one). The usual remedy,
kept here: the optimizer owns a float32 copy (the master) of every lower-precision parameter, and
float32 moments. Forward, backward and the gradients stay in the model's dtype; at each step the
gradients are copied to the masters in float32, AdamW steps the masters, and each parameter
becomes its master rounded to the nearest value of its dtype. An update too small to show in
bfloat16 accumulates in the master until it does. Float32 parameters (e.g. LoRA adapters over a
bfloat16 base) are their own masters.

The masters are part of ``state_dict()`` (``master_weights``: parameter index -> float32
tensor), so checkpoints, exact resume and the stability guard's roll-backs keep them.

float16 parameters add a dynamic loss scale (``loss_scaler``, gspo.training.loss_scale): the
scaled float16 gradients are unscaled in float32 as they move to the masters (``take_grads``),
where a gradient too small for float16 still has room; its state is in ``state_dict()`` too.
"""

from __future__ import annotations

import torch

from gspo.training.loss_scale import LossScaler


class MasterWeightsAdamW(torch.optim.AdamW):
    """AdamW over float32 masters of ``params``; ``step`` writes the rounded masters back."""

    def __init__(self, params, loss_scaler: LossScaler | None = None, **adamw):
        self.model_params = list(params)
        self.loss_scaler = loss_scaler
        """The dynamic loss scale of float16 gradients (None: the loss is not scaled)."""
        self.taken = False  # take_grads ran since the last step / zero_grad
        # parameter index -> its float32 master, for parameters not in float32 already
        self.separate = {i: p.detach().float().clone() for i, p in enumerate(self.model_params)
                         if p.dtype != torch.float32}
        self.master_params = [self.separate.get(i, p) for i, p in enumerate(self.model_params)]
        super().__init__(self.master_params, **adamw)

    def _pairs(self):
        return ((self.model_params[i], master) for i, master in self.separate.items())

    @torch.no_grad()
    def take_grads(self, scale: float = 1.0) -> list[torch.Tensor]:
        """The gradients divided by ``scale`` into the masters (float32; in place for float32
        parameters); returns the masters, whose ``.grad`` the clip and the step then read."""
        for param, master in self._pairs():
            master.grad = None if param.grad is None else param.grad.float().div_(scale)
        if scale != 1.0:
            for i, param in enumerate(self.model_params):
                if i not in self.separate and param.grad is not None:
                    param.grad.div_(scale)
        self.taken = True
        return self.master_params

    @torch.no_grad()
    def step(self, closure=None):
        if not self.taken:
            self.take_grads()
        self.taken = False
        loss = super().step(closure)
        for param, master in self._pairs():
            param.copy_(master)                         # round to nearest in the model's dtype
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.taken = False
        super().zero_grad(set_to_none)                  # the masters (and float32 parameters)
        for param, _ in self._pairs():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def state_dict(self) -> dict:
        scale = {} if self.loss_scaler is None else {"loss_scale": self.loss_scaler.state_dict()}
        return {**super().state_dict(), "master_weights": dict(self.separate), **scale}

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's state and the masters; a state without masters (saved by plain AdamW, e.g. a
        run that changed train.master_weights) takes them from the parameters as loaded."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        scale = state_dict.pop("loss_scale", None)
        if scale is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scale)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, master in self.separate.items():
                source = self.model_params[i] if saved is None else saved[i]
                master.copy_(source)
