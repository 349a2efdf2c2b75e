"""Sections for the update (``gspo.training``): the SFT cold start, the RL loop's optimizer and
minibatches, and data parallelism."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gspo.config.base import Section
from gspo.config.objectives import RolloutCorrectionConfig


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


class TrainLoopConfig(Section):
    steps: int = Field(100, ge=0)
    """RL steps (one rollout batch each)."""
    minibatches: int = Field(4, ge=1)
    """M: optimizer steps per rollout batch (the paper uses 4)."""
    minibatch_by: Literal["groups", "rows"] = "groups"
    """How the batch is dealt into the M minibatches: groups (whole groups) | rows (single responses); docs/results/performance/speed-paths.md."""
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
    max_tokens_per_microbatch: int | None = Field(None, ge=1)
    """Tokens (padding included) of one forward/backward: a minibatch's rows grouped by length into micro-batches, gradients summed (None: one per minibatch)."""
    pack_rows: bool | None = None
    """Log-prob passes on packed rows: no padding, attention confined per row (None: on a CPU without the MoE aux loss); docs/performance.md."""
    pack_length: int | None = Field(128, ge=1)
    """pack_rows: tokens per packed row under sdpa/eager attention (a longer row alone; None: one per forward, as flash-attention)."""
    logprob_chunk: int = Field(1024, ge=1)
    """Tokens per chunk when computing log-probs (bounds memory on large vocabularies)."""
    activation_checkpointing: bool = False
    """Recompute decoder layers' activations in backward during the RL update: less memory, about one more forward."""
    master_weights: Literal["model", "float32"] = "model"
    """What AdamW steps: model (parameters in model.dtype) | float32 (float32 master copies); docs/real-models.md."""
    log_rollout_logprobs: bool = False
    """Also ask the generator for its log-probs, only to log their difference from the trainer's (mismatch/*, paper §5.4)."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Rollout-mismatch correction (off by default): see its mode."""
    balance_ranks: Literal["auto", "tokens", "none"] = "auto"
    """torchrun: tokens deals each minibatch's groups to ranks by tokens | none: a rank trains the rows it sampled (auto: tokens where exact); docs/distributed.md."""
    skip_zero_advantage: bool = True
    """Skip forward/backward of rows with Â = 0 or an empty mask (their loss is 0); docs/results/performance/speed-paths.md."""


class DistConfig(Section):
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallelism under torchrun: ddp (whole model per rank) | fsdp (FSDP2, sharded per decoder layer); docs/distributed.md."""
    timeout_s: float = Field(1800.0, gt=0)
    """How long a rank waits in a collective (rank 0 evaluates and writes checkpoints while the others wait)."""
