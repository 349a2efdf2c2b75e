"""gspo.rollout.episodes.endpoint.batcher.Batcher: when calls of concurrent episodes are flushed.
Episodes that start one after another, each within ``wait_s`` of the last, still make one batch
(the rule is "no call arrived for wait_s", not "the oldest call waited wait_s"); an episode that
sends nothing holds the others ``wait_s`` after the last arrival, then a partial flush is counted."""

from __future__ import annotations

import threading
import time

import torch

from gspo.rollout.episodes.endpoint.batcher import Batcher, Request
from gspo.rollout.generate import Samples, SamplingParams


class Echo:
    """An engine whose every row samples [7, 2] (2 the EOS); it records each call's rows."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, group_size, params, seed=None, with_logprobs=True) -> Samples:
        n = len(prompts) * group_size
        self.calls.append(n)
        return Samples(torch.tensor([[7, 2]] * n), torch.ones(n, 2), torch.zeros(n, dtype=torch.bool),
                       -torch.ones(n, 2))


def _episodes(batcher: Batcher, starts: list[float | None]) -> list[threading.Thread]:
    """Episode e sends one call (its own prompt) ``starts[e]`` seconds in, then ends; None: it
    never calls and ends after the first flush (an agent busy elsewhere)."""
    def run(e, delay):
        if delay is None:
            while batcher.flushes == 0:
                time.sleep(0.01)
        else:
            time.sleep(delay)
            batcher.submit(Request(e, [e + 10], room=4, opens=False), timeout=30)
        batcher.end(e)
    threads = [threading.Thread(target=run, args=(e, d), daemon=True) for e, d in enumerate(starts)]
    for t in threads:
        t.start()
    return threads


def _run(starts: list[float | None], wait_s: float) -> tuple[Echo, Batcher, float]:
    engine = Echo()
    batcher = Batcher(engine, SamplingParams(4), seed=0, episodes=len(starts), wait_s=wait_s)
    threads = _episodes(batcher, starts)
    t0 = time.monotonic()
    batcher.run(lambda: not any(t.is_alive() for t in threads))
    return engine, batcher, time.monotonic() - t0


def test_staggered_starts_within_the_wait_make_one_batch():
    """Six episodes whose calls arrive 0.2 s apart (1.0 s from first to last) with wait_s = 0.6:
    the oldest call waits 1.0 s, beyond wait_s, and still one engine call takes all six."""
    engine, batcher, _ = _run([0.2 * e for e in range(6)], wait_s=0.6)
    assert engine.calls == [6] and batcher.partial == 0


def test_an_episode_that_never_calls_holds_the_others_wait_s_after_the_last_arrival():
    """Three episodes call at once, the fourth never does: the three are flushed once no call came
    for wait_s (a partial flush, counted), not before, and not much later."""
    engine, batcher, took = _run([0.0, 0.0, 0.0, None], wait_s=0.5)
    assert engine.calls == [3] and batcher.partial == 1
    assert 0.5 <= took < 5
