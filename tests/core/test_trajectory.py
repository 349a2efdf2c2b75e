"""gspo.core.trajectory: the batch type. select indexes every per-row field and keeps the rest;
the scored mask leaves out truncated responses (when asked) and dropped samples, never the
response mask itself; dropped_rows marks NaN rewards, None when there is none."""

import torch

from gspo.core.trajectory import Trajectories, dropped_rows, scored_mask


def _batch(**fields) -> Trajectories:
    # 3 rows, 2 prompt + 2 response columns; row 2 truncated (no EOS), row 1 one token long
    return Trajectories(torch.arange(12).view(3, 4), torch.ones(3, 4, dtype=torch.long),
                        torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
                        torch.tensor([False, False, True]), **fields)


def test_select_indexes_every_per_row_field_and_keeps_the_version():
    b = _batch(rollout_logp=-torch.ones(3, 2), dropped=torch.tensor([False, True, False]),
               loss_mask=torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]), version=7)
    s = b.select(torch.tensor([2, 0]))
    assert s.input_ids.tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]
    assert s.dropped.tolist() == [False, False] and s.truncated.tolist() == [True, False]
    assert s.loss_mask.tolist() == [[0.0, 0.0], [1.0, 0.0]] and s.version == 7
    assert s.routing is None and s.behaviour_logp is None
    assert s.response_ids.tolist() == [[10, 11], [2, 3]] and s.lengths.tolist() == [2.0, 2.0]


def test_scored_mask_by_hand():
    b = _batch(dropped=torch.tensor([True, False, False]))
    # row 0 dropped -> 0; row 1 as generated; row 2 truncated: kept unless mask_truncated
    assert scored_mask(b, False).tolist() == [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]
    assert scored_mask(b, True).tolist() == [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]
    assert b.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]     # untouched


def test_dropped_rows():
    assert dropped_rows(torch.tensor([1.0, 0.0])) is None
    assert dropped_rows(torch.tensor([1.0, float("nan"), float("inf")])).tolist() == [False, True, True]
