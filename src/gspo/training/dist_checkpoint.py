"""Checkpoints under data parallelism: rank 0 writes, every rank loads.

``save_checkpoint`` writes ``gspo.training.checkpoint``'s folder on rank 0 (the others wait for
it and hear of its failure); under fsdp the full weights and optimizer state are first gathered
from the shards (``torch.distributed.checkpoint.state_dict``, full state dicts offloaded to the
CPU), on every rank, since gathering is a collective. ``load_state`` sets full weights and an
optimizer state on every rank (fsdp: into the shards). The optimizer state keeps the layout of
``optimizer.state_dict()`` (parameters by index) in the file; torch's state-dict API speaks
fully-qualified names, so the two are mapped here (torch's modules are imported when first
needed). One process: plain ``load_state_dict`` and ``checkpoint.save_checkpoint``.
"""

from __future__ import annotations

from torch import nn

from gspo.training import checkpoint
from gspo.training.distributed import Dist


def save_checkpoint(ranks: Dist, run_dir, step: int, model, tokenizer, optimizer, scheduler,
                    state: dict, keep: int, extra=None):
    """``checkpoint.save_checkpoint`` on rank 0 (fsdp: of the gathered full state)."""
    if not ranks.enabled:
        return checkpoint.save_checkpoint(run_dir, step, model, tokenizer, optimizer,
                                          scheduler, state, keep=keep, extra=extra)
    model_state = optimizer_state = None
    if ranks.policy is not None:
        model_state, optimizer_state = full_state(ranks, model, optimizer)
    return ranks.on_main(lambda: checkpoint.save_checkpoint(
        run_dir, step, model, tokenizer, optimizer, scheduler, state, keep=keep,
        model_state=model_state, optimizer_state=optimizer_state, extra=extra))


def load_state(ranks: Dist, model, optimizer, weights: dict, optimizer_state: dict) -> None:
    """Load full weights and an optimizer state (``optimizer.state_dict()`` layout) on every rank."""
    if ranks.policy is None:
        model.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    names = param_names(model)
    fqn = {"state": {names[i]: v for i, v in optimizer_state["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                            for g in optimizer_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, fqn, options=options)


def full_state(ranks: Dist, model, optimizer) -> tuple[dict, dict]:
    """fsdp: full weights and optimizer state on rank 0 (CPU), optimizer in its id layout."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if not ranks.is_main:
        return {}, {}
    index = {name: i for i, name in enumerate(param_names(model))}
    optim = {"state": {index[k]: v for k, v in optim["state"].items()},
             "param_groups": [{**g, "params": [index[k] for k in g["params"]]}
                              for g in optim["param_groups"]]}
    return weights, optim


def param_names(model: nn.Module) -> list[str]:
    """Names of the trained parameters in the optimizer's order (``build_optimizer``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]
