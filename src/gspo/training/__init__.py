"""training: the RL step, the loop around it, and everything that changes the weights.

One step top to bottom (``step``), the policy's log-prob passes with their speed paths and MoE
routing (``passes``), the run loop with evaluation, checkpoints and resume (``trainer``), the
initial policy and its SFT cold start (``cold_start``), what differs between GSPO-like objectives,
PPO and the SFT baseline (``algorithms``), data parallelism (the ranks' ``collectives``, the
model's wrapping in ``distributed``, ``dist_checkpoint``), the stability
guard's actions (``stability``), optimizers, checkpoints and signals.

It never imports tools or the CLI. Below it: ``gspo.config``, ``gspo.rollout`` and under.
"""
