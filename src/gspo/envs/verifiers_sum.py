"""A verifiers environment (its classic API, 0.3.x) with feedback: add up a list of numbers, in up
to ``tries`` turns.

The user asks the ``multistep`` task's question ("S 4 7 3 1:"); the policy answers ("#15"). A
right answer ends the episode; a wrong one is told which way it is off ("No, too low.") and
answered again, until ``tries`` answers. The rubric pays 1 for a right first answer,
``retry_credit`` for a right later one, 0 otherwise. The sum is read off the question, so the rubric
needs no answer column (a flawed teacher's demonstration there cannot leak into the reward).

It is the environment of ``configs/verifiers_feedback.yaml`` (``agent.fn: verifiers``,
``agent.params.env_id: gspo.envs.verifiers_sum``): verifiers' own ``MultiTurnEnv`` loop drives
the recording endpoint, its rubric scores the episode. Needs ``pip install 'gspo[verifiers]'``;
verifiers is imported only when ``load_environment`` runs.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def target(question: str) -> int:
    """The sum of the question's numbers ("S 4 7 3 1:" -> 15)."""
    return sum(int(n) for n in NUMBER.findall(question))


def final_answer(reply: str) -> int | None:
    """The number after the reply's last ``#`` (the task's answer format), None without one."""
    _, sep, tail = reply.strip().rpartition("#")
    return int(tail.strip()) if sep and NUMBER.fullmatch(tail.strip()) else None


def _get(message, key: str) -> str:
    """A message's field, whether verifiers hands the message over as a dict or an object."""
    value = message.get(key) if isinstance(message, dict) else getattr(message, key, None)
    return value or ""


def answers(messages) -> list[str]:
    """The policy's replies among ``messages``, in order."""
    return [_get(m, "content").strip() for m in messages if _get(m, "role") == "assistant"]


def question_of(prompt) -> str:
    """The episode's question: its prompt's last user message."""
    return [_get(m, "content") for m in prompt if _get(m, "role") == "user"][-1]


def feedback(reply: str, total: int) -> str:
    """What the environment says to a wrong reply: which way it is off, or that it has no answer."""
    got = final_answer(reply)
    if got is None:
        return "No answer. Try again."
    return "No, too low." if got < total else "No, too high."


def score(replies: list[str], total: int, retry_credit: float) -> float:
    """1 for a right first reply, ``retry_credit`` for a right later one, else 0."""
    for turn, reply in enumerate(replies):
        if final_answer(reply) == total:
            return 1.0 if turn == 0 else retry_credit
    return 0.0


def load_environment(tries: int = 2, retry_credit: float = 0.5):
    """The environment, as ``verifiers.load_environment("gspo.envs.verifiers_sum", **env_args)``
    builds it: up to ``tries`` replies per episode."""
    import verifiers as vf
    from datasets import Dataset

    class SumWithFeedback(vf.MultiTurnEnv):
        """Up to ``tries`` replies; a wrong one is told which way it is off."""

        @vf.stop
        async def answered_right(self, state) -> bool:
            steps = state["trajectory"]
            replies = answers(steps[-1]["completion"]) if steps else []
            return bool(replies) and final_answer(replies[-1]) == target(question_of(state["prompt"]))

        async def env_response(self, messages, state, **kwargs):
            reply = feedback(answers(messages)[-1], target(question_of(state["prompt"])))
            return [vf.UserMessage(content=reply)]

    def reward(prompt, completion, **kwargs) -> float:
        return score(answers(completion), target(question_of(prompt)), retry_credit)

    # verifiers wants a dataset of its own; gspo gives each episode its row (the run's task).
    placeholder = Dataset.from_list([{"question": "S 4 7 3 1:", "answer": "#15"}])
    return SumWithFeedback(dataset=placeholder, rubric=vf.Rubric(funcs=[reward]), max_turns=tries)
