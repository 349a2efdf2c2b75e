"""gspo: Group Sequence Policy Optimization for RL of language models with verifiable rewards.

The package is a stack of layers, each a subpackage that imports only from those below it
(docs/architecture.md; checked by import-linter in ``make test``): core, models | tasks,
rewards | observe, config, rollout, training, tools, cli.
"""

__version__ = "0.1.0"
