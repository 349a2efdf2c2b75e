"""Memory-bounded token log-probs and entropies of responses under a transformers causal LM.

What it is: `response_logprobs` runs the decoder body once to get hidden states, packs the hidden
states of response tokens (`response_mask == 1`), and applies the output head chunk by chunk,
computing `log_softmax(logits / temperature)`, the gather at the sampled token and the entropy in
float32 per chunk. With grad enabled each chunk runs under non-reentrant activation checkpointing,
so only hidden states are kept and a chunk's logits are recomputed in backward. Peak memory of the
head is O(chunk_size * V) instead of the O(N * L * V) of `model(...).logits` and the O(N * T * V)
float32 log-softmax. `naive_response_logprobs` is the plain full-logits reference (tests, benchmark).
With `prompt_groups` (rows that share a prompt, e.g. the G responses of one prompt) each prompt
runs through the decoder once and its KV cache is gathered to the rows of its group. With `trim`
the decoder skips columns no response token depends on: left-padding columns of every row, response
columns after the last response token of every row, and the last column (it predicts nothing).

With `packed` (`gspo.core.packing.pack_rows`, the trainer's `train.pack_rows`) the rows run instead as packed rows:
each row's tokens up to its last response token back to back without padding, positions
restarting per row, attention confined to each row (transformers reads restarting position ids
with no attention mask as packed sequences: flash-attention varlen for one packed row, a
block-causal mask under sdpa / eager / flex; `packing_honoured` checks a model does). With
groups, a group's prompt is packed once and its rows' responses after it, each attending to the
prompt and itself through a 4D mask (sdpa / eager; not flash-attention).
`packed_logprobs` scores one packed row of arbitrary sequences: the layout of the trainer-only
throughput benchmark.

What it deliberately is not: no fused/Triton kernel, no vocabulary-parallel head, no KL or loss;
the decoder body runs unchanged (use the model's own gradient checkpointing for its activations). Head transforms handled: Cohere `logit_scale`,
Gemma `final_logit_softcapping`; a config with `logits_scaling` (Granite, MiniCPM3, ...) is
refused rather than silently mis-scored. Parallel wrappers (DDP, FSDP) must be unwrapped by the
caller: this calls the decoder and the head directly, not the wrapper's `forward` (wrap a module
whose `forward` calls this function instead).

Shapes: N sequences, L = prompt + response columns, T response columns, H hidden, V vocabulary,
K response tokens in the batch (`response_mask.sum()`), C tokens per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gspo.core.packing import PackedRows, pack_rows, row_spans


@dataclass
class TokenLogProbs:
    """Per-token log-probs and entropies of the response columns."""

    logp: torch.Tensor
    """[N, T] float32 log π(y_t | x, y_<t) at the sampling temperature; 0 where mask == 0."""
    entropy: torch.Tensor | None
    """[N, T] float32 entropy of π(· | x, y_<t); 0 where mask == 0; detached unless requested."""
    layout: "DecoderLayout | None" = None
    """The decoder forwards that ran (to lay out per-column records of them, e.g. MoE routing)."""


@dataclass
class DecoderLayout:
    """The decoder forwards behind a `response_logprobs` call, in call order.

    They covered columns ``start .. stop-1`` of the L input columns (`trim`). With shared prompts
    there were two: the first ``prefix`` of those columns for one row per group, then the others
    for all N rows, row i's prompt coming from row ``prefix_rows[i]`` of the first; else one
    (``packed``: over packed rows).
    """

    length: int
    start: int
    stop: int
    prefix: int = 0
    prefix_rows: torch.Tensor | None = None  # [N]
    packed: PackedRows | None = None
    """The rows ran packed: one forward over [B, S] columns, laid out as [N, L] by `PackedRows`."""
    tokens: int = 0
    """Positions the decoder computed, all its forwards (rows × columns)."""
    needed: torch.Tensor | int = 0
    """Of those, the positions some row's scored tokens depend on (`row_spans`); the rest is padding."""


def _packed_hidden(decoder: nn.Module, input_ids: torch.Tensor, packed: PackedRows,
                   **forward_kwargs) -> torch.Tensor:
    """Hidden states [B, S, H] of the rows [N, L] packed as ``packed``: one decoder forward, no
    attention mask (restarting positions) or the 4D mask of shared prompts."""
    mask = None
    if packed.attention is not None:  # additive [B, 1, S, S]: 0 where attended, else the dtype's min
        dtype = next(decoder.parameters()).dtype
        mask = torch.zeros(packed.attention.shape, dtype=dtype, device=input_ids.device)
        mask = mask.masked_fill_(~packed.attention.to(input_ids.device), torch.finfo(dtype).min)[:, None]
    out = decoder(input_ids=packed.gather(input_ids), position_ids=packed.position_ids.to(input_ids.device),
                  attention_mask=mask, use_cache=False, **forward_kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, S, H]


def packing_honoured(model: nn.Module, several_rows: bool = True, shared: bool = False) -> bool:
    """Whether the model's decoder gives each row of a packed layout the hidden states of that row
    alone: 4 ragged rows (2 prompts, 2 responses each) packed by `pack_rows` in one packed row or,
    with ``several_rows``, in several with padding tails; with ``shared``, each prompt once."""
    decoder, _ = decoder_and_head(model)
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (3, 2)]
    ids, am, rm = torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 3)
    for i, (p, r) in enumerate([(0, 2), (0, 3), (1, 1), (1, 2)]):
        n = len(prompts[p])
        ids[i, 3 - n:3], ids[i, 3:3 + r] = prompts[p], torch.randint(1, vocab, (r,), generator=g)
        am[i, 3 - n:3 + r], rm[i, :r] = 1, 1
    packed = pack_rows(am, rm, 8 if several_rows else None, torch.tensor([0, 0, 1, 1]) if shared else None)
    ids = ids.to(device)
    keep = row_spans(am, rm)  # [4, 6]
    with torch.no_grad():
        hidden = _packed_hidden(decoder, ids, packed).flatten(0, 1)  # [B·S, H]
        for i in range(4):
            cols = keep[i].nonzero().squeeze(-1)
            out = decoder(input_ids=ids[i, cols.to(device)][None], attention_mask=None, use_cache=False,
                          position_ids=torch.arange(len(cols), device=device)[None])
            alone = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [1, n, H]
            got = hidden[packed.where[i, cols.to(packed.where.device)].to(hidden.device)]
            if not torch.allclose(got.float(), alone[0].float(), atol=1e-2, rtol=1e-2):
                return False
    return True


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows, as HF generate uses: cumsum(mask) - 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder body (input ids -> last hidden state) and the output head of a causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise TypeError(f"{type(model).__name__}: need a decoder body and an output head")
    return decoder, head


def _logit_transform(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's forward does to `head(hidden)`, applied here in float32."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "logits_scaling", None) not in (None, 1, 1.0):
        raise NotImplementedError(f"{type(model).__name__}: config.logits_scaling is not supported")
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3: cap * tanh(logits / cap)

    def transform(z: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            z = z * scale
        if cap is not None:
            z = torch.tanh(z / cap) * cap
        return z

    return transform


def trim_columns(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int, int]:
    """(a, b, T') for `trim`: decoder input columns a..b-1 and the first T' response columns.

    Columns < a are padding in every row; response columns >= T' hold no response token of any
    row; column L-T+T'-1 (the last response token kept) predicts nothing. By causality the hidden
    states at L-T-1 .. L-T+T'-2 are those of the untrimmed input. One host sync (the masks' reach).
    """
    L, T = attention_mask.shape[1], response_mask.shape[1]
    prompt = attention_mask[:, : L - T].bool().any(0)  # [L-T] a column some row attends to
    used = response_mask.bool().any(0)  # [T]
    first, last = prompt.nonzero(), used.nonzero()  # (host sync)
    a = int(first[0]) if len(first) else L - T - 1
    T_kept = int(last[-1]) + 1 if len(last) else 0
    return min(a, L - T - 1), L - T + T_kept - 1, T_kept


def _shared_prompt_hidden(
    decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int, groups: torch.Tensor
) -> tuple[torch.Tensor, int, torch.Tensor] | None:
    """`response_hidden` running each group's prompt once: its first L-T columns for one row per
    group, their KV cache gathered to every row, then the last T columns of all rows:
    (hidden [N, T, H], P, the prefix row of each row [N]).
    None when nothing is shared, the decoder's cache cannot be gathered, or activation
    checkpointing is on with gradients (transformers then drops the cache of every layer)."""
    uniq, inverse = torch.unique(groups, return_inverse=True)  # CPU: no device sync
    N, L = input_ids.shape
    P = L - T  # prompt columns run once per group
    if P < 1 or len(uniq) == N or _checkpointing_drops_cache(decoder):
        return None
    rep = torch.empty(len(uniq), dtype=torch.long).scatter_(0, inverse, torch.arange(N))  # a row per group
    rep, inverse = rep.to(input_ids.device), inverse.to(input_ids.device)
    positions = position_ids_from_mask(attention_mask)  # [N, L]
    pre = decoder(input_ids=input_ids[rep, :P], attention_mask=attention_mask[rep, :P],
                  position_ids=positions[rep, :P], use_cache=True)
    name = "cache" if "cache" in pre else "past_key_values"  # transformers 5 renamed it `cache`
    cache = pre[name] if name in pre else None
    if not hasattr(cache, "batch_select_indices") or cache.get_seq_length() != P:
        return None  # no cache, or one the layers did not fill
    cache.batch_select_indices(inverse)  # [G·…, heads, P, d]: each row its group's prompt
    out = decoder(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=positions[:, P:],
                  use_cache=True, **{name: cache})
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [N, T, H]
    return hidden, P, inverse  # [N, T, H] the last T columns


def _checkpointing_drops_cache(decoder: nn.Module) -> bool:
    """Whether this forward runs under transformers activation checkpointing (training mode with
    gradients), which sets every layer's cache to None: a prompt pass would then fill nothing."""
    return decoder.training and torch.is_grad_enabled() and any(
        getattr(m, "gradient_checkpointing", False) for m in decoder.modules())


def _decoder_hidden(
    decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int,
    groups: torch.Tensor | None = None, **forward_kwargs
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Hidden states [N, T, H] at the last T columns of the decoder input [N, L] (each prompt once
    by `groups` when it can be), the shared prefix columns P (0: none) and its rows [N] (or None)."""
    if groups is not None and not forward_kwargs:
        shared = _shared_prompt_hidden(decoder, input_ids, attention_mask, T, groups)
        if shared is not None:
            return shared
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **forward_kwargs,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [N, L, H]
    return hidden[:, -T:], 0, None  # [N, T, H]


def response_hidden(
    decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int,
    groups: torch.Tensor | None = None, **forward_kwargs
) -> torch.Tensor:
    """Hidden states [N, T, H] at the positions that predict the response tokens (L-T-1 .. L-2),
    from a decoder pass over all L columns."""
    return _decoder_hidden(decoder, input_ids, attention_mask, T + 1, groups, **forward_kwargs)[0][:, :T]


def _chunk_logprobs(
    head: nn.Module,
    transform: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,  # [C, H]
    targets: torch.Tensor,  # [C]
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(target) and entropy for one chunk of tokens; the [C, V] logits live only here."""
    z = transform(head(h).float())  # [C, V]
    z = z / temperature if z.requires_grad else z.div_(temperature)  # [C, V]  z = logits / τ
    lse = torch.logsumexp(z, dim=-1)  # [C]
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse  # [C]  log softmax(z)[y]
    if not with_entropy:
        return logp, logp.new_zeros(())
    if not entropy_grad:
        z, lse = z.detach(), lse.detach()
    p = torch.softmax(z, dim=-1)  # [C, V]
    pz = (p * z if p.requires_grad else p.mul_(z)).sum(-1)  # [C]  Σ_v p_v z_v
    return logp, lse - pz  # H = logsumexp(z) − Σ softmax(z)·z


def _packed_logprobs(
    head: nn.Module,
    transform: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,  # [K, H]
    targets: torch.Tensor,  # [K]
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of K packed tokens, C = chunk_size at a time."""
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, ents = [], []
    for h_c, y_c in zip(h.split(chunk_size), targets.split(chunk_size)):  # [C, H], [C]
        args = (head, transform, h_c, y_c, temperature, with_entropy, entropy_grad)
        # preserve_rng_state=False: a chunk draws no random number, so its recompute needs no saved
        # RNG state, and restoring one would rewind torch's global RNG under anyone sampling from
        # it meanwhile (rollout.async's worker thread)
        lp, ent = (checkpoint(_chunk_logprobs, *args, use_reentrant=False, preserve_rng_state=False)
                   if grad else _chunk_logprobs(*args))
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps) if logps else h.new_zeros(0, dtype=torch.float32)  # [K]
    ent = torch.cat(ents) if with_entropy and ents else logp.new_zeros(0)  # [K]
    return logp, ent


def _unpack(values: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
    """Scatter K packed values back into [N, T] zeros at mask == 1 (mask [N, T'], T' <= T: the
    first T' columns; row-major, like mask indexing)."""
    out = torch.zeros((mask.shape[0], T), dtype=values.dtype, device=values.device)  # [N, T]
    out[:, : mask.shape[1]].masked_scatter_(mask, values)
    return out


def _check_layout(input_ids: torch.Tensor, response_mask: torch.Tensor) -> int:
    """T, after checking that the response fits behind at least one prompt column."""
    (N, L), (n, T) = input_ids.shape, response_mask.shape
    if n != N or T >= L:
        shapes = f"response_mask {tuple(response_mask.shape)}, input_ids {(N, L)}"
        raise ValueError(f"need response_mask [N, T] with T < L; got {shapes}")
    return T


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,  # [N, L] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor,  # [N, L]
    response_mask: torch.Tensor,  # [N, T] 1 for generated tokens up to and including EOS
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    prompt_groups: torch.Tensor | None = None,
    trim: bool = False,
    packed: PackedRows | None = None,
    **forward_kwargs,
) -> TokenLogProbs:
    """logp[i, t] = log softmax(logits / τ)[L-T+t-1] at input_ids[i, L-T+t], chunked over tokens.

    `forward_kwargs` go to the decoder body. The head runs only on the K tokens with mask == 1.
    `prompt_groups` [N] (CPU): rows with the same id have the same prompt columns (L-T), e.g. the
    G responses of one prompt; each group's prompt then runs through the decoder once and its KV
    cache serves every row of the group (same values up to float rounding, gradients included).
    `trim`: run the decoder only on the columns the response log-probs depend on (`trim_columns`;
    same values up to float rounding; one host sync). Both split or cut the forward: under a MoE
    routing capture, lay out what it recorded by the returned `layout` (`RoutingCapture.layout`);
    not under routing replay, which forces the experts of every row and column of one forward.
    `packed` (`pack_rows`): run the decoder once on the rows packed without padding instead
    (`prompt_groups` and `trim` are then not used); same values up to float rounding. Under a
    routing replay, replay ``packed.gather(routing)``.
    """
    T = _check_layout(input_ids, response_mask)
    if packed is not None:
        return _packed_rows_logprobs(model, input_ids, response_mask, packed, temperature=temperature,
                                     chunk_size=chunk_size, with_entropy=with_entropy,
                                     entropy_grad=entropy_grad, **forward_kwargs)
    decoder, head = decoder_and_head(model)
    L, a, b, T_kept = input_ids.shape[1], 0, input_ids.shape[1], 0
    if trim and not forward_kwargs:  # per-position kwargs (MoE routing replay) need every column
        a, b, T_kept = trim_columns(attention_mask, response_mask)
    if T_kept:  # [N, T', H] positions L-T-1 .. L-T+T'-2
        hidden, P, prefix_rows = _decoder_hidden(decoder, input_ids[:, a:b], attention_mask[:, a:b],
                                                 T_kept, prompt_groups)
    else:  # untrimmed (or no response token at all): all L columns
        a, b, T_kept = 0, L, T
        hidden, P, prefix_rows = _decoder_hidden(decoder, input_ids, attention_mask, T + 1, prompt_groups,
                                                 **forward_kwargs)
        hidden = hidden[:, :T]  # [N, T, H] positions L-T-1 .. L-2
    mask = response_mask[:, :T_kept].bool()  # [N, T']
    logp_k, ent_k = _packed_logprobs(
        head,
        _logit_transform(model),
        hidden[mask],  # [K, H]
        input_ids[:, L - T : L - T + T_kept][mask],  # [K]
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    entropy = _unpack(ent_k, mask, T) if with_entropy else None  # [N, T]
    layout = _padded_layout(attention_mask, response_mask, a, b, P, prefix_rows, prompt_groups)
    return TokenLogProbs(logp=_unpack(logp_k, mask, T), entropy=entropy, layout=layout)  # [N, T]


def _padded_layout(attention_mask: torch.Tensor, response_mask: torch.Tensor, a: int, b: int, P: int,
                   prefix_rows: torch.Tensor | None, groups: torch.Tensor | None) -> DecoderLayout:
    """The layout of padded forwards over columns a..b-1 (the first P once per group), with the
    positions they computed and those the rows need (no device sync)."""
    N, L = attention_mask.shape
    keep = row_spans(attention_mask, response_mask)[:, a:b]  # [N, b-a]
    if prefix_rows is None:
        return DecoderLayout(L, a, b, tokens=N * (b - a), needed=keep.sum())
    U = len(torch.unique(groups))  # rows of the prompt forward
    prompt = torch.zeros(U, dtype=torch.long, device=keep.device).scatter_(
        0, prefix_rows.to(keep.device), keep[:, :P].sum(-1))  # [U] each group's prompt tokens
    return DecoderLayout(L, a, b, P, prefix_rows, tokens=U * P + N * (b - a - P),
                         needed=prompt.sum() + keep[:, P:].sum())


def _packed_rows_logprobs(
    model: nn.Module, input_ids: torch.Tensor, response_mask: torch.Tensor, packed: PackedRows, *,
    temperature: float, chunk_size: int, with_entropy: bool, entropy_grad: bool, **forward_kwargs
) -> TokenLogProbs:
    """`response_logprobs` of the rows laid out as ``packed``: one decoder forward over [B, S]."""
    decoder, head = decoder_and_head(model)
    (N, L), T = input_ids.shape, response_mask.shape[1]
    hidden = _packed_hidden(decoder, input_ids, packed, **forward_kwargs)  # [B, S, H]
    mask = response_mask.bool()  # [N, T]
    at = packed.where.to(hidden.device)[:, L - T - 1 : L - 1][mask]  # [K] the column predicting each
    logp_k, ent_k = _packed_logprobs(
        head, _logit_transform(model), hidden.flatten(0, 1)[at],  # [K, H]
        input_ids[:, L - T :][mask], temperature=temperature, chunk_size=chunk_size,  # [K]
        with_entropy=with_entropy, entropy_grad=entropy_grad)
    entropy = _unpack(ent_k, mask, T) if with_entropy else None  # [N, T]
    layout = DecoderLayout(L, 0, L, packed=packed, tokens=packed.index.numel(), needed=packed.real)
    return TokenLogProbs(logp=_unpack(logp_k, mask, T), entropy=entropy, layout=layout)  # [N, T]


def packed_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,  # [1, S] several sequences back to back, no padding
    position_ids: torch.Tensor,  # [1, S] restarting at 0 where each sequence starts
    target_mask: torch.Tensor,  # [1, S] 1 at the tokens to score (0 at each sequence's first)
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """[1, S] float32 log π(input_ids[j] | its sequence's tokens before j) where target_mask == 1,
    else 0: one packed row, attention confined to each sequence by its restarting positions
    (transformers reads them as packed sequences when there is no attention mask and no cache:
    flash-attention varlen, or a block-causal mask for sdpa / eager). The head runs chunked on
    the scored tokens only, as in `response_logprobs`."""
    decoder, head = decoder_and_head(model)
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [1, S, H]
    mask = target_mask[:, 1:].bool()  # [1, S-1] token j+1 is predicted at column j
    logp_k, _ = _packed_logprobs(head, _logit_transform(model), hidden[:, :-1][mask],  # [K, H]
                                 input_ids[:, 1:][mask], temperature=temperature,
                                 chunk_size=chunk_size, with_entropy=False, entropy_grad=False)
    logp = torch.zeros(target_mask.shape, dtype=torch.float32, device=logp_k.device)  # [1, S]
    logp[:, 1:].masked_scatter_(mask, logp_k)
    return logp


def naive_response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,  # [N, L]
    attention_mask: torch.Tensor,  # [N, L]
    response_mask: torch.Tensor,  # [N, T]
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    **forward_kwargs,
) -> TokenLogProbs:
    """Reference: full [N, L, V] logits from `model(...)`, then a [N, T, V] float32 log-softmax.

    Same arguments and outputs as `response_logprobs`, less `chunk_size`.
    """
    T = _check_layout(input_ids, response_mask)
    L = input_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **forward_kwargs,
    )
    z = out.logits[:, L - T - 1 : L - 1].float() / temperature  # [N, T, V]
    logp_all = torch.log_softmax(z, dim=-1)  # [N, T, V]
    mask = response_mask.bool()  # [N, T]
    logp = torch.where(mask, logp_all.gather(-1, input_ids[:, -T:, None]).squeeze(-1), 0.0)  # [N, T]
    if not with_entropy:
        return TokenLogProbs(logp=logp, entropy=None)
    z = z if entropy_grad else z.detach()
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)  # [N, T]  lse − Σ p·z
    entropy = torch.where(mask, entropy, 0.0)  # [N, T]
    return TokenLogProbs(logp=logp, entropy=entropy)
