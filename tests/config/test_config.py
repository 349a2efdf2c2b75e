"""Config: defaults, dotted overrides, one-line errors that name the key, and the config hash."""

import hashlib
from pathlib import Path

import pytest

from gspo.config import (
    ConfigError,
    Environment,
    TrainConfig,
    config_hash,
    dump_yaml,
    load_config,
    parse_override,
    resolve,
    shipped_config,
)


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    message = str(info.value)
    assert "\n" not in message, "ConfigError must be one line"
    return message


# ------------------------------------------------------------------------------- defaults

def test_builtin_defaults():
    cfg = load_config()
    assert isinstance(cfg, TrainConfig)
    assert cfg.objective.name == "gspo"
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (16, 8)
    assert cfg.batch_size == 16 * 8                       # N = P x G (derived)
    assert cfg.train.minibatches == 4                     # the paper's four minibatches
    assert cfg.train.beta == 0.0                          # no KL, as the GSPO paper
    assert cfg.train.old_logprobs == "recompute"
    assert [r.type for r in cfg.rewards.sources] == ["verifier"]


def test_shipped_default_yaml_loads():
    # Pin what the file is about (GSPO on the flawed-teacher digit sums) and validity.
    cfg = load_config("configs/default.yaml")
    assert (cfg.task.name, cfg.objective.name) == ("multistep", "gspo")
    assert cfg.task.params["flawed_fraction"] == 0.5
    assert cfg.batch_size % cfg.train.minibatches == 0


REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_package_ships_the_repository_default_byte_for_byte():
    """`pip install .` then `gspo train` (no config, no repository around) runs the package's copy
    of configs/default.yaml: the two files must not drift apart."""
    assert shipped_config().read_bytes() == (REPO_CONFIGS / "default.yaml").read_bytes()


def test_command_line_without_a_config_runs_the_main_job():
    from gspo.cli import build_parser, command_config, split_config_and_overrides
    for command in (["train"], ["sft"], ["eval", "--checkpoint", "x"]):
        args = build_parser().parse_args([*command, "seed=1"])
        split_config_and_overrides(args)
        assert command_config(args) == load_config(REPO_CONFIGS / "default.yaml", ["seed=1"]), command


def test_moe_job_is_the_main_job_on_tiny_moe():
    """configs/moe.yaml adds nothing but the preset (and its folder): without the repository, the
    same job is `gspo train model.preset=tiny-moe`."""
    moe = load_config(REPO_CONFIGS / "moe.yaml")
    assert moe == load_config(shipped_config(), ["model.preset=tiny-moe", "run.dir=runs/moe"])


def test_dump_then_load_round_trips(tmp_path):
    cfg = load_config(None, ["objective.name=grpo", "train.beta=0.01", "seed=3"])
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


# ------------------------------------------------------------------------------- overrides

@pytest.mark.parametrize("text, key, value", [
    ("train.steps=5", ["train", "steps"], 5),
    ("seed=1", ["seed"], 1),
    ("run.tensorboard=false", ["run", "tensorboard"], False),
    ("model.path=null", ["model", "path"], None),
    ("train.lr=0.001", ["train", "lr"], 0.001),
    ("task.reward=mod:fn", ["task", "reward"], "mod:fn"),   # 'a:b' without a space stays a string
    ("objective.params={tau_pos: 1.0}", ["objective", "params"], {"tau_pos": 1.0}),
    ("run.dir=a=b", ["run", "dir"], "a=b"),                 # split on the first '=' only
])
def test_parse_override_yaml_scalars(text, key, value):
    assert parse_override(text) == (key, value)


def test_parse_override_exponent_without_dot_is_a_float():
    assert parse_override("model.overrides.rms_norm_eps=1e-6") == (
        ["model", "overrides", "rms_norm_eps"], 1e-6)


def test_overrides_apply_to_nested_fields():
    cfg = load_config(None, ["train.steps=7", "rollout.temperature=0.5", "objective.name=grpo",
                             "rewards.sources=[{type: verifier, weight: 2.0}]"])
    assert cfg.train.steps == 7
    assert cfg.rollout.temperature == 0.5
    assert cfg.objective.name == "grpo"
    assert cfg.rewards.sources[0].weight == 2.0


def test_override_on_top_of_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 4\ntrain:\n  steps: 9\n  lr: 2.0e-4\n")
    cfg = load_config(path, ["train.steps=3"])
    assert (cfg.seed, cfg.train.steps, cfg.train.lr) == (4, 3, 2.0e-4)   # file, override wins


@pytest.mark.parametrize("text", ["train.steps", "=5", "train..steps=5"])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="override"):
        parse_override(text)


# ------------------------------------------------------------------------------- unknown keys

@pytest.mark.parametrize("override, key, suggestion", [
    ("train.stpes=5", "train.stpes", "steps"),
    ("trian.steps=5", "trian", "train"),
    ("rollout.group_sise=4", "rollout.group_sise", "group_size"),
])
def test_unknown_key_did_you_mean(override, key, suggestion):
    message = _error(override)
    assert f"unknown key {key!r}" in message
    assert f"did you mean {suggestion!r}" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = _error("train.zzzzzz=1")
    assert "valid keys:" in message and "minibatches" in message


def test_unknown_key_inside_rewards_list_suggests():
    assert "did you mean 'type'" in _error("rewards.sources=[{tpye: verifier}]")


# ------------------------------------------------------------------------------- wrong values

@pytest.mark.parametrize("override, key", [
    ("train.steps=abc", "train.steps"),                   # wrong type
    ("rollout.group_size=1", "rollout.group_size"),       # G >= 2: a group needs two responses
    ("rollout.temperature=0", "rollout.temperature"),     # > 0
    ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.top_p=1.5", "rollout.top_p"),               # (0, 1]
    ("advantage.eps=0", "advantage.eps"),                 # > 0
    ("objective.eps_low=0", "objective.eps_low"),         # > 0
    ("objective.eps_high=-0.1", "objective.eps_high"),
    ("train.lr=0", "train.lr"),
    ("train.old_logprobs=generator", "train.old_logprobs"),
    ("objective.aggregation=sum", "objective.aggregation"),
    ("train=5", "train"),                                 # a section given a scalar
])
def test_invalid_value_names_the_key(override, key):
    message = _error(override)
    assert f"{key}:" in message
    assert "got" in message


def test_minibatches_must_divide_batch():
    # P*G = 16*8 = 128; 3 does not divide it, 4 does.
    message = _error("train.minibatches=3")
    assert "train.minibatches=3" in message and "128" in message
    assert load_config(None, ["train.minibatches=4"]).train.minibatches == 4
    # P*G = 3*2 = 6: 4 does not divide it.
    assert "train.minibatches" in _error("rollout.prompts_per_step=3", "rollout.group_size=2")


def test_custom_task_requires_files():
    assert "task.train_file" in _error("task.name=custom")
    assert "task.test_file" in _error("task.name=custom", "task.train_file=a.jsonl")
    assert "task.reward" in _error("task.name=custom", "task.train_file=a.jsonl",
                                   "task.test_file=b.jsonl")
    cfg = load_config(None, ["task.name=custom", "task.train_file=a.jsonl",
                             "task.test_file=b.jsonl", "task.reward=m:f"])
    assert cfg.task.reward == "m:f"


def test_resolve_is_pure_and_labels_what_it_derives():
    """resolve returns a new config: the one given keeps its unset values; each value filled in
    is labelled with why (vllm's default tis, then decoupled's seq_tis for sequence-level gspo)."""
    cfg = TrainConfig.model_validate({"rollout": {"engine": "vllm", "async": True}})
    before = cfg.model_dump()
    out = resolve(cfg, Environment())
    assert cfg.model_dump() == before and cfg.train.rollout_correction.mode is None
    assert (out.config.rollout.async_ratio, out.config.train.rollout_correction.mode,
            out.config.advantage.scale) == ("decoupled", "seq_tis", "group")
    assert sorted(out.derived) == ["advantage.scale", "rollout.async_ratio", "rollout.episode",
                                   "train.pack_rows", "train.rollout_correction.mode"]
    assert out.derived["train.rollout_correction.mode"].startswith("seq_tis (rollout.async_ratio")
    assert resolve(out.config, Environment()).derived == {}           # resolved: nothing left
    under_torchrun = resolve(cfg, Environment(world_size=2))     # the environment is an input
    assert under_torchrun.config.rollout.async_worker == "thread"
    assert "rollout.async_worker" in under_torchrun.derived and "rollout.async_worker" not in out.derived


def test_balance_ranks_is_tokens_under_torchrun_none_under_async_and_refused_with_async():
    """train.balance_ranks=auto: tokens under torchrun, none with rollout.async (the worker's π_prox
    is of its rank's own rows) or train.minibatch_by=rows (groups are dealt whole), nothing
    derived in one process; tokens with either: one line."""
    cfg = TrainConfig()
    assert "train.balance_ranks" not in resolve(cfg, Environment()).derived
    out = resolve(cfg, Environment(world_size=2))
    assert out.config.train.balance_ranks == "tokens"
    assert out.derived["train.balance_ranks"] == "tokens (auto: torchrun)"
    stale = TrainConfig.model_validate({"rollout": {"async": True}})
    assert resolve(stale, Environment(world_size=2)).config.train.balance_ranks == "none"
    assert load_config(None, ["train.balance_ranks=none"]).train.balance_ranks == "none"  # not YAML's off
    off = TrainConfig.model_validate({"train": {"balance_ranks": "none"}})
    assert resolve(off, Environment(world_size=2)).config.train.balance_ranks == "none"
    message = _error("train.balance_ranks=tokens", "rollout.async=true")
    assert "train.balance_ranks=tokens cannot serve rollout.async" in message
    rows = TrainConfig.model_validate({"train": {"minibatch_by": "rows"}})
    out = resolve(rows, Environment(world_size=2))
    assert out.derived["train.balance_ranks"] == "none (auto: train.minibatch_by=rows)"
    message = _error("train.balance_ranks=tokens", "train.minibatch_by=rows")
    assert "train.balance_ranks=tokens cannot serve train.minibatch_by=rows" in message


def test_balance_ranks_refused_with_async_exits_2(tmp_path):
    """The refusal is a UserError: one line on stderr and exit status 2, before any model loads."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "train.balance_ranks=tokens",
                          "rollout.async=true", f"run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "train.balance_ranks=tokens cannot serve rollout.async" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------- files

def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 0\ntrain:\n  steps: 5\n   lr: 1\n")   # line 4 over-indented
    with pytest.raises(ConfigError, match=r"bad\.yaml:4: invalid YAML"):
        load_config(path)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_error_in_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: rollout\.group_size"):
        load_config(path)


# ------------------------------------------------------------------------------- hash

def test_config_hash_pinned():
    # sha256 of json.dumps([{"a": 1}], sort_keys=True) = sha256('[{"a": 1}]'), first 12 hex digits.
    assert config_hash({"a": 1}) == hashlib.sha256(b'[{"a": 1}]').hexdigest()[:12]
    # key order does not matter (sort_keys)
    assert config_hash({"b": 2, "a": 1}) == config_hash({"a": 1, "b": 2})


def test_config_hash_stable_and_sensitive():
    a, b = load_config(None, ["seed=1"]), load_config(None, ["seed=1"])
    assert a is not b and config_hash(a.sft, a.model) == config_hash(b.sft, b.model)
    assert len(config_hash(a.sft)) == 12
    changed = load_config(None, ["seed=1", "sft.lr=0.002"])
    assert config_hash(changed.sft, changed.model) != config_hash(a.sft, a.model)
    assert config_hash(a.model, a.sft) != config_hash(a.sft, a.model)   # order of parts matters


def test_moved_keys_are_refused_with_their_new_place():
    """The reward policy is part of the rewards section now: reward.* names rewards.*."""
    assert _error("reward.on_error=drop") == (
        "config: unknown key 'reward.on_error'; did you mean 'rewards.on_error'? "
        "(section 'reward' is now part of 'rewards')")
    assert "did you mean rewards.sources?" in _error("rewards=[{type: verifier}]")
    cfg = load_config(None, ["rewards.on_error=drop", "rewards.sources=[{type: verifier}]"])
    assert cfg.rewards.on_error == "drop" and cfg.rewards.sources[0].type == "verifier"


def test_objective_kwargs_are_derived_from_the_config():
    cfg = load_config(None, ["objective.name=sapo", "objective.eps_high=0.3",
                             "objective.params={tau_pos: 1.0}", "rollout.max_new_tokens=12"])
    assert cfg.objective_kwargs() == {"eps_high": 0.3, "tau_pos": 1.0, "token_sum_norm": 12.0}
    assert cfg.token_aggregation() == "seq-mean-token-mean"            # sapo's paper default
    # gspo's seq-mean reduces per-token extras (KL, entropy) as a mean of token means
    assert load_config(None, []).token_aggregation() == "seq-mean-token-mean"
    assert load_config(None, ["objective.name=cispo"]).token_aggregation() == "token-mean"


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.yaml")
                                        if p.parent.name != "compare"))
def test_every_shipped_config_validates(path):
    """Every training config in configs/ (the recipes included, which need a GPU and downloaded
    files to run) passes the same validation as a run's: no stale or misspelt key ships."""
    cfg = load_config(CONFIGS / path)
    assert cfg.train.steps > 0 and cfg.run.dir
