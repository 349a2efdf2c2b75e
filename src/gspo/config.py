"""Validated configuration: YAML files plus dotted ``key=value`` command-line overrides.

One pydantic model per command (``TrainConfig`` for ``gspo train``; ``gspo sft`` and
``gspo eval`` read the same sections). Every field carries a docstring, unknown keys are errors
with a "did you mean", keys that moved are refused naming their new place (``MOVED``), and all
of it is checked before any model is built. ``ConfigError`` carries a one-line, user-facing
message; the CLI prints it and exits 2. The field defaults are the base every config file
overrides, not a job of their own: the main job is ``configs/default.yaml``, shipped in the
package (``shipped_config()``), which ``gspo train`` / ``sft`` / ``eval`` read when no config
file is given.

Layer: above the registries it validates names against (``gspo.core.objectives`` and
``advantages``, ``gspo.objective_presets``, ``gspo.models``, ``gspo.tasks``, ``gspo.rewards``, the
stability rules of ``gspo.observe``) and below everything that reads a config (``gspo.rollout``,
``gspo.training``, ``gspo.tools``).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gspo import objective_presets as presets
from gspo.core import advantages, correction, objectives
from gspo.observe.trackers import available as available_trackers
from gspo.errors import UserError
from gspo.models.presets import available_presets
from gspo.observe.stability_rules import check_rule
from gspo.rewards.sources import source_types
from gspo import tasks
from gspo.tasks.dataset import FIELDS

BASELINES = ("dpo", "sft")
"""objective.name values that are not a policy loss: online DPO and continued SFT at RL's budget
(gspo.training.algorithms implements them; every other name is a gspo.core.objectives loss)."""

ENGINES = ("hf", "vllm")
"""rollout.engine values: the samplers of gspo.rollout.engines, declared here by name because that
registry sits above this layer (it refuses to import if the two disagree)."""

DEFAULT_CORRECTION = {"hf": "none", "vllm": "tis"}
"""train.rollout_correction.mode when left unset, per rollout.engine: none when the policy samples
itself; tis (cap 2) for vLLM, whose kernels give other log-probs than the trainer's (as TRL
corrects by default)."""

MOVED = {"reward": "rewards"}
"""Sections renamed or merged (old name -> new one): refused with the new key, e.g.
reward.on_error -> rewards.on_error."""


class ConfigError(UserError, ValueError):
    """A user error in a config file or override: one line, names the key."""


def one_of(kind: str, name: str, valid: list[str]) -> str:
    """``name`` if it is in ``valid``, else ValueError with a "did you mean" and the valid names."""
    if name not in valid:
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown {kind} {name!r}; {hint}valid: {', '.join(valid)}")
    return name


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(Section):
    dir: str = "runs/default"
    """Output folder: config.yaml, metrics.jsonl, TensorBoard events, checkpoints, report.md."""
    save_every: int = Field(50, ge=0)
    """Checkpoint every this many RL steps (0: only at the end)."""
    eval_every: int = Field(25, ge=0)
    """Held-out evaluation every this many RL steps (0: only before and after training)."""
    overwrite: bool = False
    """Replace a previous run found in run.dir (otherwise refuse; --resume continues it)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many step checkpoints to keep (the final one is always kept)."""
    trackers: list[str] = ["tensorboard"]
    """Experiment trackers the step metrics go to besides metrics.jsonl (gspo.observe.trackers.available()): tensorboard (run.dir/tb) | wandb (offline unless WANDB_MODE says otherwise) | mlflow (a local file: store, run.dir/mlruns, unless MLFLOW_TRACKING_URI is set) | trackio (local). [] for none. Replaces the former run.tensorboard: bool."""
    progress: bool = True
    """Show a progress bar (disabled automatically when stderr is not a terminal)."""
    threads: int = Field(1, ge=0)
    """torch CPU threads (torch.set_num_threads), set when training starts; 0 leaves torch's default (one per core). 1 by default: on a 2-core machine 2 threads were ~20% faster while the other core was idle but stalled single steps 10-100x while it was busy (docs/performance.md)."""

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_key(cls, data: Any) -> Any:
        """The former ``run.tensorboard: bool`` (old configs, old runs' config.yaml): mapped to
        ``run.trackers`` ([tensorboard] or []); refused when given together with run.trackers."""
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        old = data.pop("tensorboard")
        if "trackers" in data:
            raise ValueError("run.tensorboard was replaced by run.trackers: give only run.trackers "
                             "(e.g. run.trackers=[tensorboard] or run.trackers=[])")
        if not isinstance(old, bool):
            raise ValueError(f"run.tensorboard (replaced by run.trackers) must be true or false, got {old!r}")
        data["trackers"] = ["tensorboard"] if old else []
        return data

    @field_validator("trackers")
    @classmethod
    def _trackers(cls, names: list[str]) -> list[str]:
        for name in names:
            one_of("tracker", name, available_trackers())
        if len(set(names)) < len(names):
            raise ValueError(f"a tracker is listed twice: {names}")
        return names


class LoRAConfig(Section):
    r: int = Field(16, ge=1)
    """Rank of each adapter (A: r x in, B: out x r)."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter adds (alpha / r) * B A x to the frozen layer's output."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Layers that get an adapter: all-linear (every linear layer but the output head) or a list of module names, a module matching a name when its dotted path equals it or ends with '.name' (e.g. [q_proj, v_proj]). A name that matches no module is an error."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, targets: list[str] | str) -> list[str] | str:
        if isinstance(targets, list) and not targets:
            raise ValueError("needs at least one module name (or all-linear)")
        return targets


class ModelConfig(Section):
    preset: str = "tiny-dense"
    """Built-in architecture to initialise from scratch: tiny-dense | tiny-moe."""
    path: str | None = None
    """A local transformers causal-LM checkpoint to start from instead of a preset."""
    overrides: dict[str, Any] = {}
    """Fields set on the preset's transformers config (e.g. {num_hidden_layers: 2})."""
    tokenizer: Literal["char", "bpe"] = "char"
    """Tokenizer of a preset (model.path brings its own): char (one token per ASCII character, no chat template) | bpe (byte-level BPE trained on the task's training text, Qwen-style: <|im_start|>/<|im_end|> ChatML template, <|im_end|> the EOS; docs/real-models.md)."""
    tokenizer_vocab: int = Field(4096, ge=300)
    """bpe: the most tokens it may have (256 bytes + special tokens + merges); a small corpus stops earlier."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype (bfloat16 / float16: the weights and the optimizer state are kept in it, unless train.master_weights=float32; LoRA adapters stay float32). Logits are upcast to float32 before the log-softmax, and log-probs, ratios and the loss are always float32."""
    device: str = "auto"
    """cpu | cuda | cuda:N | auto (cuda when available)."""
    lora: LoRAConfig | None = None
    """LoRA adapters through peft for RL (None: off, the whole model trains), e.g. {r: 16, alpha: 32, target_modules: all-linear}: only adapter weights train, checkpoints hold the adapter (adapter_config.json + adapter_model.safetensors), evaluation merges it, the KL reference is the base with the adapter disabled. The SFT cold start, when on, trains the whole model first (docs/real-models.md)."""

    @field_validator("preset")
    @classmethod
    def _preset(cls, name: str) -> str:
        return one_of("model preset", name, available_presets())


class TaskConfig(Section):
    name: str = "arithmetic"
    """Task from the registry (gspo.tasks.available()), or 'custom' for JSONL + reward function, or 'dataset' for JSONL / JSON / parquet / CSV / arrow files read with Hugging Face datasets (docs/real-models.md)."""
    n_train: int | None = Field(None, ge=1)
    """Training prompts to generate (built-in tasks; None: the task's default)."""
    n_test: int | None = Field(None, ge=1)
    """Held-out prompts to generate (built-in tasks; None: the task's default)."""
    n_val: int | None = Field(None, ge=1)
    """Validation prompts to generate, drawn after train and test and disjoint from both (built-in tasks; None: 200 when eval.split=validation, else none). For choosing hyper-parameters without the test split."""
    params: dict[str, Any] = {}
    """Task-specific generator options (e.g. {max_digits: 2} for arithmetic)."""
    train_file: str | None = None
    """custom task: JSONL file with 'prompt' and 'answer' per row (and any other columns). dataset task: a .jsonl / .json / .parquet / .csv / .arrow file, columns named by task.columns."""
    test_file: str | None = None
    """custom / dataset task: held-out file, same format."""
    validation_file: str | None = None
    """custom / dataset task: optional validation file, same format (needed for eval.split=validation)."""
    reward: str | None = None
    """custom task: reward function as 'module:function', called fn(completion, **row) -> float. dataset task: the same, optional (default: 1 when the final answer equals the answer column by value, math-verify)."""
    correct_threshold: float = 1.0
    """custom task: a completion counts as correct when its reward is at least this."""
    columns: dict[str, str] = {}
    """dataset task: which column of the files holds each field, e.g. {prompt: question, answer: solution} (fields: prompt, messages, answer; unset fields use their own name)."""
    chat: bool = False
    """Render prompts with the tokenizer's chat template (add_generation_prompt): the row's messages, or its prompt as one user turn. The template's end-of-turn token (e.g. <|im_end|>) becomes EOS for generation, the response mask and decoding. Needs a tokenizer with a chat template (model.tokenizer=bpe, or a model.path that has one)."""
    system_prompt: str | None = None
    """chat: a system turn put before every conversation that has none."""

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: dict) -> dict:
        for key in columns:
            one_of("task.columns field", key, list(FIELDS))
        return columns

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return one_of("task", name, tasks.available())


class RewardSpec(Section):
    type: str = "verifier"
    """Reward source: verifier (the task's) | function (module:function) | model (local reward model) | math (final answer equal by value, math-verify) | think_format (<think>...</think> answer layout)."""
    weight: float = 1.0
    """Weight of this source in the summed reward."""
    fn: str | None = None
    """function: 'module:function' with signature fn(completion, **row) -> float."""
    path: str | None = None
    """model: local AutoModelForSequenceClassification directory."""

    @field_validator("type")
    @classmethod
    def _type(cls, name: str) -> str:
        return one_of("reward type", name, source_types())

    @model_validator(mode="after")
    def _needs(self) -> "RewardSpec":
        needs = {"function": "fn", "model": "path"}.get(self.type)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"a reward of type {self.type!r} needs {needs!r}")
        return self


class SFTConfig(Section):
    enabled: bool = True
    """Cold-start the policy with supervised fine-tuning before RL (cached by its config)."""
    steps: int = Field(300, ge=0)
    """Optimizer steps of SFT; few on purpose, to stop at partial competence."""
    batch_size: int = Field(64, ge=1)
    """Demonstrations per SFT step."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (AdamW, linear warm-up, cosine decay)."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps."""
    n_examples: int | None = Field(None, ge=1)
    """Use only the first n training demonstrations (None: all)."""
    cache_dir: str = "runs/.sft-cache"
    """Where cold-start checkpoints are cached, one folder per hash of the config and the torch and transformers versions."""


class RolloutConfig(Section):
    prompts_per_step: int = Field(16, ge=1)
    """P: prompts sampled per RL step."""
    group_size: int = Field(8, ge=2)
    """G: responses per prompt (the group of the group-relative advantage)."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest response; a response without EOS by then is truncated."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; log-probs are taken at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1.0: off). Log-probs ignore it, as in the paper."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""
    dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    """Precision of the model that samples: model (the policy itself, model.dtype) or a copy of the policy in this dtype, refreshed from it before every generation (e.g. bfloat16 sampling with float32 training: a real rollout/trainer mismatch, see train.rollout_correction)."""
    engine: str = "hf"
    """Generation engine (gspo.rollout.engines, docs/engines.md): hf (transformers generate on the policy, or on its rollout.dtype copy) | vllm (a vLLM engine in this process built once from the policy after the cold start, weights synced in place before every step's generation; optional package; one process, no LoRA, no moe.routing_replay=rollout; under rollout.async a thread worker samples through the same engine, a process worker builds its own). With vllm the sampler's log-probs are always returned (mismatch/* every step) and train.rollout_correction defaults to tis."""
    engine_sleep: bool = True
    """Free the engine's memory for the training update: after a step's generation the engine sleeps (vllm on CUDA: vLLM's sleep mode, level 1: its weights offloaded to host memory, its KV cache dropped), and it wakes before the next generation, before the weight sync. On by default; a no-op where the engine holds nothing to free (hf) or has no sleep mode (vllm on a CPU). false: the engine keeps its memory (vllm is then built without sleep mode)."""
    async_: bool = Field(False, alias="async")
    """rollout.async: generate, score and take π_old of the next batches in a worker (rollout.async_worker) with its own copy of the policy while the trainer trains on this one (gspo.async_rollout, docs/performance.md). The batch of step k is sampled by the weights after step k - max_staleness, always (so runs are reproducible and resume exactly); run.threads torch threads per side on CPU."""
    async_worker: Literal["process", "thread"] = "process"
    """With rollout.async, where the worker runs: process (a child process of its own, started once from a fork server: no interpreter lock or RNG shared with the trainer; weights go to it after every step as safetensors bytes, batches come back pickled, over its own pipes; a script that trains must start under `if __name__ == "__main__":`) | thread (a thread of this process: no start-up, but both sides contend for the interpreter lock: on the default job 1.37x the synchronous step rate against the process's 1.47x, docs/performance.md). With rollout.engine=vllm a thread worker samples through the trainer's engine, a process worker builds its own (docs/engines.md)."""
    max_staleness: int = Field(1, ge=0)
    """With rollout.async: s, how many RL steps the sampling policy of a batch may lag the policy trained on it (its ratio is taken against that behaviour policy, docs/math.md). 0 runs in lockstep and reproduces the synchronous run exactly."""
    async_ratio: Literal["auto", "behaviour", "decoupled"] = "auto"
    """With rollout.async, what a stale batch's ratio is taken against (docs/math.md, Asynchronous rollouts): behaviour (π_old = the policy v that sampled it; the clip acts on π_θ/π_v) | decoupled (π_old = the trainer's weights before this step, the proximal policy: the first minibatch's own forward, the others' from the worker beside it; the clip acts on π_θ/π_prox and train.rollout_correction, which it needs, weighs each token or response by π_prox/π_v: seq_tis for sequence-level objectives such as gspo) | auto (the default: decoupled when max_staleness > 0 and train.old_logprobs=recompute, with rollout_correction.mode seq_tis for a sequence-level objective or tis for a token-level one unless a mode is set; else behaviour. Measured in docs/performance.md: at s = 1 on the default job the behaviour ratio trained both gspo and grpo more slowly than the synchronous run, the decoupled one did not, at the same step rate)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    @field_validator("engine")
    @classmethod
    def _engine(cls, name: str) -> str:
        return one_of("engine", name, list(ENGINES))


class ObjectiveConfig(Section):
    name: str = "gspo"
    """Policy loss from the registry (gspo.core.objectives.available()), with group-relative advantages; or a baseline (gspo.training.algorithms, docs/baselines.md): ppo (GAE from a critic, see the ppo section) | sft (continued SFT on demonstrations at the same step and token budget) | dpo (online DPO on each group's best-vs-worst pair, see the dpo section)."""
    eps_low: float | None = Field(None, gt=0)
    """Lower clip range (None: the objective's paper default; GSPO 3e-4)."""
    eps_high: float | None = Field(None, gt=0)
    """Upper clip range (None: the objective's paper default; GSPO 4e-4)."""
    aggregation: Literal["seq-mean", "seq-mean-token-mean", "token-mean",
                         "seq-mean-token-sum-norm"] | None = None
    """Loss aggregation (None: the objective's paper default)."""
    params: dict[str, float] = {}
    """Extra objective hyper-parameters (e.g. {tau_pos: 1.0, tau_neg: 1.05} for sapo)."""
    preset: str | None = None
    """A named recipe (gspo.objective_presets.available()): dapo | dr_grpo. Expanded into config values when the config is loaded (objective name, clip range, aggregation, advantage scale, trainer switches; docs/math.md): in a YAML file the file's own keys win; as a key=value override it stands for the preset's overrides at its place (over the file and earlier overrides, under later ones). The run's config.yaml shows the expanded values."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return one_of("objective", name, objective_names())

    @field_validator("preset")
    @classmethod
    def _preset(cls, name: str | None) -> str | None:
        return None if name is None else one_of("objective preset", name, presets.available())

    @field_validator("params")
    @classmethod
    def _params(cls, params: dict, info) -> dict:
        name = info.data.get("name")
        if name is None:  # the name itself failed
            return params
        defaults = objectives.spec(name).defaults if name in objectives.available() else {}  # sft: none
        valid = sorted(set(defaults) - {"eps_low", "eps_high", "aggregation"})
        for key in params:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"objective {name!r} has no hyper-parameter {key!r}; {hint}"
                                 f"valid: {', '.join(valid) or 'none'}")
        return params


class PPOConfig(Section):
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount γ (1.0 as TRL PPOConfig: one episode per response, the reward at its end)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ (0.95 as TRL PPOConfig and cleanrl)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the value update around the rollout-time values (TRL cliprange_value 0.2); null: unclipped."""
    critic_lr: float | None = Field(None, gt=0)
    """Critic learning rate (null: train.lr); AdamW with the policy's schedule, warm-up, weight decay and grad_clip."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to mean 0, std 1 over the batch's response tokens (cleanrl norm_adv, TRL whiten)."""
    kl_in_reward: bool = False
    """Put the KL to the reference policy in the per-token reward, −kl_coef·(log π_old − log π_ref) (TRL / InstructGPT), instead of (or besides) the train.beta loss."""
    kl_coef: float = Field(0.05, ge=0)
    """kl_in_reward: the penalty's coefficient (0.05 as TRL PPOConfig.kl_coef)."""


class AdvantageConfig(Section):
    estimator: str = "group"
    """Baseline of the group-relative advantage (gspo.core.advantages.available()): group (r_i − group mean, GSPO Eq. 6) | rloo (r_i − mean of the other responses of the group, arXiv 2402.14740). For the group-relative objectives; ppo uses GAE, sft and dpo no advantages."""
    scale: Literal["group", "batch", "none"] | None = None
    """Divide the centred rewards by the group std (paper Eq. 6), the batch std, or nothing. Unset: the estimator's own (group: group; rloo: none), written into the resolved config. rloo takes group or none."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""

    @model_validator(mode="before")
    @classmethod
    def _default_scale(cls, data: Any) -> Any:
        """An unset scale becomes the estimator's (an unknown estimator is reported by its field)."""
        if isinstance(data, dict) and data.get("scale") is None:
            name = data.get("estimator", "group")
            if name in advantages.available():
                data = {**data, "scale": advantages.default_scale(name)}
        return data

    @field_validator("estimator")
    @classmethod
    def _estimator(cls, name: str) -> str:
        return one_of("advantage estimator", name, advantages.available())

    @model_validator(mode="after")
    def _rloo_scale(self) -> "AdvantageConfig":
        if self.estimator == "rloo" and self.scale == "batch":
            raise ValueError("advantage.estimator=rloo takes advantage.scale none or group, not batch")
        return self


class DPOConfig(Section):
    beta: float = Field(0.1, gt=0)
    """objective.name=dpo: β of the DPO loss −log σ(β[(log π_θ − log π_ref)(y_w) − (log π_θ − log π_ref)(y_l)]) (0.1, as arXiv 2305.18290's experiments and TRL's DPOConfig)."""


class RolloutCorrectionConfig(Section):
    mode: str | None = None
    """None: per rollout.engine, none for hf, tis for vllm (config.DEFAULT_CORRECTION; a run's config.yaml shows the value used). Weight or mask the policy loss by π_old/π_rollout, the trainer's recomputed log-probs over the sampler's (gspo.core.correction, docs/math.md): none | tis (token weight min(ρ_t, cap)) | seq_tis (response weight min(ρ_i, cap), ρ_i the geometric mean) | seq_mask (drop a response unless low ≤ ρ_i ≤ high) | icepop (drop a token unless low ≤ ρ_t ≤ high). Anything but none asks the sampler for its log-probs and logs mismatch/kl, ratio_min, ratio_max, masked_frac, is_weight_mean."""
    cap: float | None = Field(None, gt=0)
    """tis, seq_tis: the truncation C of the importance weight (None: 2.0)."""
    low: float | None = Field(None, ge=0)
    """seq_mask, icepop: the lowest ratio kept (None: 0.5)."""
    high: float | None = Field(None, gt=0)
    """seq_mask, icepop: the highest ratio kept (None: 2.0)."""

    @field_validator("mode")
    @classmethod
    def _mode(cls, name: str | None) -> str | None:
        return None if name is None else one_of("rollout correction", name, correction.available())

    @model_validator(mode="after")
    def _params(self) -> "RolloutCorrectionConfig":
        if self.mode not in correction.available():  # the mode itself failed
            return self
        defaults = correction.spec(self.mode).defaults
        for key in ("cap", "low", "high"):
            if getattr(self, key) is not None and key not in defaults:
                raise ValueError(f"rollout correction {self.mode!r} has no parameter {key!r}; "
                                 f"valid: {', '.join(defaults) or 'none'}")
        params = self.params()
        if "low" in params and params["low"] >= params["high"]:
            raise ValueError(f"rollout correction {self.mode!r}: low={params['low']} must be "
                             f"below high={params['high']}")
        return self

    def params(self) -> dict[str, float]:
        """The mode's parameters, defaults filled in."""
        defaults = correction.spec(self.mode).defaults
        return {k: v if getattr(self, k) is None else getattr(self, k) for k, v in defaults.items()}


class TrainLoopConfig(Section):
    steps: int = Field(100, ge=0)
    """RL steps (one rollout batch each)."""
    minibatches: int = Field(4, ge=1)
    """M: optimizer steps per rollout batch (the paper uses 4)."""
    minibatch_by: Literal["groups", "rows"] = "groups"
    """How the batch is dealt into the M minibatches: groups (whole groups of G responses to one prompt, shuffled; each prompt's columns then run once per step in the forward/backward, not once per minibatch; needs rollout.prompts_per_step >= M, and minibatches differ by a group when M does not divide it) | rows (every response on its own, shuffled: each minibatch sees most prompts). Measured in docs/performance.md (speed) and docs/math.md (learning)."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """π_old log-probs: recomputed by the trainer (first minibatch exactly on-policy) or the generator's (paper §5.4)."""
    beta: float = Field(0.0, ge=0)
    """Weight of the k3 KL to the reference (initial) policy; 0 as the GSPO paper."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (subtracted from the loss)."""
    mask_truncated: bool = False
    """Drop responses that hit max_new_tokens without EOS from the loss."""
    dynamic_sampling: bool = False
    """Drop zero-variance groups and refill the batch with fresh prompts (DAPO)."""
    max_refill_rounds: int = Field(3, ge=0)
    """dynamic_sampling: extra generation rounds at most per step."""
    logprob_chunk: int = Field(1024, ge=1)
    """Tokens per chunk when computing log-probs (bounds memory on large vocabularies)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (transformers activation checkpointing, non-reentrant) during the RL update: less memory, about one extra forward of time; the update's forwards then do not share prompts (docs/real-models.md)."""
    master_weights: Literal["model", "float32"] = "model"
    """What AdamW steps: model (the parameters in model.dtype; bfloat16 rounds away updates below half a bfloat16 step of the weight) | float32 (a float32 master copy of every lower-precision parameter and float32 moments; forward, backward and gradients stay in model.dtype, each step writes the rounded masters back; float32 parameters are their own masters). The RL update only, not the cold-start SFT; not with dist.strategy=fsdp (docs/real-models.md)."""
    log_rollout_logprobs: bool = False
    """Also ask the generator for its log-probs, only to log their difference from the trainer's (mismatch/*, paper §5.4)."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Rollout-mismatch correction (off by default): see its mode."""
    skip_zero_advantage: bool = True
    """Skip the old-log-prob and training forward/backward of responses with Â = 0 (zero-variance groups) or an empty loss mask: every objective's loss is 0 there, so the update is the same. They enter the loss with ratio 1; entropy and MoE metrics cover the rows trained on. Off by itself with beta > 0, entropy_coef > 0, moe.aux_loss_coef > 0 or an audited step."""


class MoEConfig(Section):
    routing_replay: Literal["none", "old", "rollout"] = "none"
    """Force π_old's experts when computing π_θ: none | old (captured in the old-log-prob pass, paper's R2) | rollout (captured at generation, R3)."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router load-balancing loss (0: off)."""


GuardAction = Literal["warn", "skip", "pause", "rollback"]


class GuardRule(Section):
    kind: str
    """Rule kind (gspo.observe.stability_rules.available()): nan | clip_frac | approx_kl | kl_ref | grad_norm | entropy | reward_drop | moe_imbalance | metric."""
    threshold: float | None = None
    """The limit (every kind but nan): the metric above it fires (below it for entropy; reward_drop: the drop below the moving average)."""
    action: GuardAction = "warn"
    """warn | skip (discard this step's update) | pause (save, exit 3) | rollback (last good checkpoint)."""
    metric: str | None = None
    """The metric watched: required for kind=metric, otherwise replaces the kind's default metric."""
    below: bool | None = None
    """kind=metric: fire when the value falls below the threshold (default: above)."""
    ema: float | None = Field(None, gt=0, lt=1)
    """reward_drop: weight of the past in the moving average (default 0.9)."""
    warmup: int = Field(0, ge=0)
    """Skip this many RL steps before the rule is checked."""

    @model_validator(mode="after")
    def _kind(self) -> "GuardRule":
        check_rule(self)
        return self


class GuardConfig(Section):
    nan: Literal["off", "warn", "skip", "pause", "rollback"] = "skip"
    """Action when any step metric (loss, gradient norm, reward, ...) is NaN or Inf."""
    rules: list[GuardRule] = []
    """Threshold rules checked after every RL step, e.g. [{kind: clip_frac, threshold: 0.5, action: rollback}]."""
    max_rollbacks: int = Field(3, ge=0)
    """Roll-backs allowed per run; a roll-back beyond them pauses the run instead."""
    rollback_lr_scale: float = Field(1.0, gt=0, le=1)
    """Multiply the learning rate by this at every roll-back (1: unchanged)."""
    snapshot_device: Literal["cpu", "same"] = "cpu"
    """Where the pre-step copy of weights and optimizer (kept for skip / pause rules) lives."""


class AuditConfig(Section):
    every: int = Field(0, ge=0)
    """Record the rollout batch, π_old and π_new of every K-th RL step under run.dir/audit/ (0: off); check with `gspo audit`."""


class MonitorConfig(Section):
    length_buckets: int = Field(4, ge=0)
    """Equal-width response-length buckets over 1..max_new_tokens for the length/<lo>-<hi>/* metrics (0: off)."""


class FaultsConfig(Section):
    lr_factor: float = Field(1.0, gt=0)
    """Deliberate fault, to exercise the guard: multiply the learning rate by this (e.g. 1000) ..."""
    lr_from_step: int = Field(1, ge=1)
    """... from this RL step on (1-based, as logged)."""


class DistConfig(Section):
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallelism under torchrun (ignored in one process): ddp (every rank holds the whole model; gradients summed by all-reduce after backward) | fsdp (FSDP2 fully_shard per decoder layer: weights, gradients and optimizer state sharded). docs/distributed.md."""
    timeout_s: float = Field(1800.0, gt=0)
    """How long a rank waits in a collective (rank 0 evaluates and writes checkpoints while the others wait)."""


class EvalConfig(Section):
    split: Literal["test", "validation"] = "test"
    """Held-out split the evaluations score: test (what results report) | validation (for choosing hyper-parameters without looking at test, e.g. the `gspo compare` grid)."""
    n: int | None = Field(None, ge=1)
    """Held-out prompts to evaluate (None: the whole split)."""
    k: int = Field(4, ge=1)
    """Samples per prompt for mean pass@1 and pass@k."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for pass@k (greedy accuracy uses argmax)."""
    batch_size: int = Field(256, ge=1)
    """Prompts per generation batch."""
    keep_best: bool = True
    """When the task has a validation split and eval.split=test: at every evaluation (the cold start's included) also score the validation split (eval.n prompts), and keep the weights that scored best there in <run.dir>/best (summary.json: best_validation). The test split never chooses. Not under torchrun with dist.strategy=fsdp (the sharded weights are not gathered for it)."""


class DataConfig(Section):
    on_error: Literal["fail", "skip"] = "fail"
    """A bad example (bad JSON, missing or empty prompt, wrong type, characters the tokenizer cannot encode, longer than the context): fail names it (file:line); skip drops it and counts it (log, summary.json)."""


class RewardsConfig(Section):
    sources: list[RewardSpec] = [RewardSpec()]
    """Reward sources, summed with their weights."""
    on_error: Literal["fail", "zero", "drop"] = "fail"
    """A reward source that raises, hangs, or returns None / a non-number / NaN / Inf on a sample: fail stops naming the sample; zero scores it 0; drop masks the sample out of the advantages and the loss. Counted in reward/errors."""
    timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit of one reward call on one sample (a hung call counts as an error)."""
    max_hung: int = Field(8, ge=0)
    """Hung in-process calls tolerated per run (each leaves a thread behind); beyond, the run stops. Use sandbox for code that may hang."""
    sandbox: bool = False
    """Run 'function' rewards (and a custom task's reward) in a separate process with CPU, memory and wall limits and no network: for rewards that execute model-written code."""
    sandbox_cpu_s: float = Field(10.0, gt=0)
    """sandbox: CPU seconds per call (rounded up to whole seconds)."""
    sandbox_memory_mb: int = Field(1024, ge=64)
    """sandbox: address-space limit of the worker process."""


ASYNC_OBJECTIVES_REFUSED = {"ppo": "its critic is trained on each batch in step with the policy",
                            "dpo": "its pairs are not importance-weighted",
                            "sft": "it trains on demonstrations, not rollouts"}


def async_refusal(cfg: "TrainConfig") -> None:
    """Raise ValueError (one line) for what rollout.async cannot serve (gspo.async_rollout)."""
    s = cfg.rollout.max_staleness
    why = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        why = "torchrun with more than one process (one generation worker per process is not built)"
    elif cfg.objective.name in ASYNC_OBJECTIVES_REFUSED:
        why = f"objective.name={cfg.objective.name}: {ASYNC_OBJECTIVES_REFUSED[cfg.objective.name]}"
    elif cfg.moe.routing_replay != "none":
        why = (f"moe.routing_replay={cfg.moe.routing_replay}: the experts would come from the "
               "worker's policy, not the one the trainer replays them on")
    elif cfg.guard.nan == "rollback" or any(r.action == "rollback" for r in cfg.guard.rules):
        why = "a guard rollback: the batches in flight were sampled by the weights rolled back"
    elif cfg.audit.every and s > 0:
        why = "audit.every with max_staleness > 0: the audit records the trainer's weights as π_old"
    elif cfg.model.lora is not None and cfg.model.lora.dropout > 0:
        why = (f"model.lora.dropout={cfg.model.lora.dropout}: the trainer's dropout masks would be "
               "drawn from the torch RNG the worker samples from (runs not reproducible)")
    if why is not None:
        raise ValueError(f"rollout.async=true cannot serve {why}; set rollout.async=false")


class TrainConfig(Section):
    seed: int = 0
    """Seeds model init, data order, sampling: same seed, same run (on CPU)."""
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rewards: RewardsConfig = RewardsConfig()
    """Reward sources and what a failing reward call does to the run: timeouts, on_error policy, sandbox (docs/reliability.md)."""
    data: DataConfig = DataConfig()
    """What a bad training or test example does to the run (docs/reliability.md)."""
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    ppo: PPOConfig = PPOConfig()
    """objective.name=ppo: critic, GAE and value loss (docs/baselines.md); ignored otherwise."""
    advantage: AdvantageConfig = AdvantageConfig()
    """How rewards become advantages: the estimator (group | rloo) and its scaling."""
    dpo: DPOConfig = DPOConfig()
    """objective.name=dpo: online DPO on each group's best-vs-worst pair (docs/math.md); ignored otherwise."""
    train: TrainLoopConfig = TrainLoopConfig()
    eval: EvalConfig = EvalConfig()
    moe: MoEConfig = MoEConfig()
    """Mixture-of-Experts switches (only for MoE models, e.g. model.preset=tiny-moe)."""
    guard: GuardConfig = GuardConfig()
    """Stability guard: rules over the step metrics -> warn / skip / pause / rollback (docs/trust.md)."""
    audit: AuditConfig = AuditConfig()
    """Rollout records for offline re-computation of ratios, clipping and loss (docs/trust.md)."""
    monitor: MonitorConfig = MonitorConfig()
    """Extra diagnostics: length slices."""
    faults: FaultsConfig = FaultsConfig()
    """Deliberate faults for testing the guard (off by default)."""
    dist: DistConfig = DistConfig()
    """Data-parallel training under torchrun: strategy ddp | fsdp (docs/distributed.md)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, tree):
        """Refuse a section that moved, naming where its keys went."""
        if not isinstance(tree, dict):
            return tree
        for old, new in MOVED.items():
            if old in tree:
                keys = list(tree[old]) if isinstance(tree[old], dict) else []
                key = f"{old}.{keys[0]}" if keys else old
                raise ValueError(f"unknown key {key!r}; did you mean {new + key[len(old):]!r}? "
                                 f"(section {old!r} is now part of {new!r})")
        if isinstance(tree.get("rewards"), list):
            raise ValueError("rewards is a section now; did you mean rewards.sources? "
                             "(e.g. rewards.sources=[{type: verifier}])")
        return tree

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        """objective.preset: fill every key the config leaves unset with the preset's value."""
        if isinstance(data, dict) and isinstance(data.get("objective"), BaseModel):
            data = {**data, "objective": data["objective"].model_dump(exclude_unset=True)}
        return presets.expand(data)

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        n = self.rollout.prompts_per_step * self.rollout.group_size
        if n % self.train.minibatches:
            raise ValueError(
                f"train.minibatches={self.train.minibatches} must divide the batch "
                f"rollout.prompts_per_step*group_size={n}")
        if self.train.minibatch_by == "groups" and self.rollout.prompts_per_step < self.train.minibatches:
            raise ValueError(
                f"train.minibatch_by=groups deals whole groups: train.minibatches="
                f"{self.train.minibatches} needs at least as many rollout.prompts_per_step, not "
                f"{self.rollout.prompts_per_step} (or use train.minibatch_by=rows)")
        if self.moe.routing_replay == "old" and self.train.old_logprobs != "recompute":
            raise ValueError("moe.routing_replay=old captures experts in the recomputed old-log-prob "
                             "pass: it needs train.old_logprobs=recompute (or use routing_replay=rollout)")
        self._check_engine()
        correction_unset = self.train.rollout_correction.mode is None
        self._check_rollout_correction()
        if self.rollout.dtype not in ("model", self.model.dtype) and self.moe.routing_replay == "rollout":
            raise ValueError(f"rollout.dtype={self.rollout.dtype} samples with a copy of the policy, whose "
                             f"experts moe.routing_replay=rollout cannot capture: use rollout.dtype=model")
        if self.rollout.async_:
            async_refusal(self)
            if self.rollout.async_ratio == "auto":
                self._resolve_async_ratio(correction_unset)
            if self.rollout.async_ratio == "decoupled" and self.train.rollout_correction.mode == "none":
                raise ValueError("rollout.async_ratio=decoupled needs a train.rollout_correction.mode "
                                 "to weigh the proximal policy to the behaviour one (e.g. seq_tis for "
                                 "gspo, tis for grpo)")
        elif self.rollout.async_ratio not in ("auto", "behaviour"):
            raise ValueError(f"rollout.async_ratio={self.rollout.async_ratio} needs rollout.async=true")
        if self.train.beta == 0 and any(r.kind == "kl_ref" for r in self.guard.rules):
            raise ValueError("guard rule kl_ref watches the KL to the reference policy: it needs "
                             "train.beta > 0")
        required = {"custom": ("train_file", "test_file", "reward"),
                    "dataset": ("train_file", "test_file")}.get(self.task.name, ())
        for key in required:
            if getattr(self.task, key) is None:
                raise ValueError(f"task.{key} is required when task.name={self.task.name}")
        if self.task.chat and self.model.path is None and self.model.tokenizer == "char":
            raise ValueError("task.chat: true needs a tokenizer with a chat template; the char "
                             "tokenizer has none (set model.tokenizer=bpe)")
        if self.train.activation_checkpointing and (self.moe.routing_replay != "none"
                                                    or self.moe.aux_loss_coef > 0):
            raise ValueError("train.activation_checkpointing does not work with moe.routing_replay or "
                             "moe.aux_loss_coef yet (the backward's recomputation runs outside the "
                             "routing context): turn one of them off")
        if self.train.master_weights == "float32" and self.dist.strategy == "fsdp":
            raise ValueError("train.master_weights=float32 is not supported with dist.strategy=fsdp "
                             "(the masters are not sharded); use ddp")
        if self.model.lora is not None and self.objective.name == "ppo":
            raise ValueError("model.lora is not supported with objective.name=ppo (its critic and "
                             "reference are copies of the whole policy); use a group-relative objective")
        return self

    def _check_engine(self) -> None:
        """What rollout.engine cannot serve (vllm); the package and the model type are checked
        by the preflight (gspo.rollout.engines.check), before any model is built."""
        if self.rollout.engine == "hf":
            return
        world = int(os.environ.get("WORLD_SIZE", "1"))
        refused = [
            (self.moe.routing_replay == "rollout",
             "moe.routing_replay=rollout: the engine does not return the experts it routed to"),
            (self.model.lora is not None,
             "model.lora: the weight sync sends whole weights, not adapters (merging is not built)"),
            (world > 1, f"torchrun with {world} processes (one engine per node is not built)"),
        ]
        for refuse, why in refused:
            if refuse:
                raise ValueError(f"rollout.engine={self.rollout.engine} cannot serve {why}; "
                                 f"use rollout.engine=hf")

    def _check_rollout_correction(self) -> None:
        """A correction weighs a recomputed π_old against the sampler's log-probs. Unset: the
        engine's default (DEFAULT_CORRECTION; none under train.old_logprobs=rollout, whose π_old
        is the sampler's)."""
        if self.train.rollout_correction.mode is None:
            self.train.rollout_correction.mode = (DEFAULT_CORRECTION[self.rollout.engine]
                                                  if self.train.old_logprobs == "recompute" else "none")
        mode = self.train.rollout_correction.mode
        if mode != "none" and self.train.old_logprobs != "recompute":
            raise ValueError(f"train.rollout_correction.mode={mode} weighs the trainer's π_old against the "
                             f"sampler's log-probs: it needs train.old_logprobs=recompute")
        if mode != "none" and self.audit.every:
            raise ValueError(f"train.rollout_correction.mode={mode} changes the loss mask and advantages, "
                             f"which `gspo audit` does not re-derive yet: use audit.every=0 (or "
                             f"train.rollout_correction.mode=none)")

    @property
    def batch_size(self) -> int:
        """N = P x G sequences per RL step (derived)."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    def _resolve_async_ratio(self, correction_unset: bool) -> None:
        """rollout.async_ratio=auto -> decoupled when a batch can be stale and π_old is
        recomputed, with a correction unless one is set (seq_tis for a sequence-level objective,
        tis for a token-level one; ``correction_unset``: the mode was the engine's default, e.g.
        vllm's tis, not the user's), else behaviour. The config then records what ran."""
        if self.rollout.max_staleness > 0 and self.train.old_logprobs == "recompute":
            self.rollout.async_ratio = "decoupled"
            if self.train.rollout_correction.mode == "none" or correction_unset:
                name = self.objective.name
                sequence_level = objectives.spec(name).sequence_level \
                    if name in objectives.available() else False
                self.train.rollout_correction.mode = "seq_tis" if sequence_level else "tis"
        else:
            self.rollout.async_ratio = "behaviour"

    @property
    def minibatch_unit(self) -> int:
        """Rows dealt together into minibatches (derived): G under train.minibatch_by=groups, else 1."""
        return self.rollout.group_size if self.train.minibatch_by == "groups" else 1

    def objective_kwargs(self) -> dict:
        """Keyword arguments of the policy loss (derived): the clip range and aggregation when
        set (else the objective's paper defaults), objective.params, and token_sum_norm =
        rollout.max_new_tokens (the seq-mean-token-sum-norm constant)."""
        o = self.objective
        kwargs = {k: v for k, v in (("eps_low", o.eps_low), ("eps_high", o.eps_high),
                                    ("aggregation", o.aggregation)) if v is not None}
        return {**kwargs, **o.params, "token_sum_norm": float(self.rollout.max_new_tokens)}

    def token_aggregation(self) -> str:
        """How per-token extras (KL, entropy) are reduced (derived): like the objective, with
        seq-mean read as seq-mean-token-mean."""
        defaults = objectives.spec(self.objective.name).defaults \
            if self.objective.name in objectives.available() else {}
        mode = self.objective.aggregation or defaults.get("aggregation", "seq-mean")
        return "seq-mean-token-mean" if mode == "seq-mean" else mode


def objective_names() -> list[str]:
    """Every valid ``objective.name``: the policy-loss registry plus ``BASELINES``."""
    return sorted(set(objectives.available()) | set(BASELINES))


# ---------------------------------------------------------------------------------------------
# Loading: YAML + overrides -> validated model, with one-line errors.

def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.steps=5' -> (['train', 'steps'], 5); values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    return key.split("."), value


def apply_override(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """Valid keys at the location of an error (for the "did you mean")."""
    for part in loc[:-1]:
        if isinstance(part, int):  # an index into a list section, e.g. rewards[0]
            continue
        ann = getattr(model.model_fields.get(part), "annotation", None)
        args = typing.get_args(ann)
        if typing.get_origin(ann) is list and args:
            ann = args[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [f.alias or name for name, f in model.model_fields.items()]  # rollout.async, not async_


def format_validation_error(err: ValidationError, model: type[BaseModel], source: str) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc) or "<config>"
    if first["type"] == "extra_forbidden":
        names = _field_names(model, loc)
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
        return f"{source}: unknown key {key!r}{hint}"
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:
        return f"{source}: {msg}"
    got = first.get("input")
    return f"{source}: {key}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})")


def shipped_config(name: str = "default.yaml") -> Path:
    """A config file inside the installed package (``gspo/configs/<name>``, a byte copy of the
    repository's ``configs/<name>``). ``default.yaml`` is the main job: what ``gspo train``,
    ``gspo sft`` and ``gspo eval`` read when no config file is given, also outside the repository."""
    return Path(str(resources.files("gspo") / "configs" / name))


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                model: type[BaseModel] = TrainConfig) -> Any:
    """Read ``path`` (optional), apply ``key=value`` overrides, validate. Raises ConfigError.

    An ``objective.preset=NAME`` override is expanded where it stands (gspo.objective_presets.expand)."""
    tree = read_yaml(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        apply_override(tree, key, value)
        if key == ["objective", "preset"]:   # its values, here: over the file and earlier overrides
            tree = presets.expand(tree, replace=True)
    source = str(path) if path else "config"
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model, source)) from None


def config_hash(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (used to cache cold-start checkpoints)."""
    blob = json.dumps([p.model_dump() if isinstance(p, BaseModel) else p for p in parts],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def dump_yaml(config: BaseModel, path: str | Path) -> None:
    """Write atomically (temporary file, then rename): a killed run never leaves half a config."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)
