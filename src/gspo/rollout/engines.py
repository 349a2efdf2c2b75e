"""Generation engines: one interface over the samplers a rollout can use (docs/engines.md).

An engine is built once from the policy, samples G responses to each prompt given as token ids
(never re-tokenised) with sampling parameters and a seed, and returns ``rollout.Samples``:
response ids, the mask up to and including EOS, truncation flags and the sampler's own log-probs
at the sampling temperature. Between RL steps ``update_weights(weights, version)`` hands it the
trained weights as named tensors (the policy's ``state_dict`` names) and the version they are:
nothing of the trainer's module crosses, so a sampler in another process or on another machine
can implement the same interface. ``sleep`` / ``wake_up`` free and restore its memory. An
engine's constructor takes only the options it honours (``build`` refuses any other).

* ``hf``: transformers ``generate`` (``rollout.sample``) on the policy itself (``samples_on``: its
  weights are the policy's, nothing to update), or on a copy of it in another ``dtype`` (e.g.
  bfloat16 sampling for a float32 policy), updated in place.
* ``vllm``: a vLLM engine in this process (colocated), built from the policy saved once to a
  temporary directory; ``update_weights`` pushes the weights, in the checkpoint's layout,
  through the model runner's ``reload_weights`` (no disk round trip) and drops the prefix cache.
  Optional dependency.

Engines are registered by name (``available()``, ``build(name, ...)``), never chosen by an ``if``.
This module samples; it does not score, train or read configs.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import tempfile
from abc import ABC, abstractmethod
from typing import Iterator, Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

try:  # transformers 5 keeps some weights in fused in-memory layouts (a MoE's experts)
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:  # transformers 4: the in-memory layout is the checkpoint's
    def revert_weight_conversion(model, state_dict):
        return state_dict

from gspo.core.quantize import fake_quantize, quantize_weights, quantized
from gspo.errors import UserError
from gspo.models.presets import save_model
from gspo.registry import Registry
from gspo.rollout.generate import (RolloutBatch, Samples, SamplingParams, left_pad, response_mask_from_ids,
                                   rollout_batch, sample)
from gspo.tasks import Example

__all__ = ["Engine", "EngineUnavailable", "HFEngine", "VLLMEngine", "available", "build", "check",
           "generate_batch", "is_shared", "options_for", "policy_weights"]


class EngineUnavailable(UserError):
    """The engine asked for cannot run here (not installed, or cannot serve this model): one line."""


class Engine(ABC):
    """A sampler built from a policy: ``generate`` and ``update_weights``; ``sleep`` / ``wake_up``
    free and restore its memory between generation and training (no-ops where nothing is held)."""

    module: torch.nn.Module | None = None
    """The transformers model that samples when it is one (hf: routing capture and FSDP's gathered
    weights work on it); None for an engine with its own kernels (vllm)."""
    always_logprobs: bool = False
    """The sampler's log-probs come with its tokens at no cost, so a rollout always asks for
    them (vllm: mismatch/* every step); hf computes them only when asked."""
    shared: bool = False
    """One engine serves the trainer and a thread worker of rollout.async in turn (each side
    updates it to its own policy's weights before every generation, under the worker's lock): vllm, whose
    engine is built once per process. False: the worker builds its own (hf: on its policy copy)."""
    own_kernels: bool = False
    """Samples with its own kernels from its own copy of the weights (vllm): it returns no expert
    routing and takes whole weights (no LoRA adapters); gspo.config.resolve refuses those
    configs."""
    seeds_per_prompt: bool = False
    """``generate(seed=s)`` seeds prompt p of the call with s + p, independently of the other
    prompts (vllm: a generator per request), so the prompts of a batch split over calls (ranks)
    with seeds offset by each share's first index sample exactly the one-call batch. False (hf):
    one generator per call, seeded with s."""
    default_correction: str = "none"
    """train.rollout_correction.mode when the config leaves it unset: none when the policy
    samples itself; tis (cap 2) for vllm, whose kernels give other log-probs than the trainer's
    (as TRL corrects by default)."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        """G = ``group_size`` responses to each prompt, rows grouped by prompt (N = P·G)."""

    version: int | None = None
    """The weights version (RL steps done) it samples from, as its last update said."""

    @property
    def device(self) -> torch.device:
        """Where its samples' tensors are (the prompts of a batch are laid out there)."""
        return torch.device("cpu")

    def samples_on(self, module: torch.nn.Module) -> bool:
        """Whether it samples on ``module`` itself (hf on the policy): its weights are then always
        the module's, and there is nothing to update."""
        return self.module is module

    @abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Sample from ``weights`` (name -> tensor, the policy's ``state_dict`` names) from now
        on, the weights of ``version`` (None: not a training version, e.g. a test's)."""

    def sleep(self) -> None:
        """Release what the engine holds between generations (GPU memory); default: nothing."""

    def wake_up(self) -> None:
        """Undo ``sleep``."""

    def close(self) -> None:
        """Release the engine for good (vllm: its engine core and process group); default: nothing."""

    def metrics(self) -> dict:
        """What the engine measured since the last call, as metrics (generators on Ray: their
        weight syncs and restarts, gspo.rollout.remote); default: nothing."""
        return {}


_REGISTRY: Registry[type[Engine]] = Registry("engine", error=EngineUnavailable)
_REQUIRES: dict[str, str] = {}


def register(name: str, *, requires: str | None = None):
    """Class decorator: register an engine under ``name``; ``requires``: the module it needs."""

    def decorate(cls: type[Engine]) -> type[Engine]:
        _REGISTRY.add(name, cls)
        if requires:
            _REQUIRES[name] = requires
        return cls

    return decorate


available = _REGISTRY.names
"""Sorted names of the registered engines (installed or not)."""


def spec(name: str) -> type[Engine]:
    """The engine class registered as ``name`` (its capabilities are class attributes)."""
    return _REGISTRY.get(name)


def check(name: str, model_type: str | None = None) -> None:
    """EngineUnavailable (one line) unless engine ``name`` is known, installed and can serve a model
    of ``model_type`` (its transformers ``config.model_type``); before anything is built."""
    refuse = getattr(_REGISTRY.get(name), "refuses", {}).get(model_type)
    if refuse:
        raise EngineUnavailable(f"engine {name!r} cannot serve a {model_type} model: {refuse}")
    module = _REQUIRES.get(name)
    if module and importlib.util.find_spec(module) is None:
        raise EngineUnavailable(f"engine {name!r} needs the {module!r} package, which is not installed "
                                f"(GPU: pip install 'gspo[vllm]'; this CPU: make test-vllm builds .venv-vllm)")


def is_shared(name: str) -> bool:
    """Whether engine ``name`` serves a thread worker and the trainer in turn (``Engine.shared``)."""
    return _REGISTRY.get(name).shared


def options_for(name: str, settings: dict) -> dict:
    """The ``settings`` (option -> value) that engine ``name``'s constructor takes: a run offers
    each engine only what it honours (hf: no seed of its own, nothing to put to sleep)."""
    takes = inspect.signature(_REGISTRY.get(name).__init__).parameters
    return {k: v for k, v in settings.items() if k in takes}


def build(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **options) -> Engine:
    """The engine ``name`` built from ``model`` (checked first); ``options`` go to its
    constructor, which refuses any it does not take (TypeError)."""
    check(name, getattr(model.config, "model_type", None))
    return _REGISTRY.get(name)(model, tokenizer, **options)


def generate_batch(engine: Engine, tokenizer: PreTrainedTokenizerBase, examples: list[Example],
                   params: SamplingParams, *, group_size: int = 1, with_logprobs: bool = False,
                   seed: int | None = None) -> RolloutBatch:
    """``rollout.generate`` through ``engine``: the prompts' token ids (tokenised once, as the
    trainer scores them) to the engine, its samples to a ``RolloutBatch`` (N = P·G rows)."""
    prompt_ids = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
    samples = engine.generate(prompt_ids, group_size, params, seed=seed, with_logprobs=with_logprobs)
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id, engine.device)     # [P, Lp]
    return rollout_batch(tokenizer, ids, mask, samples, examples, group_size)


def policy_weights(model: PreTrainedModel, weights: Mapping[str, torch.Tensor] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of ``weights`` (a ``state_dict`` of ``model``'s
    architecture; None: ``model``'s own) as a checkpoint stores it (transformers' in-memory
    layouts reverted, e.g. a MoE's fused experts back to one tensor per expert, as
    ``save_pretrained`` writes them), ``lm_head.weight`` included even when the embeddings are
    tied (an engine that unties them would otherwise keep a stale head).

    One weight at a time: ``weights[name]`` is read only when its turn comes, so a mapping that
    gathers each tensor as it is read (FSDP's shards, ``gspo.training.distributed``) never holds
    a second whole model. Each in-memory tensor is reverted on its own (a fused tensor splits
    into checkpoint tensors; none is merged from several)."""
    weights = model.state_dict() if weights is None else weights
    names = list(weights.keys())
    head = model.get_output_embeddings()
    tied = None
    if "lm_head.weight" not in names and head is not None:
        shares = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight]
        tied = next((n for n in shares if n in weights), None)
    for name in names:
        for out, tensor in revert_weight_conversion(model, {name: weights[name]}).items():
            yield out, tensor.detach()
            if name == tied:
                yield "lm_head.weight", tensor.detach()
    if tied is None and "lm_head.weight" not in names and head is not None:
        yield "lm_head.weight", head.weight.detach()


# ----------------------------------------------------------------------------- transformers

@register("hf")
class HFEngine(Engine):
    """transformers ``generate`` (``rollout.sample``) on the policy, or on a copy in ``dtype``.
    It has no seed of its own (each ``generate`` seeds torch's generator with its ``seed``) and no
    sleep mode (the policy's memory is the trainer's): it takes neither option.
    ``share_prompts=False``: every forward sees all N rows (MoE routing captured at generation)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 dtype: torch.dtype | None = None, share_prompts: bool = True,
                 quantize: str | None = None):
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.share_prompts = share_prompts
        self.quantize = quantize
        """A format of gspo.core.quantize.FORMATS (int8 | int4 | fp8): the copy's weight matrices
        rounded to it."""
        own = (dtype is not None and dtype != next(model.parameters()).dtype) or quantize is not None
        self.model = copy.deepcopy(model).to(dtype).requires_grad_(False) if own else model
        self.owns_copy = own
        """True when ``model`` is a copy (another dtype, or quantised) that ``update_weights`` refreshes."""
        if quantize is not None:
            self.update_weights(model.state_dict(), None)

    @property
    def module(self) -> PreTrainedModel:
        return self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        if self.quantize is not None:
            weights = quantize_weights(weights, self.quantize)
        self.model.load_state_dict(weights)          # in place (a copy: cast to its dtype)
        self.version = version

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.pad_id, device)                      # [P, Lp]
        return sample(self.model, ids, mask, params, pad_id=self.pad_id, eos_id=self.eos_id,
                      group_size=group_size, with_logprobs=with_logprobs, seed=seed,
                      share_prompts=self.share_prompts)


# ----------------------------------------------------------------------------- vLLM

CPU_PREFILL_TOKENS = 4096
"""vLLM's token budget per engine step on a CPU (its own default there), or the model's length
if longer (``whole_prefills``)."""


def whole_prefills(max_model_len: int) -> dict:
    """vLLM options for a CPU: no chunked prefill. A prompt cut across engine steps has its sampled
    token discarded, and vLLM then rewinds the request's seeded generator by an offset, which
    only CUDA generators have: on a CPU a seeded batch whose prompts exceed one step's token
    budget failed with "CPU Generator does not use offset" (the long job: 256 rows of about 30
    prompt tokens against 4096). Unchunked, a step admits whole prompts only; the budget must
    then hold the longest sequence."""
    return dict(enable_chunked_prefill=False,
                max_num_batched_tokens=max(CPU_PREFILL_TOKENS, max_model_len))


def forget_moe_kernels(worker) -> int:
    """Run in vLLM's worker before ``reload_weights``: drop each MoE layer's kernel, so that the
    reload processes the new experts as a first load does; returns the number of layers.

    Why (vLLM 0.32, CPU; docs/engines.md): a first load prepacks the experts into the CPU kernel's
    grouped-gemm layout when it builds the kernel. A reload re-runs the layer's
    ``process_weights_after_loading``, which, finding the kernel built, takes the weight-update
    path: it skips the prepack, and the checkpoint-layout experts are copied into the prepacked
    tensors (log-probs off by 0.13 after syncing unchanged weights). Without a kernel the reload
    takes the first-load path (pad, prepack, a fresh kernel) and copies its result in place."""
    count = 0
    for module in worker.model_runner.model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            count += 1
    return count


VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def under_launcher() -> bool:
    """Whether this process is one rank of several of a torch.distributed job (torchrun)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def save_architecture(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    """The model's config (with its architecture, as ``save_pretrained`` records it), generation
    config and tokenizer, no weights: what vLLM builds a ``load_format="dummy"`` engine from.
    Written by every rank (``save_pretrained`` writes on rank 0 only under torch.distributed)."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)


@register("vllm", requires="vllm")
class VLLMEngine(Engine):
    """vLLM in this process, built from the policy's weights; in-place weight updates.

    ``dtype``: the engine's weights (default: the policy's). ``seed``: the engine's seed; each
    ``generate`` seeds prompt p's G samples with ``seed + p`` (``generate``'s seed), so a batch is
    reproducible for a seed on one machine and engine version. ``gpu_memory_utilization`` and
    ``enable_sleep_mode`` go to vLLM on a GPU; ``kv_cache_gib``: the KV cache on a CPU (vLLM's
    default, 4 GiB and a warm-up pass, is far more than the tiny presets need). ``weights``: the
    weights to load (default: the model's own; a sharded policy hands them gathered one tensor at
    a time). Under torchrun every rank builds its own engine through vLLM's external launcher
    (``tensor_parallel``: ranks per engine, consecutive ranks; 1: an engine per rank)."""

    refuses: dict[str, str] = {}
    """config.model_type -> why this engine cannot serve it (each one shown by a test); none now:
    the MoE experts' stale reload on a CPU is repaired by ``update_weights``."""
    always_logprobs = True
    shared = True
    own_kernels = True
    seeds_per_prompt = True
    default_correction = "tis"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 dtype: torch.dtype | None = None, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 enable_sleep_mode: bool = False, max_model_len: int | None = None,
                 kv_cache_gib: int = 1, quantize: str | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None, tensor_parallel: int = 1,
                 **llm_options):
        # In-process engine core: the model runner (reload_weights) is reachable, and no worker
        # process is spawned (which would need the caller under `if __name__ == "__main__"`).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_gpu = next(model.parameters()).is_cuda
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        import vllm  # optional dependency, imported only when this engine is built (seconds)
        from vllm.inputs import TokensPrompt
        self._vllm, self._prompt = vllm, TokensPrompt
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self._dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
        self.launched = under_launcher()
        """Built in one process of a torchrun job (vLLM's external launcher: every rank builds its
        engine at the same moment, the build is a collective), from the architecture alone; the
        weights arrive by ``update_weights``."""
        if self.launched:
            save_architecture(model, tokenizer, self._dir.name)
            launch = dict(load_format="dummy", distributed_executor_backend="external_launcher",
                          tensor_parallel_size=tensor_parallel)
        else:
            save_model(model, tokenizer, self._dir.name)        # once; later syncs stay in memory
            launch = {}
        platform = (dict(gpu_memory_utilization=gpu_memory_utilization,
                         enable_sleep_mode=enable_sleep_mode) if on_gpu
                    else whole_prefills(max_model_len or model.config.max_position_embeddings))
        self.llm = vllm.LLM(model=self._dir.name, tokenizer=self._dir.name,
                            dtype=VLLM_DTYPES[dtype or next(model.parameters()).dtype], seed=seed,
                            enforce_eager=True, max_model_len=max_model_len,
                            logprobs_mode="processed_logprobs",   # after temperature, as the trainer's
                            **{**platform, **launch, **llm_options})
        self.on_gpu = on_gpu
        self.can_sleep = on_gpu and enable_sleep_mode
        self.sleeping = False
        self.architecture = model
        """What ``update_weights`` reads the in-memory -> checkpoint layout from (a remote engine
        would hold its own copy of the architecture)."""
        self.quantize = quantize
        """A format of gspo.core.quantize.FORMATS (int8 | int4 | fp8): each weight matrix rounded to
        it as it is loaded (the scales are per matrix as the checkpoint stores it, one expert's
        projection each)."""
        if quantize is not None or self.launched:
            self.update_weights(model.state_dict() if weights is None else weights, None)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        if not self.on_gpu:   # CPU MoE: prepack the reloaded experts as a first load does
            self.llm.collective_rpc(forget_moe_kernels)
        named = policy_weights(self.architecture, weights)
        if self.quantize is not None:
            named = ((n, fake_quantize(t, self.quantize) if quantized(n, t) else t) for n, t in named)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        self.llm.reset_prefix_cache()        # cached prompt KV was computed with the old weights
        self.version = version

    def close(self) -> None:
        # before the process exits: vLLM's own clean-up at exit would find the (one-process)
        # process group it created already destroyed by the CLI, and print a traceback
        self.llm.llm_engine.engine_core.shutdown()
        self._dir.cleanup()

    def sleep(self) -> None:
        if self.can_sleep and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
        self.sleeping = False

    def sampling_params(self, params: SamplingParams, group_size: int, seed: int | None,
                        with_logprobs: bool):
        """vLLM's SamplingParams for one prompt (temperature 0 is vLLM's greedy)."""
        return self._vllm.SamplingParams(
            n=group_size, max_tokens=params.max_new_tokens, seed=seed,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p, top_k=0 if params.greedy else params.top_k,
            logprobs=0 if with_logprobs else None, detokenize=False)

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        prompts = [self._prompt(prompt_token_ids=list(p)) for p in prompt_ids]
        per_prompt = [self.sampling_params(params, group_size, None if seed is None else seed + i,
                                           with_logprobs) for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, per_prompt, use_tqdm=False)
        rows = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]   # N
        T = max(1, max(len(c.token_ids) for c in rows))
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        logp = torch.zeros(len(rows), T)
        for i, c in enumerate(rows):
            ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if with_logprobs:
                logp[i, :len(c.token_ids)] = torch.tensor(
                    [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
        mask, truncated = response_mask_from_ids(ids, self.eos_id)                    # [N, T]
        ids = torch.where(mask.bool(), ids, self.pad_id)
        return Samples(ids, mask, truncated, logp * mask if with_logprobs else None)


