"""The multi-turn rollout loop (gspo.rollout.episodes.turn_loop) with a scripted sampler and scripted
environments: exact ids, masks (policy turns and their end-of-turn tokens 1, observations 0,
attention 1 on every real token) and sampler log-probs for each way a row ends; a non-canonical
BPE split survives; observation positions reach no objective of the registry."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gspo.core import objectives
from gspo.envs import Observation, Reply, Turn
from gspo.rollout.episodes.turn_loop import Budgets, episode_metrics, run_episodes, text_observer, to_tensors

EOS, PAD = 0, 99


def encode(text: str) -> list[int]:  # a toy tokenizer: one id per character, its code point
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


class Script:
    """A sampler that replays scripted turns per row (in call order), log-prob -0.1·(k+1) each."""

    def __init__(self, turns: dict[int, list[str]], eos_after: bool = True):
        self.turns, self.calls, self.eos_after = turns, [], eos_after

    def __call__(self, contexts, max_new, rows):
        self.calls.append((contexts, max_new))
        out = []
        for row, room in zip(rows, max_new):
            text = self.turns[row].pop(0)
            ids = encode(text) + ([EOS] if not text.endswith("~") else [])   # "~": no end-of-turn
            ids = [i for i in ids if i != ord("~")][:room]
            out.append((ids, [-0.1 * (k + 1) for k in range(len(ids))]))
        return out


class Echo:
    """Answers '=<turn>' until the turn is 'stop'; counts a tool call per answer."""

    def step(self, turn: Turn) -> Reply:
        if not turn.ended or turn.text == "stop":
            return Reply(None)
        return Reply(Observation(text=f"={turn.text}\n"), tool_calls=1)

    def reward(self):
        return None


def run(turns, budgets=Budgets(max_turns=3, max_new_tokens=8, max_total_tokens=40, max_observation_tokens=10)):
    prompts = [encode(f"P{i}:") for i in range(len(turns))]
    sampler = Script({i: list(t) for i, t in enumerate(turns)})
    rows = run_episodes(sampler, prompts, [Echo() for _ in prompts], text_observer(encode), decode, EOS,
                        budgets, encode=encode)
    return rows, sampler


def test_each_way_a_row_ends_with_exact_ids_masks_and_logprobs():
    rows, sampler = run([
        ["ab", "stop"],                 # done: EOS and the environment says done
        ["ab", "cdefghijkl~"],          # no_eos: the second turn hits 8 tokens without EOS
        ["a", "b", "c"],                # turns: 3 turns used, the environment still answers
        ["abcdefghi~"],                 # no_eos on turn 1 (8 tokens, cut)
        ["abcdefg"],                    # budget: the observation "=abcdefg\n" is 9 tokens > 8
    ], Budgets(max_turns=3, max_new_tokens=8, max_total_tokens=40, max_observation_tokens=8))
    r = rows[0]
    assert r.end == "done" and r.turns == ["ab", "stop"]
    assert r.ids == encode("ab") + [EOS] + encode("=ab\n") + encode("stop") + [EOS]
    assert r.policy == [1, 1, 1] + [0] * 4 + [1] * 5           # each turn's EOS is a policy token
    assert r.logp == [-0.1, -0.2, pytest.approx(-0.3)] + [0.0] * 4 + [pytest.approx(-0.1 * k) for k in range(1, 6)]
    assert (r.tool_calls, r.observation_tokens) == (1, 4)
    assert rows[1].end == "no_eos" and rows[1].ids[-1] != EOS and rows[1].policy[-8:] == [1] * 8
    assert rows[2].end == "turns" and rows[2].turns == ["a", "b", "c"]
    assert rows[2].ids == encode("a") + [EOS] + encode("=a\n") + encode("b") + [EOS] + encode("=b\n") + encode("c") + [EOS]
    assert rows[3].end == "no_eos" and rows[3].ids == encode("abcdefgh")
    assert rows[4].end == "budget" and rows[4].ids == encode("abcdefg") + [EOS]   # 9 > 8: not appended
    # later turns continue each live row from its own ids; the room is min(per-turn, total left)
    contexts, room = sampler.calls[1]
    assert contexts[0] == encode("P0:") + encode("ab") + [EOS] + encode("=ab\n") and room == [8, 8, 8]


def test_the_total_budget_cuts_turns_and_refuses_observations():
    # 40 in all: turn 1 is 8 tokens ("abcdefg" + EOS), "=abcdefg\n" 9 -> 17; turn 2 -> 25, 9 -> 34;
    # turn 3 has 6 left: cut there without EOS
    rows, sampler = run([["abcdefg", "abcdefg", "abcdefg"]],
                        Budgets(max_turns=4, max_new_tokens=8, max_total_tokens=40, max_observation_tokens=10))
    assert rows[0].end == "no_eos" and len(rows[0].ids) == 40 and sampler.calls[2][1] == [6]
    # 34 in all: the second observation would leave no room for a turn: not appended
    rows, _ = run([["abcdefg", "abcdefg", "abcdefg"]],
                  Budgets(max_turns=4, max_new_tokens=8, max_total_tokens=34, max_observation_tokens=10))
    assert rows[0].end == "budget" and len(rows[0].ids) == 25 and sum(rows[0].policy) == 16


def test_tensors_attend_everywhere_real_and_train_only_policy_tokens():
    rows, _ = run([["ab", "stop"], ["x", "stop"]])
    t = to_tensors(rows, PAD)
    L = t["input_ids"].shape[1]
    T = t["response_mask"].shape[1]
    assert T == len(rows[0].ids) and L == 3 + T
    assert t["input_ids"][1, :3].tolist() == encode("P1:")
    assert t["attention_mask"][0].tolist() == [1] * L
    assert t["attention_mask"][1].tolist() == [1] * (3 + len(rows[1].ids)) + [0] * (T - len(rows[1].ids))
    assert t["response_mask"][0].tolist() == rows[0].policy
    assert t["response_mask"][0].sum() == 8                          # |y_i| = policy tokens only
    assert t["rollout_logp"][0, 3:7].tolist() == [0.0] * 4           # the observation "=ab\n"
    assert t["truncated"].tolist() == [False, False]


def test_a_non_canonical_bpe_split_survives_and_is_counted_as_drift():
    from gspo.rollout.tokenization import build_bpe_tokenizer
    tok = build_bpe_tokenizer(["user hello hello hello world", "assistant hello world"] * 20, 300)
    canonical = tok("hello", add_special_tokens=False)["input_ids"]
    split = [i for ch in "hello" for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert canonical != split and tok.decode(split) == "hello"
    eos = tok.eos_token_id

    def sample(contexts, room, rows):
        return [(split + [eos], [-0.5] * (len(split) + 1)) for _ in contexts]

    class Done:
        def step(self, turn):
            return Reply(None)

        def reward(self):
            return None

    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    rows = run_episodes(sample, [enc("hi")], [Done()], text_observer(enc), tok.decode, eos,
                        Budgets(), encode=enc)
    assert rows[0].ids == split + [eos] and rows[0].turns == ["hello"]   # the sampler's ids, kept
    assert episode_metrics(rows)["multiturn/retokenization_drift"] == 1.0


def test_demonstrations_replay_the_turns_through_the_environment():
    """Multi-turn SFT rows: the environment writes the observations between the demonstration's
    turns; the loss trains on the policy's turns (and their EOS) only."""
    from gspo import envs, tasks
    from gspo.envs.tools import ToolRunner
    from gspo.rollout.episodes.turn_loop import demonstrations
    example = tasks.build("calculator", n_train=1, n_test=1, call_fraction=1.0).split("train")[0]
    runner = ToolRunner(["gspo.tasks.tooluse:calc"])
    env = envs.build("tools", example, runner=runner, call_format="bracket")
    rows = demonstrations([encode(example.prompt)], [example.data["turns"]], [env], text_observer(encode),
                          encode, decode, EOS, Budgets(max_turns=3, max_new_tokens=20, max_total_tokens=80))
    call, answer = example.data["turns"]
    value = example.data["value"]
    assert rows[0].end == "done" and rows[0].turns == [call, answer]
    assert rows[0].ids == encode(call) + [EOS] + encode(f"={value}\n") + encode(answer) + [EOS]
    assert rows[0].policy == [1] * (len(call) + 1) + [0] * (len(value) + 2) + [1] * (len(answer) + 1)
    record = rows[0].record()          # what the rewards read: the conversation and its calls
    assert record.transcript == ({"role": "assistant", "content": call},
                                 {"role": "environment", "content": f"={value}\n"},
                                 {"role": "assistant", "content": answer})
    assert [c["result"] for c in record.tool_calls] == [value] and record.end == "done"
    assert record.reward is None       # the tools environment keeps no reward of its own


def test_metrics():
    rows, _ = run([["ab", "stop"], ["a", "b", "c"]])
    m = episode_metrics(rows)
    # the second row's third turn was answered too (a call pending when the turns ran out)
    assert m["multiturn/turns_mean"] == 2.5 and m["multiturn/tool_calls_mean"] == 2.0
    assert m["multiturn/end_done"] == 0.5 and m["multiturn/end_turns"] == 0.5
    assert m["multiturn/env_tokens_mean"] == (4 + 3 + 3) / 2 and m["multiturn/retokenization_drift"] == 0.0


# ----------------------------------------------------------- observation positions and the loss
NAMES = ["cispo", "gmpo", "grpo", "gspo", "gspo_token", "luspo", "ppo", "sapo"]


@pytest.mark.parametrize("name", NAMES)
def test_perturbing_logprobs_at_observation_positions_changes_neither_loss_nor_gradient(name):
    """Holes in the middle of a row (observation tokens, mask 0): any value there, for the
    current and the old log-probs, leaves the loss and its gradient unchanged."""
    assert sorted(objectives.available()) == NAMES                     # the whole registry
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.float64)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) - 0.1
    logp = (old + 0.2 * torch.randn(3, 6, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    holes = mask == 0
    logp2 = torch.where(holes, torch.full_like(logp, -40.0), logp.detach()).requires_grad_()
    old2 = torch.where(holes, torch.full_like(old, 5.0), old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _ = objectives.get(name)(logp, old, adv, mask, token_sum_norm=6.0)
        loss2, _ = objectives.get(name)(logp2, old2, adv, mask, token_sum_norm=6.0)
    (grad,) = torch.autograd.grad(loss, logp)
    (grad2,) = torch.autograd.grad(loss2, logp2)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2, grad)
    assert torch.all(grad2[holes] == 0)


def test_gspo_sequence_ratio_is_over_policy_tokens_by_hand():
    # one row: policy tokens at 0, 1, 4 with log-ratios 0.3, -0.1, 0.4; the holes hold anything.
    # log s = (0.3 - 0.1 + 0.4) / 3 = 0.2 (the length is 3, the policy's tokens, not 5)
    mask = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.float64)
    old = torch.zeros(1, 5, dtype=torch.float64)
    logp = torch.tensor([[0.3, -0.1, 9.0, -9.0, 0.4]], dtype=torch.float64, requires_grad=True)
    _, stats = objectives.get("gspo")(logp, old, torch.tensor([1.0], dtype=torch.float64), mask,
                                      eps_low=10.0, eps_high=10.0)
    assert stats["ratio_mean"].item() == pytest.approx(math.exp(0.2))


# ------------------------------------------------------------------- a real engine and model
def test_trainer_logprobs_equal_the_samplers_on_policy_tokens_of_multiturn_batches():
    """hf engine, tiny model, a tool loop: the trainer's forward over the holed
    batch (attention on every real token, log-probs on policy tokens) gives the sampler's
    log-probs on every policy token, float32, within the engine tests' tolerance."""
    from gspo import tasks
    from gspo.core.logprobs import response_logprobs
    from gspo.models.presets import build_char_tokenizer, build_model
    from gspo.rollout import engines
    from gspo.rollout.generate import SamplingParams
    from gspo.rollout.generate import demonstration_batch
    from gspo.rollout.episodes.tool_loop import collect_episodes
    from gspo.training.cold_start import sft_loss
    torch.manual_seed(0)
    model, _ = build_model("tiny-dense", 0)
    tok = build_char_tokenizer()
    task = tasks.build("calculator", n_train=8, n_test=2, digits=2, call_fraction=1.0)
    # 40 SFT steps on short answers, so that turns end with EOS and the loop goes on
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss = sft_loss(model, demonstration_batch(tok, task.split("train"), "cpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    engine = engines.build("hf", model, tok)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]

    class Always:  # every turn is answered (observation text) until the turn budget: holes in each row
        def __init__(self, ex):
            self.n = 0

        def step(self, turn):
            self.n += 1
            return Reply(Observation(text=f"={self.n}\n"), tool_calls=1)

        def reward(self):
            return None

    batch, rows = collect_episodes(engine, tok, task.split("train")[:4], 2, SamplingParams(max_new_tokens=6),
                                   Always, text_observer(enc),
                                   Budgets(max_turns=3, max_new_tokens=6, max_total_tokens=40), seed=3)
    policy = batch["response_mask"]
    assert (policy == 0).any() and all(r.observation_tokens > 0 for r in rows)   # holes exist
    assert torch.equal(batch["attention_mask"][:, -policy.shape[1]:].float() >= policy,
                       torch.ones_like(policy, dtype=torch.bool))
    with torch.no_grad():
        out = response_logprobs(model, batch["input_ids"], batch["attention_mask"], policy,
                                with_entropy=False)
    on = policy > 0
    assert (out.logp[on] - batch["rollout_logp"][on]).abs().max() < 5e-5
    # the same forward with the observations hidden from attention disagrees: they do condition
    blind = batch["attention_mask"].clone()
    blind[:, -policy.shape[1]:] = policy.long()
    with torch.no_grad():
        wrong = response_logprobs(model, batch["input_ids"], blind, policy, with_entropy=False)
    assert (wrong.logp[on] - batch["rollout_logp"][on]).abs().max() > 1e-2
