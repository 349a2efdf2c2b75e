"""Packed rows: a batch of padded rows [N, L] laid out back to back without padding.

Each row's attended tokens up to its last response token are packed one after the other into B
rows of S columns, positions restarting at 0 per row, so a decoder forward computes the tokens the
response log-probs need and (nearly) no padding. With prompt groups (the G responses of one prompt)
a group's prompt is packed once and its rows' responses after it, and an attention matrix says
who attends to whom. Units are dealt longest first to the least filled packed row, so the rows end
alike and their padding tails are short.

Pure layout arithmetic: index tensors and masks, no model. The forwards that run on the layout
are `gspo.core.logprobs` (`response_logprobs(packed=...)`); the trainer packs under
`train.pack_rows` (`gspo.training.passes`).

Shapes: N padded rows of L columns (T of them response columns), B packed rows of S columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """N padded rows [N, L] as B packed rows of S columns: each row's attended tokens up to its
    last response token (exclusive: that token predicts nothing) back to back, positions
    restarting at 0 per row, and after the last row of a packed row a padding tail (a sequence of
    its own, never scored). transformers reads restarting `position_ids` with no attention mask as
    packed sequences (`packing_honoured`). With shared prompts, a group's prompt is packed once and
    followed by each of its rows' response tokens, and ``attention`` says who attends to whom."""

    index: torch.Tensor  # [B, S] the padded column i·L + c whose token each packed column is; -1: tail
    position_ids: torch.Tensor  # [B, S]
    where: torch.Tensor  # [N, L] the flat packed position b·S + s computing each padded column; -1: none
    real: int  # packed columns that are not tail padding
    attention: torch.Tensor | None = None
    """[B, S, S] bool, query column attends key column (shared prompts: each response attends to its
    group's prompt and itself, causally); None: each row alone, read from the restarting positions."""

    def gather(self, x: torch.Tensor, fill: torch.Tensor | float = 0) -> torch.Tensor:
        """[B, S, ...] the packed layout of x [N, L, ...]; ``fill`` at the tail padding."""
        index = self.index.to(x.device)
        out = x.flatten(0, 1)[index.clamp(min=0)]  # [B, S, ...]
        valid = (index >= 0).view(*index.shape, *[1] * (x.dim() - 2))
        return torch.where(valid, out, torch.as_tensor(fill, dtype=x.dtype, device=x.device))

    def scatter(self, y: torch.Tensor, fill: torch.Tensor | float = 0) -> torch.Tensor:
        """[N, L, ...] the padded layout of y [B, S, ...]: each column the packed column that
        computed it (a shared prompt's to every row of its group); ``fill`` where none did."""
        where = self.where.to(y.device)
        out = y.flatten(0, 1)[where.clamp(min=0)]  # [N, L, ...]
        valid = (where >= 0).view(*where.shape, *[1] * (y.dim() - 2))
        return torch.where(valid, out, torch.as_tensor(fill, dtype=y.dtype, device=y.device))


def row_spans(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] bool: the columns a row's response log-probs depend on: the attended ones before its
    last response token (tool outputs between turns included; no device sync)."""
    L, T = attention_mask.shape[1], response_mask.shape[1]
    cols = torch.arange(1, T + 1, device=response_mask.device)
    reach = (response_mask.bool() * cols).amax(-1)  # [N] response columns up to the last token
    end = L - T + reach - 1  # [N] exclusive: the last response token predicts nothing
    return attention_mask.bool() & (torch.arange(L, device=end.device) < end[:, None])  # [N, L]


def pack_rows(attention_mask: torch.Tensor, response_mask: torch.Tensor,
              max_tokens: int | None = None, groups: torch.Tensor | None = None) -> PackedRows:
    """The packed layout of these rows (`PackedRows`). Units (a row; with ``groups`` [N] (CPU),
    rows of one id having the same prompt columns, a group: its prompt once, then its rows'
    response tokens; a group longer than ``max_tokens`` in parts, each with its prompt) are dealt
    longest first, each to the least filled of B packed rows (None: one), so that they end alike
    and their padding tails are short: of B = ceil(tokens / ``max_tokens``) down to rows of about
    2 ``max_tokens``, the B computing the fewest positions. A row's attended columns must be
    contiguous (left-padded prompt, right-padded response). One host sync (the rows' spans)."""
    (N, L), T = attention_mask.shape, response_mask.shape[1]
    cols = _row_columns(attention_mask, response_mask)  # N x [n_i] each row's attended columns
    units = _units(cols, groups, L - T, max_tokens)      # the rows packed together, in order
    shared = groups is not None
    split = [(cols[u[0]][cols[u[0]] < L - T], [cols[i][cols[i] >= L - T] for i in u]) if shared
             else (cols[u[0]], []) for u in units]  # (prompt or whole row, responses)
    bins, fill = _bins([len(p) + sum(len(r) for r in rs) for p, rs in split], max_tokens)
    index, positions, where, unit, branch = _lay_out(bins, units, split, (N, L), S=max(max(fill), 1))
    attention = _attention(unit, branch) if shared else None
    device = attention_mask.device
    return PackedRows(index.to(device), positions.to(device), where.to(device), int((index >= 0).sum()),
                      None if attention is None else attention.to(device))


def _row_columns(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's columns (on the host) its response log-probs depend on (`row_spans`); empty for
    a row without response token. Refuses a response token after a column its row skips."""
    (N, L), T = attention_mask.shape, response_mask.shape[1]
    scored = response_mask.cpu().bool()  # [N, T] (host sync)
    keep = row_spans(attention_mask.cpu(), scored)  # [N, L]
    if not keep[:, L - T - 1 : L - 1][scored].all():
        raise ValueError("pack_rows: a response token follows a column the row does not attend to")
    return [keep[i].nonzero().squeeze(-1) for i in range(N)]


def _units(cols: list[torch.Tensor], groups: torch.Tensor | None, P: int,
           max_tokens: int | None) -> list[list[int]]:
    """The rows packed as one unit: each live row alone, or (``groups``) a group's live rows, in
    parts of at most ``max_tokens`` tokens when it is longer (each part with the prompt's P columns)."""
    live = [len(c) > 0 for c in cols]  # a row without response token: nothing to score
    if groups is None:
        return [[i] for i in range(len(cols)) if live[i]]
    ids = groups.tolist()
    units = [[i for i in range(len(cols)) if ids[i] == g and live[i]] for g in dict.fromkeys(ids)]
    units = [u for u in units if u]
    if max_tokens is None:
        return units
    return [part for u in units for part in _parts(u, cols, P, max_tokens)]


def _bins(sizes: list[int], max_tokens: int | None) -> tuple[list[list[int]], list[int]]:
    """The units of these sizes dealt to packed rows (``_deal``), empty rows dropped: one packed row
    (``max_tokens`` None), or of ceil(total / max_tokens) rows down to rows of 2 ``max_tokens``,
    the count computing the fewest positions. (rows, fills)."""
    total = sum(sizes)
    if max_tokens is None:
        bins, fill = _deal(sizes, 1)
    else:
        counts = range(max(1, -(-total // (2 * max_tokens))), max(1, -(-total // max_tokens)) + 1)
        bins, fill = min((_deal(sizes, B) for B in reversed(counts)),
                         key=lambda d: sum(map(bool, d[0])) * max(d[1]))
    return [us for us in bins if us] or [[]], fill


def _lay_out(bins: list[list[int]], units: list[list[int]], split: list, shape: tuple[int, int], S: int):
    """The packed tensors of the units dealt to ``bins``: index, positions [B, S], where [N, L], and
    per packed column its unit (tail columns: a unit of their own each) and branch (0: a prompt or
    whole row; j + 1: the unit's j-th response)."""
    N, L = shape
    index = torch.full((len(bins), S), -1, dtype=torch.long)  # [B, S]
    positions, unit, branch = torch.zeros_like(index), torch.zeros_like(index), torch.zeros_like(index)
    where = torch.full((N, L), -1, dtype=torch.long)  # [N, L]
    for b, us in enumerate(bins):
        at = 0
        for u in sorted(us):
            prompt, responses = split[u]
            n = len(prompt)
            index[b, at:at + n] = units[u][0] * L + prompt
            positions[b, at:at + n] = torch.arange(n)
            unit[b, at:at + n] = u
            for i in units[u]:  # a shared prompt computes every row's prompt columns
                where[i, prompt] = b * S + at + torch.arange(n)
            at += n
            for j, (i, r) in enumerate(zip(units[u], responses)):  # shared prompts: each response
                index[b, at:at + len(r)] = i * L + r
                positions[b, at:at + len(r)] = n + torch.arange(len(r))  # after the prompt's n
                unit[b, at:at + len(r)] = u
                branch[b, at:at + len(r)] = j + 1
                where[i, r] = b * S + at + torch.arange(len(r))
                at += len(r)
        positions[b, at:] = torch.arange(S - at)  # the tail: a sequence of its own
        unit[b, at:] = -1 - torch.arange(S - at)  # (each column alone, for ``attention``)
    return index, positions, where, unit, branch


def _attention(unit: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """[B, S, S] bool, query attends key: same unit, causal, and the key is the prompt (branch 0)
    or the query's own response."""
    S = unit.shape[1]
    q, k = (slice(None), slice(None), None), (slice(None), None, slice(None))
    return ((unit[q] == unit[k]) & (torch.arange(S)[None, None] <= torch.arange(S)[None, :, None])
            & ((branch[k] == 0) | (branch[k] == branch[q])))


def _parts(rows: list[int], cols: list[torch.Tensor], P: int, max_tokens: int) -> list[list[int]]:
    """The rows of one group in consecutive parts of at most ``max_tokens`` tokens (the prompt's
    P' columns and the rows' response columns; a row longer alone), each part with the prompt."""
    prompt = int((cols[rows[0]] < P).sum())
    parts, size = [[]], prompt
    for i in rows:
        n = int((cols[i] >= P).sum())
        if parts[-1] and size + n > max_tokens:
            parts.append([])
            size = prompt
        parts[-1].append(i)
        size += n
    return parts


def _deal(sizes: list[int], B: int) -> tuple[list[list[int]], list[int]]:
    """Units of these sizes dealt longest first, each to the least filled of B rows: (rows, fills)."""
    bins: list[list[int]] = [[] for _ in range(B)]
    fill = [0] * B
    for u in sorted(range(len(sizes)), key=lambda u: -sizes[u]):  # stable: ties in unit order
        b = min(range(B), key=fill.__getitem__)
        bins[b].append(u)
        fill[b] += sizes[u]
    return bins, fill
