"""Generation engines: one interface over the samplers a rollout can use, one file each
(docs/engines.md).

* ``base``: the ``Engine`` interface, its ``Capabilities`` record and the registry (``build``,
  ``check``, ``capabilities``);
* ``hf``: transformers ``generate`` on the policy or a copy of it;
* ``vllm``: a vLLM engine in this process (optional package);
* ``ray_generators`` and ``ray_cluster``: any of them as generators on Ray (``rollout.placement=ray``);
* ``weights``: the policy's weights as an engine receives them, and in byte buckets for another
  process.

A new engine is one file here: a class with ``@register("name")`` and its ``Capabilities``, and
its import below. Engines are chosen by name, never by an ``if``; rules read capabilities.
"""

from gspo.rollout.engines.base import (ENGINES, Capabilities, Engine, EngineUnavailable, available,
                                       build, capabilities, check, generate_batch, options_for,
                                       register)
from gspo.rollout.engines.weights import policy_weights

# Built-in engines register themselves on import (vLLM itself is imported only when built).
from gspo.rollout.engines.hf import HFEngine  # noqa: E402  isort: skip
from gspo.rollout.engines.vllm import VLLMEngine  # noqa: E402  isort: skip

__all__ = ["ENGINES", "Capabilities", "Engine", "EngineUnavailable", "HFEngine", "VLLMEngine",
           "available", "build", "capabilities", "check", "generate_batch", "options_for",
           "policy_weights", "register"]
