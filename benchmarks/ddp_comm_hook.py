"""Does torch's DDP with a SUM comm hook give the gradients of gspo's ``Dist.sync_grads``?

Two gloo ranks on this CPU, tiny-dense, uneven shares of one batch (5 and 3 rows), one loss with
the global normaliser (each rank's loss is its part of the global loss), one backward. gspo's
way: backward on the plain model, then ``Dist.sync_grads`` (a bucketed all-reduce SUM). torch's
way: the same forward through ``DistributedDataParallel(PolicyForward(model))`` with a comm hook
that all-reduces each bucket as a SUM (DDP's default hook would divide by the world size).
Prints whether every gradient is bit-identical.

What it does not show: the trainer's several backwards per minibatch (DDP then needs
``no_sync`` for all but the last), parameters unused on every rank, or fsdp. Run:
``PYTHONPATH=src python benchmarks/ddp_comm_hook.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

PORT = 29517


def sum_hook(state, bucket):
    """All-reduce the bucket as a plain SUM (the global normalisers already divide)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def worker(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from gspo.core.logprobs import response_logprobs
    from gspo.models.presets import build_model
    from gspo.training.distributed import Dist, PolicyForward
    model, _ = build_model("tiny-dense", seed=0)
    g = torch.Generator().manual_seed(1)
    N, P, T = 8, 5, 6                                       # rows, prompt and response columns
    ids = torch.randint(0, 60, (N, P + T), generator=g)     # [N, P+T]
    attn = torch.ones(N, P + T, dtype=torch.long)
    mask = torch.ones(N, T)                                 # [N, T]
    mask[3, 4:] = 0
    rows = slice(0, 5) if rank == 0 else slice(5, N)

    def loss_of(forward):
        logp = forward(ids[rows], attn[rows], mask[rows], with_entropy=False).logp   # [n, T]
        return -(logp * mask[rows]).sum() / mask.sum()      # this rank's part of the global loss

    loss = loss_of(lambda *a, **k: response_logprobs(model, *a, **k))
    loss.backward()
    Dist(rank=rank, world=world).sync_grads(model, loss.detach())
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ddp = DDP(PolicyForward(model), find_unused_parameters=True)
    ddp.register_comm_hook(None, sum_hook)
    loss_of(ddp).backward()
    theirs = {n.removeprefix("model."): p.grad.clone() for n, p in ddp.module.named_parameters()
              if p.grad is not None}
    if rank == 0:
        same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours.keys() & theirs.keys())
        print(f"parameters with a gradient: sync_grads {len(ours)}, DDP {len(theirs)}; "
              f"bit-identical: {same}; max |difference| {worst:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
