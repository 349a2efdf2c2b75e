"""The value model of PPO: a critic V(s_t) per response position, its clipped loss and diagnostics.

The critic is a separate model initialised from the policy it will judge: a copy of the policy's
decoder body (all transformer layers, the embeddings; not the LM head) plus a scalar head
Linear(H, 1), like transformers' ``AutoModelForTokenClassification`` with one label and like the
separate value model of InstructGPT / TRL's ``PPOTrainer`` / OpenRLHF (docs/baselines.md says why
it is not a head on the policy). Position t of the response is scored from the hidden state that
predicts token y_t, i.e. the state s_t = (x, y_<t) in which the policy chose y_t, the same columns
as the policy's log-probs (``gspo.core.logprobs``).

Pure functions (`value_loss`, `explained_variance`) take tensors and return tensors; no config,
no ``.item()``. Shapes: N sequences, L = prompt + response columns, T response columns, H hidden.
This module is not the PPO update loop (``gspo.training.algorithms.PPO``) nor GAE (``gspo.core.advantages``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from gspo.core.logprobs import decoder_and_head, response_hidden

__all__ = ["Critic", "explained_variance", "value_loss"]


class Critic(nn.Module):
    """V(s_t) = w · h_t + b on a copy of the policy's decoder: [N, T] float32 values."""

    def __init__(self, decoder: nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        # small random head, zero bias: values start near 0 (OpenRLHF's value-head init, std 1/(H+1))
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module, seed: int = 0) -> "Critic":
        """A critic whose decoder is a copy of ``policy``'s (same weights, separate parameters);
        its head drawn from ``seed`` (torch's global RNG is left as it was)."""
        decoder, _ = decoder_and_head(policy)
        config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") \
            else policy.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = cls(copy.deepcopy(decoder), config.hidden_size)
        return critic.to(next(policy.parameters()).device).requires_grad_(True)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
        """Values of the T response positions: [N, T] float32, 0 where response_mask is 0."""
        T = response_mask.shape[1]
        hidden = response_hidden(self.decoder, input_ids, attention_mask, T)   # [N, T, H]
        values = self.head(hidden.float()).squeeze(-1)                            # [N, T] V(s_t)
        return torch.where(response_mask > 0, values, torch.zeros_like(values))


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the tokens with mask 1 (0 when there are none)."""
    keep = mask > 0
    return torch.where(keep, x, torch.zeros_like(x)).sum() / keep.sum().clamp(min=1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, mean over response tokens.

    V_clip = V_old + clip(V − V_old, −c, c)
    ℓ_t   = ½ max((V − R)², (V_clip − R)²)        (clip=None: ½ (V − R)²)
    as TRL ``PPOTrainer`` (cliprange_value) and OpenAI baselines ppo2; R are GAE returns, V_old the
    values at rollout time. values: [N, T] with grad; old_values, returns, mask: [N, T].
    Stats: clip_frac = share of tokens where the clipped term is the larger (its gradient is 0).
    """
    v, v_old, ret = values.float(), old_values.detach().float(), returns.detach().float()
    unclipped = (v - ret) ** 2                                                    # [N, T]
    if clip is None:
        worst, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = v_old + (v - v_old).clamp(-clip, clip)                           # [N, T] V_clip
        clipped_sq = (v_clip - ret) ** 2                                          # [N, T]
        worst = torch.maximum(unclipped, clipped_sq)
        clipped = clipped_sq.detach() > unclipped.detach()
    loss = 0.5 * _token_mean(worst, mask)
    return loss, {"clip_frac": _token_mean(clipped.float(), mask)}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 − Var[R − V] / Var[R] over response tokens (cleanrl's diagnostic; 1 is perfect, ≤ 0 no
    better than a constant). 0 when the returns have no variance (never NaN: NaN stops a run)."""
    keep = mask > 0
    r, v = returns[keep].float(), values[keep].float()                             # [K]
    if r.numel() < 2:
        return torch.zeros((), device=values.device)
    var_r = r.var()
    ev = 1 - (r - v).var() / var_r.clamp(min=1e-12)
    return torch.where(var_r > 1e-12, ev, torch.zeros_like(ev))
