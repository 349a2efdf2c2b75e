"""Concurrent episodes' calls gathered into engine calls, deterministically for deterministic agents.

The server's request threads ``submit`` a call and wait; the thread that owns the engine (the
episode's) runs ``Batcher.run``: it flushes when every live episode has a call waiting (the
episode launched the agents, so it knows how many are live), or when no call has arrived for
``wait_s`` while some wait (an agent that sends nothing holds the others that long after the last
arrival; agents still starting, or slowed by each other on a busy CPU, keep the batch whole as
long as their calls keep coming). A flush is one engine call over the waiting calls in episode order, flush k
seeded ``seed + k·TURN_SEED_STRIDE`` as the tool loop seeds its turns, so a deterministic agent
gets the same batches, and the same samples, run after run. A flush of calls that all open their
episodes, in runs of g identical prompts (a group's G first turns), is sampled g per prompt with
the prompts shared, as a single turn samples them.

Only the owning thread touches the engine. This module knows no HTTP and no chat template.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

from gspo.rollout.episodes.tool_loop import TURN_SEED_STRIDE, turns_of


class Closed(Exception):
    """The call's episode ended (its deadline passed, or the batch is done) before it was sampled."""


@dataclass
class Request:
    """One waiting call: its episode, the ids to continue, its room, and (once served) the result."""

    episode: int
    context: list[int]
    room: int
    opens: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[list[int], list[float]] | None = None
    error: Exception | None = None


def runs(contexts: list[list[int]]) -> int | None:
    """g when ``contexts`` are runs of g identical prompts, each run another prompt; else None."""
    g = 1
    while g < len(contexts) and contexts[g] == contexts[0]:
        g += 1
    if len(contexts) % g:
        return None
    for i in range(0, len(contexts), g):
        if any(c != contexts[i] for c in contexts[i:i + g]):
            return None
    return g


class Batcher:
    """Waiting calls of ``episodes`` live episodes, flushed into ``engine`` calls by ``run``."""

    def __init__(self, engine, params, seed: int | None, episodes: int, wait_s: float):
        self.engine, self.params, self.seed, self.wait_s = engine, params, seed, wait_s
        self.live = set(range(episodes))
        self.waiting: list[Request] = []
        self.last_arrival = time.monotonic()
        self.cond = threading.Condition()
        self.flushes = 0
        self.engine_calls = 0
        self.partial = 0
        """Flushes made before every live episode waited (no call for ``wait_s``): batches, and
        so seeds, that depend on timing."""

    def submit(self, request: Request, timeout: float | None = None) -> tuple[list[int], list[float]]:
        """Queue ``request`` and wait for its sample (Closed: its episode ended first)."""
        with self.cond:
            if request.episode not in self.live:
                raise Closed("the episode has ended")
            self.last_arrival = time.monotonic()
            self.waiting.append(request)
            self.cond.notify_all()
        if not request.done.wait(timeout):
            raise Closed("no sample before the deadline")
        if request.error is not None:
            raise request.error
        return request.result

    def end(self, episode: int) -> None:
        """Episode ``episode`` is no longer live: its waiting calls fail (Closed)."""
        with self.cond:
            self.live.discard(episode)
            for r in [r for r in self.waiting if r.episode == episode]:
                self.waiting.remove(r)
                r.error = Closed("the episode has ended")
                r.done.set()
            self.cond.notify_all()

    def ready(self) -> bool:
        """Every live episode waits, or calls wait and none has arrived for ``wait_s``."""
        if not self.waiting:
            return False
        if {r.episode for r in self.waiting} >= self.live:
            return True
        return time.monotonic() - self.last_arrival >= self.wait_s

    def run(self, finished, poll_s: float = 0.02) -> None:
        """Flush until ``finished()`` (called every ``poll_s``: it may end episodes) says every
        episode is over and nothing waits."""
        while True:
            over = finished()
            with self.cond:
                if not self.ready():
                    if over and not self.waiting:
                        return
                    self.cond.wait(poll_s)
                    continue
                batch = sorted(self.waiting, key=lambda r: r.episode)   # stable: arrival within one
                self.partial += not {r.episode for r in batch} >= self.live
                self.waiting = []
            self.flush(batch)

    def flush(self, batch: list[Request]) -> None:
        """One engine call over ``batch``; each request gets its ids cut to its room."""
        seed = None if self.seed is None else self.seed + self.flushes * TURN_SEED_STRIDE
        self.flushes += 1
        contexts, rooms = [r.context for r in batch], [r.room for r in batch]
        g = runs(contexts) if all(r.opens for r in batch) else None
        try:
            if g:
                got = turns_of(self.engine.generate(contexts[::g], g, replace(
                    self.params, max_new_tokens=max(rooms)), seed=seed, with_logprobs=True))
            else:
                got = turns_of(self.engine.generate(contexts, 1, replace(
                    self.params, max_new_tokens=max(rooms)), seed=seed, with_logprobs=True))
            self.engine_calls += 1
        except Exception as err:  # noqa: BLE001  the engine's failure is the run's: raised below
            for r in batch:
                r.error = Closed("the engine failed")
                r.done.set()
            raise err
        for r, (ids, logp) in zip(batch, got):
            r.result = (ids[:r.room], logp[:r.room])
            r.done.set()

    def close(self) -> None:
        """End every episode (their waiting calls fail)."""
        for e in list(self.live):
            self.end(e)
