"""rollout.engine in the config and the preflight (no vLLM needed; runs in the shared venv):
the name is checked against the engine registry, what vLLM cannot serve is one line and exit 2
before any model is built, and train.rollout_correction.mode resolves per engine."""

import dataclasses
import importlib.util

import pytest

from gspo.cli import main
from gspo.config import ConfigError, Environment, load_config
from gspo.rollout import engines

VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.usefixtures("no_model_built")  # every check here runs before a model


def _fails(capsys, tmp_path, *argv: str) -> str:
    """Exit 2, one line on stderr, no traceback, no run folder."""
    run = tmp_path / "run"
    code = main(["train", "configs/default.yaml", f"run.dir={run}",
                 f"sft.cache_dir={tmp_path / 'cache'}", *argv])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert out.err.startswith("gspo: error: ") and out.err.count("\n") == 1, out.err
    assert "Traceback" not in out.err and not run.exists()
    return out.err


def test_a_new_engine_is_one_class_and_a_registry_line(monkeypatch):
    """An engine registered here, in the test module (into a copy of the registry), with the
    capabilities of a server that runs its own kernels: rollout.engine names it, and every rule
    that depends on the engine reads its capabilities, so it gets the right refusals and defaults
    without an edit to gspo.config."""
    class Remote(engines.HFEngine):
        capabilities = engines.Capabilities(own_kernels=True, joins_process_group=True,
                                            default_correction="icepop")
    monkeypatch.setattr(engines.base, "ENGINES", engines.ENGINES.copy())
    engines.register("remote")(Remote)
    with pytest.raises(ConfigError, match="unknown engine 'nope'; valid: hf, remote, vllm"):
        load_config(None, ["rollout.engine=nope"])
    assert load_config(None, ["rollout.engine=remote"]).train.rollout_correction.mode == "icepop"
    assert not engines.capabilities("remote").adapters       # a LoRA policy reaches it merged
    assert load_config(None, ["rollout.engine=remote", "model.lora={r: 4}"]).model.lora.r == 4
    two = Environment(world_size=2)             # its own process group: a thread worker
    assert load_config(None, ["rollout.engine=remote", "rollout.async=true"],
                       environment=two).rollout.async_worker == "thread"
    assert load_config(None, ["rollout.async=true"], environment=two).rollout.async_worker == "process"


def test_the_world_size_comes_from_the_environment_given():
    """resolve reads no process state: the world is the Environment passed (load_config's
    default reads WORLD_SIZE once)."""
    tp = ["rollout.engine=vllm", "rollout.engine_tp=2"]
    with pytest.raises(ConfigError, match="engine_tp=2 with torchrun's 3 processes"):
        load_config(None, tp, environment=Environment(world_size=3))
    assert load_config(None, tp, environment=Environment(world_size=4)).rollout.engine_tp == 2


@pytest.mark.parametrize("overrides, mode", [
    ([], "none"),
    (["rollout.engine=vllm"], "tis"),
    (["rollout.engine=vllm", "train.rollout_correction.mode=icepop"], "icepop"),
    (["rollout.engine=vllm", "train.rollout_correction.mode=none"], "none"),
    (["rollout.engine=vllm", "train.old_logprobs=rollout"], "none"),   # π_old is the sampler's
    (["train.rollout_correction.mode=seq_tis"], "seq_tis"),
])
def test_rollout_correction_resolves_per_engine(overrides, mode):
    cfg = load_config("configs/default.yaml", overrides)
    assert cfg.train.rollout_correction.mode == mode
    if mode == "tis":
        assert cfg.train.rollout_correction.params() == {"cap": 2.0}
    dumped = cfg.model_dump(mode="json")            # config.yaml holds the value used
    assert dumped["train"]["rollout_correction"]["mode"] == mode


@pytest.mark.parametrize("overrides, ratio, mode", [
    ([], "decoupled", "seq_tis"),            # vllm's default tis is not the user's: gspo is sequence-level
    (["objective.name=grpo"], "decoupled", "tis"),
    (["train.rollout_correction.mode=icepop"], "decoupled", "icepop"),     # the user's, kept
    (["rollout.max_staleness=0"], "behaviour", "tis"),                     # never stale: vllm's default
    (["rollout.async_ratio=behaviour"], "behaviour", "tis"),
])
def test_vllm_with_async_resolves_ratio_and_correction(overrides, ratio, mode):
    """rollout.async with vllm: auto picks the decoupled ratio with the
    objective's correction, as with hf, unless the user set a mode; vllm's tis stays otherwise."""
    cfg = load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.async=true", *overrides])
    assert (cfg.rollout.async_ratio, cfg.train.rollout_correction.mode) == (ratio, mode)


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.engine=vlm"], "rollout.engine: unknown engine 'vlm'; did you mean 'vllm'?"),
    (["rollout.engine=vllm", "model.preset=tiny-moe", "moe.routing_replay=rollout"],
     "rollout.engine=vllm cannot serve moe.routing_replay=rollout"),
    (["rollout.engine=vllm", "audit.every=5"],
     "train.rollout_correction.mode=tis changes the loss mask"),
])
def test_combinations_vllm_cannot_serve(capsys, tmp_path, overrides, expected):
    assert expected in _fails(capsys, tmp_path, *overrides)


def test_torchrun_world_takes_an_engine_per_rank_or_per_tensor_parallel_group(monkeypatch):
    """Under torchrun vllm builds an engine per rank (or per rollout.engine_tp ranks, which must
    divide the world); a tensor-parallel split of hf, which samples on the policy, is refused."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_config("configs/default.yaml", ["rollout.engine=vllm"]).rollout.engine_tp == 1
    assert load_config("configs/default.yaml",
                       ["rollout.engine=vllm", "rollout.engine_tp=2"]).rollout.engine_tp == 2
    with pytest.raises(ConfigError, match="rollout.engine_tp=3 with torchrun's 2 processes"):
        load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.engine_tp=3"])
    with pytest.raises(ConfigError, match="rollout.engine=hf samples on the policy itself"):
        load_config("configs/default.yaml", ["rollout.engine_tp=2"])


def test_a_model_type_the_engine_refuses_is_refused_before_it_is_built(capsys, tmp_path, monkeypatch):
    """No model type is refused today (tiny-moe is served: test_vllm_moe.py); the hook is kept."""
    refusing = dataclasses.replace(engines.VLLMEngine.capabilities, refuses={"qwen3_moe": "a reason"})
    monkeypatch.setattr(engines.VLLMEngine, "capabilities", refusing)
    err = _fails(capsys, tmp_path, "rollout.engine=vllm", "model.preset=tiny-moe")
    assert "rollout.engine: engine 'vllm' cannot serve a qwen3_moe model: a reason" in err


@pytest.mark.skipif(VLLM, reason="vLLM is installed here")
def test_vllm_not_installed_is_one_line(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "rollout.engine=vllm")
    assert "rollout.engine: engine 'vllm' needs the 'vllm' package, which is not installed" in err


def test_the_inverse_cdf_sampler_is_the_hf_engines(capsys, tmp_path):
    """rollout.sampler=inverse_cdf is how the hf engine draws; vllm draws with its own sampler:
    refused in one line rather than silently ignored."""
    assert load_config(None, ["rollout.sampler=inverse_cdf"]).rollout.sampler == "inverse_cdf"
    err = _fails(capsys, tmp_path, "rollout.engine=vllm", "rollout.sampler=inverse_cdf")
    assert "rollout.sampler=inverse_cdf: the engine draws tokens with its own sampler" in err
