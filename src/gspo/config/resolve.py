"""The rules across sections: ``resolve(config, environment)`` checks them and fills in the
values a config leaves to be derived, returning a new config and a label for each derived value.

Pure: the config given is never changed (each derived value goes into a copy of its section,
validated as that section), and the only fact taken from outside the config is the
``Environment`` passed in (``Environment.of_process()`` reads ``WORLD_SIZE`` once, in
``gspo.config.loading.load_config``). A refused config raises ValueError with one line; the loader
prefixes the config's source. The rules run in a fixed order, so a config with two faults is
always refused for the same one. Derived (``Resolved.derived``, key -> why):

* ``advantage.scale``: unset -> the estimator's own (``gspo.core.advantages.default_scale``);
* ``train.rollout_correction.mode``: unset -> the engine's ``default_correction`` (none under
  ``train.old_logprobs=rollout``, whose π_old is the sampler's);
* ``rollout.async_ratio``: auto under ``rollout.async`` -> decoupled (with a correction mode for
  the objective's level unless one was set) or behaviour;
* ``train.master_weights``: unset under ``model.dtype=float16`` -> float32 (float16 AdamW moments
  underflow; the loss is scaled dynamically, gspo.training.loss_scale);
* ``rollout.async_worker``: unset under ``rollout.placement=ray`` with ``rollout.async`` ->
  thread (the generators are the worker's sampler; a process worker would start its own);
* ``train.balance_ranks``: auto under torchrun -> tokens, or none under ``rollout.async`` or
  ``train.minibatch_by=rows``;
* ``rollout.episode``: unset -> tool_loop when ``multiturn.env`` is set, else single_turn;
* ``train.pack_rows``: unset -> true on a CPU (exact, and measured faster there), false on a GPU
  (not measured) or with ``moe.aux_loss_coef > 0`` (refused when set).

This module does not read files or the environment, and builds nothing.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from pydantic import BaseModel, ValidationError

from gspo import envs, tasks
from gspo.envs.tools import load_tool
from gspo.config.train import TrainConfig
from gspo.core import advantages, objectives
from gspo.rollout import engines, episodes

ASYNC_OBJECTIVES_REFUSED = {"ppo": "its critic is trained on each batch in step with the policy",
                            "dpo": "its pairs are not importance-weighted",
                            "sft": "it trains on demonstrations, not rollouts"}
"""objective.name -> why rollout.async cannot serve it."""

@dataclass(frozen=True)
class Environment:
    """What the process offers that a config is checked against."""

    world_size: int = 1
    """Processes in the torchrun group (1 without torchrun)."""
    cuda: bool = False
    """A CUDA device is available (model.device=auto then trains on it)."""

    @classmethod
    def of_process(cls) -> "Environment":
        """This process's: ``WORLD_SIZE`` as torchrun sets it, and whether CUDA is available."""
        return cls(world_size=int(os.environ.get("WORLD_SIZE", "1")), cuda=torch.cuda.is_available())


@dataclass
class Resolved:
    """A resolved config and what resolving derived."""

    config: TrainConfig
    derived: dict[str, str] = field(default_factory=dict)
    """Dotted key -> 'value (why)', for each value filled in."""


def resolve(config: TrainConfig, environment: Environment) -> Resolved:
    """Check the rules across sections and derive what the config leaves to derive (see the
    module docstring); ValueError (one line) for a config that cannot run."""
    out = Resolved(config)
    for rule in RULES:
        rule(out, environment)
    return out


def derive(out: Resolved, key: str, value: Any, why: str) -> None:
    """Set the dotted ``key`` of ``out.config`` to ``value`` in a copy: the innermost section is
    validated again with it (a mode that does not take a parameter already set is refused)."""
    *path, name = key.split(".")
    sections = [out.config]
    for part in path:
        sections.append(getattr(sections[-1], part))
    new: BaseModel = validated(sections[-1], name, value)
    for parent, part in zip(reversed(sections[:-1]), reversed(path)):
        new = parent.model_copy(update={part: new})
    out.config = new
    out.derived[key] = f"{value} ({why})"


def validated(section: BaseModel, name: str, value: Any) -> BaseModel:
    """A copy of ``section`` with ``name`` = ``value``, validated as the section is."""
    data = {**{k: getattr(section, k) for k in section.model_fields_set}, name: value}
    try:
        return type(section).model_validate(data)
    except ValidationError as err:
        raise ValueError(err.errors()[0]["msg"].removeprefix("Value error, ")) from None


# ------------------------------------------------------------------------------------ rules
# Each rule reads out.config (with what earlier rules derived) and the environment, and raises
# ValueError or derives a value.

def advantage_scale(out: Resolved, env: Environment) -> None:
    a = out.config.advantage
    if a.scale is None:
        derive(out, "advantage.scale", advantages.default_scale(a.estimator),
               f"advantage.estimator={a.estimator}'s own")


def minibatches(out: Resolved, env: Environment) -> None:
    c = out.config
    n = c.batch_size
    if n % c.train.minibatches:
        raise ValueError(f"train.minibatches={c.train.minibatches} must divide the batch "
                         f"rollout.prompts_per_step*group_size={n}")
    if c.train.minibatch_by == "groups" and c.rollout.prompts_per_step < c.train.minibatches:
        raise ValueError(
            f"train.minibatch_by=groups deals whole groups: train.minibatches="
            f"{c.train.minibatches} needs at least as many rollout.prompts_per_step, not "
            f"{c.rollout.prompts_per_step} (or use train.minibatch_by=rows)")


def float16(out: Resolved, env: Environment) -> None:
    c = out.config
    if c.model.dtype != "float16":
        return
    if "master_weights" not in c.train.model_fields_set:
        derive(out, "train.master_weights", "float32", "model.dtype=float16")
    elif c.train.master_weights != "float32":
        raise ValueError("model.dtype=float16 trains with train.master_weights=float32 (float16 "
                         "AdamW moments underflow: its eps 1e-8 is 0 in float16)")


def packed_rows(out: Resolved, env: Environment) -> None:
    c = out.config
    aux = c.moe.aux_loss_coef > 0
    if c.train.pack_rows is None:
        gpu = c.model.device.startswith("cuda") or (c.model.device == "auto" and env.cuda)
        why = ("moe.aux_loss_coef > 0" if aux else "a GPU: not measured there" if gpu
               else "a CPU: exact and faster there, docs/performance.md")
        derive(out, "train.pack_rows", not (aux or gpu), why)
    elif c.train.pack_rows and aux:
        raise ValueError("train.pack_rows does not work with moe.aux_loss_coef > 0 (the router "
                         "loss averages over every attended column of the padded rows)")


def routing_replay_old(out: Resolved, env: Environment) -> None:
    c = out.config
    if c.moe.routing_replay == "old" and c.train.old_logprobs != "recompute":
        raise ValueError("moe.routing_replay=old captures experts in the recomputed old-log-prob "
                         "pass: it needs train.old_logprobs=recompute (or use routing_replay=rollout)")


def engine(out: Resolved, env: Environment) -> None:
    """What an engine with its own kernels (Capabilities.own_kernels: vllm) cannot serve; the package
    and the model type are checked by the preflight (gspo.rollout.engines.check)."""
    c = out.config
    if not engines.capabilities(c.rollout.engine).own_kernels:
        if c.rollout.engine_tp > 1:
            raise ValueError(f"rollout.engine_tp={c.rollout.engine_tp} splits an engine with its own "
                             f"kernels (vllm) over ranks; rollout.engine={c.rollout.engine} samples "
                             f"on the policy itself: leave rollout.engine_tp=1")
        return
    refused = [
        (c.moe.routing_replay == "rollout",
         "moe.routing_replay=rollout: the engine does not return the experts it routed to"),
        (c.rollout.sampler != "multinomial",
         f"rollout.sampler={c.rollout.sampler}: the engine draws tokens with its own sampler"),
        (env.world_size % c.rollout.engine_tp,
         f"rollout.engine_tp={c.rollout.engine_tp} with torchrun's {env.world_size} processes "
         f"(the engines' tensor-parallel groups must divide them)"),
    ]
    for refuse, why in refused:
        if refuse:
            raise ValueError(f"rollout.engine={c.rollout.engine} cannot serve {why}; "
                             f"use rollout.engine=hf")


def rollout_correction(out: Resolved, env: Environment) -> None:
    """A correction weighs a recomputed π_old against the sampler's log-probs."""
    c = out.config
    if c.train.rollout_correction.mode is None:
        recompute = c.train.old_logprobs == "recompute"
        mode = engines.capabilities(c.rollout.engine).default_correction if recompute else "none"
        why = (f"rollout.engine={c.rollout.engine}'s default" if recompute
               else "train.old_logprobs=rollout: π_old is the sampler's")
        derive(out, "train.rollout_correction.mode", mode, why)
    mode = out.config.train.rollout_correction.mode
    if mode != "none" and c.train.old_logprobs != "recompute":
        raise ValueError(f"train.rollout_correction.mode={mode} weighs the trainer's π_old against the "
                         f"sampler's log-probs: it needs train.old_logprobs=recompute")
    if mode != "none" and c.audit.every:
        raise ValueError(f"train.rollout_correction.mode={mode} changes the loss mask and advantages, "
                         f"which `gspo audit` does not re-derive yet: use audit.every=0 (or "
                         f"train.rollout_correction.mode=none)")


def async_rollout(out: Resolved, env: Environment) -> None:
    c = out.config
    if not c.rollout.async_:
        if c.rollout.async_ratio not in ("auto", "behaviour"):
            raise ValueError(f"rollout.async_ratio={c.rollout.async_ratio} needs rollout.async=true")
        return
    if (env.world_size > 1 and engines.capabilities(c.rollout.engine).joins_process_group
            and c.rollout.async_worker == "process" and "async_worker" not in c.rollout.model_fields_set):
        derive(out, "rollout.async_worker", "thread", f"torchrun with rollout.engine="
               f"{c.rollout.engine}: each rank's worker samples through the rank's engine")
        c = out.config
    if (why := async_refusal(c, env)) is not None:
        raise ValueError(f"rollout.async=true cannot serve {why}; set rollout.async=false")
    if c.rollout.async_ratio == "auto":
        async_ratio(out)
    if out.config.rollout.async_ratio == "decoupled" \
            and out.config.train.rollout_correction.mode == "none":
        raise ValueError("rollout.async_ratio=decoupled needs a train.rollout_correction.mode "
                         "to weigh the proximal policy to the behaviour one (e.g. seq_tis for "
                         "gspo, tis for grpo)")


def async_refusal(c: TrainConfig, env: Environment) -> str | None:
    """Why rollout.async cannot serve this config (gspo.training.async_rollout), or None."""
    if env.world_size > 1 and (why := async_torchrun_refusal(c)) is not None:
        return why
    if c.objective.name in ASYNC_OBJECTIVES_REFUSED:
        return f"objective.name={c.objective.name}: {ASYNC_OBJECTIVES_REFUSED[c.objective.name]}"
    if c.moe.routing_replay != "none":
        return (f"moe.routing_replay={c.moe.routing_replay}: the experts would come from the "
                "worker's policy, not the one the trainer replays them on")
    if c.guard.nan == "rollback" or any(r.action == "rollback" for r in c.guard.rules):
        return "a guard rollback: the batches in flight were sampled by the weights rolled back"
    if c.audit.every and c.rollout.max_staleness > 0:
        return "audit.every with max_staleness > 0: the audit records the trainer's weights as π_old"
    if c.model.lora is not None and c.model.lora.dropout > 0:
        return (f"model.lora.dropout={c.model.lora.dropout}: the trainer's dropout masks would be "
                "drawn from the torch RNG the worker samples from (runs not reproducible)")
    return None


def async_torchrun_refusal(c: TrainConfig) -> str | None:
    """Why rollout.async cannot serve this config under torchrun (a worker per rank, each
    sampling its rank's share: ddp; with vllm a thread worker through the rank's engine), or
    None."""
    if c.dist.strategy == "fsdp":
        return ("torchrun with dist.strategy=fsdp (each rank's worker would hold a whole copy "
                "of the policy beside the shards)")
    if c.train.dynamic_sampling:
        return ("torchrun with train.dynamic_sampling (the ranks agree on refill rounds by a "
                "collective, which a worker cannot make beside the trainer's)")
    if engines.capabilities(c.rollout.engine).joins_process_group and c.rollout.async_worker == "process":
        return (f"torchrun with rollout.engine={c.rollout.engine} and rollout.async_worker=process "
                "(the worker's own engine would join the trainers' process group: use thread)")
    if c.rollout.placement == "ray":
        return ("torchrun with rollout.placement=ray (rank 0's generators serve the other ranks "
                "by a collective, which a worker cannot make beside the trainer's)")
    return None


def async_ratio(out: Resolved) -> None:
    """rollout.async_ratio=auto -> decoupled when a batch can be stale and π_old is recomputed,
    with a correction unless the user set one (seq_tis for a sequence-level objective, tis for a
    token-level one; a mode the engine's default filled in counts as unset), else behaviour."""
    c = out.config
    if not (c.rollout.max_staleness > 0 and c.train.old_logprobs == "recompute"):
        derive(out, "rollout.async_ratio", "behaviour", "auto: no stale batch or π_old not recomputed")
        return
    derive(out, "rollout.async_ratio", "decoupled", "auto: stale batches, π_old recomputed")
    engine_default = "train.rollout_correction.mode" in out.derived
    if c.train.rollout_correction.mode == "none" or engine_default:
        name = c.objective.name
        sequence_level = name in objectives.available() and objectives.spec(name).sequence_level
        derive(out, "train.rollout_correction.mode", "seq_tis" if sequence_level else "tis",
               f"rollout.async_ratio=decoupled, a {'sequence' if sequence_level else 'token'}-level "
               f"objective")


def balance_ranks(out: Resolved, env: Environment) -> None:
    """train.balance_ranks: the rows a rank trains are dealt after the advantages, as whole groups
    (the log-prob passes find a row's prompt group by its position), which neither
    train.minibatch_by=rows nor the asynchronous worker's π_prox (computed for the rows its rank
    generated) can follow: auto is none there, tokens refused."""
    c = out.config
    why = balance_refusal(c)
    if c.train.balance_ranks == "tokens" and why is not None:
        raise ValueError(f"train.balance_ranks=tokens cannot serve {why}; use train.balance_ranks=none")
    if c.train.balance_ranks == "auto" and env.world_size > 1:
        derive(out, "train.balance_ranks", "tokens" if why is None else "none",
               "auto: torchrun" if why is None else f"auto: {why.split(' (')[0]}")


def balance_refusal(c: TrainConfig) -> str | None:
    """Why the ranks' rows cannot be dealt by tokens under this config, or None."""
    if c.rollout.async_:
        return "rollout.async (each rank's worker computes π_prox for the rows its rank generated)"
    if c.train.minibatch_by == "rows":
        return ("train.minibatch_by=rows (rows are dealt in whole groups: a prompt's responses "
                "must stay together, the log-prob passes share its prompt by position)")
    return None


def placement(out: Resolved, env: Environment) -> None:
    """What generators on Ray (gspo.rollout.engines.ray_generators) cannot serve yet; the worker of
    rollout.async is a thread whose sampler is the generators."""
    c = out.config
    if c.rollout.placement == "colocated":
        return
    refused = [
        (env.world_size > 1 and c.dist.strategy == "fsdp",
         "torchrun with dist.strategy=fsdp (rank 0 sends the generators its replica: ddp; a "
         "gather of the shards to rank 0 is not built)"),
        (c.moe.routing_replay == "rollout",
         "moe.routing_replay=rollout (the generators do not return the experts they routed to)"),
        (c.rollout.async_ and c.rollout.async_worker == "process"
         and "async_worker" in c.rollout.model_fields_set,
         "rollout.async_worker=process (the worker's sampler is the generators: use thread)"),
    ]
    for refuse, why in refused:
        if refuse:
            raise ValueError(f"rollout.placement={c.rollout.placement} cannot serve {why}; "
                             f"use rollout.placement=colocated")
    if c.rollout.async_ and c.rollout.async_worker != "thread":
        derive(out, "rollout.async_worker", "thread",
               "rollout.placement=ray: the generators are the worker's sampler")


def guard_kl_ref(out: Resolved, env: Environment) -> None:
    c = out.config
    if c.train.beta == 0 and any(r.kind == "kl_ref" for r in c.guard.rules):
        raise ValueError("guard rule kl_ref watches the KL to the reference policy: it needs "
                         "train.beta > 0")


def task_keys(out: Resolved, env: Environment) -> None:
    """The task keys the task's class requires (its parameters without a default, in order)."""
    t = out.config.task
    params = inspect.signature(tasks.get(t.name)).parameters.values()
    for key in [p.name for p in params if p.default is p.empty and p.name in type(t).model_fields]:
        if getattr(t, key) is None:
            raise ValueError(f"task.{key} is required when task.name={t.name}")
    if t.name == "dataset" and t.dataset is None:   # files, or a Hugging Face dataset
        for key in ("train_file", "test_file"):
            if getattr(t, key) is None:
                raise ValueError(f"task.{key} is required when task.name=dataset (or task.dataset)")


def chat_template(out: Resolved, env: Environment) -> None:
    c = out.config
    if c.task.chat and c.model.path is None and c.model.tokenizer == "char":
        raise ValueError("task.chat: true needs a tokenizer with a chat template; the char "
                         "tokenizer has none (set model.tokenizer=bpe)")


def not_built_together(out: Resolved, env: Environment) -> None:
    """Features that do not combine yet."""
    c = out.config
    if c.train.activation_checkpointing and (c.moe.routing_replay != "none"
                                             or c.moe.aux_loss_coef > 0):
        raise ValueError("train.activation_checkpointing does not work with moe.routing_replay or "
                         "moe.aux_loss_coef yet (the backward's recomputation runs outside the "
                         "routing context): turn one of them off")
    if c.train.master_weights == "float32" and c.dist.strategy == "fsdp":
        raise ValueError("train.master_weights=float32 is not supported with dist.strategy=fsdp "
                         "(the masters are not sharded); use ddp")
    if c.train.max_tokens_per_microbatch and (c.dist.strategy == "fsdp" or c.moe.aux_loss_coef > 0):
        raise ValueError("train.max_tokens_per_microbatch does not work with dist.strategy=fsdp "
                         "(ranks would make different numbers of collective backwards) or "
                         "moe.aux_loss_coef > 0 (the router loss is not a sum over rows)")
    if c.model.lora is not None and c.objective.name == "ppo":
        raise ValueError("model.lora is not supported with objective.name=ppo (its critic and "
                         "reference are copies of the whole policy); use a group-relative objective")


def episode(out: Resolved, env: Environment) -> None:
    """The run's episode (derived from multiturn.env when unset), and what it cannot serve."""
    c = out.config
    if c.rollout.episode is None:
        name = "single_turn" if c.multiturn.env is None else "tool_loop"
        derive(out, "rollout.episode", name, f"multiturn.env={c.multiturn.env}")
    if why := episodes.refusal(out.config.rollout.episode, out.config):
        raise ValueError(f"rollout.episode={out.config.rollout.episode}: {why}")


def multiturn(out: Resolved, env: Environment) -> None:
    """An environment's names and what does not combine with a multi-turn episode yet."""
    c, m = out.config, out.config.multiturn
    if m.env is None:
        if m.tools:
            raise ValueError("multiturn.tools is set but multiturn.env is not: set multiturn.env=tools")
        own = c.rollout.episode is not None and episodes.gives_rewards(c.rollout.episode)
        if any(s.type == "env" for s in c.rewards.sources) and not own:
            raise ValueError("rewards.sources has type env (the environment's own reward), but "
                             "multiturn.env is not set: no environment runs to give it")
        return
    if m.env == "tools" and not m.tools:
        raise ValueError("multiturn.env=tools needs multiturn.tools (typed functions, module:function)")
    if m.tools and m.env != "tools":
        raise ValueError(f"multiturn.tools are served by multiturn.env=tools, not {m.env!r}")
    if m.env != "tools":
        envs.check(m.env, m.params)             # imports a module:Class; refuses unknown params
    for tool in m.tools:
        load_tool(tool)                         # importable and typed, or one line
    refused = [
        (c.objective.name == "ppo", "objective.name=ppo (its critic scores every response token, "
                                    "observations included)"),
        (c.moe.routing_replay == "rollout", "moe.routing_replay=rollout (the experts of several "
                                            "turns' generations are not laid out as one trajectory yet)"),
        (c.rollout.async_ and m.sandbox and c.rollout.async_worker == "process",
         "rollout.async_worker=process with multiturn.sandbox (the tools' sandbox workers stay in "
         "the trainer's process; use rollout.async_worker=thread)"),
        (c.audit.every > 0, "audit.every (the audit's mask rules are the single-turn ones)"),
        (c.objective.name in ("dpo", "sft"), f"objective.name={c.objective.name}"),
    ]
    for refuse, why in refused:
        if refuse:
            raise ValueError(f"multiturn.env={m.env} does not work with {why}")


RULES: tuple[Callable[[Resolved, Environment], None], ...] = (
    advantage_scale, minibatches, float16, packed_rows, routing_replay_old, engine, rollout_correction,
    async_rollout, balance_ranks, placement, guard_kl_ref, task_keys, chat_template, not_built_together, multiturn,
    episode)
"""The rules in the order they run."""
