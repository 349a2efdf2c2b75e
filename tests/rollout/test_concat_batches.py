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


def test_the_rank_exchange_sends_each_row_once_to_the_rank_dealt_it():
    """gspo.training.balance.exchange between 3 ranks (threads, a mailbox in place of
    torch.distributed): every rank receives exactly its dealt rows, in the dealt order, each with
    its reward, advantage, completion and correctness, and a row travels once, to its rank only
    (what each rank sends sums to the rows it holds). Rank 2 is dealt nothing."""
    import threading
    from gspo.training import balance

    world = 3
    shares = [_batch(2, 3, 4, 0), _batch(3, 2, 2, 100), _batch(2, 4, 2, 200)]    # rows 0-3, 4-5, 6-7
    wanted = [torch.tensor([5, 0, 1, 6]), torch.tensor([2, 3, 4, 7]), torch.tensor([], dtype=torch.long)]
    sent, got, box = {}, {}, [None] * world
    barrier = threading.Barrier(world)

    class Rank:
        enabled = True

        def __init__(self, rank):
            self.rank, self.world = rank, world

        def exchange_objects(self, outgoing):
            sent[self.rank] = [len(ids) for ids, *_ in outgoing]
            box[self.rank] = outgoing
            barrier.wait()
            return [box[src][self.rank] for src in range(world)]

    def run(rank):
        start = sum(len(b.completions) for b in shares[:rank])
        n = len(shares[rank].completions)
        rewards = torch.arange(start, start + n, dtype=torch.float)
        got[rank] = balance.exchange(Rank(rank), shares[rank], rewards, 10 * rewards, wanted, start, PAD)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    texts = [c for b in shares for c in b.completions]
    for rank in range(world):
        batch, rewards, advantages = got[rank]
        rows = wanted[rank].tolist()
        assert batch.completions == [texts[g] for g in rows] and rewards.tolist() == rows
        assert advantages.tolist() == [10 * g for g in rows]
        assert len(batch.correct) == len(rows) and batch.input_ids.shape[0] == len(rows)
    assert got[0][0].response_mask.shape[1] == 4 and got[1][0].response_mask.shape[1] == 4
    assert [sum(sent[r]) for r in range(world)] == [len(b.completions) for b in shares]
    assert sent[2] == [1, 1, 0] and sent[0][2] == 0                    # rows only to their rank
