"""Rewards that read the episode: a function asks for the transcript, the tool calls or the
environment's info by keyword (in process and in the sandbox, with the same values), one taking
only ``**row`` gets none of them, and ``{type: env}`` scores the environment's own reward."""

from __future__ import annotations

import math

import pytest

from gspo.rewards.isolation import IsolatedReward
from gspo.rewards.sandbox import Limits
from gspo.rewards.sources import build_rewards
from gspo.tasks import Example
from gspo.tasks.record import EpisodeRecord, keywords_for

EX = Example(prompt="A 12+30:", answer="#42")
RECORDS = [
    EpisodeRecord(transcript=({"role": "assistant", "content": "[calc 12+30]"},
                              {"role": "environment", "content": "=42\n"},
                              {"role": "assistant", "content": "#42"}),
                  tool_calls=({"call": {"name": "calc", "arguments": ["12+30"]}, "result": "42",
                               "failed": False},),
                  info={"seen": "#42"}, reward=1.0),
    EpisodeRecord(transcript=({"role": "assistant", "content": "#41"},), info={}, reward=0.0),
]


def score(spec: str, records, sandbox: bool = False) -> list[float]:
    limits = Limits(wall_s=20.0) if sandbox else None
    reward = IsolatedReward(build_rewards([{"type": "function", "fn": spec}], None, limits),
                            timeout_s=30.0)
    return reward(["#42", "#41"], [EX, EX], records).total.tolist()


@pytest.mark.parametrize("sandbox", [False, True], ids=["in-process", "sandbox"])
def test_a_function_gets_the_transcript_and_calls_it_names(sandbox):
    # row 0: one call, two assistant turns = 1 + 20; row 1: no call, one turn = 10
    assert score("episode_helpers:calls_made", RECORDS, sandbox) == [21.0, 10.0]
    assert score("episode_helpers:info_seen", RECORDS, sandbox) == [3.0, 0.0]


@pytest.mark.parametrize("sandbox", [False, True], ids=["in-process", "sandbox"])
def test_a_function_of_row_alone_is_unchanged(sandbox):
    """fn(completion, **row) gets prompt and answer (the example has no data), no record field."""
    assert score("episode_helpers:plain", RECORDS, sandbox) == [1.0, 1.0]


def test_a_single_turn_row_is_its_completion():
    """No records (single turn): the transcript is the one assistant turn, no calls, no info."""
    assert score("episode_helpers:calls_made", None) == [10.0, 10.0]
    assert EpisodeRecord.single("#4").keywords() == {
        "transcript": [{"role": "assistant", "content": "#4"}], "tool_calls": [], "info": {}}


def test_keywords_for_adds_only_the_named_fields_and_they_win_over_a_column():
    record = RECORDS[0].keywords()
    row = {"prompt": "p", "info": "a data column"}
    assert keywords_for(lambda c, **row: 0, row, record) == row
    got = keywords_for(lambda c, info, **row: 0, row, record)
    assert got == {"prompt": "p", "info": {"seen": "#42"}}


def test_the_env_source_scores_the_environments_reward_and_counts_a_missing_one():
    reward = IsolatedReward(build_rewards([{"type": "env"}]), on_error="drop", timeout_s=None,
                            log=lambda m: None)
    records = [RECORDS[0], EpisodeRecord(reward=None)]
    out = reward(["#42", "x"], [EX, EX], records)
    assert out.total[0].item() == 1.0 and math.isnan(out.total[1].item())
    assert out.errors.tolist() == [False, True]
