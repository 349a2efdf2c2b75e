"""Checkpoints: round trip, checksum fallback, half-written folders, pruning; writes that fail
(a full disk: ENOSPC from a file that fills, or the error safetensors reports for it)."""

import builtins
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from gspo.training import checkpoint
from gspo import storage
from gspo.errors import WriteFailed
from gspo.observe.metrics import MetricsWriter, read_metrics

from gspo.training.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_latest,
    remove_partial,
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


# ------------------------------------------------------------------------------- full disk

class _FullFile:
    """A file on a disk that fills after ``room`` bytes: the write that crosses it stores what fits
    and raises ENOSPC, as the kernel does."""

    def __init__(self, path, mode, room: int = 100):
        self.fh, self.room = builtins.open(path, mode), room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.fh.write(bytes(data[:self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.fh.close()


@pytest.mark.parametrize("n", [10, 100_000])
def test_save_torch_reports_the_file_systems_error(tmp_path, monkeypatch, n):
    """torch's zip writer turns a full disk into a RuntimeError ('unexpected pos', 'iostream
    error'); save_torch raises the file system's ENOSPC instead, for a small file and a big one."""
    monkeypatch.setattr(storage, "open", _FullFile, raising=False)
    with pytest.raises(OSError) as caught:
        storage.save_torch({"x": torch.zeros(n)}, tmp_path / "x.pt")
    assert caught.value.errno == errno.ENOSPC


def _full_disk_at(monkeypatch, where: str) -> None:
    """The disk fills while the checkpoint writes ``where``: the weights (safetensors' error, as
    it reports ENOSPC) or the optimizer state (through torch's zip writer)."""
    if where == "weights":
        save_model = checkpoint.save_model

        def failing(model, tokenizer, path, **kwargs):
            save_model(model, tokenizer, path, **kwargs)
            raise SafetensorError("Error while serializing: I/O error: No space left on device "
                                  "(os error 28)")
        monkeypatch.setattr(checkpoint, "save_model", failing)
    else:
        def full_open(path, mode="r", *args, **kwargs):
            if Path(path).name == "optimizer.pt":
                return _FullFile(path, mode)
            return builtins.open(path, mode, *args, **kwargs)
        monkeypatch.setattr(storage, "open", full_open, raising=False)


@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_full_disk_during_a_checkpoint_write(tmp_path, parts, monkeypatch, where):
    """WriteFailed names the checkpoint, its folder and ENOSPC; nothing of it is left, the
    previous checkpoint is the newest and loads."""
    _save(tmp_path, 1, parts)
    _full_disk_at(monkeypatch, where)
    with pytest.raises(WriteFailed) as caught:
        _save(tmp_path, 2, parts)
    fault = caught.value
    assert fault.what == "the checkpoint of step 2" and fault.exit_code == 4
    assert fault.path == tmp_path / "checkpoints" / ".step_000002.tmp"
    assert fault.reason == "No space left on device (errno 28)"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert load_latest(tmp_path, warn=pytest.fail).state["step"] == 1


def test_an_error_that_is_not_the_disks_stays_a_bug(tmp_path, parts, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug")
    monkeypatch.setattr(checkpoint, "save_model", broken)
    with pytest.raises(ValueError, match="a bug"):
        _save(tmp_path, 1, parts)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_remove_partial_clears_only_temporary_folders(tmp_path, parts):
    _save(tmp_path, 1, parts)
    for step in (2, 7):
        checkpoint_dir(tmp_path, step).with_name(f".step_{step:06d}.tmp").mkdir()
    removed = remove_partial(tmp_path)
    assert [p.name for p in removed] == [".step_000002.tmp", ".step_000007.tmp"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def _short_writes(monkeypatch, after: int) -> None:
    """os.write as on a disk that fills: the first call takes ``after`` bytes, the next raises."""
    real = os.write
    calls = []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, data[:after])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(storage.os, "write", write)


def test_a_metrics_row_is_never_left_half_written(tmp_path, monkeypatch):
    """The disk takes 20 bytes of the row of step 2, then refuses: the file is cut back to the
    row of step 1, WriteFailed names the row and the file, and the next row appends whole."""
    writer = MetricsWriter(tmp_path, trackers=[])
    writer.write({"step": 1, "reward/mean": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with monkeypatch.context() as patch:
        _short_writes(patch, after=20)
        with pytest.raises(WriteFailed) as caught:
            writer.write({"step": 2, "reward/mean": 0.25})
    assert caught.value.what == "the metrics row of step 2"
    assert caught.value.path == tmp_path / "metrics.jsonl"
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    writer.write({"step": 2, "reward/mean": 0.25})
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5},
                                      {"step": 2, "reward/mean": 0.25}]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_full_disk_under_tensorboard_is_one_named_error(tmp_path, monkeypatch, capsys):
    """TensorBoard writes in its own thread: the failure is raised on the writer's next call as
    WriteFailed naming the events folder, and the thread prints no traceback of its own."""
    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    writer = MetricsWriter(tmp_path, trackers=["tensorboard"])
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(WriteFailed) as caught:
        for step in range(1, 50):          # the thread fails on the first; a later call says so
            writer.write({"step": step, "reward/mean": 0.5})
            writer.flush()
    assert caught.value.what == "TensorBoard events" and caught.value.path == tmp_path / "tb"
    assert caught.value.reason == "No space left on device (errno 28)"
    assert "Traceback" not in capsys.readouterr().err
