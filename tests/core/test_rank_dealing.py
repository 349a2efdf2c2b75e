"""Dealing a minibatch's groups to the ranks by tokens (gspo.core.plan.deal_to_ranks,
train.balance_ranks): hand-made lengths, the expected assignment, every unit dealt once, the
load bound, and the imbalance measure (``max_over_mean``) before and after."""

import torch

from gspo.core.plan import deal_to_ranks, max_over_mean, owned_rows, split_minibatches


def test_units_go_longest_first_to_the_lightest_rank():
    # one minibatch of 5 groups of 2 rows; group tokens 10, 40, 6, 30, 14 (rows 5 + 5, 20 + 20, ...)
    tokens = torch.tensor([5, 5, 20, 20, 3, 3, 15, 15, 7, 7])
    parts = [torch.arange(10)]
    dealt = deal_to_ranks(parts, tokens, world=2, unit=2)
    # 40 -> r0; 30 -> r1; 14 -> r1 (30 < 40); 10 -> r0 (40 < 44); 6 -> r1 (50 > 44)
    assert [rows.tolist() for rows in dealt[0]] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    loads = [int(tokens[rows].sum()) for rows in dealt[0]]
    assert loads == [50, 50]


def test_rows_keep_their_minibatch_order():
    tokens = torch.tensor([1, 9, 2, 8])
    dealt = deal_to_ranks([torch.tensor([3, 0, 2, 1])], tokens, world=2)
    # 9 (row 1) -> r0; 8 (row 3) -> r1; 2 (row 2) -> r1; 1 (row 0) -> r0
    assert [rows.tolist() for rows in dealt[0]] == [[0, 1], [3, 2]]


def test_ties_go_to_the_rank_with_the_fewest_tokens_of_the_step():
    """One group per minibatch: within it every rank is empty, so the step's load decides and
    each rank gets a group (no rank left without rows)."""
    tokens = torch.tensor([4, 4, 9, 9, 1, 1])
    parts = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    dealt = deal_to_ranks(parts, tokens, world=3, unit=2)
    owners = [[r for r, rows in enumerate(mb) if len(rows)] for mb in dealt]
    assert owners == [[0], [1], [2]]


def test_every_unit_dealt_once_and_the_load_bound_holds():
    g = torch.Generator().manual_seed(0)
    for world, unit, n, m in [(2, 4, 48, 3), (3, 1, 30, 2), (4, 8, 128, 4), (2, 1, 7, 3)]:
        tokens = torch.randint(1, 200, (n,), generator=g)
        parts = split_minibatches(n, m, torch.Generator().manual_seed(1), unit)
        dealt = deal_to_ranks(parts, tokens, world, unit)
        for part, ranks in zip(parts, dealt):
            got = torch.cat(ranks)
            assert sorted(got.tolist()) == sorted(part.tolist())              # each row once
            for rows in ranks:                                                 # whole units
                assert len(rows) % unit == 0
                assert bool((rows.view(-1, unit)[:, 0] % unit == 0).all())
            units = tokens[part.view(-1, unit)].sum(-1)
            loads = torch.stack([tokens[rows].sum() for rows in ranks])
            assert loads.max() <= loads.sum() / world + units.max()           # the greedy bound
        assert all(sum(len(mb[r]) for mb in dealt) for r in range(world))     # no rank empty


def test_dealing_lowers_the_imbalance_of_contiguous_shares():
    """Rank 0 generated the long responses: with contiguous shares it holds most tokens of every
    minibatch; dealt, the ranks hold about as many."""
    tokens = torch.cat([torch.full((12,), 50), torch.full((12,), 5)])         # [24], G = 4
    parts = split_minibatches(24, 2, torch.Generator().manual_seed(3), 4)
    before = max_over_mean(owned_rows(parts, [12, 12]), tokens)
    after = max_over_mean(deal_to_ranks(parts, tokens, 2, 4), tokens)
    assert before > 1.5 and after < before
    assert max_over_mean([[torch.tensor([0]), torch.tensor([1])]], torch.tensor([3, 3])) == 1.0


def test_owned_rows_are_each_ranks_contiguous_share():
    parts = [torch.tensor([4, 0, 7]), torch.tensor([1, 2, 3, 5, 6])]
    assert [[r.tolist() for r in mb] for mb in owned_rows(parts, [3, 5])] == \
        [[[0], [4, 7]], [[1, 2], [3, 5, 6]]]
