"""observe: what a run records about itself, and the reading of it.

Metric sinks (``metrics``: metrics.jsonl + TensorBoard), diagnostics beside the loss (length
slices, generator-vs-trainer mismatch), how each metric reduces over ranks (``reductions``), the
per-step time breakdown (``timing``), audit records of a step (``records``), the stability rules
over the metrics and the event log (pure, ``stability_rules``), and the run report (``report``).

It never imports rewards, rollout, training, tools or the config: whatever it records is handed
to it. Below it: ``gspo.models``, ``gspo.core``, ``gspo.errors``, ``gspo.registry``.
"""
