"""Preflight: the checks of user input that can be made before any model is built or file written.

``check_train(cfg, resume)`` looks at what the config points to: the files it names (task data,
``model.path``, reward models), the model architecture (preset overrides, MoE switches), and the
output folders (a previous run, writable, enough free space for the checkpoints still to be
written: on resume those already in the folder count). Data and reward code are checked when the
``Trainer`` builds its task and rewards, also before any model, and ``check_rewards`` scores a
few training demonstrations with every reward source.
``user_input()`` turns the errors those raise into one-line ``UserError``s: a ValueError or
OSError *inside* training is a bug and keeps its traceback.

Every message names the config key (``task.train_file``, ``run.dir``...) and what is allowed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from gspo.errors import UserError
from gspo.hub import local_path
from gspo.models.moe import ROUTER_CLASSES
from gspo.models.presets import (ADAPTER_CONFIG, adapter_base, build_char_tokenizer, is_adapter_dir,
                                 preset_config)
from gspo.observe.trackers import check_available
from gspo.rewards.isolation import IsolatedSource
from gspo.rollout import engines
from gspo.rollout.engines import ray_cluster
from gspo.rollout.data import FILE_TASKS
from gspo.training.checkpoint import list_checkpoints
from gspo.training.lora import check_targets

MB = 1 << 20
MIN_FREE_MB = 64  # logs, plots, events: beyond the checkpoints themselves


@contextlib.contextmanager
def user_input(context: str | None = None):
    """Within: ValueError / TypeError / OSError are the user's input, re-raised as UserError."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, TypeError, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, OSError) and err.filename and str(err.filename) not in message:
            message = f"{err.filename}: {message}"
        raise UserError(f"{context}: {message}" if context else message) from None


def check_train(cfg, resume: bool = False) -> None:
    """Everything about ``cfg`` that can be wrong before a model is built; raises UserError."""
    check_files(cfg)
    check_model(cfg)
    check_engine(cfg)
    check_placement(cfg)
    check_trackers(cfg)
    check_run_dir(cfg, resume)
    check_distributed(cfg, int(os.environ.get("WORLD_SIZE", "1")))


# ------------------------------------------------------------------------------------ files
def check_checkpoint(key: str, path: str) -> None:
    """A transformers checkpoint with safetensors weights, or a LoRA adapter directory (gspo's
    LoRA checkpoints) whose base is one; a hub id is looked up in the Hugging Face cache
    (``gspo.models.hub``)."""
    p = Path(local_path(path, key))
    if is_adapter_dir(p):
        if not (p / "adapter_model.safetensors").is_file():
            raise UserError(f"{key}: {path!r} has {ADAPTER_CONFIG} but no adapter_model.safetensors")
        with user_input(f"{key}: {path!r}"):
            base = adapter_base(p)
        check_checkpoint(f"{key} (the base named in its {ADAPTER_CONFIG})", str(base))
        return
    if not (p / "config.json").is_file():
        raise UserError(f"{key}: {path!r} is not a transformers checkpoint (no config.json)")
    if not any(p.glob("*.safetensors")):
        raise UserError(f"{key}: {path!r} has no *.safetensors weights (gspo loads weights only "
                        f"from safetensors, never from pickled .bin files)")
    for weights in sorted(p.glob("*.safetensors")):
        check_safetensors(key, weights)


def check_safetensors(key: str, file: Path) -> None:
    """The header of a safetensors file parses and its tensors fit in the file (reads no tensor)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}: {str(file)!r} is not a readable safetensors file ({reason})") from None


def check_files(cfg) -> None:
    """Files named by the config exist (the config file itself is checked when read)."""
    if cfg.task.name in FILE_TASKS:
        for key in ("train_file", "test_file", "validation_file"):
            path = getattr(cfg.task, key)
            if path is not None and not Path(path).is_file():
                raise UserError(f"task.{key}: no such file {path!r}")
    if cfg.model.path:
        check_checkpoint("model.path", cfg.model.path)
    for i, spec in enumerate(cfg.rewards.sources):
        if spec.type == "model":
            check_checkpoint(f"rewards.sources[{i}].path", spec.path)


# ------------------------------------------------------------------------------------ model
def _model_config(cfg):
    if cfg.model.path:
        return AutoConfig.from_pretrained(local_path(cfg.model.path), local_files_only=True)
    return preset_config(cfg.model.preset, len(build_char_tokenizer()), cfg.model.overrides)


def check_model(cfg) -> None:
    """The architecture can be built as configured, supports the MoE switches asked for, and has
    the modules model.lora targets."""
    with user_input():
        config = _model_config(cfg)
    if cfg.model.lora is not None:
        if config.model_type in ROUTER_CLASSES:
            raise UserError(f"model.lora: LoRA on Mixture-of-Experts models ({config.model_type!r}) is "
                            f"not supported yet (its routers would get adapters and routing capture "
                            f"breaks); use a dense model or train the whole model")
        import torch
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):  # module names only, no memory
            shell = AutoModelForCausalLM.from_config(config)
        with user_input():
            check_targets(shell, cfg.model.lora)
    if cfg.moe.routing_replay != "none" or cfg.moe.aux_loss_coef > 0:
        if config.model_type not in ROUTER_CLASSES:
            key = "moe.routing_replay" if cfg.moe.routing_replay != "none" else "moe.aux_loss_coef"
            raise UserError(f"{key}: needs a Mixture-of-Experts model; model type "
                            f"{config.model_type!r} is not one (supported: "
                            f"{', '.join(sorted(ROUTER_CLASSES))}; e.g. model.preset=tiny-moe)")


def check_engine(cfg) -> None:
    """rollout.engine is installed and can serve the model's architecture (the combinations it
    cannot serve are refused by the config itself)."""
    try:
        engines.check(cfg.rollout.engine, _model_config(cfg).model_type)
    except engines.EngineUnavailable as err:
        raise UserError(f"rollout.engine: {err}") from None


def check_placement(cfg) -> None:
    """rollout.placement=ray: ray installed, the cluster at rollout.ray_address answering, and
    the generators' CPUs and GPUs within its resources (or this machine's, for the local cluster
    started for the run)."""
    if cfg.rollout.placement == "ray":
        ray_cluster.check(ray_cluster.RaySpec.of(cfg.rollout, cfg.run.threads))


def check_trackers(cfg) -> None:
    """Every tracker of run.trackers has its package installed."""
    with user_input():
        check_available(cfg.run.trackers)


def checkpoint_bytes(cfg) -> int:
    """About how much one checkpoint takes: weights + AdamW's two moments (same dtype)."""
    if cfg.model.path:
        weights = sum(p.stat().st_size for p in Path(cfg.model.path).glob("*.safetensors"))
    else:
        with torch.device("meta"):  # shapes only, no memory
            model = AutoModelForCausalLM.from_config(_model_config(cfg))
        size = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
        weights = sum(p.numel() for p in model.parameters()) * size
    return 3 * weights


# ------------------------------------------------------------------------------------ output
def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _probe_writable(key: str, folder: Path) -> None:
    """Create and remove a file in the nearest existing folder (permissions, read-only mounts)."""
    base = _existing_ancestor(folder)
    if not base.is_dir():
        raise UserError(f"{key}: cannot create {str(folder)!r}: {str(base)!r} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".gspo-probe-", dir=base)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise UserError(f"{key}: cannot write to {str(base)!r} ({err.strerror or err}); choose a "
                        f"writable folder") from None


def check_run_dir(cfg, resume: bool) -> None:
    """run.dir (and the SFT cache) can be written, holds no other run, and has room."""
    run = Path(cfg.run.dir)
    if run.exists() and not run.is_dir():
        raise UserError(f"run.dir: {str(run)!r} exists and is not a folder")
    if not resume and not cfg.run.overwrite:
        previous = [n for n in ("metrics.jsonl", "checkpoints", "summary.json") if (run / n).exists()]
        if previous:
            raise UserError(f"run.dir {run} already holds a run ({', '.join(previous)}): use "
                            f"--resume {run} to continue it, run.overwrite=true to replace it, "
                            f"or another run.dir")
    _probe_writable("run.dir", run)
    if cfg.sft.enabled and cfg.sft.steps > 0:
        _probe_writable("sft.cache_dir", Path(cfg.sft.cache_dir))
    check_space(cfg, run, on_disk=len(list_checkpoints(run)) if resume else 0)


def checkpoints_to_write(keep: int, on_disk: int) -> int:
    """How many more checkpoints the folder will hold at its fullest: ``keep`` (or the
    ``on_disk`` ones, if more) plus the one being written, which is renamed into place before
    rotation deletes the oldest (gspo.training.checkpoint), less the ``on_disk`` ones already there."""
    return max(keep, on_disk) + 1 - on_disk


def check_space(cfg, run: Path, on_disk: int) -> None:
    """Room for the checkpoints still to be written (a resumed run's are there already)."""
    keep = cfg.run.keep_checkpoints
    need = checkpoint_bytes(cfg) * checkpoints_to_write(keep, on_disk) + MIN_FREE_MB * MB
    free = shutil.disk_usage(_existing_ancestor(run)).free
    if free < need:
        there = f", {on_disk} of them already on disk" if on_disk else ""
        raise UserError(f"run.dir: only {free / MB:.0f} MB free on the file system of "
                        f"{str(_existing_ancestor(run))!r}; about {need / MB:.0f} MB are needed "
                        f"({keep} kept + one being written{there}, see run.keep_checkpoints)")


def check_distributed(cfg, world: int) -> None:
    """Under torchrun (``world`` ranks): every rank gets at least one prompt; no audit records."""
    if world <= 1:
        return
    if cfg.rollout.prompts_per_step < world:
        raise UserError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is below the "
                        f"number of ranks ({world}): every rank needs at least one prompt "
                        f"(a group never splits across ranks)")
    if cfg.audit.every:
        raise UserError("audit.every: audit records are single-process only; run the audited "
                        "job without torchrun (docs/distributed.md)")
    if cfg.model.lora is not None and cfg.dist.strategy == "fsdp":
        raise UserError("model.lora with dist.strategy=fsdp: sharded adapters are not built; "
                        "LoRA under torchrun runs with dist.strategy=ddp (docs/distributed.md)")


# ------------------------------------------------------------------------------------ rewards
PROBES = 2  # training demonstrations scored before training


def check_rewards(rewards, examples: list) -> None:
    """Score the first training demonstrations with every reward source: one that fails on all
    of them (a wrong signature, a missing column...), or on any under ``rewards.on_error=fail``,
    is reported now instead of failing mid-run or silently scoring every sample 0."""
    probe = examples[:PROBES]
    for source, _ in getattr(rewards, "sources", []):
        if not isinstance(source, IsolatedSource) or not probe or source.needs_episode:
            continue                   # (the environment's reward exists once an episode ran)
        _, faults = source([ex.answer for ex in probe], probe)
        if faults and (len(faults) == len(probe) or rewards.on_error == "fail"):
            i, reason = next(iter(faults.items()))
            raise UserError(f"rewards: {source.label} fails on the demonstration of training "
                            f"example {i + 1} (prompt {probe[i].prompt[:60]!r}, answer "
                            f"{probe[i].answer[:60]!r}): {reason}")
