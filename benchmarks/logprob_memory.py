"""Peak memory of response log-probs: chunked head (gspo.core.logprobs) vs full logits, one long response.

Each variant runs in a fresh subprocess on the same seeded model and batch. On CPU the figure is
the rise of peak RSS (ru_maxrss) over the process's resident size once the model and batch exist;
on CUDA it is max_memory_allocated() over memory_allocated() at the same point. Exits non-zero
unless chunked peak <= naive peak / 8 and the values agree to 1e-5.

    python benchmarks/logprob_memory.py                      # V=151,936, T=4,096, no grad
    python benchmarks/logprob_memory.py --backward           # forward + backward of sum(logp)
    python benchmarks/logprob_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

MAX_RATIO = 1 / 8  # chunked peak / naive peak must not exceed this
ATOL = 1e-5  # values must agree to this (absolute, float32)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--vocab", type=int, default=151_936, help="V (Qwen2.5/Qwen3 vocabulary)")
    p.add_argument("--response-len", type=int, default=4096, help="T")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--backward", action="store_true", help="also backpropagate sum(logp) (training)")
    p.add_argument("--worker", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _model_and_batch(a: argparse.Namespace):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
        max_position_embeddings=a.prompt_len + a.response_len,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(a.device).eval()
    L = a.prompt_len + a.response_len
    input_ids = torch.randint(0, a.vocab, (1, L), device=a.device)  # [1, L]
    attention_mask = torch.ones_like(input_ids)  # [1, L]
    response_mask = torch.ones(1, a.response_len, dtype=torch.long, device=a.device)  # [1, T]
    return model, input_ids, attention_mask, response_mask


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(a: argparse.Namespace) -> None:
    """Build, warm up on a short batch, then measure one call of one variant."""
    from gspo.core.logprobs import naive_response_logprobs, response_logprobs

    model, ids, am, rm = _model_and_batch(a)
    fn = response_logprobs if a.worker == "chunked" else naive_response_logprobs
    kw = {"chunk_size": a.chunk_size} if a.worker == "chunked" else {}

    def run(ids, am, rm):
        with torch.set_grad_enabled(a.backward):
            out = fn(model, ids, am, rm, temperature=a.temperature, **kw)
            if a.backward:
                out.logp.sum().backward()
        return out

    run(ids[:, :32], am[:, :32], rm[:, :8])  # warm-up: lazy init, kernels
    model.zero_grad(set_to_none=True)
    if a.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    out = run(ids, am, rm)
    if a.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # ru_maxrss is KiB on Linux
    seconds = time.perf_counter() - t0
    grad = model.lm_head.weight.grad
    torch.save({"logp": out.logp.detach().cpu(), "entropy": out.entropy.cpu(),
                "head_grad": None if grad is None else grad.cpu()}, a.out)
    print(json.dumps({"peak": peak, "seconds": seconds}))


def _spawn(a: argparse.Namespace, variant: str, out: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--out", out]
    for k, v in vars(a).items():
        if k not in ("worker", "out") and v not in (None, False):
            argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{variant} worker failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    a = _args()
    if a.worker:
        _worker(a)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        stats = {v: _spawn(a, v, os.path.join(tmp, f"{v}.pt")) for v in ("chunked", "naive")}
        vals = {v: torch.load(os.path.join(tmp, f"{v}.pt")) for v in stats}
    diffs = {k: (vals["chunked"][k] - vals["naive"][k]).abs().max().item()
             for k in ("logp", "entropy", "head_grad") if vals["naive"][k] is not None}
    ratio = stats["chunked"]["peak"] / stats["naive"]["peak"]
    naive_logits = (a.prompt_len + a.response_len) * a.vocab * 4 / 2**20
    mode = "forward + backward" if a.backward else "forward, no grad"
    print(f"V={a.vocab:,} T={a.response_len:,} prompt={a.prompt_len} hidden={a.hidden} layers={a.layers} "
          f"chunk={a.chunk_size} device={a.device} ({mode})")
    print(f"one [1, L, V] float32 logits tensor = {naive_logits:,.0f} MiB")
    print(f"{'variant':<8} {'peak MiB':>10} {'seconds':>8}")
    for v, s in stats.items():
        print(f"{v:<8} {s['peak'] / 2**20:>10,.0f} {s['seconds']:>8.2f}")
    print(f"ratio chunked/naive = {ratio:.4f} (need <= {MAX_RATIO:.4f})")
    print("max |chunked - naive|: " + ", ".join(f"{k} {d:.2e}" for k, d in diffs.items()))
    ok = ratio <= MAX_RATIO and diffs["logp"] <= ATOL and diffs["entropy"] <= ATOL
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
