"""gspo.rollout.collect.concat_batches: batches of different prompt and response widths stacked
with every per-row field (ROW_LAYOUT covers ROW_FIELDS), prompts re-padded left, responses right;
what dynamic sampling refills and the torchrun rank balancing exchange with."""

import pytest
import torch

from gspo.core.trajectory import ROW_FIELDS, ROW_LAYOUT
from gspo.rollout.collect import concat_batches
from gspo.rollout.generate import RolloutBatch

PAD = 99


def _batch(prompt: int, T: int, n: int, start: int, **fields) -> RolloutBatch:
    L = prompt + T
    ids = torch.arange(start, start + n * L).view(n, L)
    return RolloutBatch(ids, torch.ones(n, L, dtype=torch.long), torch.ones(n, T),
                        torch.zeros(n, dtype=torch.bool),
                        rollout_logp=-torch.ones(n, T), behaviour_logp=-2 * torch.ones(n, T),
                        routing=torch.ones(n, L, 1, 2, dtype=torch.long),
                        loss_mask=torch.ones(n, T), completions=[f"c{start + i}" for i in range(n)],
                        examples=[{"i": start + i} for i in range(n)],
                        correct=torch.ones(n, dtype=torch.bool), version=3, **fields)


def test_every_row_field_has_a_layout():
    assert set(ROW_LAYOUT) == set(ROW_FIELDS)


def test_rows_keep_their_fields_under_the_wider_layout():
    a = _batch(prompt=2, T=3, n=1, start=0, dropped=torch.tensor([True]))
    b = _batch(prompt=3, T=2, n=2, start=100)
    out = concat_batches([a, b], PAD)
    assert out.input_ids.shape == (3, 6) and out.response_mask.shape == (3, 3)
    assert out.input_ids[0].tolist() == [PAD, 0, 1, 2, 3, 4]                     # prompt left
    assert out.input_ids[1].tolist() == [100, 101, 102, 103, 104, PAD]           # response right
    assert out.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 1]
    assert out.response_mask[1].tolist() == [1.0, 1.0, 0.0]
    assert out.rollout_logp[1].tolist() == [-1.0, -1.0, 0.0]
    assert out.behaviour_logp[2].tolist() == [-2.0, -2.0, 0.0]
    assert out.loss_mask[2].tolist() == [1.0, 1.0, 0.0]
    assert out.routing.shape == (3, 6, 1, 2) and out.routing[0, 0].tolist() == [[0, 0]]
    assert out.dropped.tolist() == [True, False, False]                          # None: none
    assert out.completions == ["c0", "c100", "c101"] and out.examples[2] == {"i": 101}
    assert out.correct.tolist() == [True, True, True] and out.version == 3
    assert len(concat_batches([a, b], PAD, limit=2).completions) == 2


def test_a_field_set_in_some_batches_only_is_refused():
    a, b = _batch(2, 3, 1, 0), _batch(2, 3, 1, 10)
    b.behaviour_logp = None
    with pytest.raises(ValueError, match="behaviour_logp"):
        concat_batches([a, b], PAD)
