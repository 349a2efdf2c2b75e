"""The hf engine's token draw at a real vocabulary: rollout.sampler multinomial vs inverse_cdf.

One decode step's sampling work on random scores [N, V] (Qwen3's V = 151,669 by default), each
variant timed alternately in the same process, median of the repeats: what ``generate`` does for
``rollout.sampler=multinomial`` (temperature warper, softmax, ``torch.multinomial``) against the
processor ``gspo.rollout.generate.InverseCDFDraw``; and, beside them, the log-softmax that
``SampledLogProbs`` adds a step when the sampler's log-probs are kept. Prints a table and the
ratio; the model's forward is not included (the head alone: ``--with-head`` adds the [N, H] x
[H, V] product at H = 64, the width of configs/qwen3_tools.yaml).

    python benchmarks/hf_sampler.py                 # N = 64 and 128 rows, V = 151,669
    python benchmarks/hf_sampler.py --vocab 4096 --rows 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper

from gspo.rollout.generate import InverseCDFDraw


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_669)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--with-head", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    warp = TemperatureLogitsWarper(args.temperature)
    draw = InverseCDFDraw(args.temperature)
    print(f"V = {args.vocab:,}, threads = {torch.get_num_threads()}, median of {args.repeats}, seconds per token")
    print("| rows | multinomial | inverse_cdf | ratio | log-softmax (log-probs kept) |")
    print("|---|---|---|---|---|")
    for n in args.rows:
        scores = torch.randn(n, args.vocab) * 4
        head = torch.randn(args.vocab, 64) if args.with_head else None
        hidden = torch.randn(n, 64)

        def logits():
            return hidden @ head.T if head is not None else scores.clone()

        def multinomial():
            return torch.multinomial(torch.softmax(warp(None, logits()), -1), 1)

        def inverse_cdf():
            return draw(None, logits()).argmax(-1)

        def log_softmax():
            return torch.log_softmax(logits() / args.temperature, -1)

        times = {f.__name__: [] for f in (multinomial, inverse_cdf, log_softmax)}
        for _ in range(args.repeats):                       # alternated, one of each per round
            for f in (multinomial, inverse_cdf, log_softmax):
                times[f.__name__] += _time(f, 1)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {n} | {med['multinomial']:.3f} | {med['inverse_cdf']:.3f} | "
              f"{med['multinomial'] / med['inverse_cdf']:.1f}x | {med['log_softmax']:.3f} |")


if __name__ == "__main__":
    main()
