"""gspo.registry.Registry, the name -> object table under every registry of the package, and the
messages users see from the registries built on it."""

import pytest

from gspo import objective_presets, tasks
from gspo.core import advantages, correction, objectives
from gspo.models import presets
from gspo.observe import stability_rules, trackers
from gspo.registry import Registry
from gspo.rewards import sources
from gspo.rollout import engines


def test_register_returns_the_object_and_get_finds_it():
    reg = Registry("widget")

    @reg.register("spin")
    def spin():
        return "spun"

    assert spin() == "spun" and reg.get("spin") is spin
    assert reg.add("stop", len) is len and reg.get("stop") is len
    assert "spin" in reg and "nope" not in reg and len(reg) == 2


def test_a_name_given_twice_is_refused_and_the_first_kept():
    reg = Registry("widget")
    reg.add("a", 1)
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered$"):
        reg.add("a", 2)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(3)
    assert reg.get("a") == 1 and len(reg) == 1


def test_unknown_name_lists_the_valid_ones_sorted():
    reg = Registry("widget")
    for name in ("b", "c", "a"):
        reg.add(name, name)
    with pytest.raises(ValueError, match=r"^unknown widget 'z'; valid: a, b, c$"):
        reg.get("z")
    labelled = Registry("task", valid="valid tasks", error=LookupError)
    labelled.add("x", 0)
    with pytest.raises(LookupError, match=r"^unknown task None; valid tasks: x$"):
        labelled.get(None)


def test_names_are_sorted_and_iteration_keeps_registration_order():
    reg = Registry("widget")
    for name in ("b", "c", "a"):
        reg.add(name, name.upper())
    assert reg.names() == ["a", "b", "c"]
    assert list(reg) == ["b", "c", "a"]


def test_a_copy_takes_new_names_without_changing_the_original():
    reg = Registry("widget", valid="valid widgets")
    reg.add("a", 1)
    other = reg.copy()
    other.add("b", 2)
    assert reg.names() == ["a"] and other.names() == ["a", "b"]
    with pytest.raises(ValueError, match="unknown widget 'c'; valid widgets: a, b$"):
        other.get("c")


# The registries of the package keep the messages users saw before they shared this class.
@pytest.mark.parametrize("lookup, error, message", [
    (tasks.get, ValueError, "unknown task 'nope'; valid tasks: arithmetic, calculator, countdown, custom, "),
    (presets.preset_config, ValueError, "unknown model preset 'nope'; valid presets: deep-moe, tiny-dense, tiny-moe, wide-moe"),
    (engines.check, engines.EngineUnavailable, "unknown engine 'nope'; valid: hf, vllm"),
    (objectives.spec, ValueError, "unknown objective 'nope'; valid: cispo, gmpo, grpo, gspo, "),
    (correction.spec, ValueError, "unknown rollout correction 'nope'; valid: "),
    (advantages.get, ValueError, "unknown advantage estimator 'nope'; valid: group, rloo"),
    (objective_presets.get, ValueError, "unknown objective preset 'nope'; valid: dapo, dr_grpo"),
    (stability_rules.kind, ValueError, "unknown guard rule kind 'nope'; valid: approx_kl, "),
])
def test_package_registries_keep_their_messages(lookup, error, message):
    args = ("nope", 1) if lookup is presets.preset_config else ("nope",)
    with pytest.raises(error) as raised:
        lookup(*args)
    assert str(raised.value).startswith(message)


def test_package_registries_refuse_a_second_registration():
    with pytest.raises(ValueError, match="reward type 'math' is already registered"):
        sources.register_source("math")(lambda task: None)
    with pytest.raises(ValueError, match="tracker 'wandb' is already registered"):
        trackers.register("wandb")(trackers.Tracker)
    assert sources.source_types() == ["env", "function", "math", "model", "think_format", "verifier"]
