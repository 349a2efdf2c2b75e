"""Rollout records and `gspo audit`: a real short run passes; a record tampered with in one field
(an old log-prob, a mask bit, a reward, the aggregation) fails, naming the step and the field.
Also the pure pieces: mask invariants, length buckets and slices against hand numbers, and the
generator-vs-trainer mismatch measured with train.log_rollout_logprobs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gspo.tools import audit
from gspo.core import objectives
from gspo.cli import main
from gspo.observe.diagnostics import length_buckets, length_slices, logprob_mismatch
from gspo.observe.metrics import read_metrics
from gspo.observe.report import build_report
from gspo.training.trainer import Trainer


def _parity(reward_module: str) -> str:
    return f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]"


@pytest.fixture(scope="module")
def audited(tmp_path_factory, small_config, reward_module):
    """5 SFT steps (responses of mixed lengths, with and without EOS), then 2 GSPO steps with
    clip range 0.05 (so that some responses clip), every step recorded."""
    root = tmp_path_factory.mktemp("audited")
    cfg = small_config(root, _parity(reward_module), "audit.every=1",
                       "train.lr=3e-3", "objective.eps_low=0.05", "objective.eps_high=0.05")
    Trainer(cfg, log=lambda m: None).run()
    return Path(cfg.run.dir)


def _copy(audited: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(audited, run)
    return run


def _audit(capsys, *args) -> tuple[int, str]:
    code = main(["audit", *map(str, args)])
    return code, capsys.readouterr().out


def test_record_layout(audited):
    assert audit.list_records(audited) == [1, 2]
    rec = audit.record_dir(audited, 1)
    for name in ("policy_old/model.safetensors", "policy_old/config.json",
                 "policy_new/model.safetensors", "batch.safetensors", "record.json"):
        assert (rec / name).is_file(), name
    assert not list(rec.rglob("*.pt")) and not list(rec.rglob("*.bin"))    # nothing pickled
    meta = json.loads((rec / "record.json").read_text())
    assert meta["objective"]["name"] == "gspo"
    assert meta["objective"]["kwargs"] == {"eps_low": 0.05, "eps_high": 0.05, "aggregation": "seq-mean",
                                           "token_sum_norm": 4.0}
    assert meta["sampling"] == {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                "greedy": False}
    assert set(meta["seeds"]) >= {"generation", "minibatch"} and len(meta["minibatch_loss"]) == 2
    t = load_file(str(rec / "batch.safetensors"))
    N, T = t["response_mask"].shape
    assert (N, T) == (16, 4) and t["old_logp"].shape == t["new_logp"].shape == (N, T)
    assert 0 < t["truncated"].sum() < N and len(set(t["lengths"].tolist())) > 1   # mixed rows
    assert meta["logged"]["policy/loss"] == pytest.approx(sum(meta["minibatch_loss"]) / 2, abs=1e-6)


def test_audit_passes_on_a_real_run(audited, capsys):
    code, out = _audit(capsys, audited)
    assert code == 0, out
    assert "audit passed: 2 step(s)" in out
    for check in ("mask", "old_logp", "new_logp", "ratio", "clip", "loss", "loss_reference",
                  "rewards", "advantages", "regenerate"):
        assert f"  {check} " in out
    assert " FAIL " not in out
    clipped = [line for line in out.splitlines() if line.strip().startswith("clip ")]
    assert any(not line.rstrip().endswith(" 0/16 rows clipped, as logged") for line in clipped), \
        "the test run should clip something, or the clip check proves little"


def _tamper_tensors(run: Path, step: int, edit) -> None:
    path = audit.record_dir(run, step) / "batch.safetensors"
    t = load_file(str(path))
    edit(t)
    save_file(t, str(path))


def _first_masked(t, *, truncated: bool | None = None) -> tuple[int, int]:
    """(row, last masked position) of a row, optionally with the given truncation."""
    for i in range(len(t["lengths"])):
        if truncated is None or bool(t["truncated"][i]) == truncated:
            return i, int(t["response_mask"][i].sum()) - 1
    raise AssertionError("no such row")


def _perturb_old_logp(t):
    i, last = _first_masked(t)
    t["old_logp"][i, last] -= 0.5


def _flip_mask_bit(t):
    i, last = _first_masked(t, truncated=False)          # a response that ended with EOS
    t["response_mask"][i, last] = 0.0                    # now it stops before its EOS


def _extend_mask_bit(t):
    i, last = _first_masked(t, truncated=False)
    t["response_mask"][i, last + 1] = 1.0                # now it runs past its EOS into padding


def _edit_reward(t):
    t["rewards"][0] = 1.0 - t["rewards"][0]


@pytest.mark.parametrize("edit, field", [(_perturb_old_logp, "old_logp"), (_flip_mask_bit, "mask"),
                                         (_extend_mask_bit, "mask"), (_edit_reward, "rewards")])
def test_tampered_tensor_fails_naming_step_and_field(audited, tmp_path, capsys, edit, field):
    run = _copy(audited, tmp_path)
    _tamper_tensors(run, 1, edit)
    code, out = _audit(capsys, run)
    assert code == audit.EXIT_MISMATCH == 1
    failed = out.splitlines()[-1]
    assert failed.startswith("audit FAILED: ") and f"step 1: {field} (" in failed
    assert "step 2:" not in failed                                     # step 2 is intact
    assert code == _audit(capsys, run, "--step", 1)[0] == 1
    assert _audit(capsys, run, "--step", 2)[0] == 0


def test_tampered_reward_also_breaks_advantages(audited, tmp_path, capsys):
    run = _copy(audited, tmp_path)
    _tamper_tensors(run, 1, _edit_reward)
    _, out = _audit(capsys, run, "--step", 1)
    assert "step 1: rewards (" in out and "step 1: advantages (" in out


def test_changed_aggregation_fails(audited, tmp_path, capsys):
    run = _copy(audited, tmp_path)
    path = audit.record_dir(run, 1) / "record.json"
    meta = json.loads(path.read_text())
    meta["objective"]["kwargs"]["aggregation"] = "seq-mean-token-sum-norm"
    path.write_text(json.dumps(meta))
    code, out = _audit(capsys, run, "--step", 1)
    assert code == 1
    assert "step 1: config (record vs config.yaml differ in objective aggregation)" in out
    assert "step 1: loss (" in out      # ℓ_i |y_i| / 4 instead of ℓ_i: lengths differ at step 1


def test_audit_usage_errors(audited, tmp_path, capsys):
    assert main(["audit", str(audited), "--step", "7"]) == 2
    assert "no audit record for step 7; recorded: 1, 2" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["audit", str(tmp_path / "empty")]) == 2
    assert "audit.every" in capsys.readouterr().err


# ------------------------------------------------------------------------------- mask invariants

def test_mask_problems_each_rule():
    eos, pad = 2, 0
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 2, 0, 0]])       # EOS, truncated, EOS
    mask = torch.tensor([[1., 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    trunc = torch.tensor([False, True, False])
    lengths = mask.sum(-1)
    check = lambda i=ids, m=mask, tr=trunc, n=lengths: audit.mask_problems(  # noqa: E731
        i, m, m.long(), tr, n, eos_id=eos, pad_id=pad, max_new_tokens=4)
    assert check() == []
    holes = mask.clone()
    holes[1, 1] = 0
    assert any("ones-then-zeros" in p for p in check(m=holes, n=holes.sum(-1)))
    short = mask.clone()
    short[0, 2] = 0                                    # stops before its EOS
    assert any("does not end at an EOS" in p for p in check(m=short, n=short.sum(-1)))
    long = mask.clone()
    long[2, 2] = 1                                     # runs past the first EOS
    problems = check(m=long, n=long.sum(-1))
    assert any("EOS before the end" in p or "does not end" in p for p in problems)
    assert any("row 0" in p for p in check(n=lengths + torch.tensor([1., 0, 0])))
    bad_pad = ids.clone()
    bad_pad[2, 3] = 9
    assert any("non-pad" in p for p in check(i=bad_pad))
    assert any("truncated row holds an EOS" in p for p in check(tr=torch.tensor([True, True, False])))


# ------------------------------------------------------------------------------- length slices

def test_length_buckets():
    assert length_buckets(16, 4) == [(1, 4), (5, 8), (9, 12), (13, 16)]
    assert length_buckets(4, 4) == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert length_buckets(10, 4) == [(1, 2), (3, 5), (6, 7), (8, 10)]
    assert length_buckets(2, 4) == [(1, 1), (2, 2)]


def test_length_slices_by_hand():
    """Six responses, lengths 1, 2, 2, 4, 7, 8 (max_new_tokens 8, buckets 1-2, 3-4, 5-6, 7-8).

    Token log-ratios are constant along a row, so GSPO's s_i = exp(that constant):
      row:      0     1     2     3     4      5
      |y|:      1     2     2     4     7      8
      log r:    0     0.1  -0.1   0     0.2    0
      Â:        1    -1     1     1     1     -1
      reward:   1     0     1     1     1      0
      correct:  T     F     T     T     F      F
    bucket 1-2 (rows 0,1,2): reward 2/3, accuracy 2/3; ratios 1, e^0.1, e^-0.1 -> mean
      (1 + 2cosh 0.1)/3; clipped (ε = 0.05): row 1 (Â<0, s=1.105 is not < 0.95: no), row 2
      (Â>0, s=0.905 is not > 1.05: no) -> 0.
    bucket 3-4 (row 3): reward 1, accuracy 1, ratio 1, clip 0.
    bucket 5-6: empty -> frac 0 only.
    bucket 7-8 (rows 4, 5): reward 1/2, accuracy 0; ratios e^0.2 and 1 -> (e^0.2 + 1)/2;
      row 4 has Â>0 and s = 1.221 > 1.05: clipped, all its 7 tokens; row 5 not ->
      clip_frac_tokens = 7 / (7 + 8).
    """
    lengths = torch.tensor([1, 2, 2, 4, 7, 8])
    T = 8
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()             # [N, T]
    log_r = torch.tensor([0.0, 0.1, -0.1, 0.0, 0.2, 0.0])
    old = -torch.rand(6, T)
    logp = old + log_r[:, None] * mask
    adv = torch.tensor([1.0, -1, 1, 1, 1, -1])
    rewards = torch.tensor([1.0, 0, 1, 1, 1, 0])
    correct = torch.tensor([True, False, True, True, False, False])
    out = length_slices(lengths, rewards, correct, logp, old, adv, mask,
                        objective=objectives.get("gspo"),
                        objective_kwargs={"eps_low": 0.05, "eps_high": 0.05},
                        buckets=length_buckets(8, 4))
    e = torch.tensor(0.1, dtype=torch.float64)
    expected = {
        "length/1-2/frac": 0.5, "length/1-2/reward": 2 / 3, "length/1-2/accuracy": 2 / 3,
        "length/1-2/clip_frac": 0.0, "length/1-2/ratio": float((1 + 2 * torch.cosh(e)) / 3),
        "length/3-4/frac": 1 / 6, "length/3-4/reward": 1.0, "length/3-4/accuracy": 1.0,
        "length/3-4/clip_frac": 0.0, "length/3-4/ratio": 1.0,
        "length/5-6/frac": 0.0,
        "length/7-8/frac": 1 / 3, "length/7-8/reward": 0.5, "length/7-8/accuracy": 0.0,
        "length/7-8/clip_frac": 7 / 15, "length/7-8/ratio": float((torch.exp(2 * e) + 1) / 2),
    }
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, abs=1e-6), key


def test_length_slices_in_a_run_and_report(audited):
    rows = read_metrics(audited)
    step = rows[1]
    buckets = [k for k in step if k.startswith("length/") and k.endswith("/frac")]
    assert buckets == [f"length/{i}-{i}/frac" for i in (1, 2, 3, 4)]       # max_new_tokens 4
    assert sum(step[k] for k in buckets) == pytest.approx(1.0)
    # the slices average back to the whole-batch reward
    total = sum(step[k] * step[k.replace("/frac", "/reward")] for k in buckets if step[k] > 0)
    assert total == pytest.approx(step["reward/mean"], abs=1e-6)
    text = build_report(audited).read_text()
    assert "![length slices](plots/length_slices.png)" in text
    assert (audited / "plots" / "length_slices.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Guard events" in text and "No guard triggers." in text


# ------------------------------------------------------------------------------- mismatch

def test_logprob_mismatch_by_hand():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    gen = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 7.0, 7.0]])               # padding ignored
    train = torch.tensor([[-1.1, -1.7, 0.0], [-0.5, 0.0, 0.0]])
    out = logprob_mismatch(gen, train, mask)
    # token diffs 0.1, -0.3, 0 -> mean |.| 0.4/3, max 0.3; seq means -0.1, 0
    assert out["mismatch/token_abs_mean"] == pytest.approx(0.4 / 3)
    assert out["mismatch/token_abs_max"] == pytest.approx(0.3)
    assert out["mismatch/seq_logratio_abs_mean"] == pytest.approx(0.05)
    assert out["mismatch/seq_logratio_abs_max"] == pytest.approx(0.1)


def test_log_rollout_logprobs_with_recompute(make_cfg, reward_module):
    cfg = make_cfg("sft.enabled=false", _parity(reward_module), "train.steps=1",
                   "train.log_rollout_logprobs=true", "rollout.temperature=0.7")
    Trainer(cfg, log=lambda m: None).run()
    row = read_metrics(cfg.run.dir)[1]
    for key in ("token_abs_mean", "token_abs_max", "seq_logratio_abs_mean", "seq_logratio_abs_max"):
        assert 0 <= row[f"mismatch/{key}"] < 1e-4       # same weights, same temperature
    assert row["policy/ratio_min"] != row["policy/ratio_max"] or row["policy/approx_kl"] == 0.0
