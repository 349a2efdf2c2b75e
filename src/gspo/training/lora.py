"""LoRA adapters through peft: the policy a run trains when ``model.lora`` is set.

What it is: ``attach`` wraps the (cold-started) policy in a peft ``PeftModel`` whose adapters are
the only trainable parameters, seeded by the run's seed; the frozen base it sits on is a
transformers directory the checkpoints name in ``adapter_config.json`` (``model.path`` itself when
RL starts from it unchanged, else ``run.dir/base`` written once). A checkpoint of such a policy is
peft's standard adapter directory (``gspo.training.checkpoint``), which ``AutoModelForCausalLM`` +
``PeftModel.from_pretrained`` load without this package and ``gspo.models.load_model`` merges.
``reference`` gives the KL reference policy: the same model with the adapter switched off
(``disable_adapter``), not a second copy of the weights.

What it is not: no QLoRA (quantised base), no adapters on the output head or the embeddings, no
multi-adapter switching; SFT cold starts train the whole model before the adapter is attached.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import warnings
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import check_target_module_exists
from safetensors.torch import load_file
from torch import nn

from gspo.config import LoRAConfig
from gspo.hub import local_path
from gspo.models.presets import save_model

ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_DIR = "base"


def peft_config(lora: LoRAConfig, base: str | Path | None = None) -> PeftLoraConfig:
    """peft's LoraConfig for ``model.lora`` (``base``: the checkpoint the adapter is named after)."""
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, task_type="CAUSAL_LM",
                          base_model_name_or_path=None if base is None else str(base))


def unmatched_targets(model: nn.Module, lora: LoRAConfig) -> list[str]:
    """The names in ``lora.target_modules`` that match no module of ``model`` (peft's own matching:
    the dotted path equals the name or ends with '.name'); [] for all-linear."""
    if isinstance(lora.target_modules, str):
        return []
    names = [name for name, _ in model.named_modules() if name]
    return [t for t in lora.target_modules
            if not any(check_target_module_exists(PeftLoraConfig(target_modules=[t]), n) for n in names)]


def check_targets(model: nn.Module, lora: LoRAConfig) -> None:
    """ValueError (one line, naming model.lora.target_modules) for a target that matches nothing,
    or targets peft cannot adapt; ``model`` may live on the meta device (no weights needed)."""
    missing = unmatched_targets(model, lora)
    if missing:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, nn.Linear)})
        raise ValueError(f"model.lora.target_modules: {', '.join(map(repr, missing))} matches no "
                         f"module of the model (its linear layers: {', '.join(leaves)})")
    try:
        _wrap(model, peft_config(lora))
    except (ValueError, TypeError) as err:  # e.g. a target that is a norm layer, not a linear one
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model.lora.target_modules: {first}") from None


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


def base_checkpoint(run_dir: str | Path, model_path: str | None, changed: bool) -> tuple[Path, bool]:
    """Where the frozen base lives and whether it must be written: ``model.path`` when RL starts
    from it unchanged (no SFT), else ``run_dir/base``."""
    if model_path and not changed:
        return Path(local_path(model_path)).absolute(), False
    return (Path(run_dir) / BASE_DIR).absolute(), True


def write_base(model: nn.Module, tokenizer, folder: Path) -> None:
    """Save the base once per run (atomically: a temporary folder renamed into place)."""
    if (folder / "config.json").is_file():
        return
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    tmp.rename(folder)


def attach(model: nn.Module, lora: LoRAConfig, *, seed: int, base: str | Path) -> PeftModel:
    """``model`` with LoRA adapters (A random by ``seed``, B = 0: the policy starts as the base);
    only adapter parameters require grad. The base weights are shared, not copied."""
    model.name_or_path = str(base)  # peft names the base after it in adapter_config.json
    model.zero_grad(set_to_none=True)  # a frozen weight keeps no stale gradient (the cold start's
    # last one would count in the clipped gradient norm, which no optimizer of the adapters zeroes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _wrap(model, peft_config(lora, base))


def _wrap(model: nn.Module, config: PeftLoraConfig) -> PeftModel:
    """get_peft_model, without the deprecation warning peft 0.21 triggers in transformers 5."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def reference(model: nn.Module):
    """A context in which ``model`` is the KL reference: the base, adapter off (nothing for a
    model without adapters)."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def frozen_reference(model: nn.Module) -> nn.Module:
    """The KL reference of train.beta > 0: a LoRA policy itself (its adapter switched off around
    the reference's forwards: ``reference``), else a frozen copy of the policy."""
    return model if is_lora(model) else copy.deepcopy(model).eval().requires_grad_(False)


def load_adapter(model: PeftModel, folder: str | Path) -> None:
    """Put the adapter weights of a checkpoint folder into ``model`` (resume, roll-back)."""
    result = set_peft_model_state_dict(model, load_file(Path(folder) / ADAPTER_WEIGHTS))
    if getattr(result, "unexpected_keys", None):
        raise KeyError(f"{folder}: adapter weights {result.unexpected_keys[:3]} fit no adapter of the model")
