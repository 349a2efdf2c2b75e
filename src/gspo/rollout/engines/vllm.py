"""The ``vllm`` engine: a vLLM engine in this process (colocated), built from the policy saved
once to a temporary directory; ``update_weights`` pushes the weights, in the checkpoint's layout,
through the model runner's ``reload_weights`` (no disk round trip) and drops the prefix cache.
Optional dependency, imported only when the engine is built."""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.core.quantize import fake_quantize, quantized
from gspo.models.presets import save_model
from gspo.rollout.engines.base import Capabilities, Engine, register
from gspo.rollout.engines.weights import policy_weights
from gspo.rollout.generate import Samples, SamplingParams, response_mask_from_ids


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


@register("vllm")
class VLLMEngine(Engine):
    """vLLM in this process, built from the policy's weights; in-place weight updates.

    ``dtype``: the engine's weights (default: the policy's). ``seed``: the engine's seed; each
    ``generate`` seeds prompt p's G samples with ``seed + p`` (``generate``'s seed), so a batch is
    reproducible for a seed on one machine and engine version. ``gpu_memory_utilization`` and
    ``enable_sleep_mode`` go to vLLM on a GPU; ``kv_cache_gib``: the KV cache on a CPU (vLLM's
    default, 4 GiB and a warm-up pass, is far more than the tiny presets need). ``weights``: the
    weights to load (default: the model's own; a sharded policy hands them gathered one tensor at
    a time; a LoRA policy its base's with the adapters merged, ``model`` being the base). Under
    torchrun every rank builds its own engine through vLLM's external launcher
    (``tensor_parallel``: ranks per engine, consecutive ranks; 1: an engine per rank)."""

    capabilities = Capabilities(always_logprobs=True, shared=True, own_kernels=True,
                                seeds_per_prompt=True, default_correction="tis",
                                joins_process_group=True, requires="vllm")
    """No model type refused: the MoE experts' stale reload on a CPU is repaired by
    ``update_weights``."""

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
            save_model(model, tokenizer, self._dir.name,        # once; later syncs stay in memory
                       state_dict=None if weights is None else dict(weights))
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
