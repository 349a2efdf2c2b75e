"""Episodes: how the prompts of a batch become trajectories through a sampler, one file each.

* ``base``: the ``Episode`` protocol and the registry (``build(name, cfg)``);
* ``single_turn``: G responses sampled once (``rollout.episode=single_turn``);
* ``tool_loop``: the multi-turn episode in an environment per row (``multiturn.env``), over the
  token-level loop of ``turn_loop``;
* ``agent``: an agent program of your own (``agent.fn``) through the recording endpoint
  (``endpoint``), an OpenAI-compatible server backed by the run's engine, or a built-in one
  (``verifiers_env``: an environment of the verifiers library, its classic API; ``verifiers_v1``: its v1 API);
* ``reset_step``: an environment of another library (textarena, GEM / gymnasium, OpenEnv) that
  opens each trajectory and answers its turns, over ``turn_loop``.

The run's episode is ``rollout.episode`` (derived from ``multiturn.env`` when unset); the trainer
and the cold start build it here. docs/architecture.md, "Where to add an episode".
"""

from gspo.rollout.episodes.base import EPISODES, Episode, build, gives_rewards, names, refusal, register

# Built-in episodes register themselves on import.
from gspo.rollout.episodes import single_turn, tool_loop, agent, reset_step, verifiers_env, verifiers_v1  # noqa: E402,F401  isort: skip
from gspo.rollout.episodes.single_turn import SingleTurn  # noqa: E402
from gspo.rollout.episodes.tool_loop import ToolLoop  # noqa: E402
from gspo.rollout.episodes.agent import Agent  # noqa: E402
from gspo.rollout.episodes.reset_step import ResetStep  # noqa: E402

__all__ = ["EPISODES", "Agent", "Episode", "ResetStep", "SingleTurn", "ToolLoop", "build", "gives_rewards", "names", "refusal", "register"]
