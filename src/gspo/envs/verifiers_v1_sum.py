"""A verifiers v1 taskset (verifiers 0.4): add up a list of numbers.

The task's prompt is the ``multistep`` task's question ("S 4 7 3 1:"); its ``@vf.reward`` pays 1
when the last reply's answer ("#15") is the sum read off the question, else 0, so no answer
column is needed (a flawed teacher's demonstration there cannot leak into the reward). A
``@vf.metric`` counts the replies.

It is the taskset of ``configs/verifiers_v1_sum.yaml`` (``agent.fn: verifiers_v1``,
``agent.params.env.taskset.id: gspo.envs.verifiers_v1_sum``), played by verifiers' ``null``
harness, its plain chat program, through the recording endpoint. Its ``load()`` yields the
default job's first questions, for ``vf-eval`` and the like; a gspo run builds each task from its
own examples. Needs ``pip install 'gspo[verifiers-v1]'``: verifiers' loader imports this module.
"""

from __future__ import annotations

import verifiers.v1 as vf

from gspo.envs.verifiers_sum import final_answer, target
from gspo.tasks.multistep import MultiStep


class SumData(vf.TaskData):
    """A question's data: its ``prompt`` only."""


class SumTask(vf.Task[SumData]):
    """Scored on the last reply: 1 when its answer is the question's sum."""

    @vf.reward
    async def right_sum(self, trace) -> float:
        return float(final_answer(trace.last_reply or "") == target(self.data.prompt_text))

    @vf.metric
    async def replies(self, trace) -> float:
        return float(len(trace.calls))


class SumTaskset(vf.Taskset[SumTask]):
    """The default job's first 100 test questions (its own split, seed 0)."""

    def load(self):
        for ex in MultiStep(seed=0, n_train=0, n_test=100, max_value=9).split("test"):
            yield SumTask(SumData(prompt=str(ex.data.get("question", ex.prompt))), self.config.task)


__all__ = ["SumTaskset"]
