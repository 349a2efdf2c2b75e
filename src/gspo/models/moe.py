"""MoE routing: capture, Routing Replay (old policy and rollout), and routing diagnostics.

What it is: forward hooks on the top-k routers of transformers MoE models (GSPO §5.3).
`capture_routing` records the top-k expert ids per position per MoE layer of every forward inside
it, as uint8 (int16 above 256 experts), without touching any output. `replay_routing` forces
earlier-captured ids: the live router still computes its logits, and the gate weights are its
softmax gathered at the replayed ids (renormalised when the router does), so the router keeps its
gradient. Captured during `generate` with a KV cache (prefill, then one column per decode step),
the ids assemble into the same [N, L] layout as a training forward: rollout routing replay
(R3, Ma et al. 2025, arXiv 2510.11370). Pure metric functions compare and summarise routings.

What it deliberately is not: no copy of the MoE block or the experts (the hook edits only the
router's returned ids and weights); no sigmoid / biased / group-limited routers (DeepSeek-V3,
GLM-4-MoE, ...); no capacity limits, token dropping or expert parallelism. A router it does not
recognise is refused (`moe_layers` raises ValueError), never silently mis-replayed.

Supported routers share one contract (transformers v5): `router(h [R, H]) -> (logits [R, E],
weights [R, k], ids [R, k])` with `weights = softmax(logits)[ids]`, renormalised over k when the
router's `norm_topk_prob` is set (Mixtral always renormalises), called by a sparse block that
receives hidden states [B, S, H] and flattens them to R = B·S rows.

Shapes: N sequences, L = prompt + response columns, T response columns, layers MoE layers
(dense layers of a mixed model are skipped), k experts per token, E experts, R router rows.
Routing tensors are [N, L, layers, k]. Which positions a response slice keeps: see `response_routing`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

# Router classes whose forward follows the contract above, by the model_type that uses them.
ROUTER_CLASSES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "mixtral": "MixtralTopKRouter",
    "olmoe": "OlmoeTopKRouter",
}


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer: its router and the sparse block that calls it."""

    name: str  # module path of the router, e.g. "model.layers.3.mlp.gate"
    router: nn.Module
    block: nn.Module
    top_k: int
    num_experts: int
    renormalize: bool  # top-k weights divided by their sum


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """The model's MoE layers in forward order; ValueError for a model without a known router.

    Routers are found by class name, so wrappers (DDP, PEFT) are fine.
    """
    classes = set(ROUTER_CLASSES.values())
    modules = dict(model.named_modules())
    layers = [
        MoeLayer(name=name, router=m, block=modules[name.rpartition(".")[0]], top_k=m.top_k,
                 num_experts=m.num_experts, renormalize=bool(getattr(m, "norm_topk_prob", True)))
        for name, m in modules.items() if type(m).__name__ in classes and "." in name
    ]
    if not layers:
        raise ValueError(f"routing replay: model type {_model_type(model)!r} is not a supported MoE "
                         f"(supported: {', '.join(sorted(ROUTER_CLASSES))})")
    return layers


def supports_moe(model: nn.Module) -> bool:
    """True when `moe_layers(model)` finds routers it can capture and replay."""
    try:
        return bool(moe_layers(model))
    except ValueError:
        return False


def _in_backward() -> bool:
    """True while autograd runs a backward pass, e.g. activation checkpointing recomputing a forward."""
    return torch._C._current_graph_task_id() != -1


def _compact_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


class RoutingCapture:
    """Top-k expert ids recorded per MoE layer, one entry per forward of the model.

    Filled by `capture_routing` (the ids the model used) and `replay_routing` (the ids the live
    router would have picked). Forwards re-run during backward (activation checkpointing) are
    not recorded.
    """

    def __init__(self, layers: list[MoeLayer], *, keep_logits: bool = False,
                 device: torch.device | str | None = None):
        self.layer_names = [layer.name for layer in layers]
        self.num_experts = layers[0].num_experts
        self.top_k = layers[0].top_k
        self.keep_logits = keep_logits
        self._device = device
        self._dtype = _compact_dtype(self.num_experts)
        self._shape: list[tuple[int, int] | None] = [None] * len(layers)  # (B, S) of the block call
        self._ids: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer, per forward: [B, S, k]
        self._logits: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer, per forward: [B·S, E]
        self.layout = None
        """A `logprobs.DecoderLayout`: the forwards were one trimmed or prompt-shared log-prob call
        (set by the caller from `TokenLogProbs.layout`); `routing` then lays them out as [N, L]."""

    def _block_called(self, i: int, hidden: torch.Tensor) -> None:
        self._shape[i] = (hidden.shape[0], hidden.shape[1])  # hidden: [B, S, H]

    def _record(self, i: int, ids: torch.Tensor, logits: torch.Tensor) -> None:
        if _in_backward():
            return
        B, S = self._shape[i]
        self._ids[i].append(ids.detach().reshape(B, S, -1).to(device=self._device, dtype=self._dtype))  # [B, S, k]
        if self.keep_logits:
            self._logits[i].append(logits)  # graph kept: the aux loss backpropagates through it

    @property
    def forwards(self) -> list[torch.Tensor]:
        """One [B, S, layers, k] tensor per forward, in call order."""
        counts = {len(calls) for calls in self._ids}
        if counts == {0}:
            raise RuntimeError("routing capture: no forward of the model ran inside the context")
        if len(counts) > 1:
            raise RuntimeError(f"routing capture: MoE layers saw different numbers of calls {sorted(counts)}")
        return [torch.stack(calls, dim=2) for calls in zip(*self._ids)]

    @property
    def routing(self) -> torch.Tensor:
        """[N, L, layers, k]: the forwards concatenated along rows (one forward, or row micro-batches),
        or laid out by ``layout``."""
        if self.layout is not None:
            return layout_routing(self.forwards, self.layout, self.top_k)
        return torch.cat(self.forwards, dim=0)

    def generated_routing(self, length: int | None = None) -> torch.Tensor:
        """[N, length, layers, k]: a KV-cache `generate`'s forwards concatenated along positions.

        The prefill gives the Lp prompt columns, each decode step one column. The last sampled
        token is never fed, so a sequence of L = Lp + T columns has L - 1 captured columns; the
        missing tail (`length` > captured) is filled with experts 0..k-1. Its routing is never
        scored: position L-1 predicts nothing in the response (see `response_routing`).
        """
        steps = self.forwards
        if len({s.shape[0] for s in steps}) > 1:
            raise RuntimeError("routing capture: forwards have different batch sizes; not one generate call")
        routing = torch.cat(steps, dim=1)  # [N, Lp + decode steps, layers, k]
        if length is None or length == routing.shape[1]:
            return routing
        N, captured, layers, k = routing.shape
        if length < captured:
            raise ValueError(f"generated_routing: length {length} < {captured} captured positions")
        fill = torch.arange(k, dtype=routing.dtype, device=routing.device).expand(N, length - captured, layers, k)
        return torch.cat([routing, fill], dim=1)

    def router_logits(self) -> tuple[torch.Tensor, ...]:
        """Per MoE layer [R, E] router logits (with graph), forwards concatenated along rows."""
        if not self.keep_logits:
            raise RuntimeError("routing capture: router logits were not kept (pass keep_logits=True)")
        return tuple(torch.cat(calls, dim=0) for calls in self._logits)


def packed_routing(routing: torch.Tensor, packed) -> torch.Tensor:
    """[B, S, layers, k]: stored experts [N, L, layers, k] laid out as packed rows (``packed``, a
    `gspo.core.packing.PackedRows`), for `replay_routing` of a packed forward; experts 0..k-1 at the tails."""
    k = routing.shape[-1]
    return packed.gather(routing, torch.arange(k, dtype=routing.dtype, device=routing.device))


def layout_routing(forwards: list[torch.Tensor], layout, k: int) -> torch.Tensor:
    """[N, L, layers, k] from the forwards of one `response_logprobs` call (``layout``, a
    `logprobs.DecoderLayout`): the shared prompt forward's rows gathered to every row, then the
    other columns; columns outside ``start .. stop-1`` (padding in every row, or past every
    response) get experts 0..k-1, like the unfed tail of `generated_routing`. They are never scored.
    Packed rows (``layout.packed``): each packed column put back at its row and column, the
    others filled likewise."""
    fill = torch.arange(k, dtype=forwards[0].dtype, device=forwards[0].device)
    if layout.packed is not None:
        (routing,) = forwards                      # [B, S, layers, k]
        return layout.packed.scatter(routing, fill)  # [N, L, layers, k]
    if layout.prefix_rows is not None:
        prefix, rest = forwards                    # [U, P, layers, k], [N, S, layers, k]
        routing = torch.cat([prefix[layout.prefix_rows.to(prefix.device)], rest], dim=1)  # [N, P + S, ...]
    else:
        (routing,) = forwards                      # [N, S, layers, k]
    N, S, layers, _ = routing.shape
    if S != layout.stop - layout.start:
        raise RuntimeError(f"routing capture: {S} columns captured, the layout says {layout.stop - layout.start}")
    left = fill.expand(N, layout.start, layers, k)
    right = fill.expand(N, layout.length - layout.stop, layers, k)
    return torch.cat([left, routing, right], dim=1)  # [N, L, layers, k]


RouterHook = Callable[[nn.Module, tuple, tuple], tuple | None]


@contextmanager
def _hooked(layers: list[MoeLayer], cap: RoutingCapture, router_hook: Callable[[int, MoeLayer], RouterHook],
            *, prepend: bool = False) -> Iterator[RoutingCapture]:
    """Install a shape-recording pre-hook on every MoE block and `router_hook(i, layer)` on its router."""
    def block_hook(i: int):
        def hook(module, args, kwargs):
            cap._block_called(i, args[0] if args else kwargs["hidden_states"])
        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.block.register_forward_pre_hook(block_hook(i), with_kwargs=True))
            handles.append(layer.router.register_forward_hook(router_hook(i, layer), prepend=prepend))
        yield cap
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_routing(model: nn.Module, *, keep_logits: bool = False,
                    device: torch.device | str | None = None) -> Iterator[RoutingCapture]:
    """Record the experts every forward inside the context uses; outputs are untouched.

    keep_logits: also keep each layer's router logits with their graph (for `router_aux_loss`).
    device: where to store the ids (None: where they were computed; "cpu" offloads, one copy per layer).
    """
    layers = moe_layers(model)
    cap = RoutingCapture(layers, keep_logits=keep_logits, device=device)

    def router_hook(i: int, layer: MoeLayer) -> RouterHook:
        def hook(module, args, out):
            cap._record(i, out[2], out[0])  # out = (logits [R, E], weights [R, k], ids [R, k])
        return hook

    with _hooked(layers, cap, router_hook):
        yield cap


@contextmanager
def replay_routing(model: nn.Module, routing: torch.Tensor, *, keep_logits: bool = False
                   ) -> Iterator[RoutingCapture]:
    """Every forward inside uses the experts in `routing` [N, L, layers, k] for its N·L positions.

    Gate weights come from the live router: w = softmax(z)[replayed ids], divided by their sum
    when the router renormalises, so gradients reach the router weights (and hidden states) as
    in a normal forward. Yields a `RoutingCapture` of the live top-k, i.e. what the router would
    have picked, for routing-change metrics. A forward whose shape differs from [N, L] raises.
    """
    layers = moe_layers(model)
    k = layers[0].top_k
    if routing.dim() != 4 or routing.shape[2] != len(layers) or routing.shape[3] != k:
        raise ValueError(f"replay_routing: routing must be [N, L, {len(layers)}, {k}], got {tuple(routing.shape)}")
    live = RoutingCapture(layers, keep_logits=keep_logits)

    def router_hook(i: int, layer: MoeLayer) -> RouterHook:
        def hook(module, args, out):
            logits, weights, ids = out  # [R, E], [R, k], [R, k]
            live._record(i, ids, logits)
            forced = routing[:, :, i].reshape(-1, k).to(ids.device, torch.long)  # [R, k]
            if forced.shape[0] != logits.shape[0]:
                raise ValueError(f"replay_routing: layer {layer.name} got {logits.shape[0]} positions, "
                                 f"routing has {tuple(routing.shape[:2])} = {forced.shape[0]}")
            w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, forced)  # [R, k] softmax(z)[ids]
            if layer.renormalize:
                w = w / w.sum(dim=-1, keepdim=True)  # w_j / Σ_k w
            return logits, w.to(weights.dtype), forced
        return hook

    # prepend: a capture opened around or inside this context sees the replayed ids
    with _hooked(layers, live, router_hook, prepend=True):
        yield live


# ---------------------------------------------------------------------------------------------
# Metrics: pure functions of routing tensors; detached results, no host synchronisation.


def response_routing(routing: torch.Tensor, T: int) -> torch.Tensor:
    """[N, T, layers, k]: the routing of positions L-T-1 .. L-2, the ones that PREDICT the response.

    Position L-T-1+t is fed y_{t-1} (the last prompt token for t = 0) and its output is scored as
    log π(y_t): the same columns `logprobs.response_logprobs` reads, so `response_mask[:, t]`
    selects exactly the positions whose logits are scored. (The position fed the final response
    token predicts nothing and is dropped; generation never computes it.)
    """
    L = routing.shape[1]
    return routing[:, L - T - 1 : L - 1]  # [N, T, layers, k]


def routing_change_rate(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Share of (token, layer) pairs whose top-k expert SET differs: (overall [], per layer [layers]).

    old, new: [N, T, layers, k] expert ids (order within k ignored); mask: [N, T].
    Overall = mean over layers, which is the share over all (token, layer) pairs.
    """
    same = (old.long().sort(dim=-1).values == new.long().sort(dim=-1).values).all(dim=-1)  # [N, T, layers]
    m = mask.to(torch.float32)  # [N, T]
    per_layer = ((~same).float() * m[..., None]).sum(dim=(0, 1)) / m.sum().clamp(min=1)  # [layers]
    return per_layer.mean(), per_layer


def expert_load(routing: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[layers, E] float32: how many masked-in tokens picked each expert, per layer."""
    N, T, layers, k = routing.shape
    ids = routing.long().permute(2, 0, 1, 3).reshape(layers, N * T * k)  # [layers, N·T·k]
    w = mask.to(torch.float32)[:, :, None].expand(N, T, k).reshape(1, -1).expand(layers, -1)  # [layers, N·T·k]
    return torch.zeros(layers, num_experts, device=routing.device).scatter_add_(1, ids, w)  # [layers, E]


def load_imbalance(load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer (max/mean, coefficient of variation std/mean with population std) of a [layers, E] load.

    Both are 1 and 0 for a perfectly balanced layer; max/mean = E when one expert takes everything.
    """
    mean = load.mean(dim=-1).clamp(min=1e-12)  # [layers]
    return load.max(dim=-1).values / mean, load.std(dim=-1, correction=0) / mean


def routing_metrics(routing: torch.Tensor, mask: torch.Tensor, num_experts: int, *,
                    old: torch.Tensor | None = None, prefix: str = "moe/") -> dict[str, torch.Tensor]:
    """Load metrics of `routing` [N, T, layers, k] over `mask` [N, T], and its change from `old`.

    Overall values are means over layers; per-layer values are suffixed `/layer_{i}`.
    """
    stats: dict[str, torch.Tensor] = {}
    per_layer: dict[str, torch.Tensor] = {}
    if old is not None:
        stats["routing_change_rate"], per_layer["routing_change_rate"] = routing_change_rate(old, routing, mask)
    max_over_mean, cv = load_imbalance(expert_load(routing, mask, num_experts))
    per_layer["expert_load_max_over_mean"], per_layer["expert_load_cv"] = max_over_mean, cv
    stats["expert_load_max_over_mean"], stats["expert_load_cv"] = max_over_mean.mean(), cv.mean()
    out = {f"{prefix}{name}": value.detach() for name, value in stats.items()}
    for name, values in per_layer.items():
        out.update({f"{prefix}{name}/layer_{i}": v.detach() for i, v in enumerate(values)})
    return out


def router_aux_loss(model: nn.Module, router_logits: tuple[torch.Tensor, ...],
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model family's own load-balancing loss (transformers' `load_balancing_loss_func`).

    Switch Transformer: E · Σ_e f_e · P_e, f_e = share of rows whose top-k holds e (Σ f = k; the
    logits' own top-k, not replayed ids), P_e = mean router probability of e, over rows where
    `attention_mask` [B, S] is 1 (matching the rows of `router_logits`, e.g. `cap.router_logits()`).
    Unscaled: multiply by `moe.aux_loss_coef` in the trainer.
    """
    layer = moe_layers(model)[0]
    loss_fn = getattr(sys.modules[type(layer.router).__module__], "load_balancing_loss_func", None)
    if loss_fn is None:
        raise ValueError(f"router_aux_loss: {type(layer.router).__module__} has no load_balancing_loss_func")
    return loss_fn(tuple(router_logits), layer.num_experts, layer.top_k, attention_mask)
