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

The masks, by construction: ``policy`` 1 on every sampled token (each turn's end-of-turn token
included), 0 on observation tokens; every real token attends. Log-probs are the sampler's on
policy tokens and exactly 0 on observation tokens, where nothing reads them (the loss mask is 0
there). |y_i|, the GSPO length, is the policy's tokens. The sampler and the observation encoder
are callables, so the loop is the same for any engine and any tokenizer (and tests script both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from gspo.envs import Environment, Observation, Turn
from gspo.rollout.generate import RolloutBatch
from gspo.rollout.turns import observation_ids
from gspo.tasks import Example

ENDS = ("done", "no_eos", "turns", "budget")

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
    observation_tokens: int = 0
    drifted_turns: int = 0
    """Turns whose decode-then-encode gives other ids than the sampler's (kept: the sampler's)."""
    info: dict = field(default_factory=dict)

    @property
    def final_turn(self) -> str:
        return self.turns[-1] if self.turns else ""


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
    return rows


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
    if encode is not None and encode(text) != body:
        row.drifted_turns += 1
    reply = env.step(Turn(text, ended=ended))
    row.tool_calls += reply.tool_calls
    row.tool_errors += reply.tool_errors
    row.tool_parse_errors += reply.parse_errors
    row.info.update(reply.info)
    if not ended:
        row.end = "no_eos"
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
    return row.end is None


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
           "multiturn/tool_call_rate": sum(r.tool_calls > 0 for r in rows) / n,
           "multiturn/env_tokens_mean": sum(r.observation_tokens for r in rows) / n,
           "multiturn/retokenization_drift": sum(r.drifted_turns for r in rows) / max(1, turns)}
    out.update({f"multiturn/end_{end}": sum(r.end == end for r in rows) / n for end in ENDS})
    return out


# ------------------------------------------------------------------------- through an engine
def turns_of(samples) -> list[tuple[list[int], list[float]]]:
    """An engine's ``Samples`` as per-row (ids, log-probs): each row's tokens up to and including
    its EOS (all of them when it has none)."""
    out = []
    for n in range(samples.response_ids.shape[0]):
        k = int(samples.response_mask[n].sum())
        logp = samples.logp[n, :k].tolist() if samples.logp is not None else [0.0] * k
        out.append((samples.response_ids[n, :k].tolist(), logp))
    return out


def engine_sampler(engine, params, seed: int | None) -> Sampler:
    """A later-turn sampler over ``engine``: every live row its own context, one sample each, as
    many new tokens as the roomiest row may take (each row then cut to its own room). Turn k's
    seed is ``seed + k·TURN_SEED_STRIDE`` (so turns do not repeat turn 1's random draws)."""
    calls = [0]

    def sample(contexts, room, rows):
        calls[0] += 1
        turn_seed = None if seed is None else seed + calls[0] * TURN_SEED_STRIDE
        got = engine.generate(contexts, 1, replace(params, max_new_tokens=max(room)), seed=turn_seed,
                              with_logprobs=True)
        return [(ids[:r], logp[:r]) for (ids, logp), r in zip(turns_of(got), room)]

    return sample


TURN_SEED_STRIDE = 1_000_003  # a prime beyond any batch's prompt count


def collect_episodes(engine, tokenizer, examples, group_size: int, params, make_env,
                     observe: Callable[[Observation], list[int]], budgets: Budgets,
                     seed: int | None = None):
    """One multi-turn batch: turn 1 as a single-turn rollout samples it (G per prompt, prompts
    shared), later turns through ``engine_sampler``; ``make_env(example)`` builds each row's
    environment. Returns (the tensors of ``to_tensors`` plus ``completions`` (each row's final
    turn) and ``examples``, the rows)."""
    prompts = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
    first = turns_of(engine.generate(prompts, group_size, replace(
        params, max_new_tokens=min(params.max_new_tokens, budgets.max_new_tokens, budgets.max_total_tokens)),
        seed=seed, with_logprobs=True))
    later = engine_sampler(engine, params, seed)
    turn = [0]

    def sample(contexts, room, rows):
        turn[0] += 1
        return [first[i] for i in rows] if turn[0] == 1 else later(contexts, room, rows)

    rows_prompts = [p for p in prompts for _ in range(group_size)]
    row_examples = [ex for ex in examples for _ in range(group_size)]
    environments = [make_env(ex) for ex in row_examples]
    encode, decode = codec(tokenizer)
    rows = run_episodes(sample, rows_prompts, environments, observe, decode, tokenizer.eos_token_id,
                        budgets, encode=encode)
    batch = to_tensors(rows, tokenizer.pad_token_id)
    batch.update(completions=[r.final_turn for r in rows], examples=row_examples)
    return batch, rows


# ---------------------------------------------------------------------------- the episode
def codec(tokenizer) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) of a turn's or an observation's text with ``tokenizer``: no special tokens
    added, none kept."""
    return (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def observer(tokenizer, template_kwargs: dict | None = None) -> Callable[[Observation], list[int]]:
    """How observations become ids with ``tokenizer``: text encoded as is; messages rendered by its
    chat template (with ``template_kwargs``) after the policy's end-of-turn token
    (``gspo.rollout.turns``), refused without one."""
    as_text = text_observer(codec(tokenizer)[0])
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def observe(obs: Observation) -> list[int]:
        if obs.text is not None:
            return as_text(obs)
        if not has_template:
            raise ValueError("the environment answered chat messages, but the tokenizer has no chat "
                             "template: answer text (e.g. multiturn.call_format=bracket)")
        return observation_ids(tokenizer, obs.messages, tokenizer.eos_token_id,
                               template_kwargs=template_kwargs)

    return observe


def as_batch(batch: dict, device) -> RolloutBatch:
    """``collect_episodes``' tensors and rows as a ``RolloutBatch`` on ``device``."""
    return RolloutBatch(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
        response_mask=batch["response_mask"].to(device), truncated=batch["truncated"].to(device),
        completions=batch["completions"], examples=batch["examples"],
        rollout_logp=batch["rollout_logp"].to(device))


@dataclass
class ToolLoop:
    """The multi-turn episode (``gspo.rollout.episodes``' second): every trajectory runs in its own
    environment from ``make_env(example)`` under ``budgets``; ``metrics`` holds the last batch's
    ``episode_metrics``. Each turn is sampled with its log-probs; the batch carries them only when
    asked (``with_logprobs``), as the single turn does."""

    make_env: Callable[[Example], Environment]
    budgets: Budgets
    metrics: dict = field(default_factory=dict)
    runner: object = None
    """The tools' runner the environments share (closed at the end of the run), if any."""
    template_kwargs: dict = field(default_factory=dict)
    """The chat template's extra variables (``task.chat_template_kwargs``) for tool turns."""

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    def __call__(self, sampler, tokenizer, examples, params, *, group_size, seed,
                 with_logprobs) -> RolloutBatch:
        batch, rows = collect_episodes(sampler, tokenizer, examples, group_size, params,
                                       self.make_env, observer(tokenizer, self.template_kwargs),
                                       self.budgets, seed)
        self.metrics = episode_metrics(rows)
        out = as_batch(batch, sampler.device)
        if not with_logprobs:   # sampled with them (each turn), handed on only when asked for
            out.rollout_logp = None
        return out

    def demonstrations(self, tokenizer, examples, device) -> RolloutBatch:
        """Multi-turn SFT rows of ``examples`` (their ``data["turns"]``, else the answer as one
        turn) through their environments: the loss mask is the policy's turns only."""
        prompts = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
        turns = [ex.data.get("turns") or [ex.answer] for ex in examples]
        encode, decode = codec(tokenizer)
        rows = demonstrations(prompts, turns, [self.make_env(ex) for ex in examples],
                              observer(tokenizer, self.template_kwargs), encode, decode,
                              tokenizer.eos_token_id, self.budgets)
        batch = to_tensors(rows, tokenizer.pad_token_id)
        batch.update(completions=[r.final_turn for r in rows], examples=list(examples))
        return as_batch(batch, device)
