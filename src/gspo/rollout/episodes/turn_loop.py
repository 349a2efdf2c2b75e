"""The multi-turn rollout loop, token in / token out: the policy's turns and the environment's
observations interleaved in one trajectory per row, with the ids the sampler produced kept as
they are (never decoded and encoded again) and the observation ids appended with loss mask 0.

    rows = run_episodes(sample, prompts, environments, observe, decode, eos, budgets)
    batch = to_tensors(rows, pad_id)   # input_ids, attention_mask, response_mask (policy), logp

Turn 1 samples every row from its prompt; each later turn continues every live row from its own
ids (prompt + everything so far). After a turn the row's environment gets the turn's text; its
observation's ids are appended, or the row ends. How a row ends (``Row.end``):

* ``done``: the turn closed with the end-of-turn token and the environment said done;
* ``no_eos``: a turn hit its token budget without the end-of-turn token (the environment is told
  ``ended=False`` and the row ends, whatever it answers);
* ``turns``: ``max_turns`` turns were sampled and the environment still answered (a call pending);
* ``budget``: the observation, or the next turn, does not fit ``max_total_tokens`` (policy +
  environment tokens after the prompt) or the observation exceeds ``max_observation_tokens``; the
  observation is not appended.
* ``env_error``: a user's environment failed at this closed turn under ``multiturn.on_env_error:
  end`` (``gspo.envs.guard``): the row keeps its turns so far and is scored as any other (a
  failure at a turn without the end-of-turn token ends ``no_eos``; both count in ``env_errors``).

The masks, by construction: ``policy`` 1 on every sampled token (each turn's end-of-turn token
included), 0 on observation tokens; every real token attends. Log-probs are the sampler's on
policy tokens and exactly 0 on observation tokens, where nothing reads them (the loss mask is 0
there). |y_i|, the GSPO length, is the policy's tokens. The sampler and the observation encoder
are callables, so the loop is the same for any engine and any tokenizer (and tests script both).
Each row also keeps its transcript and, once done, its environment's reward: ``Row.record()`` is
what the rewards read of it (gspo.tasks.record). This module knows no engine, no tokenizer and no
config: the tool-loop episode (``tool_loop``) drives it through an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gspo.envs import Environment, Observation, Turn
from gspo.tasks.record import EpisodeRecord

ENDS = ("done", "no_eos", "turns", "budget", "env_error")

Sampler = Callable[[list[list[int]], list[int], list[int]], list[tuple[list[int], list[float]]]]
"""sample(contexts, max_new, rows) -> per context (sampled ids, their log-probs): one turn each,
stopping at the end-of-turn token (included) or after max_new tokens. ``rows`` are the contexts'
row indices (an engine ignores them; a demonstration replays each row's own turns)."""


@dataclass(frozen=True)
class Budgets:
    """The limits of an episode."""

    max_turns: int = 4
    """Policy turns per trajectory."""
    max_new_tokens: int = 32
    """Tokens per policy turn."""
    max_total_tokens: int = 128
    """Tokens after the prompt, policy and environment together."""
    max_observation_tokens: int = 64
    """Tokens of one observation."""


@dataclass
class Row:
    """One trajectory: its prompt and everything after it, token by token."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    """Every token after the prompt: the policy's turns and the observations, in order."""
    policy: list[int] = field(default_factory=list)
    """1 where the policy sampled the token, 0 where the environment wrote it."""
    logp: list[float] = field(default_factory=list)
    """The sampler's log-prob of each policy token; 0.0 on observation tokens."""
    turns: list[str] = field(default_factory=list)
    """The policy's turns as text (what the environment saw)."""
    end: str | None = None
    """How the row ended (ENDS); None while it is live."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_parse_errors: int = 0
    env_errors: int = 0
    """Turns a user's environment failed on (``Reply.error``; on_env_error=end)."""
    observation_tokens: int = 0
    drifted_turns: int = 0
    """Turns whose decode-then-encode gives other ids than the sampler's (kept: the sampler's)."""
    info: dict = field(default_factory=dict)
    """The environment's ``Reply.info``, merged turn by turn."""
    transcript: list[dict] = field(default_factory=list)
    """The conversation after the prompt: each turn as an assistant message, each appended
    observation as its messages (or {"role": "environment", "content": text})."""
    reward: float | None = None
    """The environment's own reward once the row ended (``Environment.reward()``), if any."""

    @property
    def final_turn(self) -> str:
        return self.turns[-1] if self.turns else ""

    def record(self) -> EpisodeRecord:
        """What the rewards read of this row (gspo.tasks.record)."""
        return EpisodeRecord(transcript=tuple(self.transcript),
                             tool_calls=tuple(self.info.get("calls", ())), info=dict(self.info),
                             reward=self.reward, end=self.end or "done")


def run_episodes(sample: Sampler, prompts: Sequence[list[int]], environments: Sequence[Environment],
                 observe: Callable[[Observation], list[int]], decode: Callable[[list[int]], str],
                 eos: int, budgets: Budgets,
                 encode: Callable[[str], list[int]] | None = None) -> list[Row]:
    """One trajectory per (prompt, environment): rows of a group share a prompt, each its own
    environment. ``observe`` gives an observation's ids, ``decode`` a turn's text (without the
    end-of-turn token); ``encode``, when given, measures re-tokenisation drift."""
    rows = [Row(list(p)) for p in prompts]
    live = list(range(len(rows)))
    for turn in range(budgets.max_turns):
        if not live:
            break
        room = [min(budgets.max_new_tokens, budgets.max_total_tokens - len(rows[i].ids)) for i in live]
        outputs = sample([rows[i].prompt + rows[i].ids for i in live], room, live)
        still = []
        for i, (ids, logp) in zip(live, outputs):
            if take_turn(rows[i], environments[i], ids, logp, observe, decode, eos, budgets,
                         last=turn == budgets.max_turns - 1, encode=encode):
                still.append(i)
        live = still
    for row, env in zip(rows, environments):      # the environment's own reward, once done
        row.reward = env_reward(env)
    return rows


def env_reward(env: Environment) -> float | None:
    """``env.reward()`` of a finished episode; None when the environment keeps none."""
    reward = getattr(env, "reward", None)
    return None if reward is None else reward()


def take_turn(row: Row, env: Environment, ids: list[int], logp: list[float],
              observe: Callable[[Observation], list[int]], decode: Callable[[list[int]], str],
              eos: int, budgets: Budgets, *, last: bool,
              encode: Callable[[str], list[int]] | None = None) -> bool:
    """Append one sampled turn and the environment's answer to ``row``; False when the row ended."""
    if len(ids) != len(logp):
        raise ValueError(f"the sampler returned {len(ids)} ids and {len(logp)} log-probs")
    row.ids += ids
    row.policy += [1] * len(ids)
    row.logp += list(logp)
    ended = bool(ids) and ids[-1] == eos
    body = ids[:-1] if ended else ids
    text = decode(body)
    row.turns.append(text)
    row.transcript.append({"role": "assistant", "content": text})
    if encode is not None and encode(text) != body:
        row.drifted_turns += 1
    reply = env.step(Turn(text, ended=ended))
    row.tool_calls += reply.tool_calls
    row.tool_errors += reply.tool_errors
    row.tool_parse_errors += reply.parse_errors
    row.env_errors += reply.error is not None
    row.info.update(reply.info)
    if not ended:
        row.end = "no_eos"
    elif reply.error is not None:               # a user's environment failed (gspo.envs.guard)
        row.end = "env_error"
    elif reply.observation is None:
        row.end = "done"
    elif last:
        row.end = "turns"
    else:
        obs = observe(reply.observation)
        fits = (len(obs) <= budgets.max_observation_tokens
                and len(row.ids) + len(obs) < budgets.max_total_tokens)  # room for a next turn
        if not fits:
            row.end = "budget"
        else:
            row.ids += obs
            row.policy += [0] * len(obs)
            row.logp += [0.0] * len(obs)
            row.observation_tokens += len(obs)
            row.transcript += as_messages(reply.observation)
    return row.end is None


def as_messages(obs: Observation) -> list[dict]:
    """An observation as transcript messages: its chat messages, or its text as one message."""
    if obs.text is not None:
        return [{"role": "environment", "content": obs.text}]
    return [dict(m) for m in obs.messages]


def demonstrations(prompts: Sequence[list[int]], turns: Sequence[Sequence[str]],
                   environments: Sequence[Environment], observe: Callable[[Observation], list[int]],
                   encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], eos: int,
                   budgets: Budgets) -> list[Row]:
    """Multi-turn SFT demonstrations: each row's policy turns (text, encoded, EOS after each)
    replayed through the same loop, so the environment writes the observations between them as it
    will in RL, and ``policy`` marks the tokens the SFT loss trains on (the policy's turns only)."""
    queues = [list(t) for t in turns]

    def replay(contexts, room, rows):
        out = []
        for i, limit in zip(rows, room):
            ids = (encode(queues[i].pop(0)) + [eos])[:limit] if queues[i] else [eos]
            out.append((ids, [0.0] * len(ids)))
        return out

    return run_episodes(replay, prompts, environments, observe, decode, eos, budgets)


def text_observer(encode: Callable[[str], list[int]]) -> Callable[[Observation], list[int]]:
    """Observations as raw text, encoded by ``encode`` (no special tokens); messages refused."""
    def observe(obs: Observation) -> list[int]:
        if obs.text is None:
            raise ValueError("this tokenizer has no chat template: the environment must answer text, not messages")
        return encode(obs.text)
    return observe


def to_tensors(rows: Sequence[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """The rows as the trajectory batch's tensors: prompts left-padded and responses right-padded
    in ``input_ids`` [N, L]; ``attention_mask`` [N, L] 1 on every real token; ``response_mask``
    [N, T] 1 on policy tokens only (float); ``rollout_logp`` [N, T] (0 off policy tokens);
    ``truncated`` [N] True for rows whose last turn had no end-of-turn token."""
    P = max(len(r.prompt) for r in rows)
    T = max(1, max(len(r.ids) for r in rows))
    N = len(rows)
    ids = torch.full((N, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((N, P + T), dtype=torch.long)
    policy = torch.zeros((N, T))
    logp = torch.zeros((N, T))
    for n, r in enumerate(rows):
        p, t = len(r.prompt), len(r.ids)
        ids[n, P - p:P] = torch.tensor(r.prompt, dtype=torch.long)
        ids[n, P:P + t] = torch.tensor(r.ids, dtype=torch.long)
        attention[n, P - p:P + t] = 1
        policy[n, :t] = torch.tensor(r.policy, dtype=torch.float)
        logp[n, :t] = torch.tensor(r.logp, dtype=torch.float)
    truncated = torch.tensor([r.end == "no_eos" for r in rows])
    return {"input_ids": ids, "attention_mask": attention, "response_mask": policy,
            "rollout_logp": logp, "truncated": truncated}


def episode_metrics(rows: Sequence[Row]) -> dict[str, float]:
    """Per-step means: turns, tool calls and errors (parse errors among them), observation tokens,
    how rows ended, drift."""
    n = max(1, len(rows))
    turns = sum(len(r.turns) for r in rows)
    out = {"multiturn/turns_mean": turns / n,
           "multiturn/tool_calls_mean": sum(r.tool_calls for r in rows) / n,
           "multiturn/tool_errors_mean": sum(r.tool_errors for r in rows) / n,
           "multiturn/tool_parse_errors": sum(r.tool_parse_errors for r in rows) / n,
           "multiturn/env_errors_mean": sum(r.env_errors for r in rows) / n,
           "multiturn/tool_call_rate": sum(r.tool_calls > 0 for r in rows) / n,
           "multiturn/env_tokens_mean": sum(r.observation_tokens for r in rows) / n,
           "multiturn/retokenization_drift": sum(r.drifted_turns for r in rows) / max(1, turns)}
    out.update({f"multiturn/end_{end}": sum(r.end == end for r in rows) / n for end in ENDS})
    return out


def observation_rows_refusal(cfg) -> str | None:
    """Why rows holding observation tokens between the policy's turns (an agent's, an environment
    of another library's) cannot train under ``cfg``, or None."""
    blocked = [(cfg.objective.name == "ppo", "objective.name=ppo (its critic scores every token, "
                                             "observations included)"),
               (cfg.moe.routing_replay == "rollout", "moe.routing_replay=rollout"),
               (cfg.audit.every > 0, "audit.every (the audit's mask rules are the single-turn ones)"),
               (cfg.objective.name in ("dpo", "sft"), f"objective.name={cfg.objective.name}")]
    return next((f"does not work with {why}" for refuse, why in blocked if refuse), None)
