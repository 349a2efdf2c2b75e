"""Checkpoints: round trip, checksum fallback, half-written folders, pruning."""

import json

import pytest
import torch

from gspo.training.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_latest,
    save_checkpoint,
    verify,
)
from gspo.models.presets import build_model, load_model
from gspo.training.optim import build_optimizer, build_scheduler


@pytest.fixture(scope="module")
def parts():
    """A tiny model with an optimizer and scheduler that have taken one step."""
    model, tok = build_model("tiny-dense", 0)
    optimizer = build_optimizer(model, 1e-3)
    scheduler = build_scheduler(optimizer, "cosine", 2, 10)
    loss = model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits.square().mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return model, tok, optimizer, scheduler


def _save(run_dir, step, parts, keep=5, **state):
    model, tok, opt, sched = parts
    return save_checkpoint(run_dir, step, model, tok, opt, sched,
                           {"cursor": {"epoch": 0, "index": step}, **state}, keep=keep)


def _assert_state_equal(a, b):
    """Recursive equality of (optimizer / scheduler) state dicts with tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_state_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    else:
        assert a == b


def test_round_trip(tmp_path, parts):
    model, _, opt, sched = parts
    path = _save(tmp_path, 3, parts, history={"eval_before": {"accuracy": 0.25}}, wall_s=1.5)
    assert path == checkpoint_dir(tmp_path, 3) == tmp_path / "checkpoints" / "step_000003"
    loaded = load_latest(tmp_path, warn=pytest.fail)
    assert loaded.path == path
    assert loaded.state == {"cursor": {"epoch": 0, "index": 3},
                            "history": {"eval_before": {"accuracy": 0.25}}, "wall_s": 1.5, "step": 3}
    assert loaded.optimizer["state"], "the optimizer has moments after one step"
    _assert_state_equal(loaded.optimizer, opt.state_dict())
    _assert_state_equal(loaded.scheduler, sched.state_dict())
    weights, _ = load_model(path)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), weights.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    sums = json.loads((path / CHECKSUM_FILE).read_text())
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", STATE_FILE} <= set(sums)


def test_load_latest_without_checkpoints(tmp_path):
    assert load_latest(tmp_path) is None
    assert list_checkpoints(tmp_path) == []


def test_corrupt_newest_falls_back_with_warning(tmp_path, parts):
    _save(tmp_path, 1, parts)
    newest = _save(tmp_path, 2, parts)
    blob = bytearray((newest / "optimizer.pt").read_bytes())
    blob[-20] ^= 0xFF                                           # flip one byte
    (newest / "optimizer.pt").write_bytes(bytes(blob))
    warnings = []
    loaded = load_latest(tmp_path, warn=warnings.append)
    assert loaded.path == checkpoint_dir(tmp_path, 1)
    assert loaded.state["step"] == 1
    assert len(warnings) == 1 and "checksum mismatch in optimizer.pt" in warnings[0]
    assert "step_000002" in warnings[0]


def test_missing_file_and_missing_checksums_are_skipped(tmp_path, parts):
    _save(tmp_path, 1, parts)
    a = _save(tmp_path, 2, parts)
    (a / "scheduler.pt").unlink()
    with pytest.raises(CheckpointError, match="missing scheduler.pt"):
        verify(a)
    b = _save(tmp_path, 3, parts)
    (b / CHECKSUM_FILE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify(b)
    warnings = []
    assert load_latest(tmp_path, warn=warnings.append).state["step"] == 1
    assert len(warnings) == 2


def test_half_written_tmp_folder_is_ignored(tmp_path, parts):
    _save(tmp_path, 1, parts)
    # a crash while writing step 2 leaves only the temporary folder
    tmp = checkpoint_dir(tmp_path, 2).with_name(".step_000002.tmp")
    tmp.mkdir()
    (tmp / STATE_FILE).write_text("{")
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 1)]
    assert load_latest(tmp_path, warn=pytest.fail).state["step"] == 1
    # the next save of step 2 replaces the stale temporary folder
    _save(tmp_path, 2, parts)
    assert not tmp.exists()
    assert load_latest(tmp_path, warn=pytest.fail).state["step"] == 2


def test_prune_keeps_the_newest(tmp_path, parts):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, parts, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    _save(tmp_path, 10, parts, keep=1)                        # 10 sorts after 4 (zero-padded)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010"]


def test_resave_same_step_overwrites(tmp_path, parts):
    _save(tmp_path, 5, parts, wall_s=1.0)
    _save(tmp_path, 5, parts, wall_s=2.0)
    assert load_latest(tmp_path, warn=pytest.fail).state["wall_s"] == 2.0
    assert len(list_checkpoints(tmp_path)) == 1
