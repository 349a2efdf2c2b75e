"""Trainer-only throughput on fake data, in prime-rl's format: tokens/s, MFU, step time, peak memory.

What one step is: the GSPO update of gspo's trainer on one micro-batch of ``--seq-len`` tokens,
made of random-token samples (prompt + response, lengths drawn around ``--sample-len``): the
decoder forward, the chunked head on the response tokens (``gspo.core.logprobs``), the GSPO loss
(ratio 1, as gspo's first minibatch: π_old is the step's own detached forward; Â = ±1), backward,
gradient clipping and AdamW (``gspo.training.optim.build_optimizer``). No generation, no reward.

Layouts (``--layout``):

* ``packed``: the samples back to back in one row of exactly ``--seq-len`` tokens, positions
  restarting per sample, attention confined to each (``packed_logprobs``: flash-attention varlen
  on a GPU with flash-attn, a block-causal mask under sdpa);
* ``padded``: the same samples as rows, prompts left-padded and responses right-padded to the
  longest (``response_logprobs`` with column trimming: the RL passes' layout under
  train.pack_rows=false).

Figures (medians over ``--steps`` measured steps after ``--warmup``):

* tokens/s: real (non-padding) tokens of the step / step time;
* MFU: model FLOPs of those tokens / step time / the measured peak. Model FLOPs per step =
  6 · (decoder matmul parameters) · tokens + 6 · V · H · response tokens (the head runs on
  response tokens only) + 3 · Σ_samples 4 · layers · heads · head_dim · len·(len+1)/2 (causal
  attention, forward + backward); recomputation (activation checkpointing, the head's chunks) is
  not counted, as usual for MFU;
* peak: the dense matmul FLOP/s of this machine in ``--dtype`` (square matmuls, the best of a few
  before and after the steps: on a shared machine the load moves it);
* peak memory: CUDA ``max_memory_allocated``; on a CPU the process's peak RSS (``ru_maxrss``).

    python benchmarks/trainer_throughput.py                       # reduced shape, CPU
    python benchmarks/trainer_throughput.py --shape qwen3-0.6b --seq-len 16384 --device cuda \\
        --dtype bfloat16 --attn auto --layout packed              # benchmarks/throughput_gpu.sh
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import transformers

from gspo.core import objectives
from gspo.core.logprobs import packed_logprobs, response_logprobs
from gspo.models.presets import DTYPES, enable_activation_checkpointing
from gspo.training.optim import build_optimizer

SHAPES = {  # transformers Qwen3Config fields; qwen3-0.6b as Qwen/Qwen3-0.6B's config.json
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rope_theta=1_000_000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "small": dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1_000_000.0,
                  max_position_embeddings=40960, tie_word_embeddings=True),
}


def args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per step (packed: the row)")
    p.add_argument("--sample-len", type=int, default=512, help="mean sample length (prompt + response)")
    p.add_argument("--prompt-frac", type=float, default=0.25, help="share of a sample that is prompt")
    p.add_argument("--layout", default="packed", choices=["packed", "padded"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--attn", default="auto", help="auto (flash_attention_2 when importable, else sdpa) | sdpa | eager | flash_attention_2 | ...")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of the decoder layers")
    p.add_argument("--chunk-size", type=int, default=1024, help="head chunk (train.logprob_chunk)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-n", type=int, default=0, help="matmul size for the peak (0: 8192 on cuda, 1024 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def attention(name: str) -> str:
    if name != "auto":
        return name
    from transformers.utils import is_flash_attn_2_available
    return "flash_attention_2" if is_flash_attn_2_available() else "sdpa"


def build(a: argparse.Namespace) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(**SHAPES[a.shape], attn_implementation=attention(a.attn))
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = transformers.Qwen3ForCausalLM(config).to(DTYPES[a.dtype])
    if a.ac:
        enable_activation_checkpointing(model)
    return model.train()


def samples(a: argparse.Namespace, vocab: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths filling exactly ``seq_len`` tokens; lengths uniform in
    [sample_len/2, 3·sample_len/2] (ragged, as RL responses are), the last one cut to fit."""
    g = torch.Generator().manual_seed(a.seed)
    out, left = [], a.seq_len
    while left > 1:
        n = min(left, int(torch.randint(a.sample_len // 2, a.sample_len * 3 // 2 + 1, (), generator=g)))
        p = max(1, min(n - 1, round(n * a.prompt_frac)))
        out.append((p, n - p))
        left -= n
    return out


def batch(a: argparse.Namespace, lens: list[tuple[int, int]], vocab: int) -> dict:
    """The step's tensors in the chosen layout, and the [n, T] response layout of the loss."""
    g = torch.Generator().manual_seed(a.seed + 1)
    seqs = [torch.randint(3, vocab, (p + r,), generator=g) for p, r in lens]
    n, T = len(lens), max(r for _, r in lens)
    resp_mask = torch.zeros(n, T, dtype=torch.long)
    for i, (_, r) in enumerate(lens):
        resp_mask[i, :r] = 1
    if a.layout == "packed":
        ids = torch.cat(seqs)[None]                                                   # [1, S]
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]             # [1, S]
        target = torch.cat([torch.arange(p + r) >= p for p, r in lens])[None].long()  # [1, S]
        out = dict(ids=ids, positions=positions, target=target, computed=ids.numel())
    else:
        P = max(p for p, _ in lens)
        ids = torch.zeros(n, P + T, dtype=torch.long)                                 # [n, L]
        for i, ((p, r), s) in enumerate(zip(lens, seqs)):
            ids[i, P - p: P + r] = s
        attn = torch.zeros_like(ids)
        for i, (p, r) in enumerate(lens):
            attn[i, P - p: P + r] = 1
        out = dict(ids=ids, attn=attn, computed=ids.numel())
    out["resp_mask"] = resp_mask
    return {k: v.to(a.device) if torch.is_tensor(v) else v for k, v in out.items()}


def logprobs(model, a: argparse.Namespace, b: dict) -> torch.Tensor:
    """[n, T] log π_θ of the response tokens."""
    if a.layout == "padded":
        return response_logprobs(model, b["ids"], b["attn"], b["resp_mask"], chunk_size=a.chunk_size,
                                 with_entropy=False, trim=True).logp
    flat = packed_logprobs(model, b["ids"], b["positions"], b["target"], chunk_size=a.chunk_size)
    out = flat.new_zeros(b["resp_mask"].shape)                                        # [n, T]
    return out.masked_scatter_(b["resp_mask"].bool(), flat[b["target"].bool()])


def model_flops(config, lens: list[tuple[int, int]]) -> float:
    """Forward + backward FLOPs of the step's real tokens (see the module docstring)."""
    c, tokens = config, sum(p + r for p, r in lens)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    dense = 6 * c.num_hidden_layers * per_layer * tokens
    head = 6 * c.vocab_size * c.hidden_size * sum(r for _, r in lens)
    attn = 3 * sum(4 * c.num_hidden_layers * q * n * (n + 1) / 2 for n in (p + r for p, r in lens))
    return dense + head + attn


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_flops(a: argparse.Namespace) -> float:
    """Best dense matmul FLOP/s of a few square [n, n] @ [n, n] products in ``--dtype``."""
    n = a.peak_n or (8192 if a.device.startswith("cuda") else 1024)
    x = torch.randn(n, n, device=a.device, dtype=DTYPES[a.dtype])
    y = torch.randn(n, n, device=a.device, dtype=DTYPES[a.dtype])
    best, reps = float("inf"), 10 if a.device.startswith("cuda") else 3
    for _ in range(4):
        sync(a.device)
        t = time.perf_counter()
        for _ in range(reps):
            x @ y
        sync(a.device)
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n ** 3 / best


def run(a: argparse.Namespace) -> dict:
    peak = peak_flops(a)                         # before and after the steps: the best of both
    model = build(a)
    lens = samples(a, model.config.vocab_size)
    b = batch(a, lens, model.config.vocab_size)
    opt = build_optimizer(model, lr=1e-6)
    gspo = objectives.spec("gspo")
    adv = (torch.arange(len(lens), device=a.device) % 2 * 2 - 1).float()              # [n] ±1
    mask = b["resp_mask"]
    counts = {"num_seqs": float(len(lens)), "num_tokens": float(mask.sum())}
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(a.warmup + a.steps):
        sync(a.device)
        t = time.perf_counter()
        logp = logprobs(model, a, b)                                                  # [n, T]
        loss, _ = gspo.fn(logp, logp.detach(), adv, mask, **gspo.defaults, **counts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync(a.device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    tokens = sum(p + r for p, r in lens)
    mem = (torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda")
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    peak = max(peak, peak_flops(a))
    return dict(params=sum(p.numel() for p in model.parameters()), samples=len(lens), tokens=tokens,
                computed=b["computed"], step_s=step, tok_s=tokens / step,
                mfu=model_flops(model.config, lens) / step / peak, peak_tflops=peak / 1e12,
                mem_gib=mem, attn=model.config._attn_implementation)


def table(a: argparse.Namespace, r: dict) -> str:
    mem = "peak memory (GiB, CUDA allocated)" if a.device.startswith("cuda") else "peak RSS (GiB)"
    rows = [("model", f"Qwen3 {a.shape} shape, {r['params'] / 1e6:.1f}M parameters, {a.dtype}"),
            ("layout", f"{a.layout}, attention {r['attn']}, activation checkpointing {'on' if a.ac else 'off'}"),
            ("tokens per step", f"{r['tokens']} real in {r['samples']} samples; {r['computed']} computed "
                                f"(padding {1 - r['tokens'] / r['computed']:.1%})"),
            ("device", a.device if a.device == "cpu" else torch.cuda.get_device_name()),
            ("step time (s, median)", f"{r['step_s']:.3f}"),
            ("throughput (tokens/s)", f"{r['tok_s']:,.0f}"),
            ("MFU", f"{r['mfu']:.1%} of a measured {r['peak_tflops']:.2f} TFLOP/s matmul peak"),
            (mem, f"{r['mem_gib']:.2f}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


def main(argv=None) -> None:
    a = args(argv)
    print(table(a, run(a)), flush=True)


if __name__ == "__main__":
    main()
