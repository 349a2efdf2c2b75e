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
"""

from __future__ import annotations

import torch


class MasterWeightsAdamW(torch.optim.AdamW):
    """AdamW over float32 masters of ``params``; ``step`` writes the rounded masters back."""

    def __init__(self, params, **adamw):
        self.model_params = list(params)
        # parameter index -> its float32 master, for parameters not in float32 already
        self.separate = {i: p.detach().float().clone() for i, p in enumerate(self.model_params)
                         if p.dtype != torch.float32}
        self.master_params = [self.separate.get(i, p) for i, p in enumerate(self.model_params)]
        super().__init__(self.master_params, **adamw)

    def _pairs(self):
        return ((self.model_params[i], master) for i, master in self.separate.items())

    @torch.no_grad()
    def step(self, closure=None):
        for param, master in self._pairs():
            master.grad = None if param.grad is None else param.grad.float()
        loss = super().step(closure)
        for param, master in self._pairs():
            param.copy_(master)                         # round to nearest in the model's dtype
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)                  # the masters (and float32 parameters)
        for param, _ in self._pairs():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "master_weights": dict(self.separate)}

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's state and the masters; a state without masters (saved by plain AdamW, e.g. a
        run that changed train.master_weights) takes them from the parameters as loaded."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, master in self.separate.items():
                source = self.model_params[i] if saved is None else saved[i]
                master.copy_(source)
