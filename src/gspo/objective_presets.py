"""Named recipes of the field as plain config values: ``objective.preset: dapo | dr_grpo``.

A preset is a set of dotted config keys and values taken from its paper (which loss, which clip
range, how the loss is aggregated, how advantages are scaled, which trainer switches). Loading a
config expands the preset into the config tree *before* validation:

* ``objective.preset`` in a YAML file: every key the file sets itself wins, every other preset key
  takes the preset's value;
* ``objective.preset=NAME`` as a command-line override: it stands for the preset's ``key=value``
  overrides at its place in the list: over the config file and earlier overrides, under later
  ones (``objective.preset=dapo objective.eps_high=0.3`` is DAPO with ε_high 0.3).

The resolved config that a run writes (``run.dir/config.yaml``) shows what the preset expanded
to, and expanding it again changes nothing.

Pure data and one function on dicts: no torch, no config model (``gspo.config`` calls ``expand``).
What a preset leaves out of its paper's recipe is stated in its ``missing`` field and in
docs/math.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from gspo.registry import Registry

__all__ = ["Preset", "available", "expand", "get", "register"]


@dataclass(frozen=True)
class Preset:
    """One named recipe: config values and where they come from."""

    name: str
    values: Mapping[str, Any]
    """Dotted config key -> value, e.g. {"objective.eps_high": 0.28}."""
    paper: str
    """Citation and the sections the values come from."""
    missing: str = ""
    """What of the paper's recipe this library does not have (empty: nothing)."""


_REGISTRY: Registry[Preset] = Registry("objective preset")


def register(name: str, values: dict[str, Any], *, paper: str, missing: str = "") -> Preset:
    """Add preset ``name`` (a name given twice is refused); its keys must be dotted section.field paths."""
    if any("." not in key for key in values):
        raise ValueError(f"preset {name}: keys must be dotted section.field paths; got {sorted(values)}")
    return _REGISTRY.add(name, Preset(name, MappingProxyType(dict(values)), paper, missing))


available = _REGISTRY.names
"""Sorted names of the presets."""
get = _REGISTRY.get
"""The preset ``name``; ValueError listing the valid names if unknown."""


def expand(tree: Any, *, replace: bool = False) -> Any:
    """``tree`` (a raw config mapping) with its ``objective.preset`` expanded: a new dict in which
    every preset key the tree does not set holds the preset's value (``replace``: every preset key,
    set or not: a preset given as a ``key=value`` override stands for its values at that place,
    over the config file's). Anything else (no preset, an unknown one, a tree that is not a
    mapping) comes back unchanged, for validation to report."""
    if not isinstance(tree, Mapping):
        return tree
    objective = tree.get("objective")
    name = objective.get("preset") if isinstance(objective, Mapping) else None
    if name not in _REGISTRY:
        return tree
    out = _copy(tree)
    for key, value in _REGISTRY.get(name).values.items():
        *sections, field = key.split(".")
        node = out
        for part in sections:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):   # not a section: leave it for validation to report
                break
            node = child
        else:
            if replace or field not in node:
                node[field] = value
    return out


def _copy(tree: Mapping) -> dict:
    """A copy of the nested mappings of ``tree`` (leaves shared), so expanding never edits it."""
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


# ----------------------------------------------------------------------------- the presets

register(
    "dapo",
    {
        "objective.name": "grpo",                          # token-level clipped surrogate (Eq. 8)
        "objective.eps_low": 0.2,                          # Clip-Higher §3.1: ε_low = 0.2 ...
        "objective.eps_high": 0.28,                        # ... ε_high = 0.28
        "objective.aggregation": "token-mean",             # token-level policy-gradient loss §3.3
        "advantage.estimator": "group",                    # Eq. 9: (r − mean) / std of the group
        "advantage.scale": "group",
        "train.dynamic_sampling": True,                    # dynamic sampling §3.2
        "train.mask_truncated": True,                      # overlong filtering §3.4
        "train.beta": 0.0,                                 # no KL term §2.3
    },
    paper="DAPO, Yu et al., arXiv 2503.14476: Clip-Higher (§3.1), dynamic sampling (§3.2), "
          "token-level loss (§3.3), overlong filtering (§3.4), no KL (§2.3)",
    missing="soft overlong punishment (§3.4, Eq. 13: a length-dependent reward penalty) is not "
            "implemented; dynamic sampling refills at most train.max_refill_rounds times",
)

register(
    "dr_grpo",
    {
        "objective.name": "grpo",                          # PPO's clipped token surrogate
        "objective.eps_low": 0.2,                          # one ε in the paper's Eq. 3
        "objective.eps_high": 0.2,
        "objective.aggregation": "seq-mean-token-sum-norm",  # no 1/|o_i|: Σ_t / max_new_tokens
        "advantage.estimator": "group",
        "advantage.scale": "none",                         # no std(r) division
        "train.beta": 0.0,                                 # rule-based reward, no KL
    },
    paper="Dr. GRPO, Liu et al., arXiv 2503.20783 §3.1, Eq. 3: GRPO without the 1/|o_i| length "
          "normaliser (a constant, the generation budget, instead) and without std scaling",
)
