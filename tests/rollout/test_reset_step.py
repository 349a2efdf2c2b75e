"""The reset/step episode: games of textarena, GEM / gymnasium and OpenEnv shapes (tests/game_fakes.py,
the real signatures, none of the libraries installed) open each row, answer its turns through the
turn loop, and their own reward becomes the row's; a game that raises or hangs ends its row
counted, and the batch goes on. One test plays a real textarena game, one a real GEM game, and
three a real OpenEnv environment (tests/openenv_game.py: local, and behind openenv's own server
and clients on 127.0.0.1), each where its library is installed (make test-verifiers)."""

from __future__ import annotations

import time

import pytest
import torch

from game_fakes import PROMPT, GymGame
from gspo.envs.guard import Guard
from gspo.rollout.engines.base import Capabilities, Engine
from gspo.rollout.episodes.reset_step import ResetStep, refusal, seed_of
from gspo.rollout.episodes.turn_loop import Budgets
from gspo.rollout.generate import Samples, SamplingParams, left_pad
from gspo.rollout.tokenization import build_bpe_tokenizer
from gspo.tasks import Example

PARAMS = SamplingParams(max_new_tokens=8)
BUDGETS = Budgets(max_turns=6, max_new_tokens=8, max_total_tokens=120, max_observation_tokens=40)
GYM = {"make": "game_fakes:GymGame", "protocol": "gym"}


@pytest.fixture(scope="module")
def tok():
    corpus = [PROMPT, "higher lower right 0 1 2 3", "[GAME] [Player 0]", "user assistant"] * 8
    return build_bpe_tokenizer(corpus, vocab_size=300)


class Guesser(Engine):
    """Guesses k, k the number of answers ("higher" / "lower") its context holds: 0, 1, 2, 3."""

    capabilities = Capabilities()

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompt_ids, group_size, params, seed=None, with_logprobs=True) -> Samples:
        self.calls.append((len(prompt_ids), group_size, seed))
        rows = []
        for p in prompt_ids:
            text = self.tok.decode(p)
            k = text.count("higher") + text.count("lower")
            rows += [self.tok(str(k), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]] * group_size
        ids, mask = left_pad([r[::-1] for r in rows], self.tok.pad_token_id)
        ids, mask = ids.flip(1), mask.flip(1).float()
        return Samples(ids, mask, torch.zeros(len(rows), dtype=torch.bool), -((ids % 7) + 1).float() / 10 * mask)

    def update_weights(self, weights, version):
        pass


def examples(*seeds):
    return [Example(prompt=f"game {s}", answer="", data={"seed": s}) for s in seeds]


def play(tok, params, seeds=(2, 3), *, group_size=2, chat=False, budgets=BUDGETS, timeout_s=5.0):
    episode = ResetStep(dict(params), budgets, Guard(params["make"], {}, timeout_s=timeout_s, on_error="end"),
                        chat=chat)
    engine = Guesser(tok)
    batch = episode(engine, tok, examples(*seeds), PARAMS, group_size=group_size, seed=7, with_logprobs=True)
    return episode, engine, batch


def environment_says(record) -> list[str]:
    return [m["content"] for m in record.transcript if m["role"] != "assistant"]


def test_a_gym_game_opens_the_row_and_its_step_rewards_sum_to_the_row_reward(tok):
    GymGame.closed.clear()
    episode, engine, batch = play(tok, GYM)
    prompt = tok(PROMPT)["input_ids"]
    assert (batch.input_ids[:, :len(prompt)] == torch.tensor(prompt)).all()    # the reset's observation
    # targets 2, 3: guesses 0, 1, 2 (two wrong) and 0, 1, 2, 3 (three wrong), each -0.25; right: 1
    assert [r.reward for r in batch.records] == [0.5, 0.5, 0.25, 0.25]
    assert [[m["content"] for m in r.transcript if m["role"] == "assistant"] for r in batch.records][2] == ["0", "1", "2", "3"]
    assert environment_says(batch.records[0]) == ["higher", "higher"]
    assert [r.end for r in batch.records] == ["done"] * 4
    assert engine.calls[0] == (2, 2, 7)                         # turn 1: the G rows share their prompt
    assert [(ex.prompt, ex.data) for ex in batch.examples] == [(PROMPT, {"seed": 2})] * 2 + [(PROMPT, {"seed": 3})] * 2
    observation = tok("higher", add_special_tokens=False)["input_ids"]
    assert batch.response_mask[0].tolist()[2:2 + len(observation)] == [0.0] * len(observation)
    assert (batch.rollout_logp[batch.response_mask == 0] == 0).all()
    assert episode.metrics["reset_step/unfinished"] == 0 and episode.metrics["multiturn/env_errors_mean"] == 0
    assert sorted(GymGame.closed) == [2, 2, 3, 3]                # closed after the batch


def test_textarena_cumulative_observations_are_cut_to_what_is_new(tok):
    _, _, batch = play(tok, {"make": "game_fakes:textarena_make", "protocol": "textarena",
                             "kwargs": {"env_id": "Guess-v0"}})
    assert tok.decode(batch.input_ids[0][batch.attention_mask[0] == 1]).startswith(f"[GAME] {PROMPT}\n0")
    # each answer once, after the player's own line (textarena's LLM wrapper writes it back)
    assert environment_says(batch.records[0]) == ["[Player 0] 0\n[GAME] higher\n", "[Player 0] 1\n[GAME] higher\n"]
    assert [r.reward for r in batch.records] == [1.0] * 4       # player 0's reward at close()


def test_textarena_raw_observations_are_joined_without_the_players_own(tok):
    _, _, batch = play(tok, {"make": "game_fakes:textarena_make", "protocol": "textarena",
                             "kwargs": {"env_id": "Guess-v0", "cumulative": False}}, seeds=(1,), group_size=1)
    assert environment_says(batch.records[0]) == ["[GAME] higher"]
    assert batch.records[0].reward == 1.0


def test_an_unfinished_game_textarena_has_no_reward_gym_its_sum_so_far(tok):
    short = Budgets(max_turns=2, max_new_tokens=8, max_total_tokens=120, max_observation_tokens=40)
    ep, _, ta = play(tok, {"make": "game_fakes:textarena_make", "protocol": "textarena",
                           "kwargs": {"env_id": "Guess-v0"}}, seeds=(3,), budgets=short)
    assert [r.reward for r in ta.records] == [None, None] and [r.end for r in ta.records] == ["turns", "turns"]
    assert ep.metrics["reset_step/unfinished"] == 1.0
    _, _, gym = play(tok, GYM, seeds=(3,), budgets=short)
    assert [r.reward for r in gym.records] == [-0.5, -0.5]


@pytest.mark.parametrize("make, action", [("game_fakes:OpenEnvGame", "game_fakes:GuessAction"),
                                          ("game_fakes:OpenEnvClient", "game_fakes:GuessAction"),
                                          ("game_fakes:OpenEnvAsyncClient", "game_fakes:GenericAction")])
def test_openenv_typed_actions_and_observations_local_or_client(tok, make, action):
    """A local Environment, a blocking client, and an async one (its .sync(); dict observations)."""
    kwargs = {"base_url": "ws://fake"} if make.endswith("AsyncClient") else {}
    _, _, batch = play(tok, {"make": make, "kwargs": kwargs, "protocol": "openenv", "action": action,
                             "action_field": "guess", "observation_field": "feedback"})
    assert [r.reward for r in batch.records] == [0.5, 0.5, 0.25, 0.25]
    assert environment_says(batch.records[0]) == ["higher", "higher"]


def test_under_a_chat_template_the_opening_is_a_user_turn_and_answers_are_user_messages(tok):
    _, _, batch = play(tok, GYM, seeds=(1,), group_size=1, chat=True)
    want = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = batch.input_ids[0][batch.attention_mask[0] == 1].tolist()
    assert tok.decode(ids).startswith(want + "0<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n1")
    assert batch.records[0].transcript[1] == {"role": "user", "content": "higher"}


def test_a_game_that_raises_hangs_or_cannot_reset_ends_its_row_counted(tok, capsys):
    _, _, raised = play(tok, {"make": "game_fakes:Raises", "protocol": "gym"}, seeds=(3,))
    assert [r.end for r in raised.records] == ["env_error"] * 2 and [r.reward for r in raised.records] == [-0.25] * 2
    episode, _, hung = play(tok, {"make": "game_fakes:Hangs", "protocol": "gym"}, seeds=(3,), timeout_s=0.3)
    assert [r.end for r in hung.records] == ["env_error"] * 2 and episode.metrics["multiturn/env_errors_mean"] == 1
    assert [r.reward for r in hung.records] == [None, None]
    episode, _, unborn = play(tok, {"make": "game_fakes:BadReset", "protocol": "gym"}, seeds=(3,))
    assert [r.end for r in unborn.records] == ["env_error"] * 2 and episode.metrics["reset_step/unfinished"] == 1
    assert [ex.prompt for ex in unborn.examples] == ["game 3"] * 2        # no opening: the example's prompt
    err = capsys.readouterr().err
    assert "failed in step (turn 2 '1')" in err and "KeyError: 'board'" in err
    assert "failed in make or reset" in err and "RuntimeError: no board" in err


def test_the_seed_is_the_seed_column_else_a_stable_hash_of_the_prompt():
    assert seed_of(Example("x", "", {"seed": 5})) == 5
    assert seed_of(Example("abc", "")) == seed_of(Example("abc", "")) == 891568578


@pytest.mark.parametrize("params, says", [
    ({"make": "game_fakes:GymGame", "protocol": "gym", "seed": 1}, "multiturn.params.seed is not a reset_step parameter"),
    ({"protocol": "gym"}, "set multiturn.params.make"),
    ({"make": "game_fakes:GymGame", "protocol": "gymnasium"}, "set multiturn.params.protocol to one of textarena, gym, openenv"),
    ({"make": "game_fakes:OpenEnvGame", "protocol": "openenv"}, "protocol openenv needs multiturn.params.action"),
    ({"make": "game_fakes:Nothing", "protocol": "gym"}, "multiturn.params: "),
    ({"make": "no_such_module:make", "protocol": "gym"}, "cannot import module 'no_such_module'"),
])
def test_bad_params_are_one_line(params, says):
    assert says in refusal(params) and "\n" not in refusal(params)


def test_a_config_is_refused_in_one_line(make_cfg):
    base = ["rollout.episode=reset_step", "multiturn.params={make: game_fakes:GymGame, protocol: gym}",
            "rewards.sources=[{type: env}]", "rewards.on_error=drop", "sft.enabled=false"]
    assert make_cfg(*base, "multiturn.on_env_error=end").rollout.episode == "reset_step"
    for extra, says in [([], "multiturn.on_env_error=end"),
                        (["multiturn.on_env_error=end", "sft.enabled=true"], "sft.enabled=false"),
                        (["multiturn.on_env_error=end", "rewards.on_error=fail"], "rewards.on_error=drop"),
                        (["multiturn.on_env_error=end", "objective.name=ppo"], "objective.name=ppo")]:
        with pytest.raises(Exception, match="rollout.episode=reset_step") as err:
            make_cfg(*base, *extra)
        assert says in str(err.value) and "\n" not in str(err.value)


def test_a_real_textarena_game(tok):
    pytest.importorskip("textarena")
    episode, _, batch = play(tok, {"make": "textarena:make", "protocol": "textarena",
                                   "kwargs": {"env_id": "GuessTheNumber-v0"}}, seeds=(0,), group_size=1)
    record = batch.records[0]
    assert "Guess The Number" in tok.decode(batch.input_ids[0]) and record.end in ("done", "turns", "budget")
    assert episode.metrics["multiturn/env_errors_mean"] == 0


def test_a_real_gem_game(tok):
    pytest.importorskip("gem")
    episode, _, batch = play(tok, {"make": "gem:make", "protocol": "gym",
                                   "kwargs": {"env_id": "game:GuessTheNumber-v0-easy"}}, seeds=(0,), group_size=2)
    assert "Guess The Number" in tok.decode(batch.input_ids[0]) and "between 1 and 10" in tok.decode(batch.input_ids[0])
    # the opening names "higher" and "lower" once each, so the guesser answers "2", without the
    # \boxed{} GEM asks for: GEM ends the game with its -0.1 format penalty
    assert [r.end for r in batch.records] == ["done", "done"] and [r.reward for r in batch.records] == [-0.1, -0.1]
    assert [m["content"] for m in batch.records[0].transcript if m["role"] == "assistant"] == ["2"]
    assert episode.metrics["multiturn/env_errors_mean"] == 0


def test_a_real_openenv_environment(tok):
    pytest.importorskip("openenv.core")
    from openenv_game import GuessEnv
    GuessEnv.closed.clear()
    episode, _, batch = play(tok, {"make": "openenv_game:GuessEnv", "protocol": "openenv",
                                   "action": "openenv_game:GuessAction", "action_field": "guess",
                                   "observation_field": "feedback"})
    prompt = tok(PROMPT)["input_ids"]
    assert (batch.input_ids[:, :len(prompt)] == torch.tensor(prompt)).all()    # reset's observation
    assert [[m["content"] for m in r.transcript if m["role"] == "assistant"] for r in batch.records][2] == ["0", "1", "2", "3"]
    assert environment_says(batch.records[0]) == ["higher", "higher"]
    assert [r.end for r in batch.records] == ["done"] * 4
    assert [r.reward for r in batch.records] == [0.5, 0.5, 0.25, 0.25]    # the Observation's rewards, summed
    assert episode.metrics["multiturn/env_errors_mean"] == 0 and episode.metrics["reset_step/unfinished"] == 0
    assert sorted(GuessEnv.closed) == [2, 2, 3, 3]


@pytest.mark.parametrize("client, action", [("openenv_game:GuessClient", "openenv_game:GuessAction"),
                                            ("openenv.core:GenericEnvClient", "openenv.core:GenericAction")])
def test_a_real_openenv_server_through_its_client(tok, client, action):
    """openenv's server on 127.0.0.1 and its (async) WebSocket client as make: each row's client
    is driven through .sync(); the generic client's observations are dicts."""
    pytest.importorskip("openenv.core")
    from openenv_game import GuessEnv, serve
    GuessEnv.closed.clear()
    with serve() as url:
        episode, _, batch = play(tok, {"make": client, "kwargs": {"base_url": url}, "protocol": "openenv",
                                       "action": action, "action_field": "guess", "observation_field": "feedback"})
        deadline = time.monotonic() + 10
        while len(GuessEnv.closed) < 4 and time.monotonic() < deadline:    # the server closes its sessions
            time.sleep(0.05)
    assert tok.decode(batch.input_ids[0]).startswith(PROMPT)
    assert environment_says(batch.records[2]) == ["higher", "higher", "higher"]
    assert [r.end for r in batch.records] == ["done"] * 4
    assert [r.reward for r in batch.records] == [0.5, 0.5, 0.25, 0.25]    # the StepResults' rewards, summed
    assert episode.metrics["multiturn/env_errors_mean"] == 0 and episode.metrics["reset_step/unfinished"] == 0
    assert sorted(GuessEnv.closed) == [2, 2, 3, 3]          # every row's client closed its session
