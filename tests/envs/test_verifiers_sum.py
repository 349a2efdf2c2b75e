"""The verifiers environment with feedback of configs/verifiers_feedback.yaml: its arithmetic
(the sum read off the question, the answer after the last '#', the feedback, the rubric), which
needs no verifiers install; its loop against the endpoint is tested in
tests/rollout/test_verifiers_agent.py where verifiers is installed."""

from __future__ import annotations

import pytest

from gspo.envs.verifiers_sum import answers, feedback, final_answer, question_of, score, target
from gspo.tasks.multistep import MultiStep


def test_the_sum_is_read_off_the_question_as_the_task_knows_it():
    assert target("S 4 7 3 1:") == 15
    for ex in MultiStep(seed=3, n_train=50, n_test=0, max_value=9, flawed_fraction=0.5).split("train"):
        assert target(ex.prompt) == ex.data["target"]          # flawed demonstrations do not matter


@pytest.mark.parametrize("reply, want", [("#15", 15), ("4+7=11,11+3=14#14", 14), (" #9 ", 9),
                                         ("15", None), ("#", None), ("#1x", None), ("", None)])
def test_the_answer_is_the_number_after_the_last_hash(reply, want):
    assert final_answer(reply) == want


def test_a_wrong_reply_is_told_which_way_it_is_off():
    assert feedback("#14", 15) == "No, too low."
    assert feedback("#16", 15) == "No, too high."
    assert feedback("fifteen", 15) == "No answer. Try again."


@pytest.mark.parametrize("replies, want", [(["#15"], 1.0), (["#14", "#15"], 0.5), (["#14", "#13"], 0.0),
                                           ([], 0.0), (["#16", "#14", "#15"], 0.5)])
def test_the_rubric_pays_a_first_right_answer_fully_a_later_one_in_part(replies, want):
    assert score(replies, 15, retry_credit=0.5) == want


def test_messages_are_read_as_dicts_or_objects():
    class Message:
        def __init__(self, role, content):
            self.role, self.content = role, content
    talk = [{"role": "user", "content": "S 1 2:"}, Message("assistant", " #4 "),
            {"role": "user", "content": "No, too high."}, {"role": "assistant", "content": None}]
    assert answers(talk) == ["#4", ""]
    assert question_of(talk) == "No, too high." and question_of(talk[:1]) == "S 1 2:"
