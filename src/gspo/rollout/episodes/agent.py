"""The agent episode: an agent program of your own (``agent.fn``) drives each trajectory through
the recording endpoint, an OpenAI-compatible server backed by the run's engine (docs/agents.md).

    rollout: {episode: agent}
    agent: {fn: my_agents:solve, timeout_s: 60}
    rewards: {on_error: drop, sources: [{type: env}]}

For every batch the endpoint opens on a free port of 127.0.0.1 with a fresh key, and
``fn(base_url, api_key, example)`` (sync or async) runs G times per example, each call in a
thread of its own with its own ``base_url`` (the episode's identity). It returns the episode's
reward, or (reward, info); ``agent.params`` are keyword arguments of every call, or the options
of a built-in agent (``AGENTS``: ``verifiers`` in ``verifiers_env``, ``verifiers_v1`` in ``verifiers_v1``). The calls it makes are
sampled by the run's engine with the run's sampling parameters, batched across episodes (``endpoint.batcher``), and stitched into rows
(``endpoint.recorder``). The batch keeps one row per episode, N = P·G: the row of the episode's
last call (the whole conversation when the agent only appends); rows left behind by a rewritten
history are counted (``agent/rows_untrained``; docs/math.md, "Agent episodes"). Its record's
``reward`` is the agent's, so ``rewards.sources: [{type: env}]`` scores it.

An agent that raises, returns something else than a reward, or misses its deadline
(``agent.timeout_s``, the agent and its scoring) is counted and its episode gets no reward: under
``rewards.on_error=drop`` its row leaves the loss (``fail`` is refused, so that an agent's fault
never stops the run). After the batch the server and its threads are gone; a synchronous agent
still running past its deadline is left to finish in its daemon thread, its calls answered 410.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gspo.registry import Registry
from gspo.rollout.episodes.base import register
from gspo.rollout.episodes.endpoint.batcher import Batcher
from gspo.rollout.episodes.endpoint.recorder import Recorder
from gspo.rollout.episodes.endpoint.server import Endpoint, Session
from gspo.rollout.episodes.tool_loop import as_batch
from gspo.rollout.episodes.turn_loop import (Budgets, Row, episode_metrics, observation_rows_refusal,
                                             to_tensors)
from gspo.rollout.generate import RolloutBatch
from gspo.tasks.base import call_kwargs
from gspo.tasks.custom import load_function

MAX_WARNINGS = 3
"""Failed episodes reported on stderr per batch (all are counted)."""

AGENTS: Registry[Callable[..., Callable]] = Registry("built-in agent", valid="built-in agents")
"""Built-in agents by name (``agent.fn: verifiers``, ``verifiers_v1``): each a factory called with ``agent.params``
at set-up that returns the agent ``fn(base_url, api_key, example)``."""


def check_agent(spec, params: dict) -> Callable:
    """The function of ``module:function`` (or ``spec`` when callable), or the factory of a built-in,
    checked to take ``params`` (when there are any); ValueError (one line) when it does not import
    or bind."""
    if callable(spec) or ":" in spec:
        fn = spec if callable(spec) else load_function(spec)
        if params:
            call_kwargs(fn, params, what=f"agent.fn={getattr(fn, '__name__', spec)}", args=(None, None, None))
        return fn
    factory = AGENTS.get(spec)
    call_kwargs(factory, params, what=f"agent.fn={spec}")
    return factory


def agent_function(spec, params: dict) -> Callable:
    """The agent of ``agent.fn``: ``module:function`` (or a callable) with ``params`` as keyword
    arguments of every call, or a built-in made with ``params`` now."""
    fn = check_agent(spec, params)
    if callable(spec) or ":" in spec:
        return functools.partial(fn, **params) if params else fn
    return fn(**params)


@dataclass
class Outcome:
    """What one agent call came to."""

    state: str = "running"
    """running | ok | error | timeout."""
    reward: float | None = None
    info: dict = field(default_factory=dict)
    why: str = ""


def reward_and_info(value) -> tuple[float, dict]:
    """An agent's return value as (reward, info) (ValueError: it is neither)."""
    reward, info = value if isinstance(value, tuple) and len(value) == 2 else (value, {})
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the agent returned {value!r:.60}: expected a finite reward or (reward, info)")
    if not isinstance(info, dict):
        raise ValueError(f"the agent's info must be a dict, got {type(info).__name__}")
    return float(reward), info


def call_agent(fn: Callable, args: tuple, timeout_s: float):
    """``fn(*args)``; a coroutine function (or a coroutine returned) is run to completion in an
    event loop of this thread, cancelled at ``timeout_s``."""
    result = fn(*args)
    if inspect.isawaitable(result):
        async def bounded():
            return await asyncio.wait_for(result, timeout_s)
        return asyncio.run(bounded())
    return result


def launch(fn: Callable, args: tuple, outcome: Outcome, timeout_s: float, done: Callable[[], None],
           name: str) -> threading.Thread:
    """Run the agent in a daemon thread: ``outcome`` filled in, ``done()`` called when it returns."""
    def target():
        try:
            value = call_agent(fn, args, timeout_s)
            if outcome.state == "running":
                outcome.reward, outcome.info = reward_and_info(value)
                outcome.state = "ok"
        except (asyncio.TimeoutError, TimeoutError):
            if outcome.state == "running":
                outcome.state, outcome.why = "timeout", f"past agent.timeout_s={timeout_s:g}"
        except BaseException as err:  # noqa: BLE001  the agent's fault is its episode's, never the run's
            if outcome.state == "running":
                outcome.state, outcome.why = "error", f"{type(err).__name__}: {err}".splitlines()[0][:200]
        finally:
            done()

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def context_limit(engine, tokenizer) -> int:
    """The longest context the model takes: its config's max_position_embeddings, else the
    tokenizer's model_max_length."""
    config = getattr(getattr(engine, "module", None), "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", None)
    return int(min(limit or 1 << 20, 1 << 20))


@register("agent")
@dataclass
class Agent:
    """Each trajectory an agent call over the recording endpoint; ``metrics`` holds the last
    batch's agent/* and multiturn/*."""

    fn: Callable
    budgets: Budgets
    timeout_s: float = 60.0
    batch_wait_s: float = 2.0
    metrics: dict = field(default_factory=dict)
    template_kwargs: dict = field(default_factory=dict)
    """The chat template's extra variables (``task.chat_template_kwargs``) for every rendering."""
    gives_rewards = True
    multi_turn = True
    batches: int = 0
    """Batches served (each batch's URLs carry its number: a late call of an earlier one is refused)."""

    @classmethod
    def from_config(cls, cfg, task=None) -> "Agent":
        """agent.fn imported or a built-in made with agent.params (ValueError, one line), multiturn's
        budgets, the template's kwargs."""
        m = cfg.multiturn
        budgets = Budgets(max_turns=m.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                          max_total_tokens=m.max_total_tokens, max_observation_tokens=m.max_observation_tokens)
        fn = agent_function(cfg.agent.fn, dict(cfg.agent.params))
        return cls(fn, budgets, cfg.agent.timeout_s, cfg.agent.batch_wait_s,
                   template_kwargs=dict(cfg.task.chat_template_kwargs or {}))

    @staticmethod
    def refuses(cfg) -> str | None:
        if cfg.agent.fn is None:
            return "set agent.fn, the agent as module:function (docs/agents.md)"
        try:
            check_agent(cfg.agent.fn, dict(cfg.agent.params))
        except ValueError as err:
            return str(err)
        if cfg.multiturn.env is not None:
            return f"the agent is the environment: unset multiturn.env={cfg.multiturn.env}"
        if why := observation_rows_refusal(cfg):
            return why
        if cfg.rewards.on_error == "fail":
            return ("an agent that fails gives its episode no reward: set rewards.on_error=drop (its row "
                    "leaves the loss) or zero")
        return None

    def close(self) -> None:
        pass

    def __call__(self, sampler, tokenizer, examples, params, *, group_size, seed,
                 with_logprobs) -> RolloutBatch:
        rows_examples = [ex for ex in examples for _ in range(group_size)]
        n, self.batches = len(rows_examples), self.batches + 1
        limit = context_limit(sampler, tokenizer)
        name = str(getattr(getattr(getattr(sampler, "module", None), "config", None), "name_or_path", "") or "gspo-policy")
        endpoint = Endpoint(name, limit).open()
        batcher = Batcher(sampler, params, seed, n, self.batch_wait_s)
        start = time.monotonic()
        session = Session(self.batches, Recorder(tokenizer, self.budgets, n, limit, self.template_kwargs), batcher, tokenizer,
                          params, [start + self.timeout_s] * n)
        outcomes = [Outcome() for _ in range(n)]
        try:
            endpoint.serve(session)
            for e, ex in enumerate(rows_examples):
                launch(self.fn, (endpoint.base_url(e), endpoint.key, ex), outcomes[e], self.timeout_s,
                       lambda e=e: self.end(session, e), f"gspo-agent-{self.batches}.{e}")
            batcher.run(lambda: self.past_deadlines(session, outcomes))
        finally:
            endpoint.serve(None)
            batcher.close()
            endpoint.close()
        rows = self.rows(session, tokenizer, rows_examples, outcomes)
        batch = to_tensors(rows, tokenizer.pad_token_id)
        batch.update(completions=[r.final_turn for r in rows], examples=rows_examples,
                     records=[r.record() for r in rows])
        self.metrics = {**episode_metrics(rows), **self.agent_metrics(session, endpoint, outcomes)}
        out = as_batch(batch, sampler.device)
        if not with_logprobs:
            out.rollout_logp = None
        return out

    @staticmethod
    def end(session: Session, e: int) -> None:
        """Episode ``e`` is over: no more calls served, the batcher stops waiting for it."""
        session.ended.add(e)
        session.batcher.end(e)

    def past_deadlines(self, session: Session, outcomes: list[Outcome]) -> bool:
        """Time out the episodes past their deadline; True when every episode is over."""
        now = time.monotonic()
        for e, (o, deadline) in enumerate(zip(outcomes, session.deadlines)):
            if o.state == "running" and now > deadline:
                o.state, o.why = "timeout", f"past agent.timeout_s={self.timeout_s:g}"
                self.end(session, e)
        return len(session.ended) == len(outcomes)

    def rows(self, session: Session, tokenizer, examples, outcomes: list[Outcome]) -> list[Row]:
        """One row per episode: its last call's row with the agent's reward (None when it
        failed); an episode that made no call, an empty row on its example's prompt."""
        out, warned = [], 0
        for e, (log, o) in enumerate(zip(session.recorder.logs, outcomes)):
            if log.last_row is None:
                row = Row(tokenizer(examples[e].prompt)["input_ids"], end="no_eos")
            else:
                row = log.rows[log.last_row]
                last = [c for c in log.calls if c.row == log.last_row][-1]
                row.end = "done" if last.eos else "no_eos"
            row.info = {"calls": list(log.tool_calls), **o.info}
            row.reward = o.reward if o.state == "ok" else None
            if o.state != "ok" and warned < MAX_WARNINGS:
                warned += 1
                print(f"warning: agent episode {e} {o.state}: {o.why or 'no reward'}; it gets no reward "
                      "(rewards.on_error)", file=sys.stderr)
            out.append(row)
        return out

    @staticmethod
    def agent_metrics(session: Session, endpoint: Endpoint, outcomes: list[Outcome]) -> dict[str, float]:
        """agent/*: rows per episode, fresh renders, calls, overrides, timeouts, errors, refusals."""
        logs, n, c = session.recorder.logs, max(1, len(outcomes)), endpoint.counts
        rows = sum(len(log.rows) for log in logs)
        return {"agent/rows_per_episode": rows / n,
                "agent/rows_untrained": float(rows - sum(1 for log in logs if log.rows)),
                "agent/fresh_renders": float(sum(log.fresh_renders for log in logs)),
                "agent/calls_mean": sum(len(log.calls) for log in logs) / n,
                "agent/engine_calls": float(session.batcher.engine_calls),
                "agent/partial_batches": float(session.batcher.partial),
                "agent/overridden_sampling": float(c["overridden"]),
                "agent/timeouts": float(sum(o.state == "timeout" for o in outcomes)),
                "agent/errors": float(sum(o.state == "error" for o in outcomes)),
                "agent/refused": float(c["refused"]),
                "agent/malformed": float(c["malformed"]),
                "agent/unauthorized": float(c["unauthorized"]),
                "agent/late_calls": float(c["late"])}
