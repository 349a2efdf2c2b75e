"""The initial policy: a preset or checkpoint, cold-started by SFT to a deliberately partial competence.

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
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from gspo.config import SFTConfig, TrainConfig, config_hash
from gspo import hub
from gspo.core.logprobs import response_logprobs
from gspo.models.presets import (DTYPES, build_model, enable_activation_checkpointing, load_model,
                                 resolve_device, save_model)
from gspo.rollout.generate import demonstration_batch
from gspo.storage import writing
from gspo.tasks import Example
from gspo.training import lora
from gspo.rollout import episodes
from gspo.training.optim import build_optimizer, build_scheduler

DONE_FILE = "sft.json"


def sft_loss(model, batch, chunk_size: int = 1024) -> torch.Tensor:
    """Mean NLL over demonstration tokens: -(1/Σm) Σ m log π(y_t)."""
    out = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                            temperature=1.0, chunk_size=chunk_size, with_entropy=False)
    mask = batch.response_mask
    return -(out.logp * mask).sum() / mask.sum().clamp(min=1.0)


def train_sft(model, tokenizer, examples: list[Example], cfg: SFTConfig, *, seed: int,
              progress: bool = True, desc: str = "sft", demonstrations=None) -> list[dict]:
    """Run ``cfg.steps`` AdamW steps on shuffled demonstrations; returns per-step metrics.
    ``demonstrations(tokenizer, examples, device)``: how a batch of them is laid out (default:
    prompt + answer + EOS; a multi-turn episode's: the turns through the environment)."""
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
        chosen = [examples[i] for i in idx]
        batch = (demonstration_batch(tokenizer, chosen, device) if demonstrations is None
                 else demonstrations(tokenizer, chosen, device))   # multi-turn: policy turns only
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
KEYED_WHEN_SET = {"dataset", "dataset_config", "splits", "chat_template_kwargs", "tools_in_prompt"}
"""Keys that enter the cache key only when they differ from their default (so keys made before
these options existed still name the same cold start)."""


def _dump(section, exclude=frozenset()) -> dict:
    """``section`` as the cache key reads it: ``KEYED_WHEN_SET`` keys only when set."""
    fields = type(section).model_fields
    unset = {k for k in KEYED_WHEN_SET & set(fields) if getattr(section, k) == fields[k].get_default()}
    return section.model_dump(exclude=set(exclude) | unset)


def library_versions() -> list[str]:
    """The libraries whose kernels and defaults shape the cold start's weights: part of its cache
    key, so an environment with other versions trains its own (transformers 5.19 and 5.24 gave
    the default job's cold starts that differ by up to 0.14 in a weight on one machine)."""
    return [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]


def cache_key(model_cfg, task_cfg, sft_cfg: SFTConfig, seed: int, multiturn_cfg=None) -> str:
    """The cold start's cache entry: its model, training data, SFT settings and seed, and the
    ``library_versions`` that train it (not the CPU: a cache stays on its machine); with an
    environment (``multiturn.env``) its section too, since it writes the demonstrations'
    observations (without one the key is what it always was); a hub id's cached commit."""
    sft = sft_cfg.model_dump(exclude={"cache_dir", "enabled"})
    task = _dump(task_cfg, NOT_TRAINING_DATA)
    train_file = getattr(task_cfg, "train_file", None)  # custom data: its content, not only its path
    data = [hashlib.sha256(Path(train_file).read_bytes()).hexdigest()] if train_file else []
    model = model_cfg.model_dump(exclude={"lora"})  # adapters attach after the cold start
    episode = [_dump(multiturn_cfg)] if multiturn_cfg is not None and multiturn_cfg.env else []
    revision = [hub.cached_revision(model_cfg.path)] if hub.is_hub_id(model_cfg.path) else []
    return config_hash(model, task, sft, seed, *data, *library_versions(), *episode, *revision)


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


def initial_policy(cfg: TrainConfig, task, log=print, progress: bool = True, episode=None):
    """The policy RL starts from: model.path, or a preset cold-started by SFT (cached).
    Returns (model on its device, tokenizer, what it is: source, SFT steps and loss, checkpoint).
    ``episode``: the run's (``episodes.build`` of rollout.episode when not given), whose demonstrations the SFT
    trains on (multi-turn: through the environments)."""
    episode = episode if episode is not None else episodes.build(cfg.rollout.episode, cfg, task)
    dtype, device = DTYPES[cfg.model.dtype], resolve_device(cfg.model.device)
    tokenizer = getattr(task, "tokenizer", None)  # the one the data was checked with (rollout.data)
    if cfg.model.path:
        model, tokenizer = load_model(cfg.model.path, dtype, tokenizer, key="model.path")
    else:
        model, tokenizer = build_model(cfg.model.preset, cfg.seed, cfg.model.overrides, dtype,
                                       tokenizer)
    info: dict = {"source": cfg.model.path or f"preset:{cfg.model.preset}"}
    if cfg.sft.enabled and cfg.sft.steps > 0:
        key = cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed, cfg.multiturn)
        hit = cached_checkpoint(cfg.sft.cache_dir, key)
        if hit is not None:
            log(f"cold start: reusing cached SFT checkpoint {hit}")
            model, tokenizer = load_model(hit, dtype)
            info = json.loads((hit / "sft.json").read_text())
        else:
            log(f"cold start: SFT for {cfg.sft.steps} steps on {cfg.task.name} demonstrations")
            model.to(device)
            t0 = time.time()
            history = train_sft(model, tokenizer, task.split("train"), cfg.sft, seed=cfg.seed,
                                progress=progress,
                                demonstrations=getattr(episode, "demonstrations", None))
            info = {**info, "sft_steps": cfg.sft.steps, "sft_final_loss": history[-1]["sft/loss"],
                    "sft_seconds": time.time() - t0, "cache_key": key}
            with writing("the cold-start checkpoint", Path(cfg.sft.cache_dir) / key):  # disk full
                hit = save_cold_start(model, tokenizer, cfg.sft.cache_dir, key, info)
            log(f"cold start: saved {hit}")
        info["checkpoint"] = str(hit)
    return model.to(device), tokenizer, info


def prepare_policy(model, tokenizer, cfg: TrainConfig, run_dir: Path, on_main, info: dict):
    """train.activation_checkpointing on the policy; model.lora: adapters over the frozen policy,
    whose weights are saved once (by ``on_main``) as the adapters' base when no checkpoint holds
    them. Returns the policy to train (``info`` gets ``lora_base``)."""
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model, dropout=cfg.model.lora is not None
                                        and cfg.model.lora.dropout > 0)
    if cfg.model.lora is None:
        return model
    changed = cfg.sft.enabled and cfg.sft.steps > 0
    base, write = lora.base_checkpoint(run_dir, cfg.model.path, changed)
    if write:
        on_main(lambda: lora.write_base(model, tokenizer, base))
    info["lora_base"] = str(base)
    return lora.attach(model, cfg.model.lora, seed=cfg.seed, base=base)
