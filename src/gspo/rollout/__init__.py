"""rollout: turning the policy and the task into scored samples.

The configured task with its data checked against the tokenizer (``data``), batched sampling of G
responses per prompt in the prompt-left / response-right layout (``generate``), one RL step's
batch drawn, sampled and scored with dynamic sampling (``collect``), and held-out evaluation:
greedy accuracy and pass@k (``evaluation``). A new generation engine goes here.

It never imports the config model, training, tools or the CLI: nothing here computes a loss or
takes an optimizer step, and a config reaches it as a plain object (``gspo.config`` sits above it,
to check engine names against ``engines``). Below it: ``gspo.rewards``, ``gspo.observe`` and
every layer under those.
"""
