"""models: the policy networks and what is done to them from outside.

Tiny transformers presets built from a config (no download), the character tokenizer, loading and
saving of local safetensors checkpoints, dtypes and devices (``presets``); Mixture-of-Experts
routing capture, Routing Replay and routing metrics through forward hooks (``moe``).

It never imports tasks, rewards, a config or anything that trains: only ``gspo.core``,
``gspo.errors`` and ``gspo.registry`` below it. A new preset is a ``@register_preset`` function in
``presets``.
"""
