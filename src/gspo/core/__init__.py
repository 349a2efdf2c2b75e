"""core: the math of one update, as pure functions of tensors.

The policy-loss registry (``objectives``: GSPO, GRPO, GSPO-token, SAPO, CISPO, GMPO, PPO, their
aggregations and defaults from the papers), group advantages with dropped samples and GAE
(``advantages``), memory-bounded response log-probs and entropies of a causal LM (``logprobs``),
the update plan of which rows need a forward (``plan``), and the critic with its clipped value loss
(``value``). Numbers in, numbers out: no config, no I/O, no ``.item()`` inside a loss.

It never imports transformers, a config, or any other gspo layer: torch only, and the name table
``gspo.registry`` under every layer (import-linter).
"""
