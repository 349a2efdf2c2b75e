"""Cold start: supervised fine-tuning on demonstrations, to a deliberately partial competence.

The loss is the mean negative log-likelihood of the demonstration tokens (answer + EOS), computed
with the same memory-bounded log-prob path and the same prompt/response layout as RL, so the cold
start and the RL policy see identical positions. The result is cached by a hash of everything that
determines it, so a second ``gspo train`` with the same settings reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gspo.config import SFTConfig, config_hash
from gspo.logprobs import response_logprobs
from gspo.models import save_model
from gspo.optim import build_optimizer, build_scheduler
from gspo.rollout import demonstration_batch
from gspo.tasks import Example

DONE_FILE = "sft.json"


def sft_loss(model, batch, chunk_size: int = 1024) -> torch.Tensor:
    """Mean NLL over demonstration tokens: -(1/Σm) Σ m log π(y_t)."""
    out = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                            temperature=1.0, chunk_size=chunk_size, with_entropy=False)
    mask = batch.response_mask
    return -(out.logp * mask).sum() / mask.sum().clamp(min=1.0)


def train_sft(model, tokenizer, examples: list[Example], cfg: SFTConfig, *, seed: int,
              progress: bool = True, desc: str = "sft") -> list[dict]:
    """Run ``cfg.steps`` AdamW steps on shuffled demonstrations; returns per-step metrics."""
    if cfg.n_examples:
        examples = examples[:cfg.n_examples]
    device = next(model.parameters()).device
    rng = random.Random(seed)
    optimizer = build_optimizer(model, cfg.lr)
    scheduler = build_scheduler(optimizer, "cosine", cfg.warmup_steps, cfg.steps)
    model.train()
    history, order = [], []
    bar = tqdm(range(cfg.steps), desc=desc, disable=not progress, dynamic_ncols=True)
    for step in bar:
        if len(order) < cfg.batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
        batch = demonstration_batch(tokenizer, [examples[i] for i in idx], device)
        loss = sft_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        history.append({"step": step, "sft/loss": loss.item(), "sft/grad_norm": grad_norm.item()})
        bar.set_postfix(loss=f"{history[-1]['sft/loss']:.3f}")
    optimizer.zero_grad(set_to_none=True)  # the policy leaves SFT without its last gradients
    model.eval()
    return history


# Task fields that do not change the training split: left out of the key, so setting them reuses
# the cold start (validation is drawn after train; see gspo.tasks.base.make_splits).
NOT_TRAINING_DATA = {"n_val", "validation_file"}


def cache_key(model_cfg, task_cfg, sft_cfg: SFTConfig, seed: int) -> str:
    sft = sft_cfg.model_dump(exclude={"cache_dir", "enabled"})
    task = task_cfg.model_dump(exclude=NOT_TRAINING_DATA)
    train_file = getattr(task_cfg, "train_file", None)  # custom data: its content, not only its path
    data = [hashlib.sha256(Path(train_file).read_bytes()).hexdigest()] if train_file else []
    model = model_cfg.model_dump(exclude={"lora"})  # adapters attach after the cold start
    return config_hash(model, task, sft, seed, *data)


def cached_checkpoint(cache_dir: str | Path, key: str) -> Path | None:
    path = Path(cache_dir) / key
    return path if (path / DONE_FILE).is_file() else None


def save_cold_start(model, tokenizer, cache_dir: str | Path, key: str, info: dict) -> Path:
    """Write atomically: a half-written cache entry is never mistaken for a finished one, and two
    processes that trained the same cold start at once (parallel ``gspo compare`` jobs) keep one."""
    final = Path(cache_dir) / key
    tmp = Path(cache_dir) / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    (tmp / DONE_FILE).write_text(json.dumps(info, indent=1))
    if cached_checkpoint(cache_dir, key) is not None:  # another process finished it first
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    shutil.rmtree(final, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:  # lost the race between the check and the rename
        if cached_checkpoint(cache_dir, key) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final
