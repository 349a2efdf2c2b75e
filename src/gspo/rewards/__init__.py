"""rewards: scoring completions, and keeping a failing reward from costing the run.

Reward sources (``sources``: the task's verifier, a user ``module:function``, a local reward
model) summed with weights; per-sample isolation with timeouts and the ``rewards.on_error`` policy
(``isolation``); a limited worker process for reward code that runs model output (``sandbox``).

It never imports models, rollout, training or a config object's module: it reads the ``rewards``
section by its fields. Below it: ``gspo.tasks``, ``gspo.core``, ``gspo.errors``.
"""
