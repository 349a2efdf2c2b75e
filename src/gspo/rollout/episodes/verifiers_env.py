"""The verifiers agent: an environment of the verifiers library (its classic API, 0.3.x:
``load_environment``, ``SingleTurnEnv`` / ``MultiTurnEnv`` / ``ToolEnv``, rubrics) plays each agent
episode, its own rollout loop calling the recording endpoint, its rubric's reward the row's.

    rollout: {episode: agent}
    agent: {fn: verifiers, params: {env_id: my-env, env_args: {}}}
    rewards: {on_error: drop, sources: [{type: env}]}

At set-up ``verifiers.load_environment(env_id, **env_args)`` builds the environment once (a failure
is one line). Each episode is ``env.run_rollout(input, client, "policy", sampling_args)``: the
client is verifiers' ``OpenAIChatCompletionsClient`` over an ``openai.AsyncOpenAI`` pointed at the
episode's URL (no retries: a retried call is a second sample), so every model call verifiers makes
is sampled by the run's engine and recorded; the rubric scores the rollout as verifiers does, and
its ``reward`` is returned to the agent episode (``metrics`` kept in the row's info). A rollout
that verifiers ends with an error (its ``error`` field) raises, so the episode is counted in
``agent/errors`` and gets no reward instead of the 0 verifiers gives it.

The input of a row: the environment's ``system_prompt`` and ``few_shot`` messages (as its own
dataset formatting adds them), then the row's question as the user message (its ``question``
column, which ``task.chat: true`` fills with the prompt before the chat template rendered it, else
the example's prompt),
its ``answer``, and its ``info``, ``task`` and ``example_id`` columns when it has them. The rows come
from the run's task; the environment's own dataset is not read. verifiers 0.4 (the v1 API only:
tasksets, harnesses, an interception server) is refused here and served by ``verifiers_v1``; verifiers is an optional extra
(``pip install 'gspo[verifiers]'``), imported only when this agent is built.
"""

from __future__ import annotations

from gspo.errors import UserError
from gspo.optional import require
from gspo.rollout.episodes.agent import AGENTS
from gspo.tasks import Example

MODEL = "policy"
"""The model name verifiers sends (the endpoint serves the run's policy under any name)."""


def rollout_input(env, example: Example) -> dict:
    """A verifiers ``RolloutInput`` of ``example``, formatted as the environment formats its own rows."""
    messages = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    messages += list(env.few_shot or [])
    messages.append({"role": "user", "content": str(example.data.get("question", example.prompt))})
    row = {"prompt": messages, "answer": example.answer, "example_id": example.data.get("example_id", 0)}
    row.update({k: example.data[k] for k in ("info", "task") if k in example.data})
    return row


class VerifiersAgent:
    """``agent(base_url, api_key, example)`` (async): one verifiers rollout, scored by its rubric.
    Pickled as its options: an asynchronous worker process loads the environment again."""

    def __init__(self, env, options: tuple):
        self.env, self.options = env, options
        self.sampling_args, self.timeout_s = dict(options[2] or {}), options[3]

    def __reduce__(self):
        return verifiers, self.options

    async def __call__(self, base_url: str, api_key: str, example: Example):
        vf, openai = require("verifiers", "agent.fn=verifiers"), require("openai", "agent.fn=verifiers")
        native = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s)
        client = vf.OpenAIChatCompletionsClient(native)
        try:
            output = await self.env.run_rollout(rollout_input(self.env, example), client, MODEL,
                                                dict(self.sampling_args))
        finally:
            await native.close()
        if output.get("error"):
            raise RuntimeError(f"the verifiers rollout ended with an error: {output['error']}")
        metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items()}
        return float(output["reward"]), {"verifiers_metrics": metrics}


@AGENTS.register("verifiers")
def verifiers(env_id: str, env_args: dict | None = None, sampling_args: dict | None = None,
              timeout_s: float = 600.0) -> VerifiersAgent:
    """The environment ``env_id`` (an installed verifiers environment module) loaded once with
    ``env_args``; ``sampling_args`` go to every call (the run's temperature and top-p win)."""
    vf = require("verifiers", "agent.fn=verifiers")
    version = str(getattr(vf, "__version__", "0"))
    if not version.startswith(("0.1.", "0.2.", "0.3.")):
        raise UserError(f"agent.fn=verifiers serves the classic API (verifiers < 0.4); verifiers {version} "
                        f"has the v1 API only: agent.fn=verifiers_v1 serves it (or pip install 'verifiers>=0.3.1,<0.4')")
    try:
        env = vf.load_environment(env_id, **(env_args or {}))
    except Exception as err:  # noqa: BLE001  the environment's own failure, said in one line
        raise UserError(f"agent.params.env_id={env_id!r}: verifiers.load_environment failed: "
                        f"{type(err).__name__}: {err}".splitlines()[0]) from None
    return VerifiersAgent(env, (env_id, env_args, sampling_args, timeout_s))
